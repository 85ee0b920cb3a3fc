"""Markdown tables of ``benchmarks/profile_step.py`` results (the tables of docs/performance.md).

Usage::

    python benchmarks/profile_report.py benchmarks/results/profile_step.json
    python benchmarks/profile_report.py AFTER.json --before BEFORE.json   # adds before columns
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# Timers in the order of a step; nested ones are indented (their time is in the parent's).
ROWS = (
    ("rl_step", 0, "step (wall)"),
    ("produce_round", 0, "rollout round (wall; async: overlapped)"),
    ("gen.run_batch", 1, "generation, worker thread"),
    ("gen.prefill", 2, "prefill"),
    ("gen.decode_step", 2, "decode forward (per step x steps)"),
    ("gen.sample", 2, "sampling"),
    ("gen.emit", 2, "results to Python"),
    ("score", 1, "reward (wall)"),
    ("take_groups", 0, "take groups"),
    ("after_take", 0, "dumps / traces"),
    ("train", 0, "train phase"),
    ("rl_batch", 1, "batch building"),
    ("plan_and_pack", 2, "plan + pack"),
    ("advantages", 2, "advantages"),
    ("loss_weights", 2, "loss weights"),
    ("train_step", 1, "policy train_step"),
    ("forward", 2, "model forward"),
    ("logprobs", 2, "log-prob / entropy"),
    ("loss", 2, "loss"),
    ("backward", 2, "backward"),
    ("clip_grad", 2, "grad clip"),
    ("optimizer", 2, "AdamW step"),
    ("sync_weights", 0, "weight publish (sync, wall)"),
    ("serve", 0, "weight publish (async, wall)"),
    ("weights_copy", 0, "weights copy (async)"),
    ("emit", 0, "metrics / logging"),
)


def _case(data: dict[str, Any], setting: str, mode: str) -> dict[str, Any] | None:
    return next((c for c in data["cases"] if c["setting"] == setting and c["mode"] == mode), None)


def summary_table(after: dict[str, Any], before: dict[str, Any] | None) -> str:
    """One row per setting and mode: CPU-s per step, samples per CPU-s, wall, load."""
    head = "| setting | mode | CPU ms/step | samples/CPU-s | wall ms/step | load (1 min) |"
    if before:
        head = (
            "| setting | mode | CPU ms/step before | after | samples/CPU-s before | after "
            "| wall ms/step before | after | load before | after |"
        )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in after["cases"]:
        b = _case(before, c["setting"], c["mode"]) if before else None
        cpu, spc = c["process_cpu_s_per_step"] * 1000, c["samples_per_cpu_s"]
        wall, load = c["wall_s_per_step"] * 1000, c["loadavg"][0]
        label = f"| {c['setting']} ({c['samples_per_step']}) | {c['mode']} "
        if b:
            lines.append(
                label + f"| {b['process_cpu_s_per_step'] * 1000:.0f} | {cpu:.0f} "
                f"| {b['samples_per_cpu_s']:.0f} | {spc:.0f} "
                f"| {b['wall_s_per_step'] * 1000:.0f} | {wall:.0f} "
                f"| {b['loadavg'][0]:.1f} | {load:.1f} |"
            )
        else:
            lines.append(label + f"| {cpu:.0f} | {spc:.0f} | {wall:.0f} | {load:.1f} |")
    return "\n".join(lines)


def phase_table(after: dict[str, Any], before: dict[str, Any] | None, setting: str) -> str:
    """Thread-CPU ms per step of every timer, sync and async, with the share of the step's
    process CPU (wall where the timer spans threads: marked in the label)."""
    modes = [m for m in ("sync", "async") if _case(after, setting, m)]
    cols = []
    for m in modes:
        cols += [f"{m} before", f"{m} after", f"{m} share"] if before else [m, f"{m} share"]
    lines = ["| phase | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for key, depth, label in ROWS:
        cells = []
        present = False
        for m in modes:
            a = _case(after, setting, m)
            t = a["timers"].get(key)
            wall_only = t is not None and t["cpu_ms_per_step"] == 0 and t["ms_per_step"] > 0
            val = (t["ms_per_step"] if wall_only else t["cpu_ms_per_step"]) if t else None
            share = val / (a["process_cpu_s_per_step"] * 1000) if val is not None else None
            if before:
                bt = _case(before, setting, m)["timers"].get(key)
                bval = (bt["ms_per_step"] if wall_only else bt["cpu_ms_per_step"]) if bt else None
                cells.append(f"{bval:.1f}" if bval is not None else "")
            cells.append(f"{val:.1f}" if val is not None else "")
            cells.append(f"{share:.0%}" if share is not None and not wall_only else "")
            present |= t is not None
        if present:
            name = "&nbsp;&nbsp;&nbsp;" * depth + label
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ops_table(data: dict[str, Any], setting: str, mode: str = "sync", n: int = 12) -> str:
    """The profiled train step's top ops by self CPU time."""
    c = _case(data, setting, mode)
    lines = ["| op | self ms | share | calls |", "|---|---|---|---|"]
    for o in c["top_ops"][:n]:
        lines.append(
            f"| `{o['op'][:60]}` | {o['self_ms']:.1f} | {o['self_share']:.0%} | {o['calls']} |"
        )
    return "\n".join(lines)


def pyspy_table(data: dict[str, Any], case: str, n: int = 8) -> str:
    """Top self frames per busy thread of one py-spy case."""
    lines = ["| thread | frame | self share | inclusive share |", "|---|---|---|---|"]
    for thread, t in data.get("py_spy", {}).get(case, {}).items():
        if not t["inclusive_share"]:
            continue
        name = thread.split(" ", 2)[-1]
        for key, share in t["inclusive_share"].items():
            if share >= 0.01:
                lines.append(f"| {name} | `{key}` (inclusive) |  | {share:.0%} |")
        for f in t["top_self"][:n]:
            lines.append(f"| {name} | `{f['frame']}` | {f['share']:.0%} |  |")
    return "\n".join(lines)


def main() -> None:
    """Print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("after")
    ap.add_argument("--before", default=None)
    args = ap.parse_args()
    after = json.loads(Path(args.after).read_text())
    before = json.loads(Path(args.before).read_text()) if args.before else None
    print("## Summary\n")
    print(summary_table(after, before))
    for setting in after["settings"]:
        print(f"\n## Phases: {setting}\n")
        print(phase_table(after, before, setting))
        print(f"\n### Top ops of one profiled train step ({setting}, sync)\n")
        print(ops_table(after, setting))
    for case in after.get("py_spy", {}):
        print(f"\n## py-spy: {case}\n")
        print(pyspy_table(after, case))


if __name__ == "__main__":
    main()
