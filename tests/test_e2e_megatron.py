"""The Megatron-core policy (world of one process) in place of the reference policy: the demo
recipe learns (same loop, generator and algorithms, a different training backend), and a run
killed after a checkpoint resumes exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rl_trainer.cli import recipe_path

pytest.importorskip("megatron.core")


@pytest.mark.slow
@pytest.mark.long
def test_demo_learns_with_megatron_policy(tmp_path, cli):
    """Long tier (``make test-long``, ~65 s): in ``make test`` Megatron learns in
    ``test_e2e_ray``'s tensor- and data-parallel runs."""
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


def _records(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_megatron_run_killed_and_resumed_matches_uninterrupted(
    tiny_recipe, cli, kill_after_checkpoint
):
    """The trainer's checkpoints hold the Megatron policy's distributed checkpoint (weights and
    Adam state); a run killed after an RL checkpoint and resumed ends exactly like the
    uninterrupted run."""
    mega = ("--set", "policy.type=megatron")
    recipe_a, run_a = tiny_recipe("straight", rl_steps=5)
    recipe_b, run_b = tiny_recipe("killed", rl_steps=5)
    proc = cli("run", str(recipe_a), "--no-report", *mega)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    ckpt = kill_after_checkpoint(recipe_b, run_b, 6, *mega)  # 3 SFT + 3 RL steps
    assert (ckpt / "policy" / "megatron_dist").is_dir()
    proc = cli("run", str(recipe_b), "--resume", "--no-report", *mega)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    a, b = _records(run_a), _records(run_b)
    assert [(r["phase"], r["step"]) for r in a] == [(r["phase"], r["step"]) for r in b]
    assert a == b
    wa = load_file(str(run_a / "final_model" / "model.safetensors"))
    wb = load_file(str(run_b / "final_model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
