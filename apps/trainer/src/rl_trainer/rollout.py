"""Turning prompts into scored groups: default single-turn sampling, custom ``GenerateFn``s,
reward scoring with failure accounting, group rewards, and group filters."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rl_buffer.partial import continue_rollout, resume_request
from rl_core.errors import RewardError
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
    "PartialStats",
    "RolloutStats",
    "Scorer",
    "WeightUpdates",
    "derive_seed",
    "filter_groups",
    "generate_groups",
    "generate_groups_resumable",
    "rollout_from_result",
    "sample_requests",
]


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from ``parts`` (run seed, phase, step, prompt, sample): sampling does
    not depend on batch composition or process history, so resumed runs sample identically."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def rollout_from_result(prompt: Prompt, result: GenerationResult, sample_id: str) -> Rollout:
    """A single-turn rollout from one generation result (token-in/token-out: no re-encoding)."""
    r = len(result.output_ids)
    return Rollout(
        prompt_uid=prompt.uid,
        rollout_id=sample_id,
        sample_id=sample_id,
        tokens=tuple(prompt.token_ids) + tuple(result.output_ids),
        response_start=len(prompt.token_ids),
        loss_mask=(1,) * r,
        rollout_logprobs=tuple(result.output_logprobs),
        versions=(result.weight_version,) * r,
        status=result.finish_reason.to_status(),
        metadata=(
            {"failure": "generation_error"} if result.finish_reason == FinishReason.ERROR else {}
        ),
    )


def sample_requests(
    prompts: Sequence[Prompt],
    sampling: SamplingParams,
    n_samples: int,
    seed_parts: tuple[Any, ...],
) -> list[GenerationRequest]:
    """The default path's requests: ``n_samples`` per prompt, prompt-major, each with its own
    derived seed and the id ``<prompt uid>/<sample index>``."""
    return [
        GenerationRequest(
            request_id=f"{p.uid}/{j}",
            input_ids=tuple(p.token_ids),
            sampling=dataclasses.replace(sampling, seed=derive_seed(*seed_parts, i, j)),
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
) -> list[Group]:
    """Sample ``n_samples`` rollouts per prompt.

    The default path sends every request of the step to the generator in one call, so the engine
    batches them; a custom ``generate_fn`` is called once per prompt, concurrently.
    """
    if generate_fn is None:
        requests = sample_requests(prompts, sampling, n_samples, seed_parts)
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
        )
        rollouts = await generate_fn(p, ctx)
        return Group(prompt=p, rollouts=list(rollouts))

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


class WeightUpdates(Protocol):
    """What resumable generation needs from whoever releases new weights (the rollout
    pipeline, :class:`rl_trainer.pipeline.RolloutPipeline`)."""

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
) -> list[Group]:
    """The default single-turn sampling of :func:`generate_groups`, interruptible by weight
    updates (``rl.partial_rollouts``).

    While the requests generate, a newer released version (``updates.newer_than``) aborts them:
    the rollouts so far (tokens, log-probs, per-token versions) go to the buffer's partial store
    (``buffer.put_partial``) while the generator loads the newest version
    (``updates.catch_up``), then come back out (``buffer.take_partial``) and continue
    token-in/token-out on the new weights with the rest of their ``max_new_tokens`` budget and a
    fresh seed per (sample, version). Groups are returned when every rollout finished; a rollout
    whose budget ran out exactly at the abort is truncated.
    """
    requests = sample_requests(prompts, sampling, n_samples, seed_parts)
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


class Scorer:
    """Applies a reward function to rollouts: decodes responses, awaits async rewards, and marks
    a rollout failed (with a counted reason) when the reward raises or is not finite.

    With a ``group_reward_fn`` (a :class:`~rl_core.interfaces.GroupRewardFn` such as
    :class:`~rl_core.rewards.group.MajorityVote`), each group is then scored as a whole over its
    rollouts that the per-rollout reward did not fail, and the group reward is what is trained
    on: ``reward`` and ``reward_info`` come from it, and the per-rollout reward's components stay
    in ``reward_info`` as ``rollout_<key>`` (e.g. ``rollout_reward``: label accuracy next to a
    label-free majority-vote reward). A group reward that raises, returns the wrong number of
    values or a non-finite value fails the rollouts it scored (``group_reward_error`` /
    ``group_reward_invalid``); it never crashes the step.
    """

    def __init__(
        self,
        reward_fn: RewardFn | None,
        tokenizer: Tokenizer,
        *,
        reward_key: str = "reward",
        group_reward_fn: GroupRewardFn | None = None,
    ) -> None:
        if reward_fn is None and group_reward_fn is None:
            raise RewardError("Scorer: give a reward function, a group reward function, or both.")
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.reward_key = reward_key
        self.group_reward_fn = group_reward_fn

    def _to_scalar(self, value: Any, rollout: Rollout) -> tuple[float, dict[str, float]]:
        if isinstance(value, Mapping):
            if self.reward_key not in value:
                raise RewardError(
                    f"reward for {rollout.sample_id}: the mapping has no {self.reward_key!r} key "
                    f"(keys: {sorted(value)}); return it or set the reward key."
                )
            info = {str(k): float(v) for k, v in value.items()}
            scalar = info[self.reward_key]
        else:
            scalar = float(value)
            info = {self.reward_key: scalar}
        if not math.isfinite(scalar):
            raise RewardError(
                f"reward for {rollout.sample_id} is {scalar}; rewards must be finite."
            )
        return scalar, info

    async def score(self, groups: Sequence[Group], stats: RolloutStats) -> None:
        """Fill ``reward`` and ``reward_info`` of every rollout of ``groups`` in place."""
        for g in groups:
            texts: dict[int, str] = {}
            for r in g.rollouts:
                if r.status == RolloutStatus.FAILED:
                    stats.failed[r.metadata.get("failure", "generation")] += 1
                    continue
                text = self.tokenizer.decode(list(r.response_ids), skip_special_tokens=True)
                texts[id(r)] = text
                if self.reward_fn is None:
                    continue
                try:
                    value = self.reward_fn(g.prompt, text, r)
                    if inspect.isawaitable(value):
                        value = await value
                    r.reward, r.reward_info = self._to_scalar(value, r)
                except Exception as e:  # a user reward must never crash the step
                    reason = "reward_invalid" if isinstance(e, RewardError) else "reward_error"
                    self._fail(r, reason, e, stats)
            if self.group_reward_fn is not None:
                await self._score_group(g, texts, stats)

    @staticmethod
    def _fail(r: Rollout, reason: str, e: Exception, stats: RolloutStats) -> None:
        r.status = RolloutStatus.FAILED
        r.metadata["failure"] = f"{reason}: {e!r}"
        stats.failed[reason] += 1

    async def _score_group(self, g: Group, texts: dict[int, str], stats: RolloutStats) -> None:
        assert self.group_reward_fn is not None
        live = [r for r in g.rollouts if r.status != RolloutStatus.FAILED]
        if not live:
            return
        try:
            values = self.group_reward_fn(g.prompt, [texts[id(r)] for r in live], live)
            if inspect.isawaitable(values):
                values = await values
            values = list(values)
            if len(values) != len(live):
                raise RewardError(
                    f"group reward for prompt {g.prompt.uid}: {len(values)} values for "
                    f"{len(live)} rollouts; return one per rollout, in order."
                )
            scored = [self._to_scalar(v, r) for v, r in zip(values, live)]
        except Exception as e:  # a user reward must never crash the step
            reason = "group_reward_invalid" if isinstance(e, RewardError) else "group_reward_error"
            for r in live:
                self._fail(r, reason, e, stats)
            return
        for r, (scalar, info) in zip(live, scored):
            per_rollout = {f"rollout_{k}": v for k, v in r.reward_info.items()}
            r.reward, r.reward_info = scalar, {**per_rollout, **info}


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
