"""``rl-train report RUN_DIR``: PNG plots of reward, loss and throughput from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from rl_trainer.metrics import read_metrics

__all__ = ["write_report"]

PANELS = [
    ("Reward", ["rollout/reward_mean", "eval/reward_mean", "eval/exact_mean"]),
    ("Loss", ["train/loss"]),
    ("KL / entropy", ["train/kl", "train/entropy"]),
    ("Throughput (tokens/s)", ["perf/rollout_tokens_per_s", "perf/train_tokens_per_s"]),
]


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the curves of a run into ``out`` (default ``<run_dir>/report.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    records = read_metrics(run)
    out_path = Path(out) if out else run / "report.png"
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 3 * len(PANELS)), sharex=True)

    def series(key: str, phase: str | None = None) -> tuple[list[int], list[float]]:
        pts = [
            (i, float(r[key]))
            for i, r in enumerate(records)
            if isinstance(r.get(key), int | float) and (phase is None or r.get("phase") == phase)
        ]
        return [p[0] for p in pts], [p[1] for p in pts]

    for ax, (title, keys) in zip(axes, PANELS):
        for key in keys:
            if key == "train/loss":
                # SFT and RL losses live on different scales: RL on its own axis.
                xs, ys = series(key, "sft")
                if xs:
                    ax.plot(xs, ys, label="train/loss (sft)", color="tab:grey")
                xs, ys = series(key, "rl")
                if xs:
                    twin = ax.twinx()
                    twin.plot(xs, ys, label="train/loss (rl, right axis)", color="tab:blue")
                    twin.legend(fontsize=8, loc="upper center")
                continue
            xs, ys = series(key)
            if xs:
                ax.plot(xs, ys, marker="o" if key.startswith("eval/") else None, ms=3, label=key)
        sft_end = sum(1 for r in records if r.get("phase") == "sft")
        if sft_end:
            ax.axvline(sft_end - 0.5, color="grey", ls="--", lw=0.8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[-1].set_xlabel("step (SFT warm-up, then RL; dashed line = start of RL)")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
