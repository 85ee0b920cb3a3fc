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

:class:`Trainer` is the short driver: it builds the run's typed state
(:class:`~rl_trainer.run_state.RunState`) and runs the phases on it; each concern has its own
module:

- :mod:`rl_trainer.assembly`: every component built from the config (and
  :mod:`rl_trainer.build`, the steps it shares with ``rl-train check``).
- :mod:`rl_trainer.run_state`: the state the phases and stages share, as typed parts.
- :mod:`rl_trainer.phases`: the phases in order (SFT warm-up, RL) and evaluation.
- :mod:`rl_trainer.step`: running a step; :mod:`rl_trainer.step.stages` is the RL step as
  stages (round, take, plan and pack, advantages, train, publish).
- :mod:`rl_trainer.lifecycle`: the run directory, checkpoints (:mod:`rl_trainer.lifecycle.state`:
  what they capture, saving, stopping, ``--resume``), signals.
- :mod:`rl_trainer.ops`: metrics and sinks, reports, traces and dumps, replay, evaluation.
- :mod:`rl_trainer.ray`: the ``ray`` runtime, where the policy and the generators are actors
  behind proxies that implement the same interfaces, so the phases are unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rl_buffer.failures import FailureLog
from rl_core.config import to_dict
from rl_core.interfaces import Critic, Generator, Policy, Tokenizer
from rl_core.memory import FrozenObjects
from rl_trainer.assembly import Components, assemble
from rl_trainer.config import TrainerConfig
from rl_trainer.defaults import freeze_gc, thread_split
from rl_trainer.lifecycle import state as trainer_state
from rl_trainer.lifecycle.checkpoint import run_dir_write_error
from rl_trainer.lifecycle.resume_check import data_digest
from rl_trainer.lifecycle.rundir import RunLock, claim, write_config
from rl_trainer.lifecycle.stopping import StopSignals
from rl_trainer.ops.evaluation import EvalSet
from rl_trainer.ops.metrics import MetricsLogger
from rl_trainer.ops.sinks import build_sinks
from rl_trainer.phases import rl as rl_phase
from rl_trainer.phases import sft as sft_phase
from rl_trainer.run_state import Counters, DeviceHandover, LogProbModel, PhaseModels, RunState

if TYPE_CHECKING:
    from rl_trainer.ray.runtime import RayRuntime

__all__ = ["PHASES", "Trainer", "phases_for"]

logger = logging.getLogger(__name__)

Phase = Callable[[RunState], Awaitable[bool]]
"""A phase: runs on the run's state; ``True`` when a signal stopped the run."""

PHASES: tuple[Phase, ...] = (sft_phase.run, rl_phase.run)
"""The phases a training run (``mode: rl``) goes through, in order."""


def phases_for(mode: str) -> tuple[Phase, ...]:
    """The phases of a run in ``mode``: ``rl`` (SFT warm-up, RL) or ``sft`` (SFT only)."""
    return PHASES if mode == "rl" else (sft_phase.run,)


