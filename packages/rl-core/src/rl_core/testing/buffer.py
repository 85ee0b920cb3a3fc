"""Conformance suite for :class:`~rl_core.interfaces.Buffer`, a fake that passes it, and a group
builder for tests.

An implementation's tests subclass :class:`BufferConformance` and provide a factory fixture
that returns a fresh, empty buffer on each call::

    class TestGroupBuffer(BufferConformance):
        @pytest.fixture
        def buffer_factory(self):
            return lambda: GroupBuffer(GroupBuffer.Config())

Capability flags (class attributes of the subclass):

- ``supports_partial``: the buffer has ``put_partial(groups)`` / ``take_partial(n=None)`` for
  aborted rollouts, and keeps them in ``state_dict``.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import pytest
import torch

from rl_core.errors import CheckpointError
from rl_core.interfaces import Buffer
from rl_core.serde import group_from_dict, group_to_dict
from rl_core.testing._base import ConformanceSuite
from rl_core.types import Group, Prompt, Rollout, RolloutStatus

__all__ = ["BufferConformance", "FakeBuffer", "group_from_dict", "group_to_dict", "make_group"]


def make_group(
    uid: str,
    *,
    versions: Sequence[int] | int = 0,
    n: int = 2,
    response_length: int = 3,
    rewards: Sequence[float] | None = None,
    status: RolloutStatus = RolloutStatus.COMPLETED,
    fan_out: int = 1,
) -> Group:
    """A scored group of ``n`` rollouts for tests.

    Args:
        uid: the prompt uid (group id).
        versions: one policy version for every token, or one per rollout.
        n: rollouts in the group.
        response_length: response tokens per rollout.
        rewards: one reward per rollout (default ``0, 1, 0, 1, ...``).
        status: status of every rollout.
        fan_out: siblings per ``rollout_id`` (1: each rollout is its own trajectory).
    """
    vs = [versions] * n if isinstance(versions, int) else list(versions)
    rs = list(rewards) if rewards is not None else [float(i % 2) for i in range(n)]
    prompt = Prompt(
        uid=uid, input=f"prompt {uid}", token_ids=(1, 2, 3), label="x", metadata={"source": "test"}
    )
    rollouts = []
    for i in range(n):
        resp = tuple(10 + (i + j) % 50 for j in range(response_length))
        rollouts.append(
            Rollout(
                prompt_uid=uid,
                rollout_id=f"{uid}/{i // fan_out}",
                sample_id=f"{uid}/{i}",
                tokens=prompt.token_ids + resp,
                response_start=len(prompt.token_ids),
                loss_mask=(1,) * response_length,
                rollout_logprobs=tuple(-0.25 * (j + 1) for j in range(response_length)),
                versions=(vs[i],) * response_length,
                status=status,
                reward=rs[i],
                reward_info={"score": rs[i]},
                metadata={"i": i},
            )
        )
    return Group(prompt=prompt, rollouts=rollouts)


class FakeBuffer(Buffer):
    """A FIFO list of groups; ``take(min_version=...)`` drops stale groups it meets.

    Dependency-free stand-in for trainer tests; passes :class:`BufferConformance`.
    """

    def __init__(self) -> None:
        self._groups: deque[Group] = deque()

    def put(self, groups: Sequence[Group]) -> None:
        """Append groups."""
        self._groups.extend(groups)

    def take(self, n: int, *, min_version: int | None = None) -> list[Group] | None:
        """The ``n`` oldest groups whose tokens are all from ``min_version`` or newer."""
        if n < 0:
            raise ValueError(f"take: n must be >= 0, got {n}.")
        if min_version is not None:
            self._groups = deque(
                g for g in self._groups if g.min_version is None or g.min_version >= min_version
            )
        if len(self._groups) < n:
            return None
        return [self._groups.popleft() for _ in range(n)]

    def __len__(self) -> int:
        """Groups held."""
        return len(self._groups)

    def state_dict(self) -> dict[str, Any]:
        """All groups as plain data."""
        return {"groups": [group_to_dict(g) for g in self._groups]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the contents with those of ``state``."""
        if "groups" not in state:
            raise CheckpointError("FakeBuffer: state has no 'groups'; not a FakeBuffer state.")
        self._groups = deque(group_from_dict(d) for d in state["groups"])


