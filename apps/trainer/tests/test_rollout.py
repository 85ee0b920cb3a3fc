"""Scoring with failure accounting, filters, seeds and the built-in tasks."""

from __future__ import annotations

import asyncio
import math

from rl_buffer.failures import RolloutStats
from rl_buffer.filters import filter_groups
from rl_buffer.rollout import derive_seed
from rl_buffer.scoring import Scorer
from rl_core.types import Group, Prompt, RolloutStatus
from rl_trainer.tasks import AdditionTask, ReverseTask, position_match


def test_scorer_marks_failures_and_counts_them(text_group, char_tokenizer):
    def reward(prompt, response, rollout):
        if response == "boom":
            raise ValueError("bad")
        if response == "nan":
            return math.nan
        if response == "nokey":
            return {"score": 1.0}
        return {"reward": float(response == prompt.label), "len": len(response)}

    g = text_group("g", ["ab", "boom", "nan", "nokey", "xx"])
    stats = RolloutStats()
    asyncio.run(Scorer(reward, char_tokenizer).score([g], stats))
    assert [r.status for r in g.rollouts] == [
        RolloutStatus.COMPLETED,
        RolloutStatus.FAILED,
        RolloutStatus.FAILED,
        RolloutStatus.FAILED,
        RolloutStatus.COMPLETED,
    ]
    assert g.rollouts[0].reward == 1.0 and g.rollouts[0].reward_info["len"] == 2.0
    assert stats.failed == {"reward_error": 1, "reward_invalid": 2}
    assert "bad" in g.rollouts[1].metadata["failure"]
    kept = filter_groups([g], [], stats)
    assert len(kept) == 1 and len(kept[0].rollouts) == 2  # uneven group after removing failures


def test_async_reward_and_filters(text_group, char_tokenizer):
    async def reward(prompt, response, rollout):
        return float(response == prompt.label)

    same = text_group("same", ["xx", "yy"])
    mixed = text_group("mixed", ["ab", "yy"])
    stats = RolloutStats()
    asyncio.run(Scorer(reward, char_tokenizer).score([same, mixed], stats))

    def zero_std(group):
        rewards = [r.reward for r in group.rollouts]
        return None if max(rewards) > min(rewards) else "zero_std"

    kept = filter_groups([same, mixed], [zero_std], stats)
    assert [g.uid for g in kept] == ["mixed"]
    assert stats.dropped == {"zero_std": 1}


def test_seeds_are_stable_and_distinct():
    assert derive_seed(1, "rl", 3, 0, 1) == derive_seed(1, "rl", 3, 0, 1)
    seeds = {derive_seed(1, "rl", 3, i, j) for i in range(20) for j in range(8)}
    assert len(seeds) == 160 and all(0 <= s < 2**31 for s in seeds)


def test_tasks_score_and_hold_out():
    assert position_match("dcba", "dcba") == 1.0
    assert position_match("dcb", "dcba") == 0.75
    assert position_match("dcbaa", "dcba") == 0.8
    assert position_match("", "ab") == 0.0
    t = ReverseTask(ReverseTask.Config(n_train=200, n_eval=20))
    train = {e["prompt"] for e in t.examples("train")}
    evals = [e["prompt"] for e in t.examples("eval")]
    assert len(set(evals)) == 20 and not train & set(evals)
    assert all(e["label"] == e["prompt"][:-1][::-1] for e in t.examples("train"))
    assert t.score("cba", "abc") == {"reward": 1 / 3, "exact": 0.0}
    assert t.score("cba", "cba") == {"reward": 1.0, "exact": 1.0}
    a = AdditionTask(AdditionTask.Config(n_train=50, n_eval=10))
    ex = a.examples("eval")[0]
    x, y = ex["prompt"][:-1].split("+")
    assert ex["label"] == str(int(x) + int(y))
    assert a.score(ex["label"], ex["label"])["exact"] == 1.0


def test_engine_error_results_are_failed_rollouts_and_counted(char_tokenizer):
    from rl_buffer.rollout import rollout_from_result
    from rl_core.types import FinishReason, GenerationResult

    prompt = Prompt(uid="p", input="x", token_ids=(1, 2), label="ab")
    err = GenerationResult(
        request_id="r",
        output_ids=(),
        output_logprobs=(),
        finish_reason=FinishReason.ERROR,
        weight_version=0,
    )
    r = rollout_from_result(prompt, err, "p/0")
    assert r.status == RolloutStatus.FAILED and r.metadata["failure"] == "generation_error"
    stats = RolloutStats()
    asyncio.run(
        Scorer(lambda *a: 1.0, char_tokenizer).score([Group(prompt=prompt, rollouts=[r])], stats)
    )
    assert stats.failed == {"generation_error": 1} and r.reward is None
