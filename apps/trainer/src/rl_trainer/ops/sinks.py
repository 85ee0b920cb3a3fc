"""The extra metrics sinks a run's config asks for (``logging.wandb``), built for the
:class:`~rl_trainer.ops.metrics.MetricsLogger`. It sits above the sinks it builds
(:mod:`rl_trainer.ops.wandb_sink`, which writes the run's report through :mod:`rl_trainer.ops.report`,
which reads :mod:`rl_trainer.ops.metrics`), so the imports run one way."""

from __future__ import annotations

from rl_trainer.config import TrainerConfig
from rl_trainer.ops.metrics import MetricsSink

__all__ = ["build_sinks"]


def build_sinks(config: TrainerConfig) -> list[MetricsSink]:
    """The extra sinks ``config`` asks for (``logging.wandb``)."""
    sinks: list[MetricsSink] = []
    if config.logging.wandb is not None:
        from rl_trainer.ops.wandb_sink import WandbSink  # imports wandb only when asked for

        sinks.append(WandbSink(config.logging.wandb, config=config))
    return sinks
