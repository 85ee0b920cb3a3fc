"""Turning prompts into scored groups: default single-turn sampling, custom ``GenerateFn``s,
reward scoring with failure accounting, group rewards, and group filters.

User code (rewards, ``generate_fn``, filters) never crashes a round: what it breaks is marked
failed, counted in :class:`RolloutStats` and its first cause kept (:mod:`rl_trainer.failures`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rl_buffer.partial import continue_rollout, resume_request
from rl_core.errors import ConfigError, RewardError, RLError
from rl_core.interfaces import (
    Buffer,
    GenerateFn,
    Generator,
    GroupFilter,
    GroupRewardFn,
    RewardFn,
    RolloutContext,
    Tokenizer,
)
from rl_core.lora import SEQUENCE_ADAPTER_KEY
from rl_core.routing import pad_routing
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Group,
    Prompt,
    Rollout,
    RolloutStatus,
    SamplingParams,
)
from rl_trainer.bounded import STOP_GRACE_S, BoundedCaller, CallAbandoned, is_async
from rl_trainer.failures import Failure, FailureReasons, check_round
from rl_trainer.lifecycle import stopping

__all__ = [
    "AGENT_COUNTS",
    "GuardedFilter",
    "PartialStats",
    "RolloutStats",
    "RunStopped",
    "Scorer",
    "WeightUpdates",
    "agent_metrics",
    "check_generate_fn",
    "derive_seed",
    "filter_groups",
    "generate_groups",
    "generate_groups_resumable",
    "rollout_from_result",
    "sample_requests",
    "until_stopped",
]

_STOP_POLL_S = 0.25
"""How often a running ``generate_fn`` call checks for a stop signal (seconds)."""


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from ``parts`` (run seed, phase, step, prompt, sample): sampling does
    not depend on batch composition or process history, so resumed runs sample identically."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def rollout_from_result(prompt: Prompt, result: GenerationResult, sample_id: str) -> Rollout:
    """A single-turn rollout from one generation result (token-in/token-out: no re-encoding);
    the engine's routing, when it returned one, covers the prompt and the response."""
    r = len(result.output_ids)
    tokens = tuple(prompt.token_ids) + tuple(result.output_ids)
    routed = result.routed_experts
    if routed is not None and routed.shape[0] > 0:
        routed = pad_routing(routed, len(tokens))
    else:
        routed = None
    return Rollout(
        prompt_uid=prompt.uid,
        rollout_id=sample_id,
        sample_id=sample_id,
        tokens=tokens,
        response_start=len(prompt.token_ids),
        loss_mask=(1,) * r,
        rollout_logprobs=tuple(result.output_logprobs),
        versions=(result.weight_version,) * r,
        status=result.finish_reason.to_status(),
        metadata=(
            {"failure": "generation_error"} if result.finish_reason == FinishReason.ERROR else {}
        ),
        routed_experts=routed,
    )


def sample_requests(
    prompts: Sequence[Prompt],
    sampling: SamplingParams,
    n_samples: int,
    seed_parts: tuple[Any, ...],
    *,
    return_routing: bool = False,
) -> list[GenerationRequest]:
    """The default path's requests: ``n_samples`` per prompt, prompt-major, each with its own
    derived seed and the id ``<prompt uid>/<sample index>``; ``return_routing`` asks the engine
    for the experts of every token (``rollout.routing_replay``); a prompt tagged with a LoRA
    adapter (multi-LoRA, ``metadata[SEQUENCE_ADAPTER_KEY]``) asks for that adapter."""
    return [
        GenerationRequest(
            request_id=f"{p.uid}/{j}",
            input_ids=tuple(p.token_ids),
            sampling=dataclasses.replace(sampling, seed=derive_seed(*seed_parts, i, j)),
            return_routing=return_routing,
            adapter=p.metadata.get(SEQUENCE_ADAPTER_KEY),
        )
        for i, p in enumerate(prompts)
        for j in range(n_samples)
    ]


