"""Asynchronous generation (``rl.async_generation``) on the local runtime.

- ``max_staleness = 0`` reproduces the synchronous run exactly (metrics and final weights), also
  when dynamic sampling carries surplus groups over and the bound drops them;
- ``max_staleness = 1`` trains on data exactly one version old, and its runs are reproducible:
  killed and resumed, it ends like the uninterrupted run, and with the generator in a process
  of its own (``runtime.generator_process``) it is the same run;
- on the demo task an async run with staleness 1 (and TIS) learns.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rl_trainer.cli import recipe_path

ASYNC = ("--set", "rl.async_generation=true")


def _run(cli, recipe, *overrides):
    proc = cli("run", str(recipe), "--no-report", *overrides)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _records(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in _rows(run_dir)]


def _weights(run_dir):
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def _same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_staleness_zero_reproduces_sync(tiny_recipe, cli):
    recipe, sync = tiny_recipe("sync", rl_steps=6)
    recipe0, async0 = tiny_recipe("async0", rl_steps=6)
    recipe1, async1 = tiny_recipe("async1", rl_steps=6)
    recipe1p, async1p = tiny_recipe("async1p", rl_steps=6)
    _run(cli, recipe)
    _run(cli, recipe0, *ASYNC, "--set", "rl.max_staleness=0")
    _run(cli, recipe1, *ASYNC, "--set", "rl.max_staleness=1")
    # The generator in a process of its own (runtime.generator_process) is the same run.
    proc = ("--set", "runtime.generator_process=true")
    _run(cli, recipe1p, *ASYNC, "--set", "rl.max_staleness=1", *proc)
    assert _records(async1p) == _records(async1)
    assert _same_weights(_weights(async1p), _weights(async1))

    base = _records(sync)
    assert _records(async0) == base
    assert _same_weights(_weights(async0), _weights(sync))
    # Staleness 1 really is a different run: every step after the first trains on data one
    # version old, so the weights differ.
    rl1 = [r for r in _rows(async1) if r["phase"] == "rl" and r["step"] > 0]
    assert [r["rollout/staleness_max"] for r in rl1] == [0] + [1] * 5
    assert all(r["rollout/staleness_mean"] == 1.0 for r in rl1[1:])
    assert all(r["rollout/off_policy_frac"] == 1.0 for r in rl1[1:])
    assert all(r["rollout/stale_dropped"] == 0 for r in rl1)
    assert not _same_weights(_weights(async1), _weights(sync))
    assert all(r["rollout/staleness_max"] == 0 for r in base if r["phase"] == "rl" and r["step"])


def test_staleness_zero_with_dropped_surplus_matches_sync(tiny_recipe, cli):
    """Over-sampling leaves surplus groups one version old; with max_staleness 0 they are
    dropped before training, identically in both modes."""
    over = ("--set", "rollout.over_sampling_factor=2", "--set", "rl.max_staleness=0")
    recipe, sync = tiny_recipe("sync", rl_steps=4)
    recipe0, async0 = tiny_recipe("async0", rl_steps=4)
    _run(cli, recipe, *over)
    _run(cli, recipe0, *over, *ASYNC)
    rl = [r for r in _rows(sync) if r["phase"] == "rl" and r["step"] > 0]
    assert [r["rollout/stale_dropped"] for r in rl] == [0, 4, 4, 4]
    assert all(r["rollout/staleness_max"] == 0 for r in rl)
    assert _records(async0) == _records(sync)
    assert _same_weights(_weights(async0), _weights(sync))


def test_mask_older_than_zero_masks_stale_tokens(tiny_recipe, cli):
    """With staleness 1 and ``rl.mask_older_than=0`` only step 1 (on-policy) has a loss."""
    recipe, run = tiny_recipe("masked", rl_steps=3)
    _run(cli, recipe, *ASYNC, "--set", "rl.mask_older_than=0")
    rl = [r for r in _rows(run) if r["phase"] == "rl" and r["step"] > 0]
    assert [r["rollout/staleness_max"] for r in rl] == [0, 1, 1]
    assert rl[0]["train/grad_norm"] > 0
    assert [r["train/grad_norm"] for r in rl[1:]] == [0.0, 0.0]


def test_async_kill_and_resume_matches_uninterrupted(tiny_recipe, cli, kill_after_checkpoint):
    recipe_a, run_a = tiny_recipe("straight", rl_steps=8)
    recipe_b, run_b = tiny_recipe("killed", rl_steps=8)
    _run(cli, recipe_a, *ASYNC)
    # Kill once an RL-phase checkpoint exists (global step 6 = 3 SFT + 3 RL steps): the round
    # of step 4 was already produced and sits in the checkpointed buffer.
    marker = kill_after_checkpoint(recipe_b, run_b, 6, *ASYNC) / "COMPLETE"
    state = torch.load(marker.parent / "trainer_state.pt", weights_only=True)
    assert list(state["pipeline"]["ready"]) == [4] and len(state["buffer"]["groups"]) == 4
    _run(cli, recipe_b, "--resume", *ASYNC)

    a, b = _records(run_a), _records(run_b)
    assert [(r["phase"], r["step"]) for r in a] == [(r["phase"], r["step"]) for r in b]
    assert a == b
    assert _same_weights(_weights(run_a), _weights(run_b))
    assert all(r["rollout/staleness_max"] == 1 for r in a if r["phase"] == "rl" and r["step"] > 1)


@pytest.mark.slow
@pytest.mark.long
def test_async_demo_learns_with_tis(tmp_path, cli):
    """Long tier (``make test-long``, ~50 s): in ``make test`` staleness-1 async runs learn in
    ``test_e2e_ray`` and TIS's weights are checked in ``rl-core``'s loss tests."""
    run_dir = tmp_path / "demo_async"
    proc = cli(
        "run",
        str(recipe_path("demo")),
        "--no-report",
        *ASYNC,
        "--set",
        "rl.max_staleness=1",
        "--set",
        "algorithm.loss.correction=tis",
        "--set",
        f"run_dir={run_dir}",
        "--set",
        "rl.steps=150",
        "--set",
        "eval.every=50",
        "--set",
        "logging.progress=false",
        "--set",
        "logging.tensorboard=false",
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    rows = _rows(run_dir)
    evals = [r["eval/reward_mean"] for r in rows if r.get("eval/reward_mean") is not None]
    assert evals[-1] >= evals[0] + 0.1, f"eval reward {evals}"
    rl = [r for r in rows if r["phase"] == "rl" and r["step"] > 0]
    assert all(r["rollout/staleness_max"] <= 1 for r in rl)
    assert sum(r["rollout/staleness_mean"] for r in rl) / len(rl) > 0.9  # really off-policy
    # The behaviour policy (one version old) differs from the trained one: TIS has work to do.
    assert all(r["train/mismatch"] > 0.01 for r in rl[1:])
    assert all(0 < r["train/tis_weight_mean"] <= 2.0 for r in rl)


def test_partial_rollouts_resume_across_weight_updates(tiny_recipe, cli):
    """``rl.partial_rollouts``: the generator (one request at a time, so a round outlasts a
    training step) is interrupted by weight updates; aborted rollouts resume on the new version,
    so rollouts span versions, never beyond ``max_staleness``, and the run finishes."""
    recipe, run = tiny_recipe("partial", rl_steps=8)
    _run(
        cli,
        recipe,
        *ASYNC,
        "--set",
        "rl.partial_rollouts=true",
        "--set",
        "generator.max_batch_size=1",
        "--set",
        "rollout.sampling.max_new_tokens=12",
        "--set",
        "algorithm.loss.correction=tis",
        # No eval or checkpoint mid-run: they drain the producer, so no update lands mid-round.
        "--set",
        "eval.every=0",
        "--set",
        "checkpoint.every=0",
    )
    rl = [r for r in _rows(run) if r["phase"] == "rl" and r["step"] > 0]
    assert len(rl) == 8 and (run / "final_model").exists()
    assert sum(r["rollout/partial_interruptions"] for r in rl) >= 2
    assert sum(r["rollout/partial_resumed"] for r in rl) >= 2
    assert any(r["rollout/multi_version_frac"] > 0 for r in rl)  # cut mid-response, resumed
    assert all(r["rollout/staleness_max"] <= 1 for r in rl)
    # Fresher than plain staleness-1 async (every token one version old after step 1).
    assert sum(r["rollout/staleness_mean"] for r in rl[1:]) / len(rl[1:]) < 1.0
