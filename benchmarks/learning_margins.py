"""Margins of the learning assertions in ``make test``, measured over seeds.

Each learning test of ``make test`` runs one fixed-seed recipe and asserts that a reward rose by
a threshold. Another CPU model (or another version of a numeric library) changes the float
results and so the sampled trajectory: a threshold is only safe if it holds for the spread of
trajectories, not for one. This script runs each test's recipe with several seeds (each seed a
different trajectory, standing in for another machine), computes the statistic the test asserts
on, and prints a table: per-seed values, mean, standard deviation, the minimum, and the
threshold the test uses, with the margin in standard deviations. JSON goes to
``benchmarks/results/learning_margins.json``.

    .venv/bin/python benchmarks/learning_margins.py                    # every check, seeds 1-5
    .venv/bin/python benchmarks/learning_margins.py --checks ray_async1 --seeds 1 2 3

Each run is a fresh process with one torch thread (``OMP_NUM_THREADS=1``), as in the tests.
The recipes here are the tests' own: the tests import them from this file's ``CHECKS`` through
``tests/learning_checks.py`` so the two never drift apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from learning_checks import CHECKS, statistic  # noqa: E402

sys.path.insert(0, str(HERE))
from _results import write_results  # noqa: E402


def _run_one(name: str, seed: int, workdir: Path) -> dict:
    """Run check ``name`` with ``seed`` in a fresh process; returns its statistics."""
    check = CHECKS[name]
    run_dir = workdir / f"{name}_seed{seed}"
    args = check.cli_args(run_dir, seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "rl_trainer.cli", *args],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise SystemExit(
            f"{name} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return {"seed": seed, "wall_s": round(time.time() - t0, 1), **statistic(name, rows)}


def main() -> None:
    """Run the chosen checks over the chosen seeds; print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", nargs="*", default=list(CHECKS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--out", default=str(HERE / "results" / "learning_margins.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    out_path = Path(args.out)
    results = json.loads(out_path.read_text()).get("checks", {}) if out_path.exists() else {}
    with tempfile.TemporaryDirectory(prefix="margins-") as tmp:
        for name in args.checks:
            check = CHECKS[name]
            runs = [_run_one(name, seed, Path(tmp)) for seed in args.seeds]
            summary = {}
            for key, threshold in check.thresholds.items():
                values = [r[key] for r in runs]
                mean = statistics.fmean(values)
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                summary[key] = {
                    "threshold": threshold,
                    "mean": round(mean, 4),
                    "sd": round(sd, 4),
                    "min": round(min(values), 4),
                    "margin_sd": round((mean - threshold) / sd, 2) if sd else None,
                    "all_pass": all(v > threshold for v in values),
                }
            results[name] = {"doc": check.doc, "runs": runs, "summary": summary}
            for key, s in summary.items():
                vals = " ".join(f"{r[key]:+.3f}" for r in runs)
                print(
                    f"{name:16s} {key:22s} seeds[{vals}] mean {s['mean']:+.3f} sd {s['sd']:.3f} "
                    f"min {s['min']:+.3f} > {s['threshold']:+.3f}: margin {s['margin_sd']} sd "
                    f"{'ok' if s['all_pass'] else 'FAILS for a seed'}",
                    flush=True,
                )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_results(out_path, {"seeds": args.seeds, "checks": results}, load_before)


if __name__ == "__main__":
    main()