async def generate_groups(
    prompts: Sequence[Prompt],
    *,
    generator: Generator,
    tokenizer: Tokenizer,
    sampling: SamplingParams,
    n_samples: int,
    seed_parts: tuple[Any, ...],
    policy_version: int,
    generate_fn: GenerateFn | None = None,
    stats: RolloutStats | None = None,
    generate_fn_name: str = "rollout.generate_fn",
    return_routing: bool = False,
) -> list[Group]:
    """Sample ``n_samples`` rollouts per prompt.

    The default path sends every request of the step to the generator in one call, so the engine
    batches them; a custom ``generate_fn`` is called once per prompt, concurrently. A
    ``generate_fn`` that raises or returns something other than a list of ``Rollout`` gives its
    prompt an empty group and counts ``n_samples`` failed rollouts in ``stats`` (its first cause
    kept, reported under ``generate_fn_name``); without ``stats`` it raises an
    :class:`~rl_core.errors.RLError` with that cause instead. ``stats.rollouts`` counts the
    rollouts asked for. ``return_routing``: every request asks for the engine's expert routing
    (a ``generate_fn`` sees it as ``ctx.return_routing``).
    """
    if generate_fn is None:
        requests = sample_requests(
            prompts, sampling, n_samples, seed_parts, return_routing=return_routing
        )
        if stats is not None:
            stats.rollouts += len(requests)
        results = await generator.generate(requests)
        groups = []
        for i, p in enumerate(prompts):
            rs = results[i * n_samples : (i + 1) * n_samples]
            groups.append(
                Group(prompt=p, rollouts=[rollout_from_result(p, r, r.request_id) for r in rs])
            )
        return groups

    async def one(i: int, p: Prompt) -> Group:
        ctx = RolloutContext(
            generator=generator,
            tokenizer=tokenizer,
            sampling=dataclasses.replace(sampling, seed=derive_seed(*seed_parts, i)),
            n_samples=n_samples,
            policy_version=policy_version,
            return_routing=return_routing,
            adapter=p.metadata.get(SEQUENCE_ADAPTER_KEY),
        )
        try:
            out = generate_fn(p, ctx)
            if inspect.isawaitable(out):
                out = await until_stopped(out, generate_fn_name)
            rollouts = _check_rollouts(out)
        except RunStopped:
            raise
        except Exception as e:  # user code must never crash the round
            reason = (
                FailureReasons.ROLLOUT_FN_INVALID
                if isinstance(e, _InvalidResult)
                else FailureReasons.ROLLOUT_FN_ERROR
            )
            failure = _failure(reason, generate_fn_name, e, p.uid, generate_fn)
            if stats is None:
                raise RLError(f"{failure.describe()}.") from e
            stats.rollouts += n_samples
            stats.record(reason, n_samples, failure)
            return Group(prompt=p, rollouts=[])
        if stats is not None:
            stats.rollouts += len(rollouts)
        return Group(prompt=p, rollouts=rollouts)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


AGENT_COUNTS: dict[str, str] = {
    "session_turns": "turns",
    "tool_calls": "tool_calls",
    "ill_formed": "ill_formed",
    "template_mismatch": "template_mismatch",
    "tool_errors": "tool_errors",
}
"""Per-session counts an agent rollout carries in its metadata (set by
:class:`~rl_agents.session.Session` and the agent's report) -> the name of their metric in
:func:`agent_metrics`."""


