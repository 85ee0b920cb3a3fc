"""The run's state, typed: what the phases and stages of one training run share.

:class:`RunState` is built by :class:`rl_trainer.loop.Trainer` and passed to the phases
(:mod:`rl_trainer.phases`); a stage or helper that needs only some of it takes those parts (the
:class:`PhaseModels`, the :class:`WeightSync`, the :class:`Counters`, the components), so its
signature says what it reads and writes. This module imports nothing from the stages, the
phases or the driver: they all import it.

- :class:`PhaseModels`: the models of the current phase (policy, generator, reference,
  critic, teacher), rl-core's interfaces as their types.
- :class:`WeightSync`: the weight transport (sender and receiver) and how the RL phase publishes
  (full weights or LoRA adapters).
- :class:`Counters`: the step counters (``sft_step``, ``rl_step``, whether step 0 was
  evaluated) and the policy version the RL phase started at.
- :class:`ResumePoint`: what ``--resume`` read from the checkpoint until the phases use it.
- :class:`RunState`: those, the driver-side components, the runtime, the rollout pipeline, the
  metrics logger and the stop signals.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rl_agents.resumable import ResumableGenerator
from rl_buffer.failures import FailureLog
from rl_core.errors import RLError
from rl_core.interfaces import Critic, Generator, Policy, Tokenizer, WeightTransport
from rl_core.memory import FrozenObjects, HostMemoryTrim
from rl_core.types import LogProbOutput, TrainBatch
from rl_trainer.assembly import Components
from rl_trainer.config import TrainerConfig
from rl_trainer.lifecycle.stopping import StopSignals
from rl_trainer.ops.evaluation import EvalSet
from rl_trainer.ops.metrics import MetricsLogger
from rl_trainer.step.pipeline import RolloutPipeline

if TYPE_CHECKING:  # the ray runtime imports Ray's modules: only its type here
    from rl_trainer.ray.runtime import RayRuntime

__all__ = [
    "Counters",
    "DeviceHandover",
    "LogProbModel",
    "PhaseModels",
    "ResumePoint",
    "RoundSource",
    "RunState",
    "WeightSync",
]


class LogProbModel(Protocol):
    """A frozen model that scores a batch's tokens: the KL reference (a policy, or a LoRA
    policy's base view) and the distillation teacher."""

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False) -> LogProbOutput:
        """Log-probs ``[T]`` of ``batch.tokens``."""
        ...


class DeviceHandover(Protocol):
    """The colocated hand-over of device memory (:class:`rl_trainer.step.offload.Handover`)."""

    enabled: bool
    """Whether the step runs the hand-over (``runtime.offload_policy``)."""

    def onload_models(self) -> None:
        """Bring every model back to the device."""
        ...

    def offload_models(self) -> None:
        """Move every model off the device."""
        ...


class RoundSource(Protocol):
    """Where the RL step's groups come from instead of generating them (``rl-train replay``:
    :class:`rl_trainer.ops.replay.ReplaySource`)."""

    def produce_round(self, run: RunState, step: int) -> dict[str, Any]:
        """Put step ``step``'s groups into ``run.parts.buffer``; returns the round metrics."""
        ...


@dataclass
class PhaseModels:
    """The models of the current phase; each ``None`` until the phase builds it (the SFT phase
    builds only the policy)."""

    policy: Policy | None = None
    """The trained policy (on the ``ray`` runtime a proxy with the same interface)."""
    generator: Generator | None = None
    """The rollout engine (RL phase)."""
    reference: LogProbModel | None = None
    """The KL reference (``algorithm.use_reference``), else ``None``."""
    critic: Critic | None = None
    """The value model (``critic``), else ``None``."""
    teacher: LogProbModel | None = None
    """The frozen distillation teacher (``teacher``; :mod:`rl_trainer.step.teacher`), else ``None``."""

    def offloadable(self) -> list[Any]:
        """The models that hold device memory of their own in this process: policy, critic,
        reference (not a LoRA policy's base view) and a teacher that can be offloaded (an
        SGLang teacher is a server: not moved)."""
        teacher = self.teacher if hasattr(self.teacher, "offload") else None
        models = (self.policy, self.critic, self.reference, teacher)
        return [m for m in models if m is not None and not getattr(m, "shares_policy", False)]


