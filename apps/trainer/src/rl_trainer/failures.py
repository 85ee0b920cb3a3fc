"""What user code did wrong, said once and clearly: the component, how many rollouts of how
many failed, and the first exception at the user's own file and line.

Rewards, group rewards, rollout functions and filters run user code on every rollout. A failure
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

import logging
import sys
import sysconfig
import traceback
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rl_buffer.sampler import SamplingExhaustedError
from rl_core.errors import GenerationError, RewardError, RLError

__all__ = [
    "Failure",
    "FailureLog",
    "FailureReasons",
    "check_round",
    "describe_failures",
    "error_class",
    "exhausted_error",
    "fix_hint",
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
    :class:`~rl_buffer.sampler.SamplingExhaustedError` when the filters did.
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
