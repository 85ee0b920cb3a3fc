"""The Policy conformance suite at TP=2, PP=2 and DP=2: ``_conformance_ranks.py`` under pytest in
two processes (gloo on 127.0.0.1, one thread each); this test checks both ranks passed it."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

RANKS_FILE = Path(__file__).with_name("_conformance_ranks.py")
MIN_PASSED = 3 * 12
"""Three layouts x (the 11 standard tests MegatronPolicy supports + the no-override guard)."""
MAX_SKIPPED = 6
"""Once per layout: ``test_offload_onload`` (``supports_offload`` is False) and
``test_lora_trains_adapter_only`` (these policies have no ``lora``; the LoRA suite runs in
``test_lora.py``)."""


def test_conformance_suite_at_tp2_pp2_and_dp2(tmp_path: Path, launch_ranks: Any) -> None:
    """Every standard test passes on both ranks at TP=2, PP=2 and DP=2: no failure, xfail or
    skip beyond the suite's own optional-capability skips (offload and LoRA, one each per
    layout)."""
    outs = launch_ranks(
        lambda rank: [
            sys.executable,
            "-m",
            "pytest",
            str(RANKS_FILE),
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:warnings",
            f"--basetemp={tmp_path / f'rank{rank}'}",
        ],
        2,
        timeout=240,
        env={"RL_MEGATRON_SHARED_TMP": str(tmp_path / "shared"), "PYTHONWARNINGS": ""},
        check=False,
    )
    for rank, (code, out) in enumerate(outs):
        summary = out.strip().splitlines()[-1] if out.strip() else ""
        assert code == 0, f"rank {rank} failed:\n{out[-6000:]}"
        counts = {k: int(n) for n, k in re.findall(r"(\d+) ([a-z]+)", summary)}
        assert set(counts) <= {"passed", "skipped"}, f"rank {rank}: {summary}"
        assert counts.get("passed", 0) >= MIN_PASSED, f"rank {rank}: {summary}"
        assert counts.get("skipped", 0) <= MAX_SKIPPED, f"rank {rank}: {summary}"
