"""Asynchronous generation: rollout rounds run ahead of training (``local`` and ``ray`` runtimes).

With ``rl.async_generation`` the trainer starts a :class:`RolloutPipeline`. Its producer task
runs on the event loop (the main thread) and produces one *round* per RL step: the groups step
``k`` trains on, generated and scored while the policy trains an earlier step in the trainer
thread (torch releases the GIL, so on two cores both really run)::

    version the generator serves for round k  =  v_train(k) - max_staleness
    v_train(k)                                =  policy version when step k trains (v0 + k - 1)

Timeline with ``max_staleness = 1`` (``G`` generation, ``T`` training, ``v`` weight version)::

    producer:  G1(v0) G2(v0) | G3(v1) | G4(v2) ...
    trainer:          T1(v0) | T2(v1) | T3(v2) ...     each step trains on data one version old

Rules that make the schedule a pure function of the seed (so async runs are reproducible and
resume exactly, and ``max_staleness = 0`` is the synchronous run):

- Weights reach the generator only *between* rounds, and exactly the version a round needs: an
  in-flight round always finishes on the weights it started with (no abort, no partial
  rollouts). The trainer *releases* version ``v`` after step ``v``; with ``max_staleness > 0`` it
  hands over a CPU copy of the weights (the policy trains on), which the producer publishes
  through the weight transport when the round that needs ``v`` starts.
- Evaluation and checkpoints at step ``k`` first :meth:`RolloutPipeline.drain` the producer: it
  finishes every round that needs a version before ``k`` and then waits for ``k``. The generator
  is idle, the buffer holds whole rounds, nothing is in flight.

Continuous mode (``rl.async_mode: continuous``) drops the exact schedule for fresher data: the
producer generates rounds back to back while the trainer trains, each on the *newest* released
version (:meth:`RolloutPipeline.catch_up` before each round), and stops only while
``max_staleness`` produced rounds wait for the trainer (or while drained). Rounds are numbered
on their own (a round may be dropped); :meth:`RolloutPipeline.next_round` hands out the oldest
ready one. The staleness bound is then enforced per token when a step takes its groups
(:func:`rl_trainer.step.stages.take_groups`): a group holding a token older than ``max_staleness``
RL steps is dropped and the step waits for the next round (never trained on, never
regenerated: its prompt is spent, as a filtered group's is). Timeline with ``max_staleness = 1``
and generation slower than training::

    producer:  G1(v0) G2(v0) | G3(v1)      G4(v2) ...   each round on the newest release
    trainer:          T1(v0) |   T2(v1)  |   T3(v2)     waits only when no round is ready

Partial rollouts (``rl.partial_rollouts``) trade that reproducibility for fresher data: a round
still starts on (at least) the version it needs, but when the trainer releases a newer version
while the round is generating, the round's in-flight requests are aborted, their partial tokens
wait in the buffer with their versions, the generator loads the newest released version
(:meth:`RolloutPipeline.catch_up`) and the rollouts resume on it
(:func:`rl_buffer.rollout.generate_groups_resumable` waits on
:meth:`RolloutPipeline.newer_than`). A rollout's tokens then span versions, none older than the
round's needed version, so the ``max_staleness`` bound holds; where the abort lands depends on
timing, so such runs are not bit-reproducible. A custom ``rollout.generate_fn`` gets a
resumable ``ctx.generator`` (:class:`rl_agents.resumable.ResumableGenerator` on this pipeline):
only the in-flight turn of an episode is aborted and resumed, the episode itself (its finished
turns, tool results, agent state) lives on in the rollout function.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import torch

from rl_core.errors import RLError

__all__ = ["RolloutPipeline"]

Weights = Iterable[tuple[str, torch.Tensor]]
"""Weights of one version for a later round: a CPU copy (``local`` runtime) or a handle to the
copy the policy ranks keep (``ray`` runtime, :class:`rl_trainer.ray.RemoteWeights`)."""


class RolloutPipeline:
    """Produces rollout rounds ahead of training, at most ``max_staleness`` versions behind.

    ``produce(step)`` generates and scores the groups of ``step``, puts them into the buffer and
    returns the round's metrics. ``serve(version, weights)`` brings the generator to ``version``
    (``weights`` is the released copy, or ``None`` when the live policy holds exactly that
    version and is idle). ``first_version`` is the policy version at RL step 0; each RL step
    advances it by ``versions_per_step`` (its optimizer steps), and ``max_staleness`` counts
    RL steps.
    """

    def __init__(
        self,
        *,
        produce: Callable[[int], Awaitable[dict[str, Any]]],
        serve: Callable[[int, Weights | None], Awaitable[None]],
        max_staleness: int,
        first_version: int,
        last_step: int,
        versions_per_step: int = 1,
        next_step: int,
        released: int,
        ready: Mapping[int, dict[str, Any]] | None = None,
        continuous: bool = False,
    ) -> None:
        self.continuous = continuous
        """``rl.async_mode: continuous``: rounds on the newest release, numbered on their own."""
        self.produce = produce
        self.serve = serve
        self.max_staleness = max_staleness
        self.first_version = first_version
        self.versions_per_step = versions_per_step
        self.last_step = last_step
        self._ready: dict[int, dict[str, Any]] = {int(k): v for k, v in (ready or {}).items()}
        self._next = max([next_step - 1, *self._ready]) + 1
        self._paused = False
        self._released = released
        self._weights: dict[int, Weights] = {}
        self._producing = False
        self._error: BaseException | None = None
        self._cond = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    def needed_version(self, step: int) -> int:
        """The weight version the generator serves for the round of ``step``."""
        behind = max(0, step - 1 - self.max_staleness)
        return self.first_version + behind * self.versions_per_step

    # ----------------------------------------------------------------------------- producer
    def start(self) -> None:
        """Start the producer task on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="rollout-producer")

    async def _run(self) -> None:
        try:
            while self.continuous or self._next <= self.last_step:
                step = self._next
                async with self._cond:
                    if self.continuous:  # the newest release, at most max_staleness rounds ahead
                        await self._cond.wait_for(self._may_produce)
                        need = self._released
                    else:
                        need = self.needed_version(step)
                        await self._cond.wait_for(lambda need=need: self._released >= need)
                    self._producing = True
                    weights = self._take_weights(need)
                await self.serve(need, weights)
                metrics = await self.produce(step)
                async with self._cond:
                    self._ready[step] = metrics
                    self._next = step + 1
                    self._producing = False
                    self._cond.notify_all()
        except BaseException as e:  # handed to the trainer's next wait
            async with self._cond:
                self._error = e
                self._producing = False
                self._cond.notify_all()
            if not isinstance(e, Exception):
                raise

    def _may_produce(self) -> bool:
        """Continuous mode: not drained, and fewer than ``max_staleness`` rounds wait."""
        return not self._paused and len(self._ready) < self.max_staleness

    def _take_weights(self, version: int) -> Weights | None:
        """The released copy of ``version`` (``None`` if none was kept); older copies are
        dropped, the generator never goes back to them (hold ``_cond``)."""
        weights = self._weights.pop(version, None)
        for v in [v for v in self._weights if v < version]:
            del self._weights[v]
        return weights

    def _check(self) -> bool:
        if self._error is not None:
            if isinstance(self._error, RLError):
                raise self._error
            raise RLError(f"rollout producer failed: {self._error!r}") from self._error
        return False

    # ----------------------------------------------------------------------------- trainer side
    async def next_round(self, step: int) -> dict[str, Any]:
        """Wait for the round of ``step`` (continuous mode: the oldest ready round; call again
        when its groups were too stale) whose groups are in the buffer; returns its metrics."""
        async with self._cond:
            if self.continuous:
                await self._cond.wait_for(lambda: self._check() or bool(self._ready))
                metrics = self._ready.pop(min(self._ready))
                self._cond.notify_all()  # room for the producer
                return metrics
            await self._cond.wait_for(lambda: self._check() or step in self._ready)
            return self._ready.pop(step)

    async def release(self, version: int, weights: Weights | None) -> None:
        """Let rounds that need ``version`` start; ``weights`` is a copy of that version (needed
        when the policy may train on before the producer uses it)."""
        async with self._cond:
            if weights is not None:
                self._weights[version] = weights
            self._released = version
            self._paused = False
            self._cond.notify_all()

    # ----------------------------------------------------------------------------- partial rollouts
    async def newer_than(self, version: int) -> None:
        """Return once a version newer than ``version`` is released (or the producer must stop)."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._check() or self._released > version)

    async def catch_up(self) -> int:
        """Bring the generator to the newest released version (between a round's aborted and
        resumed requests); returns that version."""
        async with self._cond:
            newest = self._released
            weights = self._take_weights(newest)
        await self.serve(newest, weights)
        return newest

    async def drain(self, version: int) -> None:
        """Wait until every round that needs a version below ``version`` is produced and the
        producer waits for ``version`` (call before ``release(version)``): the generator is idle
        and the buffer holds whole rounds only. Continuous mode: the producer finishes its
        round and pauses until the next :meth:`release`."""
        if self.continuous:
            async with self._cond:
                self._paused = True
                await self._cond.wait_for(lambda: self._check() or not self._producing)
            return
        trained = (version - self.first_version) // self.versions_per_step
        last = min(self.last_step, trained + self.max_staleness)
        async with self._cond:
            await self._cond.wait_for(
                lambda: self._check() or (self._next > last and not self._producing)
            )

    def state_dict(self) -> dict[str, Any]:
        """Metrics of produced rounds not trained yet (their groups are in the buffer); only
        meaningful after :meth:`drain`. Continuous mode numbers them as rounds, not steps."""
        state: dict[str, Any] = {"ready": {int(k): dict(v) for k, v in self._ready.items()}}
        if self.continuous:
            state["continuous"] = True
        return state

    async def close(self) -> None:
        """Stop the producer (a round in progress is cancelled)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._task = None
