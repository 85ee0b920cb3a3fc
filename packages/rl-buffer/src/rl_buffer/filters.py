"""Group filters for dynamic sampling (:class:`~rl_core.interfaces.GroupFilter`).

A filter is any callable ``(group) -> str | None``: ``None`` keeps the group, a string is the
drop reason, counted as ``rollout/dynamic_filter/drop_<reason>``. The built-ins are classes with
a nested ``Config`` so a recipe can name and configure them (entry points ``rl.filters``)::

    filters = [RewardStdFilter(), OverlongFilter(OverlongFilter.Config(max_truncated_fraction=0.5))]
    reason = apply_filters(group, filters)     # first reason wins, or None

User filters named in a config are wrapped in :class:`GuardedFilter` (a filter that raises drops
its group as ``filter_error`` instead of crashing the round); :func:`filter_groups` drops the
failed rollouts of scored groups, then the groups a filter rejects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rl_buffer.failures import FailureReasons, InvalidResult, RolloutStats, short_repr, user_failure
from rl_core.config import NonNegFloat, PositiveInt, Probability
from rl_core.errors import ConfigError
from rl_core.interfaces import GroupFilter
from rl_core.types import Group, RolloutStatus

__all__ = [
    "FailedStatusFilter",
    "GuardedFilter",
    "OverlongFilter",
    "RewardStdFilter",
    "apply_filters",
    "filter_groups",
]


def apply_filters(group: Group, filters: Sequence[GroupFilter]) -> str | None:
    """Run ``filters`` in order; return the first drop reason, or ``None`` to keep the group."""
    for f in filters:
        reason = f(group)
        if reason is not None:
            return str(reason)
    return None


def _fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"filter.{name}: must be in [0, 1], got {value}.")


class RewardStdFilter:
    """DAPO dynamic sampling: drop groups whose rewards are all (nearly) equal, since their
    group-normalised advantages are zero and they carry no learning signal.

    Reasons: ``zero_reward_std`` (std <= ``min_std``), ``nonfinite_reward`` (a reward is
    missing, NaN or inf), ``too_few_rollouts`` (fewer than two rollouts).
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Options of :class:`RewardStdFilter`."""

        min_std: NonNegFloat = 1e-6
        """Keep a group only if the (population) standard deviation of its rewards exceeds this."""

        def __post_init__(self) -> None:
            if self.min_std < 0:
                raise ConfigError(f"filter.min_std: must be >= 0, got {self.min_std}.")

    def __init__(self, config: RewardStdFilter.Config | None = None) -> None:
        self.config = config or RewardStdFilter.Config()

    def __call__(self, group: Group) -> str | None:
        """Drop reason or ``None``."""
        rewards = [r.reward for r in group.rollouts]
        if any(x is None or not math.isfinite(x) for x in rewards):
            return "nonfinite_reward"
        if len(rewards) < 2:
            return "too_few_rollouts"
        mean = sum(rewards) / len(rewards)  # type: ignore[arg-type]
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))  # type: ignore[operator]
        return "zero_reward_std" if std <= self.config.min_std else None


class OverlongFilter:
    """Drop groups with too many over-long rollouts: truncated at the length limit, or with more
    than ``max_response_tokens`` response tokens. Reason: ``overlong``."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Options of :class:`OverlongFilter`."""

        max_response_tokens: PositiveInt | None = None
        """Count a rollout as over-long above this many response tokens (``None``: only the
        ``truncated`` status counts)."""
        max_truncated_fraction: Probability = 0.0
        """Keep the group while at most this fraction of its rollouts is over-long (0: any
        over-long rollout drops the group)."""

        def __post_init__(self) -> None:
            _fraction("max_truncated_fraction", self.max_truncated_fraction)
            if self.max_response_tokens is not None and self.max_response_tokens < 1:
                raise ConfigError(
                    f"filter.max_response_tokens: must be >= 1, got {self.max_response_tokens}."
                )

    def __init__(self, config: OverlongFilter.Config | None = None) -> None:
        self.config = config or OverlongFilter.Config()

    def __call__(self, group: Group) -> str | None:
        """Drop reason or ``None``."""
        if not group.rollouts:
            return "empty_group"
        cap = self.config.max_response_tokens
        n = sum(
            1
            for r in group.rollouts
            if r.status == RolloutStatus.TRUNCATED or (cap is not None and r.response_length > cap)
        )
        return "overlong" if n / len(group.rollouts) > self.config.max_truncated_fraction else None


class FailedStatusFilter:
    """Drop groups with failed or aborted rollouts (generation or reward failed, or the rollout
    was never finished). Reasons: ``failed``, ``aborted``."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Options of :class:`FailedStatusFilter`."""

        max_failed_fraction: Probability = 0.0
        """Keep the group while at most this fraction of its rollouts failed or was aborted."""

        def __post_init__(self) -> None:
            _fraction("max_failed_fraction", self.max_failed_fraction)

    def __init__(self, config: FailedStatusFilter.Config | None = None) -> None:
        self.config = config or FailedStatusFilter.Config()

    def __call__(self, group: Group) -> str | None:
        """Drop reason or ``None``."""
        if not group.rollouts:
            return "empty_group"
        failed = sum(r.status == RolloutStatus.FAILED for r in group.rollouts)
        aborted = sum(r.status == RolloutStatus.ABORTED for r in group.rollouts)
        if (failed + aborted) / len(group.rollouts) <= self.config.max_failed_fraction:
            return None
        return "failed" if failed >= aborted else "aborted"


class GuardedFilter:
    """A :class:`~rl_core.interfaces.GroupFilter` from the config that cannot crash a round.

    A filter that raises, or returns something other than ``None`` or a string (a bool is a
    common slip), drops the group with reason ``filter_error``; its rollouts count as failed in
    :attr:`stats` (``rollout/failed/filter_error``) with the first cause. The trainer points
    :attr:`stats` at each round's counters before the sampler applies the filters.
    """

    def __init__(self, fn: GroupFilter, name: str) -> None:
        self.fn = fn
        self.name = name
        """The filter's config field and type, for failure reports."""
        self.stats = RolloutStats()
        """Where failures are counted (set per round by the trainer)."""

    def __call__(self, group: Group) -> str | None:
        """The wrapped filter's verdict, or ``filter_error`` when it failed."""
        try:
            reason = self.fn(group)
            if reason is not None and not isinstance(reason, str):
                raise InvalidResult(
                    f"returned {type(reason).__name__} {short_repr(reason)} for prompt {group.uid}; "
                    "a filter returns None to keep the group or a drop-reason string"
                )
        except Exception as e:  # user code must never crash the round
            failure = user_failure(FailureReasons.FILTER_ERROR, self.name, e, group.uid, self.fn)
            self.stats.record(FailureReasons.FILTER_ERROR, len(group.rollouts), failure)
            return FailureReasons.FILTER_ERROR
        return reason


def filter_groups(
    groups: Sequence[Group], filters: Sequence[GroupFilter], stats: RolloutStats
) -> list[Group]:
    """Drop failed rollouts, then groups with no trainable rollout or rejected by a filter."""
    kept = []
    for g in groups:
        g.rollouts = [r for r in g.rollouts if r.status.is_trainable() and r.reward is not None]
        if not g.rollouts:
            stats.dropped["no_valid_rollout"] += 1
            continue
        reason = None
        for f in filters:
            reason = f(g)
            if reason:
                break
        if reason:
            stats.dropped[reason] += 1
            continue
        kept.append(g)
    return kept
