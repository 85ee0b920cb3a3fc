"""Evaluation: sample and score every eval set due at a step, with the same prompts and seeds
every time (:class:`~rl_trainer.ops.evaluation.EvalSet`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rl_buffer.failures import RolloutStats
from rl_trainer.step.stages import generate

if TYPE_CHECKING:
    from rl_trainer.run_state import RunState

__all__ = ["due", "evaluate"]


def due(run: RunState, step: int) -> bool:
    """Whether any eval set is evaluated after RL step ``step``."""
    return any(s.due(step, run.config.rl.steps) for s in run.eval_sets)


async def evaluate(run: RunState, step: int, *, every_set: bool = False) -> dict[str, float]:
    """Sample and score every eval set due at ``step`` (every set whatever its schedule with
    ``every_set``: ``rl-train eval``); the same prompts every time.

    Failed samples score 0. An eval set whose every sample failed stops the run with the
    failure report (at step 0 this is the first time the reward runs)."""
    out: dict[str, float] = {}
    for eval_set in run.eval_sets:
        if not eval_set.prompts:
            continue
        if not every_set and not eval_set.due(step, run.config.rl.steps):
            continue
        seed_parts: tuple[Any, ...] = (run.config.seed, "eval", step)
        if eval_set.name is not None:
            seed_parts = (run.config.seed, "eval", eval_set.name, step)
        stats = RolloutStats()
        groups = await generate(
            run, eval_set.prompts, eval_set.sampling, eval_set.n_samples, seed_parts, stats
        )
        await eval_set.scorer.score(groups, stats)
        where = f"eval at step {step}" + (f", set {eval_set.name!r}" if eval_set.name else "")
        stats.check(where)
        run.failure_log.log(where, stats.rollouts, stats.failed, stats.first)
        out.update(eval_set.metrics(groups))
    return out
