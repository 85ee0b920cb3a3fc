"""The colocated hand-over of device memory in the synchronous RL step
(``runtime.offload_policy: true`` with ``runtime.layout: colocated``).

Training and rollout share the accelerators, so each holds the device memory only while it
works. One RL step runs these phases, and records the memory after each as
``memory/<phase>_bytes``::

    generate   the round's rollouts        (policy offloaded, generator holds its memory)
    release    generator.release_memory()  (skipped when the backend cannot release)
    onload     policy, critic and reference .onload()
    train      stages.train                (reference/critic forwards, optimizer steps)
    publish    transport.publish(version, named_weights)
    offload    policy, critic and reference .offload()
    resume     generator.resume_memory()
    load       generator.update_weights(update)   (the version checked)

``memory/<phase>_bytes`` is ``torch.cuda.memory_allocated`` of the process holding the policy
when it runs on CUDA, else the bytes of the policy's (critic's, reference's) tensor storages that
are resident (not in the offloader's host copies; on the ``ray`` runtime, of policy rank 0).
``memory/<phase>_rss_bytes`` is that process's resident set size. Checkpoints are written with
the models onloaded (:func:`onloaded`); the phase ends with them onloaded.

On the ``local`` runtime the colocated layout is the one process and its one device; on the
``ray`` runtime generator ``i`` shares policy rank ``i``'s bundle and the release goes through
:class:`~rl_trainer.ray.colocation.Colocation`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from rl_trainer.run_state import DeviceHandover, PhaseModels
from rl_trainer.step.memory import memory_sample

__all__ = ["PHASES", "Handover", "onloaded"]

PHASES = ("generate", "release", "onload", "train", "publish", "offload", "resume", "load")
"""The phases of a colocated step, in order (each gets a ``memory/<phase>_bytes`` metric)."""


class Handover:
    """Sequences the colocated step's phases (module docstring) for one run: it moves the
    phase's ``models`` on and off the device and has the generator (or, on the ``ray``
    runtime, ``runtime.colocation``) release and resume its memory."""

    def __init__(self, models: PhaseModels, runtime: Any, *, enabled: bool) -> None:
        """``enabled``: ``runtime.offload_policy`` (validated at load: colocated, synchronous);
        ``runtime``: the ``ray`` runtime, else ``None``."""
        self._models = models
        self._runtime = runtime
        self.enabled = enabled
        """Whether the step runs the hand-over."""

    def models(self) -> list[Any]:
        """The offloadable models of the run (:meth:`PhaseModels.offloadable`)."""
        return self._models.offloadable()

    def measure(self, phase: str, record: dict[str, Any]) -> None:
        """Add ``memory/<phase>_bytes`` and ``memory/<phase>_rss_bytes`` to ``record``."""
        if self._runtime is not None:
            sample = self._models.policy.memory_sample()  # type: ignore[union-attr]
        else:
            sample = memory_sample(self.models())
        record[f"memory/{phase}_bytes"] = sample["bytes"]
        record[f"memory/{phase}_rss_bytes"] = sample["rss_bytes"]

    def offload_models(self) -> None:
        """``offload()`` every model (no-ops when already offloaded)."""
        for m in self.models():
            m.offload()

    def onload_models(self) -> None:
        """``onload()`` every model (no-ops when nothing is offloaded)."""
        for m in self.models():
            m.onload()

    async def start(self) -> None:
        """Before the first round: the models leave the device, the generator keeps it."""
        if self.enabled:
            self.offload_models()

    async def _release(self) -> None:
        rt, gen = self._runtime, self._models.generator
        if rt is not None:
            await rt.colocation.release()
        elif getattr(gen, "supports_memory_release", False):
            await gen.release_memory()  # type: ignore[union-attr]

    async def _resume(self) -> None:
        rt, gen = self._runtime, self._models.generator
        if rt is not None:
            await rt.colocation.before_generate()
        elif getattr(gen, "supports_memory_release", False):
            await gen.resume_memory()  # type: ignore[union-attr]

    async def before_train(self, record: dict[str, Any]) -> None:
        """After the round: release the generator's memory and bring the models back."""
        self.measure("generate", record)
        await self._release()
        self.measure("release", record)
        self.onload_models()
        self.measure("onload", record)

    async def publish(
        self,
        record: dict[str, Any],
        publish: Callable[[], Any],
        load: Callable[[Any], Awaitable[None]],
    ) -> float:
        """After training: ``publish()`` the weights (it returns the update), offload the
        models, give the generator its memory back and ``load(update)``; returns the seconds
        it took (:func:`rl_trainer.step.stages.publish_only` and :func:`~rl_trainer.step.stages.load_update`
        are what the RL phase passes)."""
        self.measure("train", record)
        t0 = time.perf_counter()
        update = publish()
        self.measure("publish", record)
        self.offload_models()
        self.measure("offload", record)
        await self._resume()
        self.measure("resume", record)
        await load(update)
        self.measure("load", record)
        return time.perf_counter() - t0


@contextlib.contextmanager
def onloaded(handover: DeviceHandover | None, *, offload_after: bool) -> Iterator[None]:
    """The models on the device for the block (a checkpoint), offloaded again after it when
    the colocated hand-over holds them offloaded and ``offload_after`` (steps remain)."""
    if handover is None or not handover.enabled:
        yield
        return
    handover.onload_models()
    try:
        yield
    finally:
        if offload_after:
            handover.offload_models()