def _torch_round_trip(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class BufferConformance(ConformanceSuite):
    """Standard tests every :class:`~rl_core.interfaces.Buffer` must pass.

    Override the ``buffer_factory`` fixture: a zero-argument callable returning a fresh, empty
    buffer with the configuration under test.
    """

    __test__ = False

    supports_partial: ClassVar[bool] = False
    """The buffer stores aborted groups via ``put_partial`` / ``take_partial``."""

    @pytest.fixture
    def buffer_factory(self) -> Callable[[], Buffer]:
        """Override: return a zero-argument callable that builds a fresh, empty buffer."""
        raise NotImplementedError(
            "Override the `buffer_factory` fixture in your BufferConformance subclass."
        )

    def test_new_buffer_is_empty(self, buffer_factory: Callable[[], Buffer]) -> None:
        """A fresh buffer has length 0 and ``take(1)`` returns ``None``.

        Troubleshooting: ``take`` returns ``None`` (not ``[]``, not raise) when it cannot
        serve ``n`` groups.
        """
        buf = buffer_factory()
        assert len(buf) == 0
        assert buf.take(1) is None

    def test_take_zero_returns_empty_list(self, buffer_factory: Callable[[], Buffer]) -> None:
        """``take(0)`` returns ``[]`` and ``take(-1)`` raises ``ValueError``.

        Troubleshooting: check ``n`` first; ``[]`` is a valid (empty) batch.
        """
        buf = buffer_factory()
        assert buf.take(0) == []
        with pytest.raises(ValueError):
            buf.take(-1)

    def test_fifo_order_and_len(self, buffer_factory: Callable[[], Buffer]) -> None:
        """Groups come out in the order they were put; ``len`` counts groups, not rollouts.

        Troubleshooting: keep a FIFO queue of groups; ``__len__`` is the number of groups
        ``take`` could return.
        """
        buf = buffer_factory()
        groups = [make_group(f"g{i}", n=3) for i in range(5)]
        buf.put(groups[:2])
        buf.put([])
        buf.put(groups[2:])
        assert len(buf) == 5
        assert [g.uid for g in buf.take(2)] == ["g0", "g1"]
        assert len(buf) == 3
        assert [g.uid for g in buf.take(3)] == ["g2", "g3", "g4"]
        assert len(buf) == 0

    def test_insufficient_returns_none_and_keeps_groups(
        self, buffer_factory: Callable[[], Buffer]
    ) -> None:
        """When fewer than ``n`` groups are available, ``take`` returns ``None`` and removes
        nothing.

        Troubleshooting: check the count before popping; never return a short batch.
        """
        buf = buffer_factory()
        buf.put([make_group("a"), make_group("b")])
        assert buf.take(3) is None
        assert len(buf) == 2
        assert [g.uid for g in buf.take(2)] == ["a", "b"]

    def test_groups_returned_unchanged_uneven_sizes(
        self, buffer_factory: Callable[[], Buffer]
    ) -> None:
        """Groups of different sizes (fan-out, filtered) come back equal to what was put.

        Troubleshooting: store groups as they are; never pad or reshape them to a common size.
        """
        buf = buffer_factory()
        groups = [
            make_group("one", n=1),
            make_group("three", n=3, fan_out=3),
            make_group("five", n=5, response_length=1),
        ]
        buf.put(groups)
        out = buf.take(3)
        assert out == groups
        assert [len(g.rollouts) for g in out] == [1, 3, 5]

    def test_min_version_never_returns_older(self, buffer_factory: Callable[[], Buffer]) -> None:
        """With ``min_version=v``, no returned group has a token older than ``v``; the fresh
        groups still come out in FIFO order.

        Troubleshooting: compare ``Group.min_version`` (the oldest token of any rollout, not
        the newest) against ``min_version``; skip or drop the stale ones.
        """
        buf = buffer_factory()
        buf.put(
            [
                make_group("old0", versions=0),
                make_group("new1", versions=1),
                make_group("mixed", versions=[0, 2]),
                make_group("new2", versions=2),
                make_group("old1", versions=1),
            ]
        )
        out = buf.take(2, min_version=1)
        assert out is not None
        assert [g.uid for g in out] == ["new1", "new2"]
        again = buf.take(1, min_version=2)
        assert again is None or all(g.min_version >= 2 for g in again)

    def test_min_version_insufficient_returns_none(
        self, buffer_factory: Callable[[], Buffer]
    ) -> None:
        """If fewer than ``n`` groups are fresh enough, ``take`` returns ``None``; fresh groups
        stay available.

        Troubleshooting: stale groups do not count towards ``n``.
        """
        buf = buffer_factory()
        buf.put([make_group("old", versions=0), make_group("new", versions=3)])
        assert buf.take(2, min_version=3) is None
        assert [g.uid for g in buf.take(1, min_version=3)] == ["new"]

    def test_state_dict_round_trip(self, buffer_factory: Callable[[], Buffer]) -> None:
        """``state_dict`` survives ``torch.save`` / ``torch.load(weights_only=True)``, and a
        fresh buffer loaded from it yields exactly the same groups as the original.

        Troubleshooting: store groups as plain data (lists, dicts, str, numbers), not
        dataclasses or enums (see :func:`group_to_dict`); keep FIFO order.
        """
        buf = buffer_factory()
        buf.put([make_group(f"g{i}", n=1 + i % 3, versions=i) for i in range(6)])
        buf.take(2)
        state = _torch_round_trip(buf.state_dict())
        other = buffer_factory()
        other.load_state_dict(state)
        assert len(other) == len(buf) == 4
        assert other.take(4) == buf.take(4)

    def test_load_replaces_contents(self, buffer_factory: Callable[[], Buffer]) -> None:
        """``load_state_dict`` replaces what the buffer held (no duplicates, no leftovers).

        Troubleshooting: clear the queue (and any partial store) before loading.
        """
        src = buffer_factory()
        src.put([make_group("x")])
        dst = buffer_factory()
        dst.put([make_group("y"), make_group("z")])
        dst.load_state_dict(src.state_dict())
        assert [g.uid for g in dst.take(1)] == ["x"]
        assert len(dst) == 0

    def test_load_rejects_foreign_state(self, buffer_factory: Callable[[], Buffer]) -> None:
        """Loading an empty dict raises instead of silently emptying the buffer.

        Troubleshooting: check the keys you need and raise
        :class:`~rl_core.errors.CheckpointError` naming what is missing.
        """
        with pytest.raises((CheckpointError, KeyError, ValueError)):
            buffer_factory().load_state_dict({})

    def test_partial_rollouts_round_trip(self, buffer_factory: Callable[[], Buffer]) -> None:
        """(``supports_partial``) Aborted groups put with ``put_partial`` are not returned by
        ``take``, survive ``state_dict``, and come back from ``take_partial`` unchanged.

        Troubleshooting: keep partial groups in a separate store that is part of the state;
        ``len`` counts only trainable groups.
        """
        if not self.supports_partial:
            pytest.skip("buffer does not declare supports_partial")
        buf = buffer_factory()
        partial = make_group("p", status=RolloutStatus.ABORTED, versions=[3, 4])
        buf.put_partial([partial])  # type: ignore[attr-defined]
        buf.put([make_group("done", versions=4)])
        assert len(buf) == 1
        other = buffer_factory()
        other.load_state_dict(_torch_round_trip(buf.state_dict()))
        assert other.take_partial() == [partial]  # type: ignore[attr-defined]
        assert other.take_partial() == []  # type: ignore[attr-defined]
        assert [g.uid for g in other.take(1)] == ["done"]
