"""Train-only and rollout-only runs: ``rl-train replay`` and ``rl-train rollout``.

``rl-train replay DUMP_DIR [RECIPE]`` trains on the groups a run dumped (``rollout.dump_dir``,
:mod:`rl_trainer.ops.dumps`) instead of generating them: each RL step puts the step's dumped groups
into the buffer in place of a rollout round, and the rest of the step (take, advantages, pack,
train) is the ordinary one. Nothing is generated: the generator is :class:`ReplayGenerator`,
which only records the weight version it was sent, and evaluation is off. On the same layout
(world size, micro-batch cap, backend, dtype) the replayed run ends with bitwise the same weights
as the run that wrote the dump. Without ``RECIPE`` the config is the one stored in the dump,
provided it names no code to import (a dump is data anyone may send; :mod:`rl_trainer.lifecycle.trust`);
with ``RECIPE`` its code references must be the ones the dump names.

``rl-train rollout RECIPE`` runs the rounds without training (data generation, serving
capacity tests): generation, rewards, filters and dumps, with the generator's weights fixed at
the start checkpoint (every step is policy version 0).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from rl_core.config import ComponentSpec, apply_overrides, to_dict
from rl_core.errors import ConfigError, DataError, RLError
from rl_core.interfaces import Generator, WeightTransport
from rl_core.types import GenerationRequest, GenerationResult, WeightUpdate
from rl_trainer.config import TrainerConfig, load_trainer_config
from rl_trainer.lifecycle.trust import check_same_code, code_refs, refuse_stored_code
from rl_trainer.ops import dumps
from rl_trainer.run_state import RunState

__all__ = [
    "ReplayGenerator",
    "ReplaySource",
    "replay_config",
    "run_rollout_only",
]

REPLAY_GENERATOR = "rl_trainer.ops.replay:ReplayGenerator"
"""The generator type a replay runs with."""


class ReplayGenerator(Generator):
    """The generator of a replayed run: it generates nothing and keeps the version of the last
    weights it was sent, so the run's weight publication stays checked."""

    supports_abort: ClassVar[bool] = False

    def __init__(self) -> None:
        self._version = 0

    @property
    def weight_version(self) -> int:
        """The version of the last update received (0 at start)."""
        return self._version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Always raises: a replayed run's groups come from its dump."""
        raise RLError(
            "rl-train replay: the replay generator cannot sample; the rollouts come from the "
            "dump. Evaluate the result with `rl-train eval RUN_DIR/final_model RECIPE`."
        )

    async def update_weights(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """Record ``update.version``."""
        self._version = update.version


class ReplaySource:
    """Feeds the dumped groups of ``dump_dir`` to an RL run in place of its rollout rounds
    (:func:`rl_trainer.step.stages.produce_round` calls :meth:`produce_round`)."""

    def __init__(self, dump_dir: str | Path) -> None:
        self.dump_dir = Path(dump_dir)
        dumps.read_manifest(self.dump_dir)
        self.steps = dumps.dumped_steps(self.dump_dir)

    def produce_round(self, run: RunState, step: int) -> dict[str, Any]:
        """Put step ``step``'s dumped groups into the run's buffer; returns the round metrics
        the original round logged (with ``perf/gen_time`` 0: nothing was generated)."""
        if step not in self.steps:
            raise DataError(
                f"{self.dump_dir}: no dump of RL step {step} (it holds {len(self.steps)} steps); "
                f"replay at most that many steps (--set rl.steps={len(self.steps)})."
            )
        dumped = dumps.load_step(self.dump_dir, step)
        want = run.config.rollout.prompts_per_step
        if len(dumped.groups) != want:
            raise ConfigError(
                f"rollout.prompts_per_step: {want}, but step {step} of {self.dump_dir} holds "
                f"{len(dumped.groups)} groups; replay with the recipe that wrote the dump "
                "(leave RECIPE out to use the dump's own config)."
            )
        run.parts.buffer.put(dumped.groups)
        record = dumped.round_metrics
        record["perf/gen_time"] = 0.0
        return record


def replay_config(
    dump_dir: str | Path, recipe: str | Path | None, overrides: Sequence[str]
) -> TrainerConfig:
    """The config of a replay of ``dump_dir``: ``recipe`` (else the config stored in the dump)
    with ``overrides``, then made train-only: the replay generator, evaluation and dumps off,
    synchronous steps, and ``run_dir`` ``<run_dir>-replay`` unless overridden."""
    manifest = dumps.read_manifest(dump_dir)
    stored = manifest.get("config") or {}
    source = Path(dump_dir) / "dump.json"
    if recipe is None:
        data = dict(stored)
        data["run_dir"] = f"{data.get('run_dir', 'runs/default')}-replay"
    else:
        from rl_core.config import load_config_file

        data = load_config_file(recipe)
        data["run_dir"] = f"{data.get('run_dir', 'runs/default')}-replay"
    data = apply_overrides(data, list(overrides), base_dir=Path.cwd())
    if recipe is None:  # the dump's own code is never imported: only code --set names
        from_dump = code_refs(stored)
        refuse_stored_code(
            {k: v for k, v in code_refs(data).items() if from_dump.get(k) == v},
            source,
            f"rl-train replay {dump_dir} RECIPE",
        )
    cfg = load_trainer_config(data)
    if recipe is not None:
        check_same_code(stored, to_dict(cfg), source, recipe)
    if cfg.rl.partial_rollouts:
        cfg.rl.partial_rollouts = False
    cfg.rl.async_generation = False  # a step trains on the same groups either way
    cfg.rollout.dump_dir = None
    cfg.eval.every = 0
    cfg.generator = ComponentSpec(type=REPLAY_GENERATOR)
    return cfg


def run_replay(
    dump_dir: str | Path, recipe: str | Path | None, overrides: Sequence[str]
) -> tuple[Any, list[dict[str, Any]]]:
    """Replay ``dump_dir`` (see the module docstring); returns the trainer and its records."""
    from rl_trainer.loop import Trainer

    cfg = replay_config(dump_dir, recipe, overrides)
    source = ReplaySource(dump_dir)
    if cfg.rl.steps > len(source.steps):
        raise ConfigError(
            f"rl.steps: {cfg.rl.steps}, but {dump_dir} holds {len(source.steps)} dumped steps; "
            f"set --set rl.steps={len(source.steps)} or fewer."
        )
    trainer = Trainer(cfg)
    trainer.parts.eval_sets = []  # nothing can be sampled
    trainer.run_state.replay = source
    return trainer, trainer.run()


class _FixedVersion:
    """The policy stand-in of a rollout-only run: its version never changes, no adapters."""

    version = 0
    lora = None


def run_rollout_only(recipe: str | Path, overrides: Sequence[str]) -> list[dict[str, Any]]:
    """Run ``rl.steps`` rollout rounds of ``recipe`` without training (see the module
    docstring); returns the records (also in ``<run_dir>/metrics.jsonl``)."""
    from rl_trainer.assembly import build_generator
    from rl_trainer.loop import Trainer
    from rl_trainer.ops.metrics import MetricsLogger
    from rl_trainer.ops.samples import after_take
    from rl_trainer.ops.sinks import build_sinks
    from rl_trainer.step.stages import produce_round, take_groups

    cfg = load_trainer_config(recipe, list(overrides))
    if cfg.sft.steps:
        raise ConfigError(
            "sft.steps: rl-train rollout generates with the initial model and runs no "
            "warm-up; set --set sft.steps=0 (or point model.path at the warmed-up model)."
        )
    cfg.rl.async_generation = False
    cfg.rl.partial_rollouts = False
    trainer = Trainer(cfg)
    run = trainer.run_state

    async def main() -> list[dict[str, Any]]:
        metrics = MetricsLogger(
            run.run_dir,
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
            phase_steps={"rollout": cfg.rl.steps},
            resume_lines=None,
            sinks=build_sinks(cfg),
        )
        run.start_records(metrics)
        records: list[dict[str, Any]] = []
        run.models.policy = _FixedVersion()  # type: ignore[assignment]
        try:
            run.models.generator = await build_generator(cfg, run.runtime, run.rl_start_path())
            for step in range(1, cfg.rl.steps + 1):
                # train_version(step) == 0: the weights never change
                run.counters.first_version = 1 - step
                t0 = time.perf_counter()
                rec = await produce_round(run, step)
                groups, staleness = take_groups(
                    run.parts.buffer,
                    n=cfg.rollout.prompts_per_step,
                    version=0,
                    max_staleness=cfg.rl.max_staleness,
                )
                run.counters.rl_step = step
                after_take(run, step, groups, rec, staleness)
                record = {"step": step, "phase": "rollout", **rec, **staleness}
                record["perf/step_time"] = time.perf_counter() - t0
                run.emit(record)
                records.append(record)
        finally:
            metrics.close()
            if run.models.generator is not None:
                await run.models.generator.close()
            if run.runtime is not None:
                run.runtime.shutdown()
            trainer.release_run_dir()
        return records

    return asyncio.run(main())
