"""Operations on runs: metrics and their sinks, reports, sample traces and dumps, replay,
evaluation.

- :mod:`~rl_trainer.ops.metrics`: ``metrics.jsonl``, TensorBoard, the progress bar;
  :mod:`~rl_trainer.ops.sinks` builds the extra sinks (:mod:`~rl_trainer.ops.wandb_sink`).
- :mod:`~rl_trainer.ops.report`: the run's report figure.
- :mod:`~rl_trainer.ops.samples` and :mod:`~rl_trainer.ops.dumps`: sample traces and
  rollout dumps.
- :mod:`~rl_trainer.ops.replay`: ``rl-train replay`` and ``rl-train rollout``.
- :mod:`~rl_trainer.ops.evaluation` (the eval sets) and :mod:`~rl_trainer.ops.eval_only`
  (``rl-train eval``).
"""
