"""Metrics sinks: ``<run_dir>/metrics.jsonl`` (one object per step), TensorBoard, a progress bar.

Metric names are stable: ``rollout/*``, ``train/*``, ``perf/*``, ``eval/*``; every record has
``step`` (the phase's step) and ``phase`` (``"sft"`` or ``"rl"``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "read_metrics"]


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Appends step records to JSONL and TensorBoard; shows progress with rich."""

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool,
        progress: bool,
        total_steps: int,
        resume_lines: int | None,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_lines is not None and self.path.exists():
            # Drop records written after the checkpoint we resume from.
            lines = self.path.read_text().splitlines(keepends=True)[:resume_lines]
            self.path.write_text("".join(lines))
        elif resume_lines is None and self.path.exists():
            self.path.unlink()
        self.lines = len(self.path.read_text().splitlines()) if self.path.exists() else 0
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))
        self._progress = None
        self._task = None
        if progress:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]{task.fields[phase]}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._task = self._progress.add_task("run", total=total_steps, phase="", info="")
            self._progress.start()
        self._global = 0

    def log(self, record: dict[str, Any], *, global_step: int) -> None:
        """Write one step's record."""
        record = {k: _clean(v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.lines += 1
        if self._tb is not None:
            for k, v in record.items():
                if (
                    isinstance(v, int | float)
                    and not isinstance(v, bool)
                    and v is not None
                    and "/" in k
                ):
                    self._tb.add_scalar(k, v, global_step)
        if self._progress is not None:
            info = []
            for key, label in (
                ("rollout/reward_mean", "reward"),
                ("eval/reward_mean", "eval"),
                ("train/loss", "loss"),
                ("perf/rollout_tokens_per_s", "gen tok/s"),
            ):
                v = record.get(key)
                if isinstance(v, float):
                    info.append(f"{label} {v:.3f}" if abs(v) < 1000 else f"{label} {v:.0f}")
            self._progress.update(
                self._task,
                completed=global_step,
                phase=record.get("phase", ""),
                info="  ".join(info),
            )

    def close(self) -> None:
        """Flush and close the sinks."""
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._progress is not None:
            self._progress.stop()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``<run_dir>/metrics.jsonl``."""
    p = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
