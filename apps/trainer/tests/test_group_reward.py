"""Group rewards in the trainer's Scorer: a GroupRewardFn (majority vote) scores each group as a
whole, is what is trained on, keeps the per-rollout reward as metrics, and its failures are
counted, never raised."""

from __future__ import annotations

import asyncio

from rl_buffer.failures import RolloutStats
from rl_buffer.filters import filter_groups
from rl_buffer.scoring import Scorer
from rl_core.rewards.group import MajorityVote
from rl_core.types import RolloutStatus


def exact(prompt, response, rollout):
    if response == "boom":
        raise ValueError("bad rollout")
    return float(response == prompt.label)


def test_majority_vote_is_trained_on_and_label_reward_kept_as_metric(text_group, char_tokenizer):
    g1 = text_group(
        "a", ["19", "19", "18", "boom"], label="19"
    )  # majority 19 (the failed rollout cannot vote)
    g2 = text_group("b", ["7", "8"], label="7")  # tie: no consensus, all 0
    stats = RolloutStats()
    scorer = Scorer(exact, char_tokenizer, group_reward_fn=MajorityVote())
    asyncio.run(scorer.score([g1, g2], stats))
    assert [r.reward for r in g1.rollouts[:3]] == [1.0, 1.0, 0.0]
    assert g1.rollouts[3].status == RolloutStatus.FAILED and g1.rollouts[3].reward is None
    assert g1.rollouts[0].reward_info["rollout_reward"] == 1.0  # label accuracy kept
    assert g1.rollouts[2].reward_info["rollout_reward"] == 0.0
    assert g1.rollouts[0].reward_info["agreement"] == 2 / 3
    assert [r.reward for r in g2.rollouts] == [0.0, 0.0]
    assert g2.rollouts[0].reward_info["rollout_reward"] == 1.0
    assert stats.failed == {"reward_error": 1}
    kept = filter_groups([g1, g2], [], stats)
    assert [len(g.rollouts) for g in kept] == [3, 2]


def test_group_reward_alone_label_free(text_group, char_tokenizer):
    g = text_group("a", ["5", "5", "6"], label=None)
    asyncio.run(
        Scorer(None, char_tokenizer, group_reward_fn=MajorityVote()).score([g], RolloutStats())
    )
    assert [r.reward for r in g.rollouts] == [1.0, 1.0, 0.0]


def test_group_reward_failures_fail_the_group_and_are_counted(text_group, char_tokenizer):
    def raises(prompt, responses, rollouts):
        raise RuntimeError("judge down")

    def short(prompt, responses, rollouts):
        return [1.0]

    async def nan(prompt, responses, rollouts):
        return [float("nan")] * len(responses)

    for fn, reason in (
        (raises, "group_reward_error"),
        (short, "group_reward_invalid"),
        (nan, "group_reward_invalid"),
    ):
        g = text_group("a", ["1", "2"], label="19")
        stats = RolloutStats()
        asyncio.run(Scorer(exact, char_tokenizer, group_reward_fn=fn).score([g], stats))
        assert [r.status for r in g.rollouts] == [RolloutStatus.FAILED] * 2, reason
        assert stats.failed == {reason: 2}
        assert reason in g.rollouts[0].metadata["failure"]
        assert filter_groups([g], [], stats) == []


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
