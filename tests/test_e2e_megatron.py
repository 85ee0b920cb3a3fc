"""The demo recipe learns with the Megatron-core policy (world of one process) in place of the
reference policy: same loop, generator and algorithms, a different training backend."""

from __future__ import annotations

import json

import pytest

from rl_trainer.cli import recipe_path

pytest.importorskip("megatron.core")


@pytest.mark.slow
def test_demo_learns_with_megatron_policy(tmp_path, cli):
    run_dir = tmp_path / "demo_megatron"
    proc = cli(
        "run",
        str(recipe_path("demo")),
        "--no-report",
        "--set",
        f"run_dir={run_dir}",
        "--set",
        "policy.type=megatron",
        "--set",
        "rl.steps=100",
        "--set",
        "eval.every=50",
        "--set",
        "logging.progress=false",
        "--set",
        "logging.tensorboard=false",
    )
    out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/reward_mean"] for r in records if r.get("eval/reward_mean") is not None]
    assert evals[-1] >= evals[0] + 0.08, evals
    assert (run_dir / "final_model" / "config.json").exists()
