"""Metrics sinks: ``<run_dir>/metrics.jsonl`` (one object per step), TensorBoard, a progress bar,
and any extra :class:`MetricsSink` (Weights & Biases: :mod:`rl_trainer.ops.wandb_sink`). Sample
traces (:mod:`rl_trainer.ops.samples`) go to ``<run_dir>/samples.jsonl``, TensorBoard text and the
extra sinks.

Metric names are stable: ``rollout/*``, ``train/*``, ``perf/*``, ``eval/*``; every record has
``step`` (the phase's step) and ``phase`` (``"sft"`` or ``"rl"``). The RL phase also writes a
record at step 0 (the evaluation before the first RL step), so an RL phase of ``n`` steps has
``n + 1`` records; :func:`count_steps` counts steps, not records.

The progress bar has one line per phase (``sft 30/30``, ``rl 12/200``) and redraws at most
:data:`PROGRESS_REFRESH_PER_S` times a second from rich's refresh thread: a redraw costs about a
millisecond of the main thread's time (and the GIL), which at small steps was 6% of the run
when rich redrew ten times a second.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "PROGRESS_REFRESH_PER_S",
    "MetricsLogger",
    "MetricsSink",
    "count_steps",
    "read_metrics",
    "samples_markdown",
]

PROGRESS_REFRESH_PER_S = 1.0
"""Progress-bar redraws per second (rich's default is 10)."""


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsSink(Protocol):
    """Somewhere else step records and sample traces go (W&B, MLflow, ...)."""

    def log(self, record: Mapping[str, Any], *, step: int) -> None:
        """Log one step's record (non-finite floats already ``None``) at global ``step``."""

    def log_samples(self, lines: Sequence[Mapping[str, Any]], *, step: int) -> None:
        """Log the sample trace lines of global ``step`` (:mod:`rl_trainer.ops.samples`)."""

    def close(self) -> None:
        """Flush and finish."""


def samples_markdown(lines: Sequence[Mapping[str, Any]]) -> str:
    """Sample trace lines as a Markdown table (TensorBoard text)."""
    rows = ["| prompt | response | reward | advantage | max mismatch |", "|---|---|---|---|---|"]

    def cell(x: Any) -> str:
        text = f"{x:.4g}" if isinstance(x, float) else str(x)
        return text.replace("|", "\\|").replace("\n", " ")

    for g in lines:
        for r in g["rollouts"]:
            rows.append(
                f"| {cell(g['prompt'])} | {cell(r['response'])} | {cell(r['reward'])} | "
                f"{cell(r['advantage'])} | {cell(r['mismatch_max'])} |"
            )
    return "\n".join(rows)


class MetricsLogger:
    """Appends step records to JSONL and TensorBoard (and ``sinks``); shows progress with rich.

    ``phase_steps`` gives each phase's step count (``{"sft": 30, "rl": 200}``); phases with 0
    steps get no progress line. ``resume_lines``: keep the first that many lines of an existing
    ``metrics.jsonl`` (a resumed run) instead of starting it afresh (``None``; a fresh run also
    starts ``samples.jsonl`` afresh).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool,
        progress: bool,
        phase_steps: Mapping[str, int],
        resume_lines: int | None,
        sinks: Sequence[MetricsSink] = (),
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self.sinks = list(sinks)
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_lines is None and self.samples_path.exists():
            self.samples_path.unlink()
        kept: list[str] = []
        if resume_lines is not None and self.path.exists():
            # Drop records written after the checkpoint we resume from.
            kept = self.path.read_text().splitlines(keepends=True)[:resume_lines]
            self.path.write_text("".join(kept))
        elif resume_lines is None and self.path.exists():
            self.path.unlink()
        self.lines = len(kept)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"))
        self._progress = None
        self._tasks: dict[str, Any] = {}
        if progress:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description:>3}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                transient=False,
                refresh_per_second=PROGRESS_REFRESH_PER_S,
            )
            done = count_steps(json.loads(line) for line in kept if line.strip())
            for phase, total in phase_steps.items():
                if total > 0:
                    self._tasks[phase] = self._progress.add_task(
                        phase, total=total, completed=done.get(phase, 0), info=""
                    )
            self._progress.start()

    def log(self, record: dict[str, Any], *, global_step: int) -> None:
        """Write one step's record (``global_step``: the TensorBoard x-axis, SFT and RL steps
        counted together)."""
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
        for sink in self.sinks:
            sink.log(record, step=global_step)
        task = self._tasks.get(str(record.get("phase")))
        if self._progress is not None and task is not None:
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
                if key.endswith("reward_mean"):  # failures, next to the mean they count as 0 in
                    failed = record.get(key.replace("reward_mean", "failed_fraction"))
                    if isinstance(failed, float) and failed > 0:
                        info.append(f"[red]failed {failed:.0%}[/red]")
            # No redraw here: the refresh thread draws the latest state.
            self._progress.update(task, completed=int(record["step"]), info="  ".join(info))

    def log_samples(self, lines: Sequence[Mapping[str, Any]], *, global_step: int) -> None:
        """Append sample trace ``lines`` to ``samples.jsonl``, TensorBoard text (``samples``)
        and the sinks."""
        with self.samples_path.open("a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
        if self._tb is not None:
            self._tb.add_text("samples", samples_markdown(lines), global_step)
        for sink in self.sinks:
            sink.log_samples(lines, step=global_step)

    def close(self) -> None:
        """Flush and close the sinks."""
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        for sink in self.sinks:
            sink.close()
        if self._progress is not None:
            self._progress.stop()


def count_steps(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Steps per phase in ``records`` (``{"sft": 30, "rl": 200}``): one per record after step 0
    (a phase's step-0 record is the evaluation before training: RL's, or ``mode: sft``'s)."""
    out: dict[str, int] = {}
    for r in records:
        phase = str(r.get("phase"))
        if r.get("step") == 0:
            continue
        out[phase] = out.get(phase, 0) + 1
    return out


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``<run_dir>/metrics.jsonl``."""
    p = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
