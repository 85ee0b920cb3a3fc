"""The CPU redirection module and import hygiene."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rl_core.errors import RLError


def test_importing_the_package_does_not_import_megatron() -> None:
    """``import rl_megatron`` (and its policy module) loads neither megatron-core nor the CPU
    redirections; only building a policy does."""
    code = (
        "import sys, rl_megatron, rl_megatron.policy, rl_megatron.convert; "
        "bad = [m for m in sys.modules if m.startswith('megatron') or m.endswith('_cpu_support')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only redirections")
def test_cpu_support_is_idempotent_and_refuses_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enabling twice keeps one function mode; with CUDA reported available it refuses."""
    from rl_megatron import _cpu_support

    _cpu_support.enable_cpu_support()
    mode = _cpu_support._MODE
    _cpu_support.enable_cpu_support()
    assert _cpu_support.cpu_support_enabled() and _cpu_support._MODE is mode
    assert torch.zeros(2, device="cuda").device.type == "cpu"  # device="cuda" is redirected
    monkeypatch.setattr(_cpu_support, "_ENABLED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RLError, match="refusing"):
        _cpu_support.enable_cpu_support()
    monkeypatch.undo()
    _cpu_support.disable_cpu_support()
    assert not _cpu_support.cpu_support_enabled()
    with pytest.raises((AssertionError, RuntimeError)):  # plain torch again: no CUDA here
        torch.zeros(1, device="cuda")


def test_entry_point_resolves_to_the_policy() -> None:
    """The trainer finds the policy by its registry name ``megatron`` (group ``rl.policies``)."""
    from rl_core import registry
    from rl_megatron.policy import MegatronPolicy

    assert "megatron" in registry.available("rl.policies")
    assert registry.resolve("rl.policies", "megatron") is MegatronPolicy


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only redirections")
def test_transformers_imports_after_the_redirections() -> None:
    """The redirected ``torch.cuda.Stream`` stays a class: transformers' continuous batching
    annotates ``torch.cuda.Stream | None`` at import, and a Megatron run that imported it after
    the redirections died with ``unsupported operand type(s) for |`` (e2e kill-and-resume)."""
    code = (
        "from rl_megatron import _cpu_support; _cpu_support.enable_cpu_support(); "
        "import torch; assert isinstance(torch.cuda.Stream(), torch.cuda.Stream); "
        "import transformers.generation.continuous_batching"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
