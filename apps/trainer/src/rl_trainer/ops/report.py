"""``rl-train report RUN_DIR [RUN_DIR ...]``: PNG plots from metrics.jsonl.

One run: reward, loss, KL/entropy, throughput, the step-time breakdown (generation, waiting for
the round, training, weight sync; stacked), staleness and the engine/trainer log-prob mismatch.
Several runs: the same panels with one colour per run (the step time as one line per part), to
compare two runs on one figure. The x-axis is the record index (SFT warm-up, then RL; a dashed
line marks the start of RL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rl_core.errors import DataError
from rl_trainer.ops.metrics import read_metrics

__all__ = ["PANELS", "STEP_TIME", "build_figure", "write_comparison", "write_report"]

STEP_TIME = [
    ("perf/gen_time", "generation"),
    ("perf/rollout_wait", "waiting"),
    ("perf/train_time", "training"),
    ("perf/sync_time", "sync"),
]
"""The parts of an RL step's time, as the step-time panel shows them (metric, label)."""

PANELS = [
    (  # a failed rollout scores 0 in the means; the failed fractions beside them
        "Reward",
        [
            "rollout/reward_mean",
            "eval/reward_mean",
            "eval/exact_mean",
            "rollout/failed_fraction",
            "eval/failed_fraction",
        ],
    ),
    ("Loss", ["train/loss"]),
    ("KL / entropy", ["train/kl", "train/entropy"]),
    ("Throughput (tokens/s)", ["perf/rollout_tokens_per_s", "perf/train_tokens_per_s"]),
    ("Step time (s)", [key for key, _ in STEP_TIME]),
    ("Staleness (versions)", ["rollout/staleness_mean", "rollout/staleness_max"]),
    ("Log-prob mismatch", ["train/mismatch", "train/tis_clipfrac"]),
    (  # agent runs only (rl_buffer.rollout.agent_metrics); drawn when a record has them
        "Agent sessions (per session; problems: round totals)",
        [
            "rollout/agent/turns_mean",
            "rollout/agent/tool_calls_mean",
            "rollout/agent/ill_formed",
            "rollout/agent/template_mismatch",
            "rollout/agent/tool_errors",
        ],
    ),
]
"""The panels: title and the metrics drawn in it."""

OPTIONAL_PANELS = {"Agent sessions (per session; problems: round totals)"}
"""Panels left out of a figure whose runs hold none of their metrics."""

_STYLES = ["-", "--", ":", "-."]


def _series(
    records: Sequence[Mapping[str, Any]], key: str, phase: str | None = None
) -> tuple[list[int], list[float]]:
    pts = [
        (i, float(r[key]))
        for i, r in enumerate(records)
        if isinstance(r.get(key), int | float) and (phase is None or r.get("phase") == phase)
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


def _step_time_stack(ax: Any, records: Sequence[Mapping[str, Any]]) -> None:
    """The RL steps' time parts stacked (a missing part counts 0)."""
    rl = [(i, r) for i, r in enumerate(records) if r.get("phase") == "rl" and r.get("step")]
    if not rl:
        return
    xs = [i for i, _ in rl]
    ys = [[float(r.get(key) or 0.0) for _, r in rl] for key, _ in STEP_TIME]
    ax.stackplot(xs, ys, labels=[label for _, label in STEP_TIME], alpha=0.8)
    xt, yt = _series(records, "perf/step_time", "rl")
    if xt:
        ax.plot(xt, yt, color="black", lw=0.8, label="step total")


def _draw_run(
    ax: Any,
    title: str,
    keys: list[str],
    records: Sequence[Mapping[str, Any]],
    run: str | None,
    color: str | None,
) -> None:
    """Draw ``keys`` of one run into ``ax``; ``run`` labels it and ``color`` colours it in a
    comparison (``None``: a single run)."""
    prefix = f"{run}: " if run is not None else ""
    if title.startswith("Step time") and run is None:
        _step_time_stack(ax, records)
        return
    for n, key in enumerate(keys):
        style = _STYLES[n % len(_STYLES)] if run is not None else "-"
        if key == "train/loss" and run is None:
            # SFT and RL losses live on different scales: RL on its own axis.
            xs, ys = _series(records, key, "sft")
            if xs:
                ax.plot(xs, ys, label="train/loss (sft)", color="tab:grey")
            xs, ys = _series(records, key, "rl")
            if xs:
                twin = ax.twinx()
                twin.plot(xs, ys, label="train/loss (rl, right axis)", color="tab:blue")
                twin.legend(fontsize=8, loc="upper center")
            continue
        phase = "rl" if key == "train/loss" else None
        xs, ys = _series(records, key, phase)
        if xs:
            marker = "o" if key.startswith("eval/") else None
            ax.plot(xs, ys, ls=style, marker=marker, ms=3, color=color, label=prefix + key)


def build_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> Any:
    """The report figure of one run (``{name: records}``) or a comparison of several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (title, keys)
        for title, keys in PANELS
        if title not in OPTIONAL_PANELS
        or any(k in r for records in runs.values() for r in records for k in keys)
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3 * len(panels)), sharex=True)
    single = len(runs) == 1
    for ax, (title, keys) in zip(axes, panels):
        for k, (name, records) in enumerate(runs.items()):
            if single:
                _draw_run(ax, title, keys, records, None, None)
            else:
                _draw_run(ax, title, keys, records, name, f"C{k}")
        first = next(iter(runs.values()))
        sft_end = sum(1 for r in first if r.get("phase") == "sft")
        if sft_end:
            ax.axvline(sft_end - 0.5, color="grey", ls="--", lw=0.8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[-1].set_xlabel("record (SFT warm-up, then RL; dashed line = start of RL)")
    if not single:
        fig.suptitle(" vs ".join(runs))
    fig.tight_layout(rect=(0, 0, 1, 1 if single else 0.985))
    return fig


def _save(fig: Any, out_path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def _records(run_dir: Path) -> list[dict[str, Any]]:
    if not (run_dir / "metrics.jsonl").is_file():
        raise DataError(
            f"{run_dir / 'metrics.jsonl'}: not found; pass the run_dir of an rl-train run."
        )
    return read_metrics(run_dir)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the curves of a run into ``out`` (default ``<run_dir>/report.png``)."""
    run = Path(run_dir)
    out_path = Path(out) if out else run / "report.png"
    return _save(build_figure({run.name: _records(run)}), out_path)


def write_comparison(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Draw several runs on one figure into ``out`` (default
    ``<first run_dir>/compare_<name>_<name>.png``)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for d in run_dirs:
        p = Path(d)
        runs[p.name if p.name not in runs else str(p)] = _records(p)
    first = Path(run_dirs[0])
    out_path = (
        Path(out) if out else first / f"compare_{'_'.join(Path(d).name for d in run_dirs)}.png"
    )
    return _save(build_figure(runs), out_path)
