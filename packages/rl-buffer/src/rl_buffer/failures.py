"""What user code did wrong, said once and clearly: the component, how many rollouts of how
many failed, and the first exception at the user's own file and line.

Rewards (:mod:`rl_buffer.scoring`), group rewards, rollout functions (:mod:`rl_buffer.rollout`)
and filters (:class:`rl_buffer.filters.GuardedFilter`) run user code on every rollout. A failure
there never crashes a step with a raw traceback: the rollout (or group) is marked failed, counted
under ``rollout/failed/<reason>``, and the first cause of each reason is kept as a
:class:`Failure`. When every rollout of a round fails, :func:`check_round` stops the run with a
report such as::

    RewardError: step 1, round 1: 4 of 4 rollouts failed, so the run stops (none could be
    used). 4 reward_error from reward (type 'my_reward:score'): ZeroDivisionError: division by
    zero at /home/me/my_reward.py:7 in score: `return 1 / 0` (first on sample train:0:16/0).
    Fix the reward where it raised.
"""

from __future__ import annotations

import inspect
import logging
import sys
import sysconfig
import traceback
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_buffer.bounded import CallAbandoned
from rl_core.errors import GenerationError, RewardError, RLError

__all__ = [
    "Failure",
    "FailureLog",
    "FailureReasons",
    "InvalidResult",
    "RolloutStats",
    "check_round",
    "defined_at",
    "describe_failures",
    "error_class",
    "fix_hint",
    "short_repr",
    "user_failure",
    "user_frame",
]


class FailureReasons:
    """The failure reasons (``rollout/failed/<reason>``) of user code, by component."""

    REWARD_ERROR = "reward_error"
    """The reward raised."""
    REWARD_INVALID = "reward_invalid"
    """The reward returned something that is not a finite number (``None``, NaN, a string...)."""
    REWARD_TIMEOUT = "reward_timeout"
    """The reward did not return within ``rollout.reward_timeout_s`` (or the round's
    ``rollout.reward_round_timeout_s``, or the run was stopping); the call is abandoned."""
    GROUP_REWARD_ERROR = "group_reward_error"
    """The group reward raised."""
    GROUP_REWARD_INVALID = "group_reward_invalid"
    """The group reward returned the wrong number of values or a value that is not finite."""
    ROLLOUT_FN_ERROR = "rollout_fn_error"
    """``rollout.generate_fn`` raised; the prompt's ``n_samples`` rollouts count as failed."""
    ROLLOUT_FN_INVALID = "rollout_fn_invalid"
    """``rollout.generate_fn`` returned something that is not a list of ``Rollout``."""
    FILTER_ERROR = "filter_error"
    """A filter raised (or returned something other than ``None`` or a string); the group's
    rollouts count as failed and the group is dropped."""


_OUR_PACKAGES = ("rl_core", "rl_trainer", "rl_buffer", "rl_weightsync", "rl_sglang", "rl_megatron")


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _package_dirs() -> tuple[str, ...]:
    """Directories of our imported packages (framework code, never the user's)."""
    dirs = []
    for name in _OUR_PACKAGES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            dirs.append(str(Path(file).resolve().parent))
    return tuple(dirs)


def _library_dirs() -> tuple[str, ...]:
    """The stdlib and site-packages directories."""
    paths = sysconfig.get_paths()
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    return tuple(str(Path(paths[k]).resolve()) for k in keys if paths.get(k))


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The frame of ``exc``'s traceback most likely to be the user's own line: the last one
    outside our packages, the stdlib and site-packages; else the last one outside our packages
    (user code installed as a package, or a library it called); else the last frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    ours = _package_dirs()
    not_user = ours + _library_dirs()
    paths = [str(Path(f.filename).resolve()) for f in frames]
    for skip in (not_user, ours):
        chosen = [f for f, p in zip(frames, paths) if not _under(p, skip)]
        if chosen:
            return chosen[-1]
    return frames[-1]