def agent_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """What the round's agent sessions did (``rollout/agent/*``), from the counts in the
    rollouts' metadata (:data:`AGENT_COUNTS`). A session's rollouts (one ``rollout_id``: merged
    turns, forks, sub-agents) carry the same counts, so each session counts once:
    ``rollout/agent/sessions``; per count ``rollout/agent/<count>`` (the round's total) and
    ``rollout/agent/<count>_mean`` (per session); ``rollout/agent/trajectories_mean``
    (rollouts per session: above 1 when the agent rewrote its history or forked);
    ``rollout/agent/multi_version`` (sessions whose trained tokens came from more than one
    policy version: a weight update landed during the session, between turns or inside a
    resumed turn). Empty when no rollout carries a count (not an agent run), so other runs
    log nothing new."""
    sessions: dict[str, Rollout] = {}
    trajectories: Counter[str] = Counter()
    versions: dict[str, set[int]] = {}
    for r in rollouts:
        if any(k in r.metadata for k in AGENT_COUNTS):
            sessions.setdefault(r.rollout_id, r)
            trajectories[r.rollout_id] += 1
            trained = (v for v, m in zip(r.versions, r.loss_mask, strict=False) if m)
            versions.setdefault(r.rollout_id, set()).update(trained)
    if not sessions:
        return {}
    out: dict[str, float] = {"rollout/agent/sessions": float(len(sessions))}
    for key, name in AGENT_COUNTS.items():
        values = [
            float(v)
            for r in sessions.values()
            if isinstance(v := r.metadata.get(key), int | float) and not isinstance(v, bool)
        ]
        if values:
            out[f"rollout/agent/{name}"] = float(sum(values))
            out[f"rollout/agent/{name}_mean"] = sum(values) / len(values)
    out["rollout/agent/trajectories_mean"] = sum(trajectories.values()) / len(sessions)
    out["rollout/agent/multi_version"] = float(sum(len(v) > 1 for v in versions.values()))
    return out


class RunStopped(RLError):
    """A stop signal (Ctrl-C, SIGTERM) came while a ``generate_fn`` (an agent run) was still
    running and it did not return within :data:`~rl_trainer.bounded.STOP_GRACE_S`: the round is
    abandoned and the run ends without a checkpoint of the step; ``--resume`` continues from
    the newest checkpoint."""


async def until_stopped(awaitable: Any, name: str = "rollout.generate_fn") -> Any:
    """Await ``awaitable`` (one ``generate_fn`` call), but cancel it and raise
    :class:`RunStopped` once it has run :data:`~rl_trainer.bounded.STOP_GRACE_S` past a stop
    signal (:func:`rl_trainer.lifecycle.stopping.stop_requested`): the first Ctrl-C stops a run whose
    agents hang or wait on each other, instead of waiting for the step to finish."""
    task = asyncio.ensure_future(awaitable)
    stop_seen: float | None = None
    try:
        while True:
            await asyncio.wait({task}, timeout=_STOP_POLL_S)
            if task.done():
                return task.result()
            if not stopping.stop_requested():
                continue
            now = time.monotonic()
            stop_seen = now if stop_seen is None else stop_seen
            if now - stop_seen > STOP_GRACE_S:
                raise RunStopped(
                    f"{name} was still running {STOP_GRACE_S:g} s after a stop signal, so its "
                    "rollouts were abandoned and the run stops without a checkpoint of this "
                    "step; `rl-train run ... --resume` continues from the newest checkpoint."
                )
    finally:
        if not task.done():
            task.cancel()


class _InvalidResult(RewardError):
    """User code returned a value of the wrong kind (the message says what and what is expected)."""


def check_generate_fn(fn: Any, *, field: str, ref: str) -> None:
    """Refuse, at load, a ``generate_fn`` the trainer cannot await: the rollout calls
    ``ctx.generate`` (a coroutine), so it must be an ``async def`` function or an object with
    ``async def __call__``; a :class:`~rl_core.errors.ConfigError` names ``field`` and ``ref``."""
    if is_async(fn):
        return
    name = getattr(fn, "__name__", None) or type(fn).__name__
    raise ConfigError(
        f"{field}: {ref!r} is not async ({name} is a plain function); the trainer awaits one "
        "call per prompt and the rollout awaits ctx.generate(...). Define it as "
        f"`async def {name}(prompt, ctx)` (or a class with `async def __call__`)."
    )