@dataclass
class WeightSync:
    """How the RL phase brings the generator to the policy's weights."""

    transport: WeightTransport | None = None
    """The sender side of the weight transport (``None`` on the ``ray`` runtime: rank 0 sends)."""
    receiver: WeightTransport | None = None
    """The generator's side (the same object for file and in-process transports)."""
    adapter_sync: bool = False
    """The RL phase publishes LoRA adapters, not full weights (``rl.lora_sync``)."""
    adapters_served: bool = False
    """Multi-LoRA: the generator holds every adapter (after the first adapter update), so
    requests name their adapters (before it, fresh adapters equal the base it serves)."""
    base_path: str = ""
    """The checkpoint the RL phase started from: the base an adapter update names."""


@dataclass
class Counters:
    """The run's step counters (what checkpoints hold under ``state``)."""

    sft_step: int = 0
    """SFT steps done."""
    rl_step: int = 0
    """RL steps done."""
    eval_at_0: bool = False
    """Whether step 0 of the RL phase was evaluated."""
    first_version: int = 0
    """The policy version before RL step 1 (not checkpointed: derived when the RL phase
    starts)."""

    @property
    def global_step(self) -> int:
        """SFT and RL steps together, as checkpoint names, TensorBoard and W&B count them."""
        return self.sft_step + self.rl_step

    def train_version(self, step: int, updates_per_step: int) -> int:
        """The policy version that trains RL step ``step`` when each RL step takes
        ``updates_per_step`` optimizer steps (one version each)."""
        return self.first_version + (step - 1) * updates_per_step

    def as_checkpoint(self) -> dict[str, Any]:
        """The counters as a checkpoint stores them (``trainer_state.pt``'s ``state``)."""
        return {"sft_step": self.sft_step, "rl_step": self.rl_step, "eval_at_0": self.eval_at_0}

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> Counters:
        """The counters a checkpoint stored (:meth:`as_checkpoint`)."""
        return cls(
            sft_step=int(state["sft_step"]),
            rl_step=int(state["rl_step"]),
            eval_at_0=bool(state["eval_at_0"]),
        )


