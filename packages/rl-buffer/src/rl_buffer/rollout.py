"""Turning prompts into groups of rollouts: the default single-turn sampling (one batched
generator call per round, a derived seed per sample), custom ``GenerateFn``s (agents, multi-turn)
and generation interruptible by weight updates (partial rollouts); the agent metrics of a round.

Scoring the groups (rewards, group rewards) is :mod:`rl_buffer.scoring`, filtering them
:func:`rl_buffer.filters.filter_groups`. User code (``generate_fn``) never crashes a round: what
it breaks is marked failed, counted in :class:`~rl_buffer.failures.RolloutStats` and its first
cause kept (:mod:`rl_buffer.failures`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rl_buffer.bounded import STOP_GRACE_S, is_async, stop_requested
from rl_buffer.failures import FailureReasons, InvalidResult, RolloutStats, short_repr, user_failure
from rl_buffer.partial import continue_rollout, resume_request
from rl_core.errors import ConfigError, RLError
from rl_core.interfaces import (
    Buffer,
    GenerateFn,
    Generator,
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

__all__ = [
    "AGENT_COUNTS",
    "PartialStats",
    "RunStopped",
    "WeightUpdates",
    "agent_metrics",
    "check_generate_fn",
    "derive_seed",
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
                if isinstance(e, InvalidResult)
                else FailureReasons.ROLLOUT_FN_ERROR
            )
            failure = user_failure(reason, generate_fn_name, e, p.uid, generate_fn)
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
    running and it did not return within :data:`~rl_buffer.bounded.STOP_GRACE_S`: the round is
    abandoned and the run ends without a checkpoint of the step; ``--resume`` continues from
    the newest checkpoint."""


async def until_stopped(awaitable: Any, name: str = "rollout.generate_fn") -> Any:
    """Await ``awaitable`` (one ``generate_fn`` call), but cancel it and raise
    :class:`RunStopped` once it has run :data:`~rl_buffer.bounded.STOP_GRACE_S` past a stop
    signal (:func:`rl_buffer.bounded.stop_requested`): the first Ctrl-C stops a run whose
    agents hang or wait on each other, instead of waiting for the step to finish."""
    task = asyncio.ensure_future(awaitable)
    stop_seen: float | None = None
    try:
        while True:
            await asyncio.wait({task}, timeout=_STOP_POLL_S)
            if task.done():
                return task.result()
            if not stop_requested():
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
    """``out`` as a list of rollouts, or :class:`InvalidResult` saying what it was."""
    if isinstance(out, Rollout) or not isinstance(out, Sequence) or isinstance(out, str):
        raise InvalidResult(
            f"returned {type(out).__name__} {short_repr(out)}; a GenerateFn returns a list of Rollout"
        )
    if not out:
        raise InvalidResult(
            "returned an empty list; a GenerateFn returns the prompt's rollouts (ctx.n_samples "
            "of them for a GRPO group)"
        )
    bad = [x for x in out if not isinstance(x, Rollout)]
    if bad:
        raise InvalidResult(
            f"returned a list holding {type(bad[0]).__name__} {short_repr(bad[0])}; a GenerateFn "
            "returns a list of Rollout"
        )
    return list(out)


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
