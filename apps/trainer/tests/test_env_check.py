"""``rl-train check`` on an environment recipe (``reward: {type: env_reward}``): the reward
probe says it scores an environment's episode (not an agent's session) and scores a dry
episode instead of the dummy responses."""

from __future__ import annotations

from pathlib import Path

import pytest

import rl_trainer
from rl_trainer.check import check_recipe

RECIPE = Path(rl_trainer.__file__).parent / "recipes" / "env_reasoning_gym_multiturn.yaml"


def test_env_reward_is_described_as_an_environment_episode() -> None:
    pytest.importorskip("reasoning_gym")
    report = check_recipe(RECIPE, rows=1)
    assert report.problems == [], report.problems
    (train,) = [f for f in report.findings if f.where == "reward on train"]
    assert "an environment's episode (env_reward" in train.message, train.message
    assert "agent's session" not in train.message
    assert "the dry episode(s) on prompt" in train.message and "scored" in train.message
