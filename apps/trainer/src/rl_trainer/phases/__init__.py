"""The phases of a run, in order, driven by :class:`rl_trainer.loop.Trainer`
(:data:`rl_trainer.loop.PHASES`).

Each phase is a module with ``async def run(run_state) -> bool`` that takes the run's typed
state (:class:`~rl_trainer.run_state.RunState`), builds the models it needs, runs its steps
(emitting metrics, checkpointing on schedule, stopping on a signal) and returns ``True`` when
a signal stopped the run. A new mode (rollout-only, replay, eval-only) is a new module here and
an entry in :func:`rl_trainer.loop.phases_for`, not a branch in the driver.

- :mod:`~rl_trainer.phases.sft`: the SFT warm-up on the training labels, or with
  ``mode: sft`` the whole run on chat data (:mod:`~rl_trainer.phases.chat_sft`).
- :mod:`~rl_trainer.phases.rl`: the RL phase (its steps are :mod:`rl_trainer.step.stages`).
- :mod:`~rl_trainer.phases.eval`: evaluation, called by the RL phase on schedule.
"""
