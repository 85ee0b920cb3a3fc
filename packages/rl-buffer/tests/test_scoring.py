"""Scoring (:class:`rl_buffer.scoring.Scorer`): rewards and group rewards fill each rollout's
reward; what a reward breaks (raises, returns a non-finite or wrong value, hangs past its time
limit or the round's deadline, or runs on past a stop) is marked failed and counted with its
first cause, never raised; the filters then drop failed rollouts and rejected groups."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from rl_buffer import bounded
from rl_buffer.failures import RolloutStats
from rl_buffer.filters import filter_groups
from rl_buffer.scoring import Scorer
from rl_core.rewards.group import MajorityVote
from rl_core.types import Group, Prompt, RolloutStatus


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


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "returned None; a reward returns a float or a mapping with a 'reward' key"),
        ("1.0", "returned '1.0'; a reward returns a float"),
        ((1.0, {"len": 2}), "returned tuple (1.0, {'len': 2}); a reward returns a float"),
        ({"reward": None}, "returned None under key 'reward'"),
        ({"score": 1.0}, "returned a mapping without the 'reward' key (keys: ['score'])"),
        (float("inf"), "returned inf; rewards must be finite numbers"),
    ],
)
def test_wrong_reward_values_are_invalid_with_their_cause(
    text_group, char_tokenizer, value, message
):
    g = text_group("g", ["ab", "ba"])
    stats = RolloutStats()
    asyncio.run(Scorer(lambda p, t, r: value, char_tokenizer).score([g], stats))
    assert stats.failed == {"reward_invalid": 2}
    assert all(r.status == RolloutStatus.FAILED for r in g.rollouts)
    assert message in stats.first["reward_invalid"].describe()
    assert "<lambda> is defined at" in stats.first["reward_invalid"].describe()


def test_group_reward_with_too_few_values_fails_its_group(text_group, char_tokenizer):
    g = text_group("g", ["ab", "ba", "aa"])
    stats = RolloutStats()
    scorer = Scorer(None, char_tokenizer, group_reward_fn=lambda p, texts, rs: [1.0])
    asyncio.run(scorer.score([g], stats))
    assert stats.failed == {"group_reward_invalid": 3}
    assert "returned 1 values for 3 rollouts" in stats.first["group_reward_invalid"].error


_FOREVER = threading.Event()  # never set: waiting on it is a call that never returns


def _hang_on(*texts: str):
    def reward(prompt, response, rollout=None):
        if response in texts:
            _FOREVER.wait()
        return 1.0

    return reward


def test_hung_sync_reward_is_abandoned_and_counted(text_group, char_tokenizer):
    """Two of four calls never return: each is given up after 0.3 s, its rollout fails with
    reward_timeout (cause: the time limit), the others are scored, in well under a second."""
    scorer = Scorer(_hang_on("x", "z"), char_tokenizer, timeout_s=0.3, reward_name="reward")
    g = text_group("p0", ["x", "y", "z", "w"])
    stats = RolloutStats()
    t0 = time.monotonic()
    asyncio.run(scorer.score([g], stats))
    took = time.monotonic() - t0
    assert 0.5 < took < 2.0, took
    assert stats.failed == {"reward_timeout": 2}
    assert (
        "did not return within 0.3 s (rollout.reward_timeout_s)"
        in stats.first["reward_timeout"].describe()
    )
    assert [r.reward for r in g.rollouts] == [None, 1.0, None, 1.0]
    assert scorer.caller.abandoned_threads == 2


def test_hung_async_reward_and_round_deadline(text_group, char_tokenizer):
    """An async reward that never returns is cancelled at the round's deadline even without a
    per-call limit."""

    async def reward(prompt, response, rollout=None):
        if response == "y":
            await asyncio.Event().wait()
        return 0.5

    scorer = Scorer(reward, char_tokenizer, timeout_s=None, round_timeout_s=0.4)
    g = text_group("p0", ["x", "y"])
    stats = RolloutStats()
    t0 = time.monotonic()
    asyncio.run(scorer.score([g], stats))
    assert time.monotonic() - t0 < 2.0
    assert stats.failed == {"reward_timeout": 1}
    assert "round's deadline" in stats.first["reward_timeout"].error
    assert [r.reward for r in g.rollouts] == [0.5, None]


def test_sync_rewards_still_run_in_rollout_order(text_group, char_tokenizer):
    seen: list[str] = []
    scorer = Scorer(lambda p, t, r=None: seen.append(t) or 1.0, char_tokenizer, timeout_s=5)
    asyncio.run(scorer.score([text_group("p0", list("abcdef"))], RolloutStats()))
    assert seen == list("abcdef")


def test_hung_async_reward_hits_its_per_call_limit(text_group, char_tokenizer):
    async def reward(prompt, response, rollout=None):
        if response == "x":
            await asyncio.Event().wait()
        return 1.0

    scorer = Scorer(reward, char_tokenizer, timeout_s=0.3, round_timeout_s=None)
    g = text_group("p0", ["x", "y"])
    stats = RolloutStats()
    t0 = time.monotonic()
    asyncio.run(scorer.score([g], stats))
    assert time.monotonic() - t0 < 1.5
    assert "did not return within 0.3 s" in stats.first["reward_timeout"].error


def test_calls_queued_behind_a_hung_one_meet_the_round_deadline(text_group, char_tokenizer):
    """Synchronous calls queue behind a hung one; at the round's deadline the running one and
    the queued ones are given up together."""
    scorer = Scorer(_hang_on("a"), char_tokenizer, timeout_s=None, round_timeout_s=0.4)
    g = text_group("p0", ["a", "b", "c"])
    stats = RolloutStats()
    t0 = time.monotonic()
    asyncio.run(scorer.score([g], stats))
    assert time.monotonic() - t0 < 1.5
    assert stats.failed == {"reward_timeout": 3}


def test_main_thread_rewards_run_inline(text_group, char_tokenizer):
    """math_equiv's own timeout is SIGALRM (main thread only): it is called on the main thread;
    other synchronous rewards in the worker thread."""
    from rl_core.rewards.math_answer import MathEquiv

    assert MathEquiv.main_thread
    threads: list[str] = []

    class Inline:
        main_thread = True

        def __call__(self, prompt, response, rollout=None):
            threads.append(threading.current_thread().name)
            return 1.0

    asyncio.run(
        Scorer(Inline(), char_tokenizer, timeout_s=5).score(
            [text_group("p", ["a"])], RolloutStats()
        )
    )
    asyncio.run(
        Scorer(
            lambda p, t, r=None: threads.append(threading.current_thread().name) or 1.0,
            char_tokenizer,
            timeout_s=5,
        ).score([text_group("p", ["a"])], RolloutStats())
    )
    assert threads == ["MainThread", "rl-user-call"]


def test_inline_rewards_run_on_the_calling_thread_without_a_worker(text_group, char_tokenizer):
    """A reward whose ``inline`` attribute is true (the trainer's built-in tasks) is called on the
    event loop's thread, in rollout order, with no worker thread started for it; its failures
    are counted as any reward's."""
    seen: list[tuple[str, str]] = []

    class Quick:
        inline = True

        def __call__(self, prompt, response, rollout=None):
            seen.append((threading.current_thread().name, response))
            if response == "bad":
                raise ValueError("no score")
            return 1.0

    before = {t.name for t in threading.enumerate()}
    scorer = Scorer(Quick(), char_tokenizer, timeout_s=5)
    stats = RolloutStats()
    asyncio.run(scorer.score([text_group("p", ["a", "bad", "c"])], stats))
    assert seen == [("MainThread", "a"), ("MainThread", "bad"), ("MainThread", "c")]
    assert "rl-user-call" not in {t.name for t in threading.enumerate()} - before
    assert stats.failed == {"reward_error": 1}


def test_a_hung_reward_is_abandoned_soon_after_a_registered_stop(text_group, char_tokenizer):
    """No per-call limit: only the stop check registered with :mod:`rl_buffer.bounded` (as
    the trainer's SIGTERM handler registers itself) gives up on the hung call, STOP_GRACE_S
    after the stop; once unregistered, the check no longer counts."""
    stopping = threading.Event()
    check = stopping.is_set
    bounded.add_stop_check(check)
    try:
        assert not bounded.stop_requested()
        threading.Timer(0.2, stopping.set).start()
        # The round's deadline only keeps this test from hanging when the stop is not seen.
        scorer = Scorer(_hang_on("a"), char_tokenizer, timeout_s=None, round_timeout_s=6.0)
        stats = RolloutStats()
        t0 = time.monotonic()
        asyncio.run(scorer.score([text_group("p0", ["a"])], stats))
        took = time.monotonic() - t0
        assert bounded.STOP_GRACE_S < took < bounded.STOP_GRACE_S + 2.0, took
        assert stats.failed == {"reward_timeout": 1}
        assert "when the run stopped" in stats.first["reward_timeout"].error
        assert bounded.stop_requested()
    finally:
        bounded.remove_stop_check(check)
    assert not bounded.stop_requested()
