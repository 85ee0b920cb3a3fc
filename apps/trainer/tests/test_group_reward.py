"""Group rewards through the trainer: a ``group_reward`` in a recipe is built, trained on and
logged (the Scorer's own group-reward tests are in packages/rl-buffer/tests/test_scoring.py)."""

from __future__ import annotations


def test_group_reward_from_the_recipe_drives_training(tmp_path, tiny_recipe_dict):
    """``group_reward`` in a recipe: the trainer builds it, trains on it and logs the per-rollout
    reward next to it."""
    from rl_trainer.config import load_trainer_config
    from rl_trainer.loop import Trainer

    recipe = tiny_recipe_dict(
        tmp_path / "run", seed=3, group_reward={"type": "majority_vote"}, eval={"every": 0}
    )
    records = Trainer(load_trainer_config(recipe)).run()
    steps = [r for r in records if r["phase"] == "rl" and "rollout/reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert "rollout/rollout_reward_mean" in r  # the task's per-rollout reward, kept as a metric
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0  # majority agreement in [0, 1]
