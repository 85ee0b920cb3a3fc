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
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rl_trainer.loop import Trainer

__all__ = ["PHASES", "Handover", "memory_sample", "onloaded", "process_rss_bytes"]

PHASES = ("generate", "release", "onload", "train", "publish", "offload", "resume", "load")
"""The phases of a colocated step, in order (each gets a ``memory/<phase>_bytes`` metric)."""


def process_rss_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_sample(models: list[Any]) -> dict[str, int]:
    """``bytes`` (CUDA allocated when the models are on CUDA, else their resident tensor
    bytes) and ``rss_bytes`` of this process; ``models`` offer ``resident_storages()``."""
    on_cuda = any(getattr(m, "device", torch.device("cpu")).type == "cuda" for m in models)
    if on_cuda or (not models and torch.cuda.is_available()):
        allocated = int(torch.cuda.memory_allocated())
    else:
        allocated = sum(s.nbytes for m in models for s in m.resident_storages())
    return {"bytes": allocated, "rss_bytes": process_rss_bytes()}


class Handover:
    """Sequences the colocated step's phases (module docstring) for one run."""

    def __init__(self, trainer: Trainer) -> None:
        """Enabled by ``runtime.offload_policy`` (validated at load: colocated, synchronous)."""
        self.trainer = trainer
        self.enabled = bool(trainer.config.runtime.offload_policy)
        """Whether the step runs the hand-over."""

    def models(self) -> list[Any]:
        """The offloadable models of the run: policy, critic, reference and a teacher that
        lives in this process's memory (an SGLang teacher is a server: not moved)."""
        t = self.trainer
        teacher = getattr(t, "teacher", None)
        teacher = teacher if hasattr(teacher, "offload") else None
        models = (t.policy, t.critic, t.reference, teacher)
        # A LoRA run's reference is the policy's base view (rl_trainer.lora): no own memory.
        return [m for m in models if m is not None and not getattr(m, "shares_policy", False)]

    def measure(self, phase: str, record: dict[str, Any]) -> None:
        """Add ``memory/<phase>_bytes`` and ``memory/<phase>_rss_bytes`` to ``record``."""
        if self.trainer.runtime is not None:
            sample = self.trainer.policy.memory_sample()
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
        rt, gen = self.trainer.runtime, self.trainer.generator
        if rt is not None:
            await rt.colocation.release()
        elif getattr(gen, "supports_memory_release", False):
            await gen.release_memory()

    async def _resume(self) -> None:
        rt, gen = self.trainer.runtime, self.trainer.generator
        if rt is not None:
            await rt.colocation.before_generate()
        elif getattr(gen, "supports_memory_release", False):
            await gen.resume_memory()

    async def before_train(self, record: dict[str, Any]) -> None:
        """After the round: release the generator's memory and bring the models back."""
        self.measure("generate", record)
        await self._release()
        self.measure("release", record)
        self.onload_models()
        self.measure("onload", record)

    async def publish(self, record: dict[str, Any]) -> float:
        """After training: publish the weights, offload the models, give the generator its
        memory back and load the published weights; returns the seconds it took."""
        from rl_trainer import lora, stages

        run = self.trainer
        self.measure("train", record)
        t0 = time.perf_counter()
        version = run.policy.version
        update = stages.publish_only(run, version, lora.policy_weights(run))
        self.measure("publish", record)
        self.offload_models()
        self.measure("offload", record)
        await self._resume()
        self.measure("resume", record)
        await stages.load_update(run, version, update)
        self.measure("load", record)
        return time.perf_counter() - t0


@contextlib.contextmanager
def onloaded(trainer: Trainer) -> Iterator[None]:
    """The models on the device for the block (a checkpoint), offloaded again after it when
    the colocated hand-over holds them offloaded."""
    handover = getattr(trainer, "handover", None)
    if handover is None or not handover.enabled:
        yield
        return
    handover.onload_models()
    try:
        yield
    finally:
        if trainer.state["rl_step"] < trainer.config.rl.steps:
            handover.offload_models()
