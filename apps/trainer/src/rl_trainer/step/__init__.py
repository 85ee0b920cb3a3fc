"""Running a step: the RL step's stages and what they hand work to.

- :mod:`~rl_trainer.step.stages`: the RL step as stages (round, take, advantages, train,
  publish).
- :mod:`~rl_trainer.step.packing`: plan and pack a step's rollouts; loss weights.
- :mod:`~rl_trainer.step.ppo_updates`: PPO epochs and mini-batches of the train stage.
- :mod:`~rl_trainer.step.pipeline`: async rollout rounds ahead of training.
- :mod:`~rl_trainer.step.truncation`: top-p/top-k sampling the policies score under.
- :mod:`~rl_trainer.step.routing`: MoE routing replay.
- :mod:`~rl_trainer.step.teacher`: on-policy distillation's teacher.
- :mod:`~rl_trainer.step.lora`: LoRA reference, adapter sync and export.
- :mod:`~rl_trainer.step.offload`: the colocated hand-over of device memory
  (:mod:`~rl_trainer.step.memory` measures it).

The stages take the run's typed state (:class:`~rl_trainer.run_state.RunState`) or the parts
of it they use; nothing here imports the phases or the driver.
"""