class Trainer:
    """Builds every component from a :class:`TrainerConfig` and runs SFT warm-up then RL.

    The state the phases and stages share is :attr:`run_state`, a typed
    :class:`~rl_trainer.run_state.RunState` (the driver-side components, the models of the
    current phase, the weight transport, the counters, the runtime, the pipeline); the
    properties here are read-only views of it (:attr:`policy`, :attr:`generator`,
    :attr:`reference`, :attr:`critic`, :attr:`runtime`, :attr:`counters`, ...).
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
        see changed (:mod:`rl_trainer.lifecycle.resume_check`); ``own_dir``: lock ``run_dir`` for this
        run and refuse an earlier run there (:mod:`rl_trainer.lifecycle.rundir`; eval-only runs do not)."""
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
        parts = assemble(config)
        self.run_state = RunState(
            config=config,
            run_dir=self.run_dir,
            parts=parts,
            failure_log=FailureLog(logger),
            data_digest=data_digest(to_dict(config), exclude=self.run_dir.absolute()),
            allow_changed=self.allow_changed,
        )
        """The run's typed state, shared by the phases and stages (:mod:`rl_trainer.run_state`)."""
        self.init_model_path = parts.init_model_path
        if self.resume:
            trainer_state.restore(self.run_state)
        if self.run_lock is not None:
            write_config(self.run_dir, to_dict(config))
        if config.runtime.type == "ray":
            from rl_trainer.ray import RayRuntime

            self.run_state.runtime = RayRuntime(config)

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    # ----------------------------------------------------------------------------- views
    @property
    def parts(self) -> Components:
        """The driver-side components (data, buffer, rewards, filters, sampler, algorithm)."""
        return self.run_state.parts

    @property
    def models(self) -> PhaseModels:
        """The models of the current phase."""
        return self.run_state.models

    @property
    def policy(self) -> Policy | None:
        """The current phase's policy (``None`` before a phase builds it)."""
        return self.run_state.models.policy

    @property
    def generator(self) -> Generator | None:
        """The RL phase's generator."""
        return self.run_state.models.generator

    @property
    def reference(self) -> LogProbModel | None:
        """The KL reference model, else ``None``."""
        return self.run_state.models.reference

    @property
    def critic(self) -> Critic | None:
        """The critic, else ``None``."""
        return self.run_state.models.critic

    @property
    def teacher(self) -> LogProbModel | None:
        """The distillation teacher, else ``None``."""
        return self.run_state.models.teacher

    @property
    def runtime(self) -> RayRuntime | None:
        """The :class:`~rl_trainer.ray.RayRuntime` on the ``ray`` runtime, else ``None``."""
        return self.run_state.runtime

    @property
    def handover(self) -> DeviceHandover | None:
        """The colocated hand-over of device memory of the RL phase (:mod:`rl_trainer.step.offload`)."""
        return self.run_state.handover

    @property
    def counters(self) -> Counters:
        """The step counters."""
        return self.run_state.counters

    @property
    def state(self) -> dict[str, Any]:
        """The step counters as checkpoints store them (``sft_step``, ``rl_step``,
        ``eval_at_0``): a copy of :attr:`counters`, for reading."""
        return self.run_state.counters.as_checkpoint()

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.run_state.tokenizer

    @property
    def eval_sets(self) -> list[EvalSet]:
        """The eval sets (``eval``)."""
        return self.run_state.eval_sets

    @property
    def stopped_by(self) -> int | None:
        """The signal that stopped the run before its last step (``None``: it ran to the end)."""
        return self.run_state.stopped_by

    @property
    def stop_checkpoint(self) -> Path | None:
        """The checkpoint written when a signal stopped the run."""
        return self.run_state.stop_checkpoint

    def rl_start_path(self) -> str:
        """The checkpoint the RL phase starts from: the warm-up's weights, or the initial model."""
        return self.run_state.rl_start_path()

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
        run = self.run_state
        run.stopped_by, run.stop_checkpoint = None, None
        with StopSignals() as run.stop_signals:
            try:
                return asyncio.run(self._run())
            except OSError as e:
                named = run_dir_write_error(e, self.run_dir)
                if named is None:
                    raise
                raise named from e

    async def _run(self) -> list[dict[str, Any]]:
        """Run the mode's phases in order (:func:`phases_for`) until one is stopped by a
        signal; everything built is closed whatever happens."""
        run, cfg = self.run_state, self.config
        run.frozen = FrozenObjects(enabled=freeze_gc(cfg))
        run.start_records(
            MetricsLogger(
                self.run_dir,
                tensorboard=cfg.logging.tensorboard,
                progress=cfg.logging.progress,
                phase_steps={"sft": cfg.sft.steps, "rl": cfg.rl.steps if cfg.mode == "rl" else 0},
                resume_lines=run.resume.metrics_lines,
                sinks=build_sinks(cfg),
            )
        )
        try:
            for phase in phases_for(cfg.mode):
                if await phase(run):
                    break
        finally:
            try:
                await self._close()
            finally:
                run.frozen.thaw()  # even when closing failed: never leave the process frozen
        return run.records

    async def _close(self) -> None:
        """Stop the pipeline and the train thread, then close the metrics, generator, weight
        transport and the runtime."""
        run = self.run_state
        if run.pipeline is not None:
            await run.pipeline.close()
        if run.train_thread is not None:
            run.train_thread.shutdown(wait=True)
        if run.metrics is not None:
            run.metrics.close()
        if run.models.generator is not None:
            await run.models.generator.close()
        transport, receiver = run.sync.transport, run.sync.receiver
        if transport is not None:
            transport.close()
        # (the ray runtime closes its own receiver)
        if receiver not in (None, transport) and run.runtime is None:
            receiver.close()
        if run.runtime is not None:
            run.runtime.shutdown()
        self.release_run_dir()
