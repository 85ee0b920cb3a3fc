"""Samples that give no gradient are left out of the forward and backward passes
(``rl.skip_zero_advantage``, on by default) and the update stays the same: a run with the skip
ends with the weights of the run without it, up to the order of floating-point sums; the share
skipped is logged; terms that give such samples gradient turn the skip off."""

from __future__ import annotations

import pytest
import torch

from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer


def half_equal_reward(prompt, response: str, rollout=None) -> float:
    """All-equal rewards (advantage 0) for prompts of even length, spread rewards otherwise."""
    if len(prompt.token_ids) % 2 == 0:
        return 0.5
    return sum(map(ord, response)) % 7 / 7


def _run(tiny_recipe_dict, run_dir, skip: bool, **algorithm):
    recipe = tiny_recipe_dict(
        run_dir,
        seed=3,
        reward={"type": f"{__file__}:half_equal_reward"},
        rollout={
            "prompts_per_step": 6,
            "n_samples": 4,
            "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        },
        policy={"type": "hf", "lr": 0.01},
        algorithm={"advantage": "grpo", **algorithm},
        rl={"steps": 3, "skip_zero_advantage": skip, "max_tokens_per_micro_batch": 64},
        eval={"every": 0},
    )
    trainer = Trainer(load_trainer_config(recipe))
    records = trainer.run()
    weights = {n: t.detach().clone() for n, t in trainer.policy.named_weights()}
    return [r for r in records if r.get("phase") == "rl" and "train/loss" in r], weights


def test_skip_gives_the_same_update(tiny_recipe_dict, tmp_path) -> None:
    on, w_on = _run(tiny_recipe_dict, tmp_path / "on", skip=True)
    off, w_off = _run(tiny_recipe_dict, tmp_path / "off", skip=False)
    skipped = [r["train/skipped_samples_frac"] for r in on]
    assert all(s > 0 for s in skipped), skipped  # the even-length prompts' groups were left out
    assert all("train/skipped_samples_frac" not in r for r in off)
    assert w_on.keys() == w_off.keys()
    # lr 0.01 over 3 steps moves weights by ~1e-2; the runs differ by float rounding only
    # (measured: <= 7e-7, and 8e-6 on k_proj.bias, whose exact gradient is 0 so Adam scales its
    # rounding noise up)
    for name in w_on:
        torch.testing.assert_close(w_on[name], w_off[name], rtol=0, atol=5e-5, msg=name)
    # the same rollouts were sampled (the weights agree step by step) and the losses agree
    for a, b in zip(on, off, strict=True):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-7)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)


def test_an_entropy_bonus_turns_the_skip_off(tiny_recipe_dict, tmp_path) -> None:
    on, _ = _run(tiny_recipe_dict, tmp_path / "ent", skip=True, loss={"entropy_coef": 0.01})
    assert all("train/skipped_samples_frac" not in r for r in on)
