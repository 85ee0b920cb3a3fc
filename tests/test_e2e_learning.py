"""The embedded default learns: a fixed-seed run of the demo recipe (shortened) raises the
held-out reward clearly above where RL started, and the report draws the curves."""

from __future__ import annotations

import json

import pytest

from rl_trainer.cli import recipe_path


@pytest.mark.slow
def test_demo_recipe_learns(tmp_path, cli):
    run_dir = tmp_path / "demo"
    proc = cli(
        "run",
        str(recipe_path("demo")),
        "--set",
        f"run_dir={run_dir}",
        "--set",
        "rl.steps=150",
        "--set",
        "eval.every=50",
        "--set",
        "logging.progress=false",
    )
    out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval/reward_mean") is not None]
    assert evals[0]["phase"] == "rl" and evals[0]["step"] == 0  # evaluated before the first update
    first, last = evals[0]["eval/reward_mean"], evals[-1]["eval/reward_mean"]
    assert last >= first + 0.1, f"eval reward {first:.3f} -> {last:.3f}"
    rl = [r for r in records if r["phase"] == "rl" and r["step"] > 0]
    early = sum(r["rollout/reward_mean"] for r in rl[:20]) / 20
    late = sum(r["rollout/reward_mean"] for r in rl[-20:]) / 20
    assert late > early + 0.05, f"training reward {early:.3f} -> {late:.3f}"
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
