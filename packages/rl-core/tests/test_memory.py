"""``rl_core.memory.trim_host_memory``: glibc's ``malloc_trim`` returns freed arena memory to the
system; live tensors keep their values."""

from __future__ import annotations

import sys

import pytest
import torch

from rl_core.memory import trim_host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_trim_runs_on_linux_and_keeps_live_values() -> None:
    """It runs (glibc) between allocations of large temporaries; a tensor alive across the trim
    keeps its values bitwise."""
    kept = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    before = kept.clone()
    for _ in range(3):
        tmp = torch.ones(1 << 22)  # 16 MB freed right after
        del tmp
        assert trim_host_memory() is True
    assert torch.equal(kept, before)