@dataclass
class ResumePoint:
    """What ``--resume`` read from a checkpoint (:func:`rl_trainer.lifecycle.state.restore`)."""

    checkpoint: Path | None = None
    """The checkpoint whose models the next phase loads (``None`` once loaded, or fresh)."""
    state: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's trainer state (``trainer_state.pt``)."""
    metrics_lines: int | None = None
    """How many lines ``metrics.jsonl`` held at the checkpoint (``None``: a fresh run)."""
    ready_rounds: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Rollout rounds an async run had produced ahead (handed to the pipeline at start)."""


@dataclass(kw_only=True)
class RunState:
    """The state the phases and stages of one run share (module docstring)."""

    config: TrainerConfig
    """The run's config."""
    run_dir: Path
    """The run directory (``run_dir``)."""
    parts: Components
    """The driver-side components (data, buffer, rewards, filters, sampler, algorithm)."""
    failure_log: FailureLog
    """Logs user-code failures once per reason."""
    data_digest: dict[str, str]
    """Content digests of the data files the run reads (checked by ``--resume``)."""
    allow_changed: tuple[str, ...] = ()
    """Fields ``--resume`` may see changed (:mod:`rl_trainer.lifecycle.resume_check`)."""
    models: PhaseModels = field(default_factory=PhaseModels)
    """The models of the current phase."""
    sync: WeightSync = field(default_factory=WeightSync)
    """The weight transport and how weights are published."""
    counters: Counters = field(default_factory=Counters)
    """The step counters."""
    resume: ResumePoint = field(default_factory=ResumePoint)
    """What ``--resume`` read (empty for a fresh run)."""
    runtime: RayRuntime | None = None
    """The :class:`~rl_trainer.ray.RayRuntime` on the ``ray`` runtime, else ``None``."""
    pipeline: RolloutPipeline | None = None
    """The rollout pipeline of an async RL phase (``rl.async_generation``), else ``None``."""
    train_thread: concurrent.futures.ThreadPoolExecutor | None = None
    """The thread the policy trains in while the pipeline generates (async mode)."""
    host_trim: HostMemoryTrim = field(default_factory=HostMemoryTrim)
    """The allocator trim once per RL step (``runtime.trim_host_memory``): after the first
    step, only when the resident memory grew by 256 MiB or more since the last one."""
    frozen: FrozenObjects = field(default_factory=lambda: FrozenObjects(enabled=False))
    """What the phases built, kept out of the garbage collector's passes until the run ends
    (``runtime.freeze_gc``); :class:`~rl_trainer.loop.Trainer` sets it when the run starts."""
    handover: DeviceHandover | None = None
    """The colocated hand-over of device memory (:mod:`rl_trainer.step.offload`), RL phase."""
    replay: RoundSource | None = None
    """A :class:`~rl_trainer.ops.replay.ReplaySource` when the rounds come from a dump
    (``rl-train replay``), else ``None``."""
    resumable_generator: ResumableGenerator | None = None
    """The generator a custom ``generate_fn`` gets with partial rollouts
    (:func:`rl_trainer.step.stages.resumable_generator`), else ``None``."""
    metrics: MetricsLogger | None = None
    """The metrics logger (set while the run runs)."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """The records emitted this run."""
    t_start: float = 0.0
    """When this process started the run (``perf_counter``)."""
    stop_signals: StopSignals | None = None
    """The SIGTERM/SIGINT watch while the run runs."""
    stopped_by: int | None = None
    """The signal that stopped the run before its last step (``None``: it ran to the end)."""
    stop_checkpoint: Path | None = None
    """The checkpoint written when a signal stopped the run."""

    # ----------------------------------------------------------------------- derived
    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.parts.tokenizer

    @property
    def eval_sets(self) -> list[EvalSet]:
        """The eval sets (``eval``)."""
        return self.parts.eval_sets

    @property
    def sft_model_path(self) -> Path:
        """Where the warm-up's final weights go; the RL phase starts from them."""
        return self.run_dir / "sft_model"

    def rl_start_path(self) -> str:
        """The checkpoint the RL phase starts from: the warm-up's weights, or the initial model."""
        return str(self.sft_model_path) if self.config.sft.steps > 0 else self.parts.init_model_path

    def train_version(self, step: int) -> int:
        """The policy version that trains RL step ``step`` (``rl.updates_per_step`` versions
        per RL step)."""
        return self.counters.train_version(step, self.config.rl.updates_per_step)

    def checkpoint_due(self) -> bool:
        """Whether the schedule (``checkpoint.every``) writes a checkpoint at the current step."""
        every = self.config.checkpoint.every
        return bool(every) and self.counters.global_step % every == 0

    @property
    def stop_requested(self) -> bool:
        """Whether a signal asked the run to stop after the current step."""
        return self.stop_signals is not None and self.stop_signals.signum is not None

    # ----------------------------------------------------------------------- records
    def start_records(self, metrics: MetricsLogger) -> None:
        """Start recording into ``metrics`` (the run's start: wall time counts from now)."""
        self.metrics = metrics
        self.records = []
        self.t_start = time.perf_counter()

    def emit(self, rec: dict[str, Any]) -> None:
        """Record and log one metrics record (with this process's wall time). ``step`` is the
        step within its phase; ``global_step`` (added unless given) counts SFT and RL steps
        together, as checkpoint names (``step_<global_step>``), TensorBoard and W&B do."""
        if self.metrics is None:
            raise RLError("RunState.emit: call it from a phase, inside Trainer.run().")
        rec.setdefault("global_step", self.counters.global_step)
        rec["perf/elapsed_s"] = time.perf_counter() - self.t_start  # wall time of this process
        self.records.append(rec)
        self.metrics.log(rec, global_step=int(rec["global_step"]))

    def log_samples(self, step: int, lines: list[dict[str, Any]]) -> None:
        """Write sample trace ``lines`` of RL step ``step`` (:mod:`rl_trainer.ops.samples`), each
        labelled with its ``global_step`` too."""
        if self.metrics is None:
            raise RLError("RunState.log_samples: call it from a phase, inside Trainer.run().")
        global_step = self.counters.sft_step + step
        for line in lines:
            line.setdefault("global_step", global_step)
        self.metrics.log_samples(lines, global_step=global_step)