def _check_rollouts(out: Any) -> list[Rollout]:
    """``out`` as a list of rollouts, or :class:`_InvalidResult` saying what it was."""
    if isinstance(out, Rollout) or not isinstance(out, Sequence) or isinstance(out, str):
        raise _InvalidResult(
            f"returned {type(out).__name__} {_short(out)}; a GenerateFn returns a list of Rollout"
        )
    if not out:
        raise _InvalidResult(
            "returned an empty list; a GenerateFn returns the prompt's rollouts (ctx.n_samples "
            "of them for a GRPO group)"
        )
    bad = [x for x in out if not isinstance(x, Rollout)]
    if bad:
        raise _InvalidResult(
            f"returned a list holding {type(bad[0]).__name__} {_short(bad[0])}; a GenerateFn "
            "returns a list of Rollout"
        )
    return list(out)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failure(reason: str, component: str, e: Exception, sample: str, fn: Any) -> Failure:
    """The cause of a failure of user code ``fn``: at the user's frame when it raised; where
    ``fn`` is defined when it returned a wrong value or hung (the traceback is then ours)."""
    if isinstance(e, _InvalidResult | CallAbandoned):
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


class WeightUpdates(Protocol):
    """What resumable generation needs from whoever releases new weights (the rollout
    pipeline, :class:`rl_trainer.step.pipeline.RolloutPipeline`)."""

    async def newer_than(self, version: int) -> None:
        """Return once a version newer than ``version`` is released."""
        ...

    async def catch_up(self) -> int:
        """Load the newest released version into the generator; returns it."""
        ...


@dataclass(slots=True)
class PartialStats:
    """What partial rollouts did in one round."""

    interruptions: int = 0
    """Weight updates that cut the round's generation short."""
    resumed: int = 0
    """Requests resumed on newer weights (a rollout resumed twice counts twice)."""
    resumed_tokens: int = 0
    """Response tokens the resumed requests had already sampled (kept, not regenerated)."""


