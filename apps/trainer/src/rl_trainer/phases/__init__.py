"""The phases of a run, in order, driven by :class:`rl_trainer.loop.Trainer`.

Each phase is a module with ``async def run(trainer) -> bool`` that builds the models it needs,
runs its steps (emitting metrics, checkpointing on schedule, stopping on a signal) and returns
``True`` when a signal stopped the run. A new mode (rollout-only, replay, eval-only) is a new
module here and an entry in :data:`PHASES`, not a branch in the driver.

- :mod:`~rl_trainer.phases.sft`: the SFT warm-up on the training labels, or with
  ``mode: sft`` the whole run on chat data (:mod:`~rl_trainer.phases.chat_sft`).
- :mod:`~rl_trainer.phases.rl`: the RL phase (its steps are :mod:`rl_trainer.stages`).
- :mod:`~rl_trainer.phases.eval`: evaluation, called by the RL phase on schedule.
"""

from rl_trainer.phases import rl, sft

PHASES = (sft.run, rl.run)
"""The phases a training run (``mode: rl``) goes through, in order."""


def phases_for(mode: str) -> tuple:
    """The phases of a run in ``mode``: ``rl`` (SFT warm-up, RL) or ``sft`` (SFT only)."""
    return PHASES if mode == "rl" else (sft.run,)


__all__ = ["PHASES", "phases_for"]
