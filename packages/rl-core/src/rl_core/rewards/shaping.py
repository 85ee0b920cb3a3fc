"""Reward shaping applied on top of whatever reward scored a rollout.

**Soft overlong punishment** (DAPO, Yu et al. 2025, eq. 13): with a maximum response length
``L_max`` and a band ``L_cache`` before it, a response of ``|y|`` tokens gets::

    R_length(y) =  0                                   |y| <= L_max - L_cache
                   ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                  -1                                   L_max < |y|

added to its reward (times ``coef``): long answers are discouraged smoothly inside the band
instead of a truncated answer's reward falling off a cliff. Example with ``L_max = 20``,
``L_cache = 4``: lengths 16, 17, 18, 20, 21 get 0, -0.25, -0.5, -1, -1.

Lengths are response tokens (``Rollout.response_length``: everything after the prompt).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rl_core.config import NonNegFloat, PositiveInt
from rl_core.errors import ConfigError
from rl_core.types import Rollout

__all__ = ["OverlongPenalty", "overlong_penalty"]


def overlong_penalty(length: int, *, max_length: int, band: int) -> float:
    """DAPO's soft overlong penalty of a response of ``length`` tokens, in ``[-1, 0]`` (module
    docstring): 0 up to ``max_length - band``, linear down to -1 at ``max_length``, -1 beyond."""
    if not 0 < band <= max_length:
        raise ConfigError(
            f"overlong penalty: need 0 < band <= max_length, got band={band}, "
            f"max_length={max_length}."
        )
    start = max_length - band
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / band
    return -1.0


class OverlongPenalty:
    """Adds ``coef * overlong_penalty(response_length)`` to each scored rollout's reward and
    records it as the ``overlong_penalty`` component of ``Rollout.reward_info``.

    Example::

        shaping = OverlongPenalty(OverlongPenalty.Config(max_length=20, band=4))
        shaping.apply(rollouts)   # rollouts whose reward is None (failed) are left alone
    """

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Settings of :class:`OverlongPenalty`."""

        max_length: PositiveInt | None = None
        """``L_max`` in tokens; ``None``: the sampling limit (the trainer uses
        ``rollout.sampling.max_new_tokens``)."""
        band: PositiveInt
        """``L_cache``: the penalty grows linearly over the last ``band`` tokens before
        ``max_length`` (DAPO: 4096 of 20480)."""
        coef: NonNegFloat = 1.0
        """Weight of the penalty in the reward."""

        def __post_init__(self) -> None:
            if self.max_length is not None and self.band > self.max_length:
                raise ConfigError(
                    f"OverlongPenalty.Config.band: {self.band} exceeds max_length "
                    f"{self.max_length}; choose a band of at most max_length tokens."
                )
            if self.coef < 0:
                raise ConfigError(f"OverlongPenalty.Config.coef: must be >= 0, got {self.coef}.")

    def __init__(self, config: OverlongPenalty.Config, *, max_length: int | None = None) -> None:
        """``max_length`` fills in ``config.max_length`` when that is ``None``."""
        limit = config.max_length if config.max_length is not None else max_length
        if limit is None:
            raise ConfigError(
                "OverlongPenalty.Config.max_length: not set and no sampling limit given; set "
                "max_length."
            )
        if config.band > limit:
            raise ConfigError(
                f"OverlongPenalty.Config.band: {config.band} exceeds the maximum length {limit}; "
                "choose a band of at most that many tokens."
            )
        self.config = config
        self.max_length = int(limit)

    def penalty(self, rollout: Rollout) -> float:
        """``coef * overlong_penalty(rollout.response_length)``."""
        cfg = self.config
        return cfg.coef * overlong_penalty(
            rollout.response_length, max_length=self.max_length, band=cfg.band
        )

    def apply(self, rollouts: Iterable[Rollout]) -> None:
        """Shape the reward of every scored rollout in place (failed ones, ``reward is None``,
        are skipped)."""
        for r in rollouts:
            if r.reward is None:
                continue
            p = self.penalty(r)
            r.reward = float(r.reward) + p
            r.reward_info = {**r.reward_info, "overlong_penalty": p}
