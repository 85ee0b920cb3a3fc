"""The embedded default learns: a fixed-seed run of the demo recipe (shortened) raises the
held-out reward clearly above where RL started, and the report draws the curves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rl_trainer.cli import recipe_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning_checks import CHECKS, assert_learns


@pytest.mark.slow
def test_demo_recipe_learns(tmp_path, cli):
    run_dir = tmp_path / "demo"
    sets = [f"run_dir={run_dir}", *CHECKS["demo150"].overrides]
    proc = cli("run", str(recipe_path("demo")), *[a for s in sets for a in ("--set", s)])
    out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval/reward_mean") is not None]
    assert evals[0]["phase"] == "rl" and evals[0]["step"] == 0  # evaluated before the first update
    assert_learns("demo150", records)  # held-out and training reward (margins: learning_checks)
    rl = [r for r in records if r["phase"] == "rl" and r["step"] > 0]
    required = {
        "step",
        "phase",
        "rollout/reward_mean",
        "train/loss",
        "train/grad_norm",
        "train/kl",
        "train/entropy",
        "perf/step_time",
        "perf/step_cpu_s",
        "perf/rollout_tokens_per_s",
        "perf/train_tokens_per_s",
    }
    assert required <= set(rl[-1]), required - set(rl[-1])
    assert all(isinstance(rl[-1][k], float) for k in required - {"step", "phase"})
    assert {r["phase"] for r in records} == {"sft", "rl"}
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert (run_dir / "tb").is_dir() and any((run_dir / "tb").iterdir())
