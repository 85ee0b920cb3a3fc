"""Scoring groups of rollouts: a reward function per rollout (sync or async, bounded in time),
then an optional group reward over each group's rollouts; what a reward breaks is marked failed
and counted (:class:`~rl_buffer.failures.RolloutStats`), never a crash and never a silent 0::

    scorer = Scorer(reward_fn, tokenizer, timeout_s=30.0)
    stats = RolloutStats()
    await scorer.score(groups, stats)      # fills rollout.reward / reward_info in place
    stats.check("step 1, round 1")         # raises when every rollout failed
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rl_buffer.bounded import BoundedCaller, CallAbandoned
from rl_buffer.failures import (
    Failure,
    FailureReasons,
    InvalidResult,
    RolloutStats,
    short_repr,
    user_failure,
)
from rl_core.errors import RewardError
from rl_core.interfaces import GroupRewardFn, RewardFn, Tokenizer
from rl_core.types import Group, Rollout, RolloutStatus

__all__ = ["Scorer"]


class Scorer:
    """Applies a reward function to rollouts: decodes responses, awaits async rewards, and marks
    a rollout failed (with a counted reason and its first cause) when the reward raises or does
    not return a finite number: ``None``, a string, NaN or inf are failures (``reward_invalid``),
    never a silent 0.

    ``reward_name`` and ``group_reward_name`` say how the config names each function (its field
    and type), for failure reports.

    With a ``group_reward_fn`` (a :class:`~rl_core.interfaces.GroupRewardFn` such as
    :class:`~rl_core.rewards.group.MajorityVote`), each group is then scored as a whole over its
    rollouts that the per-rollout reward did not fail, and the group reward is what is trained
    on: ``reward`` and ``reward_info`` come from it, and the per-rollout reward's components stay
    in ``reward_info`` as ``rollout_<key>`` (e.g. ``rollout_reward``: label accuracy next to a
    label-free majority-vote reward). A group reward that raises, returns the wrong number of
    values or a non-finite value fails the rollouts it scored (``group_reward_error`` /
    ``group_reward_invalid``); it never crashes the step.

    Bounds (:mod:`rl_buffer.bounded`): each call gets ``timeout_s`` from when it starts and
    every call of one :meth:`score` ends by ``round_timeout_s``; a call past either, or still
    running a moment after a stop signal, is abandoned and its rollouts fail with
    ``reward_timeout``. Synchronous rewards run one at a time, in rollout order, in a worker
    thread (so a hung one can be left behind).
    """

    def __init__(
        self,
        reward_fn: RewardFn | None,
        tokenizer: Tokenizer,
        *,
        reward_key: str = "reward",
        group_reward_fn: GroupRewardFn | None = None,
        reward_name: str = "reward",
        group_reward_name: str = "group_reward",
        timeout_s: float | None = None,
        round_timeout_s: float | None = None,
    ) -> None:
        if reward_fn is None and group_reward_fn is None:
            raise RewardError("Scorer: give a reward function, a group reward function, or both.")
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.reward_key = reward_key
        self.group_reward_fn = group_reward_fn
        self.reward_name = reward_name
        self.group_reward_name = group_reward_name
        self.round_timeout_s = round_timeout_s
        """Time limit of one :meth:`score` (``rollout.reward_round_timeout_s``)."""
        self.caller = BoundedCaller(timeout_s)
        """Runs the reward calls under ``timeout_s`` (``rollout.reward_timeout_s``)."""

    def set_timeouts(self, timeout_s: float | None, round_timeout_s: float | None) -> None:
        """Set the per-call and per-round time limits (seconds; ``None``: none)."""
        self.caller.timeout_s = timeout_s
        self.round_timeout_s = round_timeout_s

    def _to_scalar(self, value: Any) -> tuple[float, dict[str, float]]:
        """``(reward, components)`` of what a reward returned, or :class:`InvalidResult`."""
        expected = f"a reward returns a float or a mapping with a {self.reward_key!r} key"
        if isinstance(value, Mapping):
            if self.reward_key not in value:
                raise InvalidResult(
                    f"returned a mapping without the {self.reward_key!r} key (keys: "
                    f"{sorted(map(str, value))}); {expected}"
                )
            info = {str(k): _number(v, str(k), expected) for k, v in value.items()}
            scalar = info[self.reward_key]
        else:
            scalar = _number(value, None, expected)
            info = {self.reward_key: scalar}
        if not math.isfinite(scalar):
            raise InvalidResult(f"returned {scalar}; rewards must be finite numbers")
        return scalar, info

    async def score(self, groups: Sequence[Group], stats: RolloutStats) -> None:
        """Fill ``reward`` and ``reward_info`` of every rollout of ``groups`` in place.

        Every rollout's reward call starts before any is awaited (synchronous rewards run in
        rollout order), so async rewards of a round run concurrently and a batching reward
        (:class:`rl_hf.reward_model.RewardModel`) scores the whole round in few forwards; group
        rewards run after, group by group."""
        texts_of: list[dict[int, str]] = []
        calls = []
        deadline = (
            time.monotonic() + self.round_timeout_s if self.round_timeout_s is not None else None
        )
        for g in groups:
            texts: dict[int, str] = {}
            for r in g.rollouts:
                if r.status == RolloutStatus.FAILED:  # failed while generating
                    stats.record(*_generation_failure(r))
                    continue
                text = self.tokenizer.decode(list(r.response_ids), skip_special_tokens=True)
                texts[id(r)] = text
                if self.reward_fn is not None:
                    calls.append(self._score_one(g, r, text, stats, deadline))
            texts_of.append(texts)
        await asyncio.gather(*calls)
        if self.group_reward_fn is not None:
            for g, texts in zip(groups, texts_of, strict=True):
                await self._score_group(g, texts, stats, deadline)

    async def _score_one(
        self, g: Group, r: Rollout, text: str, stats: RolloutStats, deadline: float | None
    ) -> None:
        """Score one rollout with the reward function (failures marked and counted)."""
        assert self.reward_fn is not None
        try:
            value = await self.caller.call(self.reward_fn, g.prompt, text, r, deadline=deadline)
            r.reward, r.reward_info = self._to_scalar(value)
        except CallAbandoned as e:
            self._fail([r], FailureReasons.REWARD_TIMEOUT, e, stats)
        except Exception as e:  # a user reward must never crash the step
            self._fail([r], FailureReasons.REWARD_ERROR, e, stats)

    def _fail(self, rs: Sequence[Rollout], error_reason: str, e: Exception, stats: RolloutStats):
        """Mark ``rs`` failed: ``<component>_invalid`` when the value was wrong, else
        ``error_reason`` (the function raised); keep the first cause."""
        group = error_reason.startswith("group_")
        name = self.group_reward_name if group else self.reward_name
        fn = self.group_reward_fn if group else self.reward_fn
        if isinstance(e, CallAbandoned):
            error_reason = FailureReasons.REWARD_TIMEOUT
        # A RewardError (ours, or raised by a library reward such as `combine`) is a bad value.
        invalid = isinstance(e, RewardError)
        reason = error_reason.replace("_error", "_invalid") if invalid else error_reason
        failure = user_failure(reason, name, e, rs[0].sample_id, fn)
        for r in rs:
            r.status = RolloutStatus.FAILED
            r.metadata["failure"] = f"{reason}: {failure.error}"
        stats.record(reason, len(rs), failure)

    async def _score_group(
        self, g: Group, texts: dict[int, str], stats: RolloutStats, deadline: float | None
    ) -> None:
        assert self.group_reward_fn is not None
        live = [r for r in g.rollouts if r.status != RolloutStatus.FAILED]
        if not live:
            return
        try:
            values = await self.caller.call(
                self.group_reward_fn,
                g.prompt,
                [texts[id(r)] for r in live],
                live,
                deadline=deadline,
            )
            if not isinstance(values, Sequence) or isinstance(values, (str, Mapping)):
                raise InvalidResult(
                    f"returned {type(values).__name__} {short_repr(values)}; a group reward returns "
                    "a list with one value per rollout, in order"
                )
            values = list(values)
            if len(values) != len(live):
                raise InvalidResult(
                    f"returned {len(values)} values for {len(live)} rollouts of prompt "
                    f"{g.prompt.uid}; return one per rollout, in order"
                )
            scored = [self._to_scalar(v) for v in values]
        except Exception as e:  # a user reward must never crash the step
            self._fail(live, FailureReasons.GROUP_REWARD_ERROR, e, stats)
            return
        for r, (scalar, info) in zip(live, scored):
            per_rollout = {f"rollout_{k}": v for k, v in r.reward_info.items()}
            r.reward, r.reward_info = scalar, {**per_rollout, **info}


def _number(value: Any, key: str | None, expected: str) -> float:
    """``float(value)`` for a real number (bools, numpy and 0-d tensor scalars included), else
    :class:`InvalidResult` saying what came back; ``key`` is its key in a returned mapping."""
    under = f" under key {key!r}" if key is not None else ""
    if value is None or isinstance(value, (str, bytes)):
        raise InvalidResult(f"returned {short_repr(value)}{under}; {expected}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidResult(
            f"returned {type(value).__name__} {short_repr(value)}{under}; {expected}"
        ) from None


def _generation_failure(r: Rollout) -> tuple[str, int, Failure]:
    """Reason, count and cause of a rollout that came back failed from generation: the engine
    (``generation_error``) or a ``generate_fn`` that marked it (``agent_error: ...``: the
    reason is the text before the first colon)."""
    text = str(r.metadata.get("failure", "generation_error"))
    reason = text.split(":", 1)[0].strip().replace(" ", "_") or "generation_error"
    engine = reason == "generation_error"
    failure = Failure(
        reason=reason,
        component="generator" if engine else "rollout.generate_fn",
        error="the engine returned an error for this request (see its log)" if engine else text,
        sample=r.sample_id,
    )
    return reason, 1, failure
