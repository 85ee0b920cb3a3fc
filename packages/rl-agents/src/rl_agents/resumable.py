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
the request is aborted (:meth:`~rl_core.interfaces.Generator.abort`), its partial tokens and
log-probs are kept as one piece (finish reason ``abort``, the old version), the generator is
brought to the newest version (``updates.catch_up()``, shared by every turn waiting on it) and
the turn continues from prompt + partial tokens with the rest of its ``max_new_tokens``
budget. Finished turns are never touched. Per-token versions therefore show exactly which
policy sampled each token, so the staleness bound can be enforced per token.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Protocol

from rl_core.errors import ConfigError
from rl_core.interfaces import Generator
from rl_core.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams

__all__ = ["ResumableTurns", "ResumeStats", "WeightUpdates"]


class WeightUpdates(Protocol):
    """Who releases new weights (the trainer's rollout pipeline implements it)."""

    async def newer_than(self, version: int) -> None:
        """Return once a version newer than ``version`` is released."""
        ...

    async def catch_up(self) -> int:
        """Load the newest released version into the generator; returns it."""
        ...


@dataclasses.dataclass(slots=True)
class ResumeStats:
    """What :class:`ResumableTurns` did."""

    interruptions: int = 0
    """Turns cut short by a weight update."""
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
        """Counts of interruptions and kept tokens."""
        self._catching_up: asyncio.Task[int] | None = None

    async def _catch_up(self) -> int:
        # One catch-up for every turn interrupted by the same release.
        if self._catching_up is None or self._catching_up.done():
            self._catching_up = asyncio.ensure_future(self.updates.catch_up())
        return await asyncio.shield(self._catching_up)

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, *, request_id: str
    ) -> list[GenerationResult]:
        """One turn, as the pieces that sampled it (oldest first; the last one finished)."""
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
            req = GenerationRequest(request_id=rid, input_ids=ids, sampling=params)
            served = self.generator.weight_version
            gen = asyncio.ensure_future(self.generator.generate([req]))
            newer = asyncio.ensure_future(self.updates.newer_than(served))
            try:
                await asyncio.wait({gen, newer}, return_when=asyncio.FIRST_COMPLETED)
                interrupted = not gen.done()
                if interrupted:
                    await self.generator.abort([rid])
                (res,) = await gen
            finally:
                newer.cancel()
                if not gen.done():
                    gen.cancel()
            if res.finish_reason != FinishReason.ABORT or not interrupted:
                pieces.append(res)
                return pieces
            self.stats.interruptions += 1
            self.stats.resumed_tokens += len(res.output_ids)
            if res.output_ids:
                pieces.append(res)
            ids += tuple(res.output_ids)
            left -= len(res.output_ids)
            await self._catch_up()
            if left < 1:  # the abort landed on the budget's last token
                last = pieces[-1]
                pieces[-1] = dataclasses.replace(last, finish_reason=FinishReason.LENGTH)
                return pieces
            part += 1
