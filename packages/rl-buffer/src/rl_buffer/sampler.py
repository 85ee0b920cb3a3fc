"""Dynamic sampling: over-sample prompt groups until a step has its full batch of kept groups.

The sampler does not generate; it tells the caller how many prompts to generate next, filters
what comes back, counts drop reasons, and carries surplus kept groups over to the next step
(``surplus="carry"``) or discards them (``surplus="discard"``, as slime, verl's DAPO recipe and
the DAPO paper do)::

    sampler = DynamicSampler(DynamicSampler.Config(batch_size=32), [RewardStdFilter()])
    while not sampler.full:
        prompts = source.next_prompts(sampler.request_size())
        sampler.add(await generate_and_score(prompts))
    batch = sampler.pop_batch()          # exactly 32 kept groups, oldest first
    log(sampler.last_step_metrics)       # rollout/dynamic_filter/drop_zero_reward_std, ...

or, with a function that turns a prompt count into scored groups, ``sampler.fill(produce)`` /
``await sampler.afill(produce)``.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from rl_buffer.failures import (
    Failure,
    FailureReasons,
    describe_failures,
    error_class,
    fix_hint,
)
from rl_buffer.filters import apply_filters
from rl_core.config import PositiveInt, Range
from rl_core.errors import ConfigError, RLError
from rl_core.interfaces import GroupFilter
from rl_core.serde import group_from_dict, group_to_dict
from rl_core.types import Group

__all__ = ["DynamicSampler", "SamplingExhaustedError", "exhausted_error"]


class SamplingExhaustedError(RLError, RuntimeError):
    """Over-sampling ran ``max_rounds`` rounds without filling the batch (the filters drop
    almost everything)."""


class DynamicSampler:
    """Filters scored groups and over-samples until ``batch_size`` groups are kept."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Options of :class:`DynamicSampler`."""

        batch_size: PositiveInt
        """Kept groups per optimizer step."""
        over_sampling_factor: Annotated[float, Range(ge=1)] = 1.0
        """Multiply each request by this (>= 1) on top of the observed keep rate."""
        min_keep_rate: Annotated[float, Range(gt=0, le=1)] = 0.05
        """Floor of the keep-rate estimate, so one bad round does not ask for a huge request."""
        max_request: PositiveInt | None = None
        """Upper bound on one request (prompts); ``None``: no bound."""
        max_rounds: PositiveInt = 64
        """Rounds per step before :class:`SamplingExhaustedError` is raised."""
        surplus: Literal["carry", "discard"] = "carry"
        """Kept groups beyond ``batch_size`` when a batch is popped: ``carry`` them over to the
        next step, or ``discard`` them (counted as ``surplus_discarded``)."""

        def __post_init__(self) -> None:
            if self.batch_size < 1:
                raise ConfigError(f"sampler.batch_size: must be >= 1, got {self.batch_size}.")
            if self.over_sampling_factor < 1:
                raise ConfigError(
                    f"sampler.over_sampling_factor: must be >= 1, got {self.over_sampling_factor}."
                )
            if not 0 < self.min_keep_rate <= 1:
                raise ConfigError(
                    f"sampler.min_keep_rate: must be in (0, 1], got {self.min_keep_rate}."
                )
            if self.max_rounds < 1:
                raise ConfigError(f"sampler.max_rounds: must be >= 1, got {self.max_rounds}.")
            if self.surplus not in ("carry", "discard"):
                raise ConfigError(f"sampler.surplus: 'carry' or 'discard', got {self.surplus!r}.")

    def __init__(self, config: DynamicSampler.Config, filters: Sequence[GroupFilter] = ()) -> None:
        self.config = config
        self.filters = list(filters)
        """Filters applied in order; the first drop reason wins."""
        self._kept: deque[Group] = deque()
        self._step: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()
        """Counts over the whole run: ``seen``, ``kept``, ``drop_<reason>``."""
        self.last_step_metrics: dict[str, float] = {}
        """Metrics of the last :meth:`pop_batch` (``rollout/dynamic_filter/*``)."""

    @property
    def num_kept(self) -> int:
        """Kept groups waiting (surplus from earlier steps included)."""
        return len(self._kept)

    @property
    def step_counts(self) -> dict[str, int]:
        """Counts of the step in progress (since the last :meth:`pop_batch`): ``rounds``,
        ``seen``, ``kept`` and ``drop_<reason>`` per filter drop reason; for error messages that
        must say who dropped the groups."""
        return dict(self._step)

    @property
    def full(self) -> bool:
        """Whether a full batch of kept groups is available."""
        return len(self._kept) >= self.config.batch_size

    def keep_rate(self) -> float:
        """Kept / seen over the run so far (1 before anything was seen), floored by
        ``min_keep_rate``."""
        seen = self.totals["seen"]
        rate = self.totals["kept"] / seen if seen else 1.0
        return max(rate, self.config.min_keep_rate)

    def request_size(self) -> int:
        """Prompts to generate next: the missing groups over the keep rate, times the factor."""
        missing = self.config.batch_size - len(self._kept)
        if missing <= 0:
            return 0
        n = math.ceil(missing * self.config.over_sampling_factor / self.keep_rate() - 1e-9)
        if self.config.max_request is not None:
            n = min(n, self.config.max_request)
        return max(n, 1)

    def add(self, groups: Sequence[Group]) -> list[str | None]:
        """Filter ``groups``; keep the survivors. Returns the drop reason (or ``None``) of each."""
        reasons = []
        self._step["rounds"] += 1
        for g in groups:
            reason = apply_filters(g, self.filters)
            reasons.append(reason)
            self._step["seen"] += 1
            self.totals["seen"] += 1
            if reason is None:
                self._kept.append(g)
                self._step["kept"] += 1
                self.totals["kept"] += 1
            else:
                self._step[f"drop_{reason}"] += 1
                self.totals[f"drop_{reason}"] += 1
        return reasons

    def drop_older_than(self, min_version: int) -> int:
        """Drop carried-over kept groups with a token from a policy version below
        ``min_version`` (bounded staleness); returns how many were dropped (also counted in
        :attr:`totals` as ``drop_stale``)."""
        fresh = deque(g for g in self._kept if (v := g.min_version) is None or v >= min_version)
        dropped = len(self._kept) - len(fresh)
        self._kept = fresh
        self.totals["drop_stale"] += dropped
        return dropped

    def pop_batch(self) -> list[Group]:
        """The ``batch_size`` oldest kept groups; the rest stay for the next step. Also closes
        the step's metrics (:attr:`last_step_metrics`)."""
        if not self.full:
            raise RuntimeError(
                f"pop_batch: {len(self._kept)} kept groups, need {self.config.batch_size}; "
                "keep adding groups until `full`."
            )
        out = [self._kept.popleft() for _ in range(self.config.batch_size)]
        if self.config.surplus == "discard" and self._kept:
            self._step["surplus_discarded"] += len(self._kept)
            self.totals["surplus_discarded"] += len(self._kept)
            self._kept.clear()
        m = {f"rollout/dynamic_filter/{k}": float(v) for k, v in self._step.items()}
        seen = self._step["seen"]
        m["rollout/dynamic_filter/keep_rate"] = self._step["kept"] / seen if seen else 1.0
        m["rollout/dynamic_filter/surplus"] = float(len(self._kept))
        self.last_step_metrics = m
        self._step = Counter()
        return out

    def _check_rounds(self) -> None:
        if self._step["rounds"] >= self.config.max_rounds:
            raise SamplingExhaustedError(
                f"dynamic sampling: {self.config.max_rounds} rounds kept only {len(self._kept)} "
                f"of {self.config.batch_size} groups (drops: "
                f"{ {k: v for k, v in self._step.items() if k.startswith('drop_')} }). Loosen the "
                "filters, or raise sampler.max_rounds."
            )

    def fill(self, produce: Callable[[int], Sequence[Group]]) -> list[Group]:
        """Call ``produce(n)`` (generate and score ``n`` prompts' groups) until full; pop a batch."""
        while not self.full:
            self._check_rounds()
            self.add(produce(self.request_size()))
        return self.pop_batch()

    async def afill(
        self, produce: Callable[[int], Awaitable[Sequence[Group]] | Sequence[Group]]
    ) -> list[Group]:
        """:meth:`fill` for an async (or sync) ``produce``."""
        while not self.full:
            self._check_rounds()
            out = produce(self.request_size())
            if inspect.isawaitable(out):
                out = await out
            self.add(out)  # type: ignore[arg-type]
        return self.pop_batch()

    def state_dict(self) -> dict[str, Any]:
        """Surplus kept groups and the counters, as plain data."""
        return {
            "kept": [group_to_dict(g) for g in self._kept],
            "step": dict(self._step),
            "totals": dict(self.totals),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._kept = deque(group_from_dict(d) for d in state["kept"])
        self._step = Counter({k: int(v) for k, v in state["step"].items()})
        self.totals = Counter({k: int(v) for k, v in state["totals"].items()})


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def exhausted_error(
    *,
    rounds: int,
    kept: int,
    wanted: int,
    n_samples: int,
    step_counts: Mapping[str, int],
    rollouts: int,
    failed: Mapping[str, int],
    first: Mapping[str, Failure],
    unusable: int,
) -> RLError:
    """The error when ``rollout.max_rounds`` rounds kept only ``kept`` of ``wanted`` groups.

    It names what lost the groups, the larger cause first: the filters, with their drop reasons
    (``step_counts``: the sampler's counts of the step), and failing code, with the first cause
    of each reason (``failed``/``first`` of ``rollouts``). ``unusable`` groups had no trainable
    rollout left. A :class:`RewardError` when a failing reward lost most, a
    :class:`SamplingExhaustedError` when the filters did.
    """
    drops = {
        k.removeprefix("drop_"): n
        for k, n in step_counts.items()
        if k.startswith("drop_") and k != f"drop_{FailureReasons.FILTER_ERROR}"
    }
    n_failed = sum(failed.values())
    parts: list[tuple[int, str]] = []  # (rollouts lost, explanation)
    if drops:
        n = sum(drops.values())
        listed = ", ".join(f"{k}: {v}" for k, v in sorted(drops.items()))
        parts.append(
            (
                n * n_samples,
                f"the filters dropped {n} of the {step_counts.get('seen', 0)} groups they saw "
                f"({listed}); relax them, or raise rollout.max_rounds or "
                "rollout.over_sampling_factor",
            )
        )
    if n_failed:
        hint = fix_hint(failed).rstrip(".")
        parts.append(
            (
                n_failed,
                f"{n_failed} of {rollouts} rollouts failed ({describe_failures(failed, first)}); "
                f"{hint[:1].lower()}{hint[1:]}",
            )
        )
    if not parts and unusable:
        parts.append((unusable, f"{_plural(unusable, 'group')} had no trainable rollout left"))
    parts.sort(key=lambda p: -p[0])
    why = ". ".join(text[:1].upper() + text[1:] for _, text in parts) or "Nothing was dropped"
    cls: type[RLError] = RLError
    if n_failed and parts[0][0] == n_failed:
        cls = error_class(failed)
    elif drops:
        cls = SamplingExhaustedError
    return cls(
        f"rollout.max_rounds: {_plural(rounds, 'generation round')} kept only {kept} of "
        f"{wanted} groups. {why}."
    )
