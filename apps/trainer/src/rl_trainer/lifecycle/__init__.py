"""The run's lifecycle: its directory, checkpoints, stopping and resuming.

- :mod:`~rl_trainer.lifecycle.rundir`: a run owns its directory (lock, config, overwrite).
- :mod:`~rl_trainer.lifecycle.checkpoint`: checkpoint files, verified by their manifest.
- :mod:`~rl_trainer.lifecycle.state`: what a checkpoint captures of the run; save on
  schedule, stop on a signal, ``--resume``.
- :mod:`~rl_trainer.lifecycle.resume_check`: what ``--resume`` may see changed.
- :mod:`~rl_trainer.lifecycle.stopping`: SIGTERM/SIGINT stop a run cleanly.
- :mod:`~rl_trainer.lifecycle.trust`: nothing read from a run's files runs code.
"""