@dataclass(slots=True)
class Failure:
    """The first failure of one reason: which component, what went wrong, where, on what."""

    reason: str
    """The counted reason (``reward_error``, ...: :class:`FailureReasons`)."""
    component: str
    """The config field and type of the component, e.g. ``reward (type 'my_reward:score')``."""
    error: str
    """The exception (``ZeroDivisionError: division by zero``) or what was returned wrong."""
    where: str = ""
    """``file:line in function: `source line``` of the user's code, when there is a traceback."""
    sample: str = ""
    """The sample id (or prompt uid) it first happened on."""
    defined_at: str = ""
    """For a wrong return value (no user frame in the traceback): where the function is
    defined, ``score is defined at file:line``."""

    @classmethod
    def from_exception(
        cls, reason: str, component: str, exc: BaseException, sample: str = ""
    ) -> Failure:
        """A failure caused by ``exc``, located at the user's frame of its traceback."""
        frame = user_frame(exc)
        where = ""
        if frame is not None:
            where = f"{frame.filename}:{frame.lineno} in {frame.name}"
            if frame.line:
                where += f": `{frame.line.strip()}`"
        text = str(exc) if isinstance(exc, RLError) else f"{type(exc).__name__}: {exc}"
        return cls(reason=reason, component=component, error=text, where=where, sample=sample)

    def describe(self) -> str:
        """``<component>: <error> at <file:line ...> (first on sample <id>)``."""
        out = f"{self.component}: {self.error}"
        if self.where:
            out += f" at {self.where}"
        if self.defined_at:
            out += f" ({self.defined_at})"
        if self.sample:
            out += f" (first on sample {self.sample})"
        return out


def describe_failures(failed: Mapping[str, int], first: Mapping[str, Failure]) -> str:
    """``<N> <reason> from <component>: <first cause>; ...`` for every counted reason, most
    frequent first."""
    parts = []
    for reason, n in Counter(failed).most_common():
        cause = first.get(reason)
        text = f"{n} {reason}"
        parts.append(f"{text} from {cause.describe()}" if cause is not None else text)
    return "; ".join(parts)


def error_class(failed: Mapping[str, int]) -> type[RLError]:
    """The error to stop with: :class:`RewardError` when a reward failed, a
    :class:`GenerationError` when only the generator did, else :class:`RLError`."""
    if any(r.startswith(("reward_", "group_reward_")) for r in failed):
        return RewardError
    if failed and all(r.startswith("generation") for r in failed):
        return GenerationError
    return RLError


_HINTS = {
    "reward_error": "fix the reward where it raised",
    "reward_invalid": "make the reward return a finite number (or a mapping with a 'reward' "
    "key) on every path, e.g. 0.0 where it cannot score",
    "reward_timeout": "make the reward return sooner (it hung or was slow), or raise "
    "rollout.reward_timeout_s / rollout.reward_round_timeout_s",
    "group_reward_error": "fix the group reward where it raised",
    "group_reward_invalid": "make the group reward return one finite number (or mapping) per "
    "rollout, in order",
    "rollout_fn_error": "fix rollout.generate_fn where it raised",
    "rollout_fn_invalid": "make rollout.generate_fn return a list of Rollout",
    "filter_error": "fix the filter: it returns None to keep a group or a drop-reason string",
}


def fix_hint(failed: Mapping[str, int]) -> str:
    """What to do about the counted reasons (``failed``), most frequent first."""
    hints = [_hint(r) for r, _ in Counter(failed).most_common()]
    text = "; ".join(dict.fromkeys(hints))
    return text[:1].upper() + text[1:] + "."


def _hint(reason: str) -> str:
    if reason in _HINTS:
        return _HINTS[reason]
    if reason.startswith("generation"):
        return "the generator failed these requests; see its log"
    return "see metadata['failure'] of the failed rollouts (set by rollout.generate_fn)"


