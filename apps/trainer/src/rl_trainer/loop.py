"""The training run (DESIGN §6), synchronous or asynchronous, on the ``local`` or ``ray``
runtime::

    for step in range(rl.steps):
        round: prompts  = train_data.next_prompts(P)       # DataSource
               groups   = generate n rollouts per prompt    # Generator / GenerateFn
               score    -> rewards, failures counted        # RewardFn
               filter   -> over-sample until P fresh groups # GroupFilter (stale surplus dropped)
               buffer.put(groups)                           # Buffer
        groups = buffer.take(P, min_version=policy.version - rl.max_staleness)
        advantages -> packed TrainBatch (+ ref log-probs)   # AdvantageFn, loss weights
                      (with a critic: values -> GAE)        # Critic
        policy.train_step(batch, loss)                      # Policy, LossFn
        critic.train_step(batch, value_loss)                # Critic, ValueLossFn (optional)
        update = transport.publish(version, named_weights)  # WeightTransport
        generator.update_weights(update, transport)
        evaluate / checkpoint on schedule

:class:`Trainer` is the short driver; each concern has its own module:

- :mod:`rl_trainer.assembly`: every component built from the config (and
  :mod:`rl_trainer.build`, the steps it shares with ``rl-train check``).
- :mod:`rl_trainer.phases`: the phases in order (SFT warm-up, RL) and evaluation.
- :mod:`rl_trainer.stages`: the RL step as stages (round, take, plan and pack, advantages,
  train, publish).
- :mod:`rl_trainer.state`: what checkpoints capture, and ``--resume``.
- :mod:`rl_trainer.ray`: the ``ray`` runtime, where the policy and the generators are actors
  behind proxies that implement the same interfaces, so the phases are unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_core.config import to_dict
from rl_core.errors import RLError
from rl_trainer import state as trainer_state
from rl_trainer.assembly import Components, assemble, thread_split
from rl_trainer.checkpoint import latest_checkpoint, run_dir_write_error
from rl_trainer.config import TrainerConfig
from rl_trainer.evaluation import EvalSet
from rl_trainer.failures import FailureLog
from rl_trainer.metrics import MetricsLogger, build_sinks
from rl_trainer.offload import Handover, onloaded
from rl_trainer.phases import eval as evaluation
from rl_trainer.phases import phases_for
from rl_trainer.pipeline import RolloutPipeline
from rl_trainer.resume_check import data_digest
from rl_trainer.rundir import RunLock, claim, write_config
from rl_trainer.stopping import StopSignals

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)


class Trainer:
    """Builds every component from a :class:`TrainerConfig` and runs SFT warm-up then RL.

    It holds the run's state that the phases and stages share: the driver-side components
    (:attr:`parts`), the models of the current phase (:attr:`policy`, :attr:`generator`,
    :attr:`reference`, :attr:`critic`), the weight transport, the step counters
    (:attr:`state`) and, on the ``ray`` runtime, :attr:`runtime`.
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        resume: bool = False,
        overwrite: bool = False,
        allow_changed: Sequence[str] = (),
        own_dir: bool = True,
    ) -> None:
        """``resume``: continue from the newest checkpoint; ``overwrite``: move an earlier run
        in ``run_dir`` aside instead of refusing; ``allow_changed``: fields ``--resume`` may
        see changed (:mod:`rl_trainer.resume_check`); ``own_dir``: lock ``run_dir`` for this
        run and refuse an earlier run there (:mod:`rl_trainer.rundir`; eval-only runs do not)."""
        self.config = config
        self.resume = resume
        self.allow_changed = tuple(allow_changed)
        self.run_dir = config.run_path
        self.run_lock: RunLock | None = None
        """The lock this run holds on ``run_dir`` (released when :meth:`run` ends)."""
        if own_dir:
            self.run_lock = claim(self.run_dir, resume=resume, overwrite=overwrite)
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._init(config)
        except BaseException:
            self.release_run_dir()
            raise

    def release_run_dir(self) -> None:
        """Release the lock on ``run_dir`` (idempotent)."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _init(self, config: TrainerConfig) -> None:
        torch.set_num_threads(thread_split(config)[0])
        self._seed_everything(config.seed)
        self.parts: Components = assemble(config)
        """The driver-side components (data, buffer, rewards, filters, sampler, algorithm)."""
        self.init_model_path = self.parts.init_model_path
        self.failure_log = FailureLog(logger)
        self.runtime: Any = None
        """The :class:`~rl_trainer.ray.RayRuntime` on the ``ray`` runtime, else ``None``."""
        self.policy: Any = None
        self.generator: Any = None
        self.reference: Any = None
        self.adapter_sync = False
        """The RL phase publishes LoRA adapters, not full weights (``rl.lora_sync``)."""
        self.adapters_served = False
        """Multi-LoRA: the generator holds every adapter (after the first adapter update), so
        requests name their adapters (before it, fresh adapters equal the base it serves)."""
        self.teacher: Any = None
        """The frozen distillation teacher (``teacher``; :mod:`rl_trainer.teacher`)."""
        self.critic: Any = None
        self.resumable_generator: Any = None
        """The generator a custom ``generate_fn`` gets with partial rollouts
        (:func:`rl_trainer.stages.resumable_generator`), else ``None``."""
        self.transport: Any = None
        self.receiver: Any = None
        self.state: dict[str, Any] = {"sft_step": 0, "rl_step": 0, "eval_at_0": False}
        """Step counters: ``sft_step``, ``rl_step`` and whether step 0 was evaluated."""
        self.handover: Handover | None = None
        """The colocated hand-over of device memory (:mod:`rl_trainer.offload`), RL phase."""
        self.pipeline: RolloutPipeline | None = None
        self.train_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.first_version = 0
        self.ready_rounds: dict[int, dict[str, Any]] = {}
        self.resume_lines: int | None = None
        self._resume_from: Path | None = None
        self.resume_state: dict[str, Any] = {}
        self.replay: Any = None
        """A :class:`~rl_trainer.replay.ReplaySource` when the rounds come from a dump
        (``rl-train replay``), else ``None``."""
        self.stopped_by: int | None = None
        """The signal that stopped the run before its last step (``None``: it ran to the end)."""
        self.stop_checkpoint: Path | None = None
        """The checkpoint written when a signal stopped the run."""
        self._stop_signals: StopSignals | None = None
        self._metrics: MetricsLogger | None = None
        self._records: list[dict[str, Any]] = []
        self._t_start = 0.0
        self.data_digest: dict[str, str] = data_digest(
            to_dict(config), exclude=self.run_dir.absolute()
        )
        """Content digests of the data files the run reads (checked by ``--resume``)."""
        if self.resume:
            trainer_state.restore(self)
        if self.run_lock is not None:
            write_config(self.run_dir, to_dict(config))
        if config.runtime.type == "ray":
            from rl_trainer.ray import RayRuntime

            self.runtime = RayRuntime(config)

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    @property
    def tokenizer(self) -> Any:
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
        return str(self.sft_model_path) if self.config.sft.steps > 0 else self.init_model_path

    def train_version(self, step: int) -> int:
        """The policy version that trains RL step ``step``: each RL step takes
        ``rl.updates_per_step`` optimizer steps (one by default), each a version."""
        return self.first_version + (step - 1) * self.config.rl.updates_per_step

    async def evaluate(self, step: int) -> dict[str, float]:
        """Sample and score every eval set due at ``step`` (:func:`rl_trainer.phases.eval.evaluate`)."""
        return await evaluation.evaluate(self, step)

    # ----------------------------------------------------------------------------- main
    def run(self) -> list[dict[str, Any]]:
        """Run to the end (resuming if asked); returns the records written this run.

        While it runs (from the main thread), SIGTERM and SIGINT stop it cleanly: the current
        step finishes, a checkpoint is written and ``run`` returns early with
        :attr:`stopped_by` set to the signal, so ``--resume`` continues exactly where it
        stopped. A second signal exits the process at once (status ``128 + signal``) without a
        checkpoint; the newest complete checkpoint stays valid.

        A file of the run directory that cannot be written (a full disk, a read-only file
        system, no permission, the file-size limit) ends the run with a
        :class:`~rl_core.errors.CheckpointError` naming the file and the cause.
        """
        self.stopped_by, self.stop_checkpoint = None, None
        with StopSignals() as self._stop_signals:
            try:
                return asyncio.run(self._run())
            except OSError as e:
                named = run_dir_write_error(e, self.run_dir)
                if named is None:
                    raise
                raise named from e

    async def _run(self) -> list[dict[str, Any]]:
        """Run the mode's phases in order (:func:`rl_trainer.phases.phases_for`) until one is stopped by a
        signal; everything built is closed whatever happens."""
        cfg = self.config
        self._metrics = MetricsLogger(
            self.run_dir,
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
            phase_steps={"sft": cfg.sft.steps, "rl": cfg.rl.steps if cfg.mode == "rl" else 0},
            resume_lines=self.resume_lines,
            sinks=build_sinks(cfg),
        )
        self._records = []
        self._t_start = time.perf_counter()
        try:
            for phase in phases_for(cfg.mode):
                if await phase(self):
                    break
        finally:
            await self._close()
        return self._records

    async def _close(self) -> None:
        """Stop the pipeline and the train thread, then close the metrics, generator, weight
        transport and the runtime."""
        if self.pipeline is not None:
            await self.pipeline.close()
        if self.train_thread is not None:
            self.train_thread.shutdown(wait=True)
        if self._metrics is not None:
            self._metrics.close()
        if self.generator is not None:
            await self.generator.close()
        if self.transport is not None:
            self.transport.close()
        # (the ray runtime closes its own receiver)
        if self.receiver not in (None, self.transport) and self.runtime is None:
            self.receiver.close()
        if self.runtime is not None:
            self.runtime.shutdown()
        self.release_run_dir()

    # ----------------------------------------------------------------------------- for phases
    def emit(self, rec: dict[str, Any]) -> None:
        """Record and log one metrics record (with this process's wall time). ``step`` is the
        step within its phase; ``global_step`` (added unless given) counts SFT and RL steps
        together, as checkpoint names (``step_<global_step>``), TensorBoard and W&B do."""
        if self._metrics is None:
            raise RLError("Trainer.emit: call it from a phase, inside Trainer.run().")
        rec.setdefault("global_step", self.state["sft_step"] + self.state["rl_step"])
        rec["perf/elapsed_s"] = time.perf_counter() - self._t_start  # wall time of this process
        self._records.append(rec)
        self._metrics.log(rec, global_step=int(rec["global_step"]))

    def log_samples(self, step: int, lines: list[dict[str, Any]]) -> None:
        """Write sample trace ``lines`` of RL step ``step`` (:mod:`rl_trainer.samples`), each
        labelled with its ``global_step`` too."""
        if self._metrics is None:
            raise RLError("Trainer.log_samples: call it from a phase, inside Trainer.run().")
        global_step = self.state["sft_step"] + step
        for line in lines:
            line.setdefault("global_step", global_step)
        self._metrics.log_samples(lines, global_step=global_step)

    def checkpoint_due(self) -> bool:
        """Whether the schedule (``checkpoint.every``) writes a checkpoint at the current step."""
        every = self.config.checkpoint.every
        return bool(every) and (self.state["sft_step"] + self.state["rl_step"]) % every == 0

    def save(self) -> None:
        """Write a checkpoint of the current step (:func:`rl_trainer.state.save`)."""
        if self._metrics is None:
            raise RLError("Trainer.save: call it from a phase, inside Trainer.run().")
        with onloaded(self):
            trainer_state.save(self, self._metrics.lines)

    @property
    def stop_requested(self) -> bool:
        """Whether a signal asked the run to stop after the current step."""
        return self._stop_signals is not None and self._stop_signals.signum is not None

    async def stop(self, *, saved: bool) -> None:
        """Stop early on a signal: quiesce the rollout pipeline (async mode) and write a
        checkpoint of the step just finished unless ``saved`` (the schedule already wrote it)."""
        if self.pipeline is not None:
            await self.pipeline.drain(self.policy.version)
        if not saved:
            self.save()
        if self._stop_signals is None:
            raise RLError("Trainer.stop: call it from a phase, inside Trainer.run().")
        self.stopped_by = self._stop_signals.signum
        self.stop_checkpoint = latest_checkpoint(self.run_dir)
