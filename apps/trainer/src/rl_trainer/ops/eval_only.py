"""``rl-train eval CHECKPOINT [RECIPE]``: the eval sets (reward, accuracy, pass@k, per-component
means; :mod:`rl_trainer.ops.evaluation`) on any checkpoint, without training.

``CHECKPOINT`` is a run's ``final_model``, one of its ``checkpoints/step_N`` directories, or any
model directory the generator loads. The config is ``RECIPE`` when given, else the one the run
stored in its checkpoints (``trainer_state.pt``) provided it names no code to import
(:mod:`rl_trainer.lifecycle.trust`: a checkpoint is data anyone may send). Samples are drawn with the
seeds of RL step 0, so two checkpoints of one run are evaluated on the same prompts with the
same seeds.

Results go to ``<run>/eval/<name>/eval.json`` (or ``--out``), as one record to that directory's
``metrics.jsonl``, and to the metrics sinks the config enables (``logging.wandb``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_core.config import apply_overrides, to_dict
from rl_core.errors import CheckpointError, ConfigError
from rl_trainer.config import TrainerConfig, load_trainer_config
from rl_trainer.lifecycle.checkpoint import latest_checkpoint, load_trainer_state

__all__ = ["resolve_checkpoint", "run_eval"]


def resolve_checkpoint(checkpoint: str | Path) -> tuple[Path, dict[str, Any] | None, int | None]:
    """``(model directory, stored config or None, RL step or None)`` of ``checkpoint``."""
    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise CheckpointError(
            f"{ckpt}: not a directory; pass a run's final_model, a checkpoints/step_N directory "
            "or a model directory."
        )
    if (ckpt / "trainer_state.pt").is_file():  # checkpoints/step_N
        state = load_trainer_state(ckpt)
        return ckpt / "policy", state.get("config"), state["state"].get("rl_step")
    # A model directory: the config of the run it belongs to, if any.
    run_dir = ckpt.parent
    newest = latest_checkpoint(run_dir) if (run_dir / "checkpoints").is_dir() else None
    if newest is not None:
        state = load_trainer_state(newest)
        step = state["state"].get("rl_step") if ckpt.name == "final_model" else None
        return ckpt, state.get("config"), step
    return ckpt, None, None


def _eval_dir(ckpt: Path) -> Path:
    base = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return base / "eval" / ckpt.name


def eval_config(
    checkpoint: str | Path, recipe: str | Path | None, overrides: Sequence[str]
) -> tuple[TrainerConfig, Path, int | None]:
    """The config of evaluating ``checkpoint`` (its model as ``model.path``, ``run_dir`` the
    eval directory), the model directory and the checkpoint's RL step (if known)."""
    ckpt = Path(checkpoint)
    model_dir, stored, step = resolve_checkpoint(ckpt)
    if recipe is not None:
        from rl_core.config import load_config_file

        data = load_config_file(recipe)
    elif stored is not None:
        from rl_trainer.lifecycle.trust import refuse_stored_code

        refuse_stored_code(stored, ckpt, f"rl-train eval {ckpt} RECIPE")
        data = dict(stored)
    else:
        raise ConfigError(
            f"{ckpt}: no run config found next to it (no checkpoints/ with trainer_state.pt); "
            "pass the recipe: rl-train eval CHECKPOINT RECIPE."
        )
    data = {**data, "model": {"path": str(model_dir.absolute())}}
    data["run_dir"] = str(_eval_dir(ckpt))
    data = apply_overrides(data, list(overrides), base_dir=Path.cwd())
    cfg = load_trainer_config(data)
    cfg.rl.async_generation = False
    cfg.rl.partial_rollouts = False
    return cfg, model_dir, step


class _Version:
    """The policy stand-in of an eval-only run (the sampled weights' version)."""

    def __init__(self, version: int) -> None:
        self.version = version


def run_eval(
    checkpoint: str | Path,
    recipe: str | Path | None,
    overrides: Sequence[str],
    *,
    out: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate ``checkpoint`` (see the module docstring); returns what ``eval.json`` holds:
    ``checkpoint``, ``step``, ``wall_time_s`` and ``metrics`` (``eval/...``)."""
    from rl_trainer.assembly import build_generator
    from rl_trainer.loop import Trainer
    from rl_trainer.ops.metrics import MetricsLogger
    from rl_trainer.ops.sinks import build_sinks
    from rl_trainer.phases import eval as evaluation

    cfg, model_dir, step = eval_config(checkpoint, recipe, overrides)
    trainer = Trainer(cfg, own_dir=False)  # eval/<name>/ is re-evaluated in place
    if not any(s.prompts for s in trainer.eval_sets):
        raise ConfigError(
            "eval: no eval prompts; the task's eval split, data.eval or eval.datasets must "
            "give some."
        )
    out_path = Path(out) if out else trainer.run_dir / "eval.json"
    # The checkpoint's step counted as its name counts it: SFT and RL steps together.
    global_step = cfg.sft.steps + step if step is not None else 0

    run = trainer.run_state

    async def main() -> dict[str, Any]:
        metrics = MetricsLogger(
            run.run_dir,
            tensorboard=cfg.logging.tensorboard,
            progress=False,
            phase_steps={},
            resume_lines=None,
            sinks=build_sinks(cfg),
        )
        run.start_records(metrics)
        t0 = run.t_start
        run.models.policy = _Version(0)  # type: ignore[assignment]
        try:
            run.models.generator = await build_generator(cfg, run.runtime, str(model_dir))
            result = await evaluation.evaluate(run, 0, every_set=True)
            run.emit({"step": step or 0, "phase": "eval", "global_step": global_step, **result})
        finally:
            metrics.close()
            if run.models.generator is not None:
                await run.models.generator.close()
            if run.runtime is not None:
                run.runtime.shutdown()
        return {
            "checkpoint": str(Path(checkpoint)),
            "step": step,
            "global_step": global_step if step is not None else None,
            "wall_time_s": round(time.perf_counter() - t0, 3),
            "metrics": result,
            "config": to_dict(cfg),
        }

    payload = asyncio.run(main())
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(payload, indent=1) + "\n")
    return {k: v for k, v in payload.items() if k != "config"} | {"out": str(out_path)}
