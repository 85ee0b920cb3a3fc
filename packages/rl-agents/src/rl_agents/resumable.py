"""Multi-turn partial rollouts: a turn interrupted by a weight update resumes on the new
weights, the turns before it keep their tokens and versions.

Single-turn partial rollouts (``rl.partial_rollouts``) abort every in-flight request when a
newer policy version is released, park the partial rollouts, load the new weights and continue
each request token-in/token-out. :class:`ResumableTurns` does the same *per turn* for a custom
multi-turn rollout::

    turns = ResumableTurns(ctx.generator, updates)          # updates: newer_than / catch_up
    for turn in range(max_turns):
        pieces = await turns.generate(traj.input_ids, traj.clamp(sampling),
                                      request_id=f"{uid}/{turn}")
        for piece in pieces:                  # 1 piece, or aborted part(s) + resumed part
            traj.append_model(piece)          # each piece keeps the version that sampled it
        ...

A turn runs until its request finishes or ``updates.newer_than(served_version)`` fires; then
every in-flight request is aborted once (:meth:`~rl_core.interfaces.Generator.abort`, all
requests: every one of them runs on the old weights), their partial tokens and log-probs are
kept as one piece each (finish reason ``abort``, the old version), the generator is brought to
the newest version (``updates.catch_up()``, once per release, after every aborted request has
come back) and each turn continues from prompt + partial tokens with the rest of its
``max_new_tokens`` budget. Turns that start while a catch-up runs wait for it, so an abort never
hits a request on the new weights. Finished turns are never touched. Per-token versions
therefore show exactly which policy sampled each token, so the staleness bound can be enforced
per token.

:class:`ResumableGenerator` puts that behind the plain :class:`~rl_core.interfaces.Generator`
interface, so rollout code written for ``ctx.generate`` / ``ctx.generator`` (the calculator
example, :class:`~rl_agents.rollout.AgentRollout` and its OpenAI/Anthropic server) becomes
resumable unchanged: the trainer hands it to a custom ``generate_fn`` as ``ctx.generator`` when
``rl.partial_rollouts`` is on. A resumed turn comes back as one :class:`ResumedResult` whose
:attr:`~ResumedResult.pieces` keep each part's version;
:meth:`~rl_agents.trajectory.TrajectoryBuilder.append_model` records them per token.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from rl_core.errors import ConfigError
from rl_core.interfaces import Generator
from rl_core.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams

__all__ = ["ResumableGenerator", "ResumableTurns", "ResumeStats", "ResumedResult", "WeightUpdates"]


class WeightUpdates(Protocol):
    """Who releases new weights (the trainer's rollout pipeline implements it)."""

    async def newer_than(self, version: int) -> None:
        """Return once a version newer than ``version`` is released."""
        ...

    async def catch_up(self) -> int:
        """Load the newest released version into the generator; returns it."""
        ...


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ResumedResult(GenerationResult):
    """One turn that a weight update cut and that resumed on newer weights: the pieces' tokens
    and log-probs end to end.

    ``weight_version`` is the *oldest* piece's version, so code that reads only it over-states
    the staleness of the newer tokens (never the opposite); :attr:`token_versions` is exact.
    ``finish_reason`` and ``routed_experts`` are the last piece's (its request's input held the
    earlier pieces' tokens, so its routing covers the whole turn).
    """

    pieces: tuple[GenerationResult, ...]
    """The parts, oldest first: aborted part(s) (finish reason ``abort``) then the finished one."""

    @property
    def token_versions(self) -> tuple[int, ...]:
        """``[R]``: the version that sampled each output token."""
        return tuple(p.weight_version for p in self.pieces for _ in p.output_ids)

    @classmethod
    def merge(cls, pieces: Sequence[GenerationResult]) -> GenerationResult:
        """The turn of ``pieces`` as one result (the piece itself when there is only one)."""
        if len(pieces) == 1:
            return pieces[0]
        first, last = pieces[0], pieces[-1]
        return cls(
            request_id=first.request_id,
            output_ids=tuple(t for p in pieces for t in p.output_ids),
            output_logprobs=tuple(x for p in pieces for x in p.output_logprobs),
            finish_reason=last.finish_reason,
            weight_version=min(p.weight_version for p in pieces),
            routed_experts=last.routed_experts,
            pieces=tuple(pieces),
        )


def token_versions(result: GenerationResult) -> tuple[int, ...]:
    """``[R]``: the version of each output token of ``result`` (resumed or not)."""
    if isinstance(result, ResumedResult):
        return result.token_versions
    return (result.weight_version,) * len(result.output_ids)


@dataclasses.dataclass(slots=True)
class ResumeStats:
    """What :class:`ResumableTurns` did."""

    releases: int = 0
    """Weight releases that cut running turns short (one abort and one catch-up each)."""
    interruptions: int = 0
    """Turns cut short by a weight update (a turn cut twice counts twice)."""
    resumed_tokens: int = 0
    """Tokens those turns had sampled before the cut (kept, not regenerated)."""


class ResumableTurns:
    """Generates turns that survive weight updates; see the module docstring."""

    def __init__(self, generator: Generator, updates: WeightUpdates) -> None:
        if not generator.supports_abort:
            raise ConfigError(
                f"partial multi-turn rollouts: generator {type(generator).__name__} cannot abort "
                "requests; use one that can (hf, sglang) or turn partial rollouts off."
            )
        self.generator = generator
        self.updates = updates
        self.stats = ResumeStats()
        """Counts of releases, interruptions and kept tokens."""
        self._cond = asyncio.Condition()
        self._inflight: Counter[int] = Counter()  # served version -> requests running
        self._aborted_through = -1  # requests served at or below this version were aborted
        self._interrupt: asyncio.Task[int] | None = None

    def _start_interrupt(self) -> asyncio.Task[int]:
        """The running abort + catch-up, or a new one (one per release)."""
        if self._interrupt is None or self._interrupt.done():
            self._aborted_through = self.generator.weight_version
            self.stats.releases += 1
            self._interrupt = asyncio.ensure_future(self._abort_and_catch_up())
        return self._interrupt

    async def _abort_and_catch_up(self) -> int:
        await self.generator.abort()
        async with self._cond:  # every aborted request is back: the engine is idle
            await self._cond.wait_for(lambda: not +self._inflight)
        return await self.updates.catch_up()

    async def _gate(self) -> None:
        """Wait while an abort + catch-up runs (a request started now would be aborted)."""
        while self._interrupt is not None and not self._interrupt.done():
            await asyncio.shield(self._interrupt)

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str,
        return_routing: bool = False,
        adapter: str | None = None,
    ) -> list[GenerationResult]:
        """One turn, as the pieces that sampled it (oldest first; the last one finished), every
        piece on the LoRA ``adapter`` (``GenerationRequest.adapter``)."""
        pieces: list[GenerationResult] = []
        ids = tuple(input_ids)
        left = sampling.max_new_tokens
        part = 0
        while True:
            rid = request_id if part == 0 else f"{request_id}/resume{part}"
            params = dataclasses.replace(sampling, max_new_tokens=left)
            if params.seed is not None and part:
                params = dataclasses.replace(
                    params, seed=(params.seed * 1_000_003 + part) & 0x7FFFFFFF
                )
            req = GenerationRequest(
                request_id=rid,
                input_ids=ids,
                sampling=params,
                return_routing=return_routing,
                adapter=adapter,
            )
            await self._gate()
            served = self.generator.weight_version
            self._inflight[served] += 1
            gen = asyncio.ensure_future(self.generator.generate([req]))
            newer = asyncio.ensure_future(self.updates.newer_than(served))
            try:
                await asyncio.wait({gen, newer}, return_when=asyncio.FIRST_COMPLETED)
                if newer.done() and newer.exception() is not None:
                    raise newer.exception()  # type: ignore[misc]  # the updater failed
                if not gen.done():
                    self._start_interrupt()
                (res,) = await gen
            finally:
                newer.cancel()
                if not gen.done():
                    gen.cancel()
                async with self._cond:
                    self._inflight[served] -= 1
                    self._cond.notify_all()
            ours = res.finish_reason == FinishReason.ABORT and served <= self._aborted_through
            if not ours:  # finished (or aborted by someone else: it stays aborted)
                pieces.append(res)
                return pieces
            self.stats.interruptions += 1
            self.stats.resumed_tokens += len(res.output_ids)
            if res.output_ids:
                pieces.append(res)
            ids += tuple(res.output_ids)
            left -= len(res.output_ids)
            await asyncio.shield(self._start_interrupt())
            if left < 1:  # the abort landed on the budget's last token
                last = pieces[-1]
                pieces[-1] = dataclasses.replace(last, finish_reason=FinishReason.LENGTH)
                return pieces
            part += 1


