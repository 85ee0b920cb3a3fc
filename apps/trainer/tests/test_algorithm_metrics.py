"""What the train metrics mean, whatever the algorithm: per-token metrics are per-token means
under Dr.GRPO's constant aggregation too, and ``train/kl`` is the KL to the reference only."""

from __future__ import annotations

import math

import pytest

from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer


def parity_reward(prompt, response, rollout) -> float:
    """A reward that varies across a random model's samples."""
    return float(sum(rollout.tokens[rollout.response_start :]) % 3) / 2


def _first_step(tmp_path, tiny_recipe_dict, name, **algorithm):
    recipe = tiny_recipe_dict(
        tmp_path / name,
        seed=3,
        rl={"steps": 1},
        reward={"type": f"{__file__}:parity_reward"},
        algorithm=algorithm,
    )
    records = Trainer(load_trainer_config(recipe)).run()
    (step,) = [r for r in records if r["phase"] == "rl" and r["step"] == 1]
    return step


def test_constant_aggregation_logs_per_token_means(tmp_path, tiny_recipe_dict):
    """The same first step (same seed, same rollouts, same weights) under token-mean and
    Dr.GRPO's constant aggregation: the loss differs, the per-token metrics do not (before the
    fix they were scaled by tokens / (constant * sequences): entropy 0.44 against 5.55)."""
    token = _first_step(tmp_path, tiny_recipe_dict, "token", aggregation="token")
    const = _first_step(
        tmp_path, tiny_recipe_dict, "constant", aggregation="constant", aggregation_constant=50
    )
    assert token["rollout/reward_mean"] == const["rollout/reward_mean"]  # the same rollouts
    for key in ["train/entropy", "train/mismatch"]:
        assert key in token and key in const, key
        assert math.isfinite(token[key])
        assert const[key] == pytest.approx(token[key], rel=1e-4, abs=1e-7), key
    assert token["train/entropy"] > 0.1  # a real per-token entropy, not a vanishing number


def test_train_kl_is_the_reference_kl_only(tmp_path, tiny_recipe_dict):
    """Without a reference model there is no train/kl (it used to carry the PPO KL under that
    name); the policy's move over the step stays train/ppo_kl. With a reference, train/kl is
    the KL to it."""
    no_ref = _first_step(tmp_path, tiny_recipe_dict, "noref")
    assert no_ref.get("train/kl") is None
    assert "train/ppo_kl" in no_ref
    ref = _first_step(tmp_path, tiny_recipe_dict, "ref", use_reference=True)
    assert ref["train/kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
    assert "train/ppo_kl" in ref
