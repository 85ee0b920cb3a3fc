"""GroupBuffer: conformance, staleness control, off-policy masking, partial rollouts."""

from __future__ import annotations

import json

import pytest

from rl_buffer.buffer import GroupBuffer
from rl_core.errors import CheckpointError, ConfigError
from rl_core.testing.buffer import BufferConformance, make_group
from rl_core.types import RolloutStatus


class TestGroupBuffer(BufferConformance):
    supports_partial = True

    @pytest.fixture
    def buffer_factory(self):
        return lambda: GroupBuffer(GroupBuffer.Config())


class TestGroupBufferStaleRecycle(BufferConformance):
    supports_partial = True

    @pytest.fixture
    def buffer_factory(self):
        return lambda: GroupBuffer(
            GroupBuffer.Config(max_staleness=2, on_stale="recycle", mask_offpolicy_tokens=True)
        )


def test_max_staleness_from_policy_version_drops_and_counts():
    buf = GroupBuffer(GroupBuffer.Config(max_staleness=1))
    buf.put([make_group(f"v{v}", versions=v) for v in (3, 4, 5, 2, 5)])
    out = buf.take(3, policy_version=5)  # bound 4: v3 and v2 are stale
    assert [g.uid for g in out] == ["v4", "v5", "v5"]
    assert buf.counters["stale_dropped"] == 2
    assert buf.stats()["buffer/stale_dropped"] == 2.0
    assert len(buf) == 0


def test_explicit_min_version_and_staleness_take_the_stricter_bound():
    buf = GroupBuffer(GroupBuffer.Config(max_staleness=3))
    buf.put([make_group("a", versions=6), make_group("b", versions=8)])
    assert [g.uid for g in buf.take(1, min_version=7, policy_version=8)] == ["b"]
    assert buf.counters["stale_dropped"] == 1


def test_recycle_returns_prompts_of_stale_groups():
    buf = GroupBuffer(GroupBuffer.Config(max_staleness=0, on_stale="recycle"))
    old = make_group("old", versions=1)
    buf.put([old, make_group("new", versions=2)])
    assert buf.take(2, policy_version=2) is None
    assert [p.uid for p in buf.pop_recycled()] == ["old"]
    assert buf.pop_recycled() == []
    assert [g.uid for g in buf.take(1, policy_version=2)] == ["new"]


def test_no_bound_without_max_staleness():
    buf = GroupBuffer()
    buf.put([make_group("ancient", versions=0)])
    assert [g.uid for g in buf.take(1, policy_version=100)] == ["ancient"]


def test_mask_offpolicy_tokens_zeroes_older_tokens_only():
    g = make_group("p", n=1, response_length=4)
    r = g.rollouts[0]
    from dataclasses import replace

    g.rollouts[0] = replace(r, versions=(3, 3, 4, 4), loss_mask=(1, 0, 1, 1))
    buf = GroupBuffer(GroupBuffer.Config(mask_offpolicy_tokens=True))
    buf.put([g])
    (out,) = buf.take(1)
    assert out.rollouts[0].loss_mask == (0, 0, 1, 1)
    assert buf.counters["masked_offpolicy_tokens"] == 1
    # the stored original is not mutated
    assert g.rollouts[0].loss_mask == (1, 0, 1, 1)


def test_mask_offpolicy_off_keeps_mask():
    g = make_group("p", n=1, response_length=2)
    from dataclasses import replace

    g.rollouts[0] = replace(g.rollouts[0], versions=(1, 2))
    buf = GroupBuffer()
    buf.put([g])
    assert buf.take(1)[0].rollouts[0].loss_mask == (1, 1)


def test_max_groups_drops_oldest():
    buf = GroupBuffer(GroupBuffer.Config(max_groups=2))
    buf.put([make_group(u) for u in "abc"])
    assert [g.uid for g in buf.take(2)] == ["b", "c"]
    assert buf.counters["overflow_dropped"] == 1


def test_state_is_json_and_restores_partial_recycled_counters():
    buf = GroupBuffer(GroupBuffer.Config(max_staleness=0, on_stale="recycle"))
    buf.put([make_group("old", versions=0), make_group("keep", versions=1)])
    buf.take(2, policy_version=1)  # recycles "old", returns None
    partial = make_group("part", status=RolloutStatus.ABORTED, versions=[0, 1])
    buf.put_partial([partial])
    state = json.loads(json.dumps(buf.state_dict()))
    other = GroupBuffer(GroupBuffer.Config(max_staleness=0, on_stale="recycle"))
    other.load_state_dict(state)
    assert other.counters == buf.counters
    assert [p.uid for p in other.pop_recycled()] == ["old"]
    assert other.take_partial(1) == [partial]
    assert other.num_partial == 0
    assert [g.uid for g in other.take(1)] == ["keep"]


def test_take_partial_limits():
    buf = GroupBuffer()
    buf.put_partial([make_group(u, status=RolloutStatus.ABORTED) for u in "xyz"])
    assert [g.uid for g in buf.take_partial(2)] == ["x", "y"]
    assert [g.uid for g in buf.take_partial(5)] == ["z"]


def test_bad_config_and_state():
    with pytest.raises(ConfigError, match="max_staleness"):
        GroupBuffer.Config(max_staleness=-1)
    with pytest.raises(ConfigError, match="on_stale"):
        GroupBuffer.Config(on_stale="keep")
    with pytest.raises(CheckpointError, match="format"):
        GroupBuffer().load_state_dict({"groups": []})
