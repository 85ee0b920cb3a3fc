"""Killing a run and resuming it ends with the same metrics and weights as an uninterrupted run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file


def _records(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _weights(run_dir):
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def test_kill_and_resume_matches_uninterrupted(tiny_recipe, cli, kill_after_checkpoint):
    recipe_a, run_a = tiny_recipe("straight", rl_steps=8)
    recipe_b, run_b = tiny_recipe("killed", rl_steps=8)

    proc = cli("run", str(recipe_a), "--no-report")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out

    # Kill the second run once an RL-phase checkpoint exists (global step 6 = 3 SFT + 3 RL).
    kill_after_checkpoint(recipe_b, run_b, 6)

    proc = cli("run", str(recipe_b), "--resume", "--no-report")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out

    a, b = _records(run_a), _records(run_b)
    assert [(r["phase"], r["step"]) for r in a] == [(r["phase"], r["step"]) for r in b]
    assert a == b  # rewards, losses, grad norms, KL, eval: identical after the resume
    wa, wb = _weights(run_a), _weights(run_b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(
        not torch.equal(wa[k], load_file(str(run_a / "sft_model" / "model.safetensors"))[k])
        for k in wa
    )


@pytest.mark.long
def test_resume_in_sft_phase(tiny_recipe, cli):
    """A checkpoint taken during the warm-up resumes the warm-up, then RL.

    Long tier (~20 s): ``make test`` resumes from an SFT-phase checkpoint exactly in
    ``test_e2e_stop.py::test_sigint_mid_sft_then_resume_is_exact``."""
    recipe_a, run_a = tiny_recipe("straight", rl_steps=2)
    recipe_b, run_b = tiny_recipe("killed", rl_steps=2)
    for recipe in (recipe_a,):
        proc = cli("run", str(recipe), "--no-report")
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
    # Run b: the warm-up only, then roll its run directory back to the state a kill right after
    # the first checkpoint (global step 2, inside the 3-step warm-up) would leave.
    proc = cli(
        "run", str(recipe_b), "--no-report", "--set", "rl.steps=0", "--set", "checkpoint.every=2"
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    # Keep only the SFT-phase checkpoint (step 2) and forget everything after it.
    for d in (run_b / "checkpoints").iterdir():
        if d.name != "step_000002":
            shutil.rmtree(d)
    shutil.rmtree(run_b / "sft_model")
    proc = cli("run", str(recipe_b), "--resume", "--no-report")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert _records(run_a) == _records(run_b)