async def generate_groups_resumable(
    prompts: Sequence[Prompt],
    *,
    generator: Generator,
    buffer: Buffer,
    sampling: SamplingParams,
    n_samples: int,
    seed_parts: tuple[Any, ...],
    updates: WeightUpdates,
    stats: PartialStats,
    return_routing: bool = False,
) -> list[Group]:
    """The default single-turn sampling of :func:`generate_groups`, interruptible by weight
    updates (``rl.partial_rollouts``).

    While the requests generate, a newer released version (``updates.newer_than``) aborts them:
    the rollouts so far (tokens, log-probs, per-token versions) go to the buffer's partial store
    (``buffer.put_partial``) while the generator loads the newest version
    (``updates.catch_up``), then come back out (``buffer.take_partial``) and continue
    token-in/token-out on the new weights with the rest of their ``max_new_tokens`` budget and a
    fresh seed per (sample, version). Groups are returned when every rollout finished; a rollout
    whose budget ran out exactly at the abort is truncated. With ``return_routing`` the resumed
    requests ask for routing too, and a continued rollout takes the resumed request's routing
    (:func:`rl_buffer.partial.continue_rollout`).
    """
    requests = sample_requests(
        prompts, sampling, n_samples, seed_parts, return_routing=return_routing
    )
    prompt_of = {q.request_id: prompts[k // n_samples] for k, q in enumerate(requests)}
    index_of = {q.request_id: k for k, q in enumerate(requests)}
    done: dict[str, Rollout] = {}
    pending = requests
    while pending:
        served = generator.weight_version
        gen = asyncio.ensure_future(generator.generate(pending))
        newer = asyncio.ensure_future(updates.newer_than(served))
        try:
            await asyncio.wait({gen, newer}, return_when=asyncio.FIRST_COMPLETED)
            interrupted = not gen.done()
            if interrupted:
                await generator.abort()
            results = await gen
        finally:
            newer.cancel()
            if not gen.done():
                gen.cancel()
        for res in results:
            rid = res.request_id
            prev = done.get(rid)
            if prev is None:
                done[rid] = rollout_from_result(prompt_of[rid], res, rid)
            else:
                r = continue_rollout(prev, res)
                if res.finish_reason == FinishReason.ERROR:
                    r.metadata["failure"] = "generation_error"
                done[rid] = r
        aborted = [
            q.request_id for q in pending if done[q.request_id].status == RolloutStatus.ABORTED
        ]
        if not aborted or not interrupted:
            break  # aborted by someone else (not a weight update): those rollouts stay aborted
        stats.interruptions += 1
        # The partial rollouts wait in the buffer, with their versions, while the weights change.
        waiting = sorted({index_of[rid] // n_samples for rid in aborted})
        parked = [
            Group(
                prompt=prompts[i],
                rollouts=[
                    done[q.request_id] for q in requests[i * n_samples : (i + 1) * n_samples]
                ],
            )
            for i in waiting
        ]
        buffer.put_partial(parked)
        version = await updates.catch_up()
        pending = []
        for g in buffer.take_partial(len(parked)):
            for r in g.rollouts:
                if r.status != RolloutStatus.ABORTED:
                    continue
                base = requests[index_of[r.sample_id]].sampling
                params = dataclasses.replace(
                    base, seed=derive_seed(*seed_parts, index_of[r.sample_id], "resume", version)
                )
                req = resume_request(r, params, request_id=r.sample_id)
                if req is None:  # the abort landed on the budget's last token
                    done[r.sample_id] = dataclasses.replace(r, status=RolloutStatus.TRUNCATED)
                    continue
                pending.append(req)
                stats.resumed += 1
                stats.resumed_tokens += r.response_length
    return [
        Group(
            prompt=p,
            rollouts=[done[q.request_id] for q in requests[i * n_samples : (i + 1) * n_samples]],
        )
        for i, p in enumerate(prompts)
    ]


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
        (:func:`rl_trainer.failures.check_round`)."""
        check_round(where, self.rollouts, self.failed, self.first)


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

    Bounds (:mod:`rl_trainer.bounded`): each call gets ``timeout_s`` from when it starts and
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
        """``(reward, components)`` of what a reward returned, or :class:`_InvalidResult`."""
        expected = f"a reward returns a float or a mapping with a {self.reward_key!r} key"
        if isinstance(value, Mapping):
            if self.reward_key not in value:
                raise _InvalidResult(
                    f"returned a mapping without the {self.reward_key!r} key (keys: "
                    f"{sorted(map(str, value))}); {expected}"
                )
            info = {str(k): _number(v, str(k), expected) for k, v in value.items()}
            scalar = info[self.reward_key]
        else:
            scalar = _number(value, None, expected)
            info = {self.reward_key: scalar}
        if not math.isfinite(scalar):
            raise _InvalidResult(f"returned {scalar}; rewards must be finite numbers")
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
        failure = _failure(reason, name, e, rs[0].sample_id, fn)
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
                raise _InvalidResult(
                    f"returned {type(values).__name__} {_short(values)}; a group reward returns "
                    "a list with one value per rollout, in order"
                )
            values = list(values)
            if len(values) != len(live):
                raise _InvalidResult(
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
    :class:`_InvalidResult` saying what came back; ``key`` is its key in a returned mapping."""
    under = f" under key {key!r}" if key is not None else ""
    if value is None or isinstance(value, (str, bytes)):
        raise _InvalidResult(f"returned {_short(value)}{under}; {expected}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise _InvalidResult(
            f"returned {type(value).__name__} {_short(value)}{under}; {expected}"
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
                raise _InvalidResult(
                    f"returned {type(reason).__name__} {_short(reason)} for prompt {group.uid}; "
                    "a filter returns None to keep the group or a drop-reason string"
                )
        except Exception as e:  # user code must never crash the round
            failure = _failure(FailureReasons.FILTER_ERROR, self.name, e, group.uid, self.fn)
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
