"""Group filters for dynamic sampling (:class:`~rl_core.interfaces.GroupFilter`).

A filter is any callable ``(group) -> str | None``: ``None`` keeps the group, a string is the
drop reason, counted as ``rollout/dynamic_filter/drop_<reason>``. The built-ins are classes with
a nested ``Config`` so a recipe can name and configure them (entry points ``rl.filters``)::

    filters = [RewardStdFilter(), OverlongFilter(OverlongFilter.Config(max_truncated_fraction=0.5))]
    reason = apply_filters(group, filters)     # first reason wins, or None
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rl_core.config import NonNegFloat, PositiveInt, Probability
from rl_core.errors import ConfigError
from rl_core.interfaces import GroupFilter
from rl_core.types import Group, RolloutStatus

__all__ = ["FailedStatusFilter", "OverlongFilter", "RewardStdFilter", "apply_filters"]


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