def check_round(
    where: str, rollouts: int, failed: Mapping[str, int], first: Mapping[str, Failure]
) -> None:
    """Raise when every one of ``rollouts`` failed: nothing of the round can be used, and
    retrying would fail the same way, so the run stops at once with the causes."""
    n_failed = sum(failed.values())
    if rollouts <= 0 or n_failed < rollouts:
        return
    raise error_class(failed)(
        f"{where}: {n_failed} of {rollouts} rollouts failed, so the run stops (none could be "
        f"used). {describe_failures(failed, first)}. {fix_hint(failed)}"
    )


class FailureLog:
    """Logs each failure reason the first time it happens in a run, with its first cause; later
    failures of that reason are only counted (``rollout/failed/<reason>``)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.logged: set[str] = set()
        """Reasons already logged."""

    def log(
        self, where: str, rollouts: int, failed: Mapping[str, int], first: Mapping[str, Failure]
    ) -> None:
        """Warn about the reasons of ``failed`` not logged before (``where``: step and round)."""
        new = {r: n for r, n in failed.items() if r not in self.logged}
        if not new:
            return
        self.logged.update(new)
        self.logger.warning(
            "%s: %d of %d rollouts failed: %s. Counted in rollout/failed/<reason>; each reason "
            "is logged once.",
            where,
            sum(failed.values()),
            rollouts,
            describe_failures(new, first),
        )


class InvalidResult(RewardError):
    """User code returned a value of the wrong kind (the message says what and what is expected)."""


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (for messages about returned values)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def user_failure(reason: str, component: str, e: Exception, sample: str, fn: Any) -> Failure:
    """The cause of a failure of user code ``fn``: at the user's frame when it raised; where
    ``fn`` is defined when it returned a wrong value or hung (the traceback is then ours)."""
    if isinstance(e, InvalidResult | CallAbandoned):
        return Failure(
            reason=reason,
            component=component,
            error=str(e),
            sample=sample,
            defined_at=defined_at(fn),
        )
    return Failure.from_exception(reason, component, e, sample=sample)


def defined_at(fn: Any) -> str:
    """``<name> is defined at file:line`` for ``fn`` (or its class, for a callable object), or
    ``""`` when unknown: where to look when it returned a wrong value."""
    target = fn if inspect.isroutine(fn) else type(fn)
    try:
        target = inspect.unwrap(target)
        file = inspect.getsourcefile(target)
        _, line = inspect.getsourcelines(target)
    except (TypeError, OSError):
        return ""
    return f"{getattr(target, '__qualname__', target)} is defined at {file}:{line}"


@dataclass(slots=True)
class RolloutStats:
    """Counts of what happened to rollouts and groups in one step."""

    failed: Counter = field(default_factory=Counter)
    """Failure reason -> rollouts marked failed."""
    dropped: Counter = field(default_factory=Counter)
    """Drop reason -> groups dropped."""
    rollouts: int = 0
    """Rollouts asked for (a failed ``generate_fn`` call counts its ``n_samples``)."""
    first: dict[str, Failure] = field(default_factory=dict)
    """Failure reason -> its first cause (component, exception, user file:line, sample)."""

    def record(self, reason: str, n: int, failure: Failure | None = None) -> None:
        """Count ``n`` rollouts failed for ``reason``; keep ``failure`` if it is the first."""
        self.failed[reason] += n
        if failure is not None:
            self.first.setdefault(reason, failure)

    def merge(self, other: RolloutStats) -> None:
        """Add ``other``'s counts; keep the earlier first causes."""
        self.failed.update(other.failed)
        self.dropped.update(other.dropped)
        self.rollouts += other.rollouts
        for reason, failure in other.first.items():
            self.first.setdefault(reason, failure)

    def check(self, where: str) -> None:
        """Raise the failure report when every rollout counted here failed
        (:func:`check_round`)."""
        check_round(where, self.rollouts, self.failed, self.first)
