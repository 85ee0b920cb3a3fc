"""Group filters and the dynamic (over-)sampler."""

from __future__ import annotations

import asyncio
import math

import pytest

from rl_buffer.filters import FailedStatusFilter, OverlongFilter, RewardStdFilter, apply_filters
from rl_buffer.sampler import DynamicSampler, SamplingExhaustedError
from rl_core.errors import ConfigError
from rl_core.interfaces import GroupFilter
from rl_core.testing.buffer import make_group
from rl_core.types import RolloutStatus


def test_reward_std_filter():
    f = RewardStdFilter()
    assert isinstance(f, GroupFilter)
    assert f(make_group("a", rewards=[1.0, 0.0])) is None
    assert f(make_group("b", rewards=[1.0, 1.0, 1.0])) == "zero_reward_std"
    assert f(make_group("c", n=1, rewards=[1.0])) == "too_few_rollouts"
    assert f(make_group("d", rewards=[1.0, math.nan])) == "nonfinite_reward"
    g = make_group("e", rewards=[0.5, 0.5])
    g.rollouts[0].reward = None
    assert f(g) == "nonfinite_reward"
    # population std of [0, 0.1] is 0.05
    assert (
        RewardStdFilter(RewardStdFilter.Config(min_std=0.05))(make_group("f", rewards=[0.0, 0.1]))
        == "zero_reward_std"
    )
    assert (
        RewardStdFilter(RewardStdFilter.Config(min_std=0.049))(make_group("f", rewards=[0.0, 0.1]))
        is None
    )


def test_overlong_filter():
    g = make_group("t", n=4, response_length=5)
    g.rollouts[1].status = RolloutStatus.TRUNCATED
    assert OverlongFilter()(g) == "overlong"
    assert OverlongFilter(OverlongFilter.Config(max_truncated_fraction=0.25))(g) is None
    assert OverlongFilter()(make_group("ok", response_length=5)) is None
    cap = OverlongFilter(OverlongFilter.Config(max_response_tokens=4))
    assert cap(make_group("long", response_length=5)) == "overlong"
    assert cap(make_group("short", response_length=4)) is None


def test_failed_status_filter():
    f = FailedStatusFilter()
    assert f(make_group("ok")) is None
    assert f(make_group("x", status=RolloutStatus.FAILED)) == "failed"
    assert f(make_group("y", status=RolloutStatus.ABORTED)) == "aborted"
    g = make_group("z", n=4)
    g.rollouts[0].status = RolloutStatus.FAILED
    assert f(g) == "failed"
    assert FailedStatusFilter(FailedStatusFilter.Config(max_failed_fraction=0.25))(g) is None


def test_apply_filters_first_reason_wins_and_plain_functions_work():
    g = make_group("a", rewards=[1.0, 1.0], status=RolloutStatus.FAILED)
    assert apply_filters(g, [FailedStatusFilter(), RewardStdFilter()]) == "failed"
    assert apply_filters(g, [RewardStdFilter(), FailedStatusFilter()]) == "zero_reward_std"
    assert apply_filters(g, [lambda g: None]) is None
    assert apply_filters(make_group("b"), []) is None


def test_filter_config_validation():
    with pytest.raises(ConfigError, match="max_truncated_fraction"):
        OverlongFilter.Config(max_truncated_fraction=1.5)
    with pytest.raises(ConfigError, match="min_std"):
        RewardStdFilter.Config(min_std=-1)
    with pytest.raises(ConfigError, match="batch_size"):
        DynamicSampler.Config(batch_size=0)


def _producer(keep_every: int):
    """Makes n groups; every `keep_every`-th has distinct rewards, the others are all-equal."""
    counter = {"i": 0, "requests": []}

    def produce(n):
        counter["requests"].append(n)
        out = []
        for _ in range(n):
            i = counter["i"]
            counter["i"] += 1
            rewards = [0.0, 1.0] if i % keep_every == 0 else [1.0, 1.0]
            out.append(make_group(f"g{i}", rewards=rewards))
        return out

    return produce, counter


def test_sampler_over_samples_until_full_and_counts_drops():
    sampler = DynamicSampler(DynamicSampler.Config(batch_size=4), [RewardStdFilter()])
    produce, c = _producer(keep_every=3)
    batch = sampler.fill(produce)
    assert [g.uid for g in batch] == ["g0", "g3", "g6", "g9"]
    # first request 4 (keep rate unknown), then 4 missing... over the observed rate
    assert c["requests"][0] == 4
    m = sampler.last_step_metrics
    assert m["rollout/dynamic_filter/seen"] == c["i"]
    assert m["rollout/dynamic_filter/kept"] == 4 + sampler.num_kept
    assert (
        m["rollout/dynamic_filter/drop_zero_reward_std"]
        == c["i"] - m["rollout/dynamic_filter/kept"]
    )
    assert m["rollout/dynamic_filter/surplus"] == sampler.num_kept
    # the second request used the observed keep rate 2/4 -> ceil(2 / 0.5) = 4
    assert c["requests"][1] == 4


def test_sampler_surplus_carries_over_and_state_round_trips():
    sampler = DynamicSampler(DynamicSampler.Config(batch_size=2, over_sampling_factor=2.0))
    produce, _ = _producer(keep_every=1)
    assert [g.uid for g in sampler.fill(produce)] == ["g0", "g1"]
    assert sampler.num_kept == 2  # asked for 4 (factor 2), kept all
    other = DynamicSampler(DynamicSampler.Config(batch_size=2))
    other.load_state_dict(sampler.state_dict())
    assert other.full and other.request_size() == 0
    assert [g.uid for g in other.pop_batch()] == ["g2", "g3"]
    assert other.totals == sampler.totals


def test_sampler_gives_up_after_max_rounds():
    sampler = DynamicSampler(DynamicSampler.Config(batch_size=2, max_rounds=3), [RewardStdFilter()])
    produce, c = _producer(keep_every=10**9)  # only g0 is kept
    with pytest.raises(SamplingExhaustedError, match="zero_reward_std"):
        sampler.fill(produce)
    # keep rate 1/2 after round one -> ceil(1 / 0.5) = 2; 1/4 after round two -> 4
    assert c["requests"] == [2, 2, 4]


def test_sampler_async_fill():
    sampler = DynamicSampler(DynamicSampler.Config(batch_size=3), [RewardStdFilter()])
    produce, _ = _producer(keep_every=2)

    async def aproduce(n):
        return produce(n)

    batch = asyncio.run(sampler.afill(aproduce))
    assert [g.uid for g in batch] == ["g0", "g2", "g4"]


def test_pop_batch_when_not_full_raises():
    with pytest.raises(RuntimeError, match="need 1"):
        DynamicSampler(DynamicSampler.Config(batch_size=1)).pop_batch()


def test_drop_older_than_removes_only_stale_carry_over():
    """Surplus kept groups older than the staleness bound are dropped and counted."""
    from rl_buffer.sampler import DynamicSampler
    from rl_core.testing.buffer import make_group

    sampler = DynamicSampler(DynamicSampler.Config(batch_size=1))
    old, new = make_group("old", versions=3), make_group("new", versions=5)
    sampler.add([old, new])
    assert sampler.drop_older_than(4) == 1
    assert sampler.totals["drop_stale"] == 1
    assert [g.uid for g in sampler.pop_batch()] == [new.uid]
    assert sampler.drop_older_than(100) == 0