class ResumableGenerator(Generator):
    """A :class:`~rl_core.interfaces.Generator` whose requests survive weight updates: each
    request runs as one :meth:`ResumableTurns.generate` turn and comes back as one result (a
    :class:`ResumedResult` when it was cut and resumed). Weight updates, abort, pause and
    health go to the wrapped generator; :meth:`close` leaves it open (its owner closes it)."""

    supports_abort = True

    def __init__(self, generator: Generator, updates: WeightUpdates) -> None:
        self.inner = generator
        """The wrapped generator."""
        self.turns = ResumableTurns(generator, updates)
        """The turn runner (its :attr:`~ResumableTurns.stats` count what was resumed)."""
        self.supports_routing = generator.supports_routing  # type: ignore[misc]
        self.supports_pause = generator.supports_pause  # type: ignore[misc]

    @property
    def updates(self) -> WeightUpdates:
        """Who releases new weights."""
        return self.turns.updates

    @property
    def stats(self) -> ResumeStats:
        """What was resumed so far."""
        return self.turns.stats

    @property
    def weight_version(self) -> int:
        """The wrapped generator's version."""
        return self.inner.weight_version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Every request as one resumable turn (concurrently), results in request order."""

        async def one(q: GenerationRequest) -> GenerationResult:
            pieces = await self.turns.generate(
                q.input_ids,
                q.sampling,
                request_id=q.request_id,
                return_routing=q.return_routing,
                adapter=q.adapter,
            )
            return ResumedResult.merge(pieces)

        return list(await asyncio.gather(*(one(q) for q in requests)))

    async def update_weights(self, update: Any, transport: Any) -> None:
        """Load ``update`` into the wrapped generator."""
        await self.inner.update_weights(update, transport)

    async def health(self) -> bool:
        """The wrapped generator's health."""
        return await self.inner.health()

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort on the wrapped generator (such turns are not resumed)."""
        await self.inner.abort(request_ids)

    async def pause(self) -> None:
        """Pause the wrapped generator."""
        await self.inner.pause()

    async def resume(self) -> None:
        """Resume the wrapped generator."""
        await self.inner.resume()
