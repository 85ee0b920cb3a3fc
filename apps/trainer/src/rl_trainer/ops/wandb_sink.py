"""Weights & Biases as a metrics sink (``logging.wandb``; ``pip install 'rlpost-trainer[wandb]'``).

What a run sends: the whole config (``wandb.config``), every step record's numeric metrics at
the run's global step (SFT and RL steps counted together, as on TensorBoard), a ``samples``
table each time a sample trace is written (``logging.samples_every``,
:mod:`rl_trainer.ops.samples`), and at the end the PNG report (``report``). With ``mode: offline``
nothing leaves the machine: the run is written under ``<dir>/wandb/offline-run-*`` and
``wandb sync`` uploads it later.

A W&B failure never stops training after start-up: a ``log`` that raises is logged once and
the sink turns itself off (telemetry must not crash the run it observes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rl_core.config import to_dict
from rl_core.errors import ConfigError
from rl_trainer.config import TrainerConfig, WandbConfig

__all__ = ["SAMPLE_COLUMNS", "WandbSink"]

logger = logging.getLogger(__name__)

SAMPLE_COLUMNS = [
    "step",
    "prompt_uid",
    "prompt",
    "label",
    "response",
    "reward",
    "advantage",
    "mismatch_max",
]
"""The columns of the ``samples`` table: one row per traced rollout."""


class WandbSink:
    """A :class:`~rl_trainer.ops.metrics.MetricsSink` that logs to one W&B run."""

    def __init__(self, cfg: WandbConfig, *, config: TrainerConfig) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(
                "logging.wandb: the wandb package is not installed; pip install "
                "'rlpost-trainer[wandb]' (or pip install wandb), or remove logging.wandb."
            ) from e
        self._wandb = wandb
        self.run_dir = Path(config.run_dir)
        directory = Path(cfg.dir) if cfg.dir else self.run_dir
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or self.run_dir.name,
            mode=cfg.mode,
            dir=str(directory),
            tags=list(cfg.tags),
            config=to_dict(config),
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        self._broken = False

    def _guard(self, what: str, fn: Any) -> None:
        if self._broken:
            return
        try:
            fn()
        except Exception:  # telemetry must never crash the run it observes
            logger.exception("logging.wandb: %s failed; W&B logging is off for this run.", what)
            self._broken = True

    def log(self, record: Mapping[str, Any], *, step: int) -> None:
        """Log the numeric metrics of ``record`` at ``step``."""
        data = {
            k: v
            for k, v in record.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and "/" in k
        }
        self._guard("log", lambda: self.run.log(data, step=step))

    def log_samples(self, lines: Sequence[Mapping[str, Any]], *, step: int) -> None:
        """Log sample trace ``lines`` as the ``samples`` table (one row per rollout)."""
        rows = [
            [
                g["step"],
                g["prompt_uid"],
                str(g["prompt"]),
                str(g["label"]),
                r["response"],
                r["reward"],
                r["advantage"],
                r["mismatch_max"],
            ]
            for g in lines
            for r in g["rollouts"]
        ]
        table = self._wandb.Table(columns=SAMPLE_COLUMNS, data=rows)
        self._guard("log_samples", lambda: self.run.log({"samples": table}, step=step))

    def close(self) -> None:
        """Log the PNG report of the run so far, then finish the W&B run."""

        def report() -> None:
            from rl_trainer.ops.report import write_report

            if (self.run_dir / "metrics.jsonl").is_file():
                path = write_report(self.run_dir)
                self.run.log({"report": self._wandb.Image(str(path))})

        self._guard("report", report)
        self.run.finish()
