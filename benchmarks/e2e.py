"""End-to-end GRPO on CPU: our local loop (sync and async) against TRL's ``GRPOTrainer``.

The demo task (reverse a string, reward = position match) with the demo's tiny Qwen2 model
(hidden 128, 2 layers, byte tokenizer). One SFT warm-up with our trainer produces a Hugging Face
checkpoint; every system starts RL from it with the same settings:

- prompts per step and their order (TRL gets the exact sequence our data source draws, unshuffled),
  group size, max new tokens, temperature, learning rate (constant, AdamW, grad clip 1), PPO clip
  ranges (0.2 / 0.28), token-mean loss (TRL ``loss_type="dapo"``), GRPO advantages, no KL
  (``beta=0``; our ``use_reference=false``), one optimizer step per rollout batch;
- the same held-out eval every ``--eval-every`` steps: greedy answers to the 128 held-out prompts
  with ``HFGenerator`` and the task's reward (the code of ``Trainer.evaluate``, fed TRL's weights).

Systems (each in its own process, one after the other, so they never compete for the cores):

- ``ours sync``: generate, then train, step by step (``--ours-threads``: once per torch thread
  count, default 1 and 2, as ``ours_sync_t1``, ``ours_sync_t2``);
- ``ours async``: ``rl.async_generation=true, rl.max_staleness=1``: generation of step k+1 overlaps
  training of step k in the generator and trainer threads (up to 2 cores); ``--ours-threads`` is
  the recipe's ``threads`` (torch threads of each), once per count (``ours_async_t1``, ...);
- ``TRL``: ``GRPOTrainer`` on CPU (transformers ``generate``), from a separate venv
  (``$RL_BENCH_HOME/trl``, default ``~/.cache/rl-bench/trl``) that this script creates if missing
  with ``torch==2.13.0`` pinned and our pure-Python packages installed ``--no-deps``; once per
  ``--trl-threads`` count (default 1 and 2: ``trl_t1``, ``trl_t2``), and every speed-up is
  taken against the fastest (the issue's "TRL at its best thread count");
- optional (``--systems ...,ours_ray``): the async loop on the ``ray`` runtime (a local 2-CPU
  cluster, disaggregated policy and generator actors, ``disk_full`` weight transport).

Reported per system: samples/s and response tokens/s over the RL phase with evaluation time
excluded, wall time (eval excluded) until the held-out reward first reaches ``--target``, the eval
curve, process CPU seconds and peak RSS (``wait4`` of the process), and the end-to-end wall time
(``end_to_end_s``, median over seeds): from the command that starts the system's process to its
exit after the last step, so start-up, model load, compile, every step, the evals and the final
save all count (``end_to_end_speedup_vs_trl``: TRL's best over ours).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/e2e.py          # demo setting, 100 steps x 3 seeds
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/e2e.py --setting small   # 8 prompts, 8 new tokens
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/e2e.py --smoke  # 3 steps, 1 seed, ~1 min
    ... --systems ours_sync,ours_async,trl,ours_ray                 # plus the Ray runtime row

Prints a table and writes ``benchmarks/results/e2e.json`` (``--smoke`` writes nothing): one entry
per setting under ``settings`` (a run replaces its own setting and keeps the others), each with
its config, the load average before and after, per system the summary (samples/s, CPU-seconds
per sample, step-phase times, ``speedup_vs_trl``) and the runs, and the issue-22 bars
(``bars``: needed and measured speed-up, met or not).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "e2e.json"
WORKER = HERE / "_e2e_worker.py"
sys.path.insert(0, str(HERE))
from _e2e_worker import parse_overrides  # noqa: E402  (the worker file, also run in TRL's venv)

OUR_PACKAGES = ("packages/rl-core", "packages/rl-buffer", "packages/rl-hf", "apps/trainer")
# Every package TRL's speed depends on, pinned: with accelerate and datasets left open, a venv
# rebuilt on 2026-11-29 measured TRL 1.5x faster on the demo than the earlier venvs had
# (docs/performance.md section 13), and what those held was not recorded.
TRL_PINS = (
    "torch==2.13.0",
    "trl==1.16.0",
    "transformers==5.23.0",
    "accelerate==1.15.0",
    "datasets==5.2.0",
)


# Named settings and their bars (x TRL's samples/s at its best thread count, per step): the
# embedded demo's batch and a small one where per-step overhead weighs more. Issue 22 set the
# synchronous bars; issue 36 the asynchronous ones (with the trainer's default choices: no
# variant overrides) and, for both settings, end to end >= 2x (``E2E_BAR``).
SETTINGS: dict[str, dict[str, Any]] = {
    "demo": {"prompts": 32, "max_new_tokens": 12, "bars": {"ours_sync": 2.5, "ours_async": 3.0}},
    "small": {"prompts": 8, "max_new_tokens": 8, "bars": {"ours_sync": 1.6, "ours_async": 2.5}},
}
E2E_BAR = 2.0
"""Issue 36: the command-to-exit wall time of our fastest default system >= 2x TRL's best."""


def bench_home() -> Path:
    """Where the TRL venv and the run directories live."""
    return Path(os.environ.get("RL_BENCH_HOME", Path.home() / ".cache" / "rl-bench"))


def ensure_trl_venv(venv: Path) -> Path:
    """The TRL venv's python; create the venv (torch pinned) if missing. Our packages are
    (re)installed ``--no-deps`` every time, so the TRL side runs the current task and eval code."""
    py = venv / "bin" / "python"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    marker = venv / ".rl-bench-ok"
    # Rebuilt when the pins changed since it was made (the marker holds them).
    if not marker.exists() or marker.read_text().split() != list(TRL_PINS):
        print(f"creating the TRL venv in {venv} (a few minutes) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        # An exact torch pin: any looser resolution pulls the multi-GB CUDA build.
        subprocess.run([str(py), "-m", "pip", "install", "-q", *TRL_PINS], check=True, env=env)
        marker.write_text(" ".join(TRL_PINS) + "\n")
    subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            *(str(REPO / p) for p in OUR_PACKAGES),
        ],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return py


def run_worker(python: str, mode: str, settings: Path, out: Path, log: Path) -> dict[str, Any]:
    """Run one worker process; its result JSON plus wall time, CPU time and peak RSS."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    t0 = time.perf_counter()
    with log.open("w") as f:
        # cwd: the work dir (TRL must not start from a directory that holds a `vllm/` folder).
        proc = subprocess.Popen(
            [python, str(WORKER), mode, str(settings), str(out)],
            cwd=settings.parent,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{mode} worker failed (exit {proc.returncode}); log {log}:\n{tail}")
    res = json.loads(out.read_text())
    res["process_total_s"] = wall
    res["cpu_s"] = usage.ru_utime + usage.ru_stime
    res["peak_rss_mb"] = usage.ru_maxrss / 1024
    return res


def summarize(runs: list[dict[str, Any]], target: float, *, one_process: bool) -> dict[str, Any]:
    """Throughput (pooled over seeds), time-to-target (median over seeds) and reward of one
    system. ``one_process``: the worker process did all the work, so its CPU time and peak RSS
    are the system's (not so on Ray, whose actors are other processes: those stay ``None``)."""
    train_s = sum(r["train_s"] for r in runs)
    cpu_s = sum(r["train_cpu_s"] for r in runs) if one_process else 0.0
    samples = sum(r["samples"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    reach = [
        next((c for c in r["curve"] if c["step"] > 0 and c["reward"] >= target), None) for r in runs
    ]
    hit = sorted(c["train_s"] for c in reach if c is not None)
    hit_steps = sorted(c["step"] for c in reach if c is not None)
    # Median over seeds, counting a seed that never got there as infinitely slow.
    half = len(runs) // 2
    ttt = hit[half] if len(hit) > half else None
    stt = hit_steps[half] if len(hit_steps) > half else None
    curve_steps = sorted({c["step"] for r in runs for c in r["curve"]})
    mean_curve = []
    for st in curve_steps:
        vals = [c["reward"] for r in runs for c in r["curve"] if c["step"] == st]
        mean_curve.append({"step": st, "reward": sum(vals) / len(vals), "n": len(vals)})
    after0 = [c["reward"] for r in runs for c in r["curve"] if c["step"] > 0]
    # Mean rollout (training) reward of the last 20 steps: 256 sampled answers a step, a less
    # noisy per-step comparison than the greedy eval of 128 prompts.
    last = [x for r in runs for x in r["train_reward_mean"][-20:] if x is not None]
    return {
        "seeds": len(runs),
        "samples_per_s": samples / train_s if train_s > 0 else float("nan"),
        "cpu_s_per_sample": cpu_s / samples if cpu_s > 0 and samples else None,
        "tokens_per_s": sum(r["response_tokens"] for r in runs) / train_s
        if train_s > 0
        else float("nan"),
        "samples_per_cpu_s": samples / cpu_s if cpu_s > 0 else None,
        "s_per_step": train_s / steps if steps else float("nan"),
        "samples_per_s_by_seed": [r["samples"] / r["train_s"] for r in runs if r["train_s"] > 0],
        "time_to_target_s": ttt,
        "step_to_target": stt,
        "seeds_reaching_target": len(hit),
        "final_reward": sum(r["curve"][-1]["reward"] for r in runs) / len(runs),
        "mean_eval_reward_after_0": sum(after0) / len(after0) if after0 else float("nan"),
        "train_reward_last20": sum(last) / len(last) if last else float("nan"),
        "final_reward_by_seed": [r["curve"][-1]["reward"] for r in runs],
        "train_reward_last20_by_seed": [_mean_last(r["train_reward_mean"], 20) for r in runs],
        "mean_curve": mean_curve,
        "phase_s_per_step": {
            k: sum(r.get("perf_sums_s", {}).get(k, 0.0) for r in runs) / steps
            for k in sorted({k for r in runs for k in r.get("perf_sums_s", {})})
        },
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs) if one_process else None,
        "process_cpu_s_mean": sum(r["cpu_s"] for r in runs) / len(runs) if one_process else None,
        # From the command to the process's exit after the last step (run_worker's wall time).
        "end_to_end_s": sorted(r["process_total_s"] for r in runs)[len(runs) // 2],
        # Settings our trainer chose because the recipe left them open (rl_trainer.defaults).
        "auto_choices": runs[0].get("auto_choices"),
    }


def _mean_last(values: list[float | None], n: int) -> float:
    """Mean of the last ``n`` values that are not ``None`` (NaN when there are none)."""
    kept = [x for x in values[-n:] if x is not None]
    return sum(kept) / len(kept) if kept else float("nan")


def split_system(name: str) -> tuple[str, int | None]:
    """A system and its torch thread count: ``("trl", 2)`` for ``trl_t2``, ``(name, None)`` for
    a system run once (at the count of its ``--*-threads`` option); a ``--variant`` suffix
    (``ours_sync_t2+compiled``) is dropped."""
    head = name.partition("+")[0]
    base, sep, count = head.rpartition("_t")
    if sep and base in LABELS and count.isdigit():
        return base, int(count)
    return head, None


def parse_variants(items: list[str]) -> dict[str, dict[str, Any]]:
    """``--variant NAME:KEY=VALUE[;KEY=VALUE...]`` options as ``{NAME: overrides}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, rest = item.partition(":")
        if not sep or not name.isidentifier() or not rest:
            raise SystemExit(
                f"--variant {item!r}: expected NAME:KEY=VALUE[;KEY=VALUE], e.g. "
                "compiled:policy.compile_model=true"
            )
        out[name] = parse_overrides(rest.split(";"))
    return out


def label(name: str) -> str:
    """The table label of a system (``trl_t2``, ``ours_sync_t2``: with 2 torch threads)."""
    base, threads = split_system(name)
    variant = name.partition("+")[2]
    text = LABELS[base] if threads is None else f"{LABELS[base]} {threads}thr"
    return f"{text} +{variant}" if variant else text


def trl_reference(results: dict[str, dict[str, Any]]) -> str | None:
    """The TRL system the speed-ups are taken against: the fastest of its thread counts (the
    issue's "TRL at its best thread count")."""
    trls = [n for n in results if split_system(n)[0] == "trl"]
    return max(trls, key=lambda n: results[n]["summary"]["samples_per_s"], default=None)


LABELS = {
    "ours_sync": "ours sync",
    "ours_async": "ours async (stale 1)",
    "ours_ray": "ours ray async (st 1)",
    "trl": "TRL GRPOTrainer",
}


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """The side-by-side table, the mean eval curves and the per-phase seconds per step."""
    ref = trl_reference(results)
    trl = results[ref]["summary"] if ref else None
    print(
        f"\nGRPO on the reverse task, qwen2 h128 L2, {args.prompts} prompts x {args.samples} "
        f"samples, <= {args.max_new_tokens} new tokens, T={args.temperature}, lr {args.lr}, "
        f"{args.steps} steps x seeds {args.seeds}, eval every {args.eval_every} "
        "(128 held-out prompts, greedy)"
    )
    tgt = f"t->{args.target:.2f}"
    print(
        f"{'system':<22}{'samples/s':>10}{'tok/s':>7}{'s/step':>7}{'x TRL':>7}{'smp/CPUs':>9}"
        f"{'x TRL':>7}{tgt + ' s':>10}{'@step':>6}{'hit':>5}{'final R':>8}{'mean R':>7}"
        f"{'trainR':>7}"
        f"{'RSS MB':>7}{'e2e s':>7}{'x TRL':>7}"
    )
    for name, res in results.items():
        s = res["summary"]
        r1 = s["samples_per_s"] / trl["samples_per_s"] if trl else float("nan")
        spc = s["samples_per_cpu_s"]
        r2 = spc / trl["samples_per_cpu_s"] if trl and spc else float("nan")
        spc_s = f"{spc:>9.1f}" if spc else f"{'n/a':>9}"
        r2_s = f"{r2:>6.2f}x" if r2 == r2 else f"{'n/a':>7}"  # NaN: no CPU time (Ray actors)
        rss_s = f"{s['peak_rss_mb']:>7.0f}" if s["peak_rss_mb"] else f"{'n/a':>7}"
        ttt = f"{s['time_to_target_s']:.1f}" if s["time_to_target_s"] is not None else "never"
        stt = str(s["step_to_target"]) if s["step_to_target"] is not None else "-"
        print(
            f"{label(name):<22}{s['samples_per_s']:>10.1f}{s['tokens_per_s']:>7.0f}"
            f"{s['s_per_step']:>7.2f}{r1:>6.2f}x{spc_s}{r2_s}"
            f"{ttt:>10}{stt:>6}{s['seeds_reaching_target']:>3}/{s['seeds']}"
            f"{s['final_reward']:>8.3f}{s['mean_eval_reward_after_0']:>7.3f}"
            f"{s['train_reward_last20']:>7.3f}"
            f"{rss_s}{s['end_to_end_s']:>7.1f}"
            + (f"{x:>6.2f}x" if (x := s.get("end_to_end_speedup_vs_trl")) else f"{'n/a':>7}")
        )
    print("mean held-out eval reward per step (over seeds):")
    steps_seen = sorted({c["step"] for r in results.values() for c in r["summary"]["mean_curve"]})
    print(f"{'step':<22}" + "".join(f"{st:>6}" for st in steps_seen))
    for name, res in results.items():
        by = {c["step"]: c["reward"] for c in res["summary"]["mean_curve"]}
        print(
            f"{label(name):<22}" + "".join(f"{by.get(st, float('nan')):>6.3f}" for st in steps_seen)
        )
    print("chosen by the trainer's defaults (rl_trainer.defaults):")
    for name, res in results.items():
        if (chosen := res["summary"].get("auto_choices")) is not None:
            print(f"  {label(name):<20}" + ", ".join(f"{k}={v}" for k, v in chosen.items()))
    print("seconds per step by phase:")
    for name, res in results.items():
        ph = res["summary"]["phase_s_per_step"]
        print(
            f"  {label(name):<20}"
            + ", ".join(f"{k.removeprefix('perf/')} {v:.3f}" for k, v in ph.items())
        )
    print(
        "samples/s, tok/s (response tokens), s/step and t->target: RL wall time without the evals, "
        "pooled over seeds;\nfinal R / mean R: held-out eval at the last step / over all evals "
        "after step 0; trainR: mean rollout\nreward of the last 20 steps; smp/CPUs: samples per "
        "process-CPU second (all threads; less "
        "sensitive to other jobs); t->target\nand @step: median over seeds of the first eval at "
        "or above the target; RSS: peak of the process (n/a on Ray:\nits actors are other "
        "processes); e2e s: median over seeds of the wall time from the command to the\n"
        "process's exit after the last step (start-up, compile, evals and final save included), "
        "x TRL: TRL's over ours.\nasync runs generation and training in "
        "two threads (up to 2 cores); thr: torch threads.\nStill different: TRL samples with "
        "transformers generate (its own RNG), pads instead of packing,\nuses std eps 1e-4 in "
        "the advantage (ours 1e-6) and fused AdamW; async trains on rollouts one version stale."
    )


def add_speedups(results: dict[str, dict[str, Any]]) -> None:
    """``speedup_vs_trl`` in every system's summary: its samples/s and samples per CPU-second
    over those of TRL at its fastest thread count (``None`` where TRL did not run or a figure is
    missing)."""
    ref = trl_reference(results)
    trl = results[ref]["summary"] if ref else None
    for res in results.values():
        s = res["summary"]
        spc, tspc = s["samples_per_cpu_s"], trl["samples_per_cpu_s"] if trl else None
        s["speedup_vs_trl"] = {
            "samples_per_s": s["samples_per_s"] / trl["samples_per_s"] if trl else None,
            "samples_per_cpu_s": spc / tspc if spc and tspc else None,
        }
        # End to end: TRL's (best thread count) command-to-exit time over this system's.
        s["end_to_end_speedup_vs_trl"] = (
            trl["end_to_end_s"] / s["end_to_end_s"] if trl and s.get("end_to_end_s") else None
        )


def check_bars(setting: str | None, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The bars of a named setting: per-step speed-up per system (issues 22 and 36), end to end
    and the async runs' reward against the synchronous seeds' spread (issue 36)."""
    bars = SETTINGS.get(setting or "", {}).get("bars", {})
    out = {}
    for name, need in bars.items():
        # A system run at several thread counts (ours_sync_t1, ours_sync_t2) counts at its best.
        got, by = None, None
        for n, res in results.items():
            if split_system(n)[0] == name:
                x = res["summary"]["speedup_vs_trl"]["samples_per_s"]
                if x is not None and (got is None or x > got):
                    got, by = x, n
        out[name] = {
            "needed": need,
            "measured": got,
            "by": by,
            "met": got is not None and got >= need,
        }
    if not bars:
        return out
    # End to end (issue 36): our fastest system without variant overrides, command to exit.
    e2e = [
        (res["summary"].get("end_to_end_speedup_vs_trl"), n)
        for n, res in results.items()
        if split_system(n)[0] in ("ours_sync", "ours_async") and "+" not in n
    ]
    e2e = [(x, n) for x, n in e2e if x is not None]
    got, by = max(e2e, default=(None, None))
    out["end_to_end"] = {
        "needed": E2E_BAR,
        "measured": got,
        "by": by,
        "met": got is not None and got >= E2E_BAR,
    }
    # Async learns as well per step (issue 36): the async runs' mean reward over seeds lies
    # within the synchronous runs' spread over seeds (>= their lowest seed), for the held-out
    # eval at the last step and the training reward of the last 20 steps.
    for n_async, res in results.items():
        kind, count = split_system(n_async)
        if kind != "ours_async" or "+" in n_async:
            continue
        n_sync = n_async.replace("ours_async", "ours_sync")
        if n_sync not in results:
            continue
        a, s_ = res["summary"], results[n_sync]["summary"]
        for metric in ("final_reward", "train_reward_last20"):
            sync_seeds = s_[f"{metric}_by_seed"]
            async_seeds = a[f"{metric}_by_seed"]
            mean_async = sum(async_seeds) / len(async_seeds)
            out[f"async_reward_{metric}" + (f"_t{count}" if count else "")] = {
                "needed": f">= min over sync seeds {min(sync_seeds):.3f}",
                "sync_by_seed": sync_seeds,
                "async_by_seed": async_seeds,
                "measured": mean_async,
                "met": mean_async >= min(sync_seeds),
            }
    return out


def main() -> None:
    """Run SFT once, then every system for every seed; print the table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--setting",
        choices=sorted(SETTINGS),
        default=None,
        help="a named setting of issue 22 (sets --prompts and --max-new-tokens; default: demo "
        "when neither is given)",
    )
    ap.add_argument("--steps", type=int, default=100, help="RL steps per run")
    ap.add_argument("--seeds", default="1,2,3", help="RL seeds (sampling and data order)")
    ap.add_argument(
        "--eval-every",
        type=int,
        default=10,
        help="held-out eval every N steps (>= 1: the evals delimit the timed RL phase)",
    )
    ap.add_argument("--target", type=float, default=0.45, help="held-out reward to reach")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 32)")
    ap.add_argument("--samples", type=int, default=8, help="group size")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 12")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--sft-seed", type=int, default=1)
    ap.add_argument(
        "--systems", default="ours_sync,ours_async,trl", help="comma list of systems to run"
    )
    ap.add_argument(
        "--trl-threads",
        default="1,2",
        help="torch threads of the TRL process; a comma list runs TRL once per count "
        "(systems trl_t1, trl_t2, ...) and the speed-ups are taken against the fastest",
    )
    ap.add_argument(
        "--ours-threads",
        default="1,2",
        help="torch threads (the recipe's `threads`) of our sync and async runs; a comma list "
        "runs each once per count (ours_sync_t1, ours_async_t2, ...), the bar counts the fastest",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for our runs (not SFT, not TRL), e.g. policy.compile_model=true; "
        "VALUE is parsed as JSON when it can be; repeatable",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[;KEY=VALUE]",
        help="run each of our systems once more with these recipe overrides on top of --set, "
        "as SYSTEM+NAME (e.g. compiled:policy.compile_model=true gives ours_sync_t2+compiled); "
        "repeatable",
    )
    ap.add_argument("--smoke", action="store_true", help="3 steps, one seed, nothing written")
    ap.add_argument("--work-dir", default=None, help="default: $RL_BENCH_HOME/e2e")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.eval_every < 1:
        ap.error(
            f"--eval-every {args.eval_every}: must be >= 1 (the eval at step 0 starts the RL "
            "phase's clock and the evals give the reward curve); use a large value for few evals"
        )
    if args.setting is None and args.prompts is None and args.max_new_tokens is None:
        args.setting = "demo"
    if args.setting is not None:
        named = SETTINGS[args.setting]
        for key in ("prompts", "max_new_tokens"):
            given = getattr(args, key)
            if given is not None and given != named[key]:
                raise SystemExit(
                    f"--{key.replace('_', '-')} {given} contradicts --setting {args.setting} "
                    f"({named[key]}); drop one of them"
                )
            setattr(args, key, named[key])
    args.prompts = 32 if args.prompts is None else args.prompts
    args.max_new_tokens = 12 if args.max_new_tokens is None else args.max_new_tokens
    if args.smoke:
        args.steps, args.eval_every, args.sft_steps, args.seeds = 3, 3, 5, "1"
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for name in systems:
        if name not in LABELS:
            raise SystemExit(f"--systems: unknown {name!r}; choose from {', '.join(LABELS)}")
    threads = {
        "trl": [int(x) for x in str(args.trl_threads).split(",") if x.strip()],
        "ours_sync": [int(x) for x in str(args.ours_threads).split(",") if x.strip()],
    }
    threads["ours_async"] = threads["ours_sync"]
    overrides = parse_overrides(args.set)
    variants = parse_variants(args.variant)
    # A system given several thread counts runs once per count (trl_t1, trl_t2, ...).
    systems = [
        f"{name}_t{t}" if len(threads.get(name, [])) > 1 else name
        for name in systems
        for t in threads.get(name, [1])
    ]
    systems += [f"{name}+{v}" for v in variants for name in systems if name.startswith("ours")]

    work = Path(args.work_dir or bench_home() / ("e2e-smoke" if args.smoke else "e2e")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    any_trl = any(split_system(n)[0] == "trl" for n in systems)
    trl_python = ensure_trl_venv(bench_home() / "trl") if any_trl else None

    base = {
        "work_dir": str(work),
        "seed": args.sft_seed,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "prompts_per_step": args.prompts,
        "n_samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "lr": args.lr,
        "eps_low": 0.2,
        "eps_high": 0.28,
        "sft_steps": args.sft_steps,
        "trl_threads": threads["trl"][0],
        "ours_threads": 1,  # SFT; our RL runs take --ours-threads
        "async": False,
    }

    def settings_file(name: str, **extra: Any) -> Path:
        p = work / f"settings_{name}.json"
        p.write_text(json.dumps({**base, **extra}, indent=2))
        return p

    load_start = os.getloadavg()
    print(f"SFT warm-up ({args.sft_steps} steps) -> {work / 'sft' / 'sft_model'}", flush=True)
    sft = run_worker(
        sys.executable, "sft", settings_file("sft"), work / "sft.json", work / "sft.log"
    )
    print(f"  SFT held-out reward {sft['curve'][-1]['reward']:.3f}", flush=True)

    # torch.compile's first compile on a machine (C++ kernels into inductor's on-disk cache) is
    # a one-time cost of the machine, not of a run: one untimed 2-step run per compiled
    # configuration and torch thread count (inductor specialises its kernels to the thread
    # count: part of the cache key) fills the cache, so every seed's run pays the same
    # per-run compile.
    warmups: dict[str, float] = {}
    for vname, ov in [("", overrides), *variants.items()]:
        if not ov.get("policy.compile_model"):
            continue
        for count in sorted(set(threads["ours_sync"])):
            tag = f"compile_warmup_t{count}" + (f"+{vname}" if vname else "")
            print(f"{tag}: filling the compile cache (2 untimed steps) ...", flush=True)
            st = settings_file(
                tag, steps=2, run_name=tag, recipe_overrides=ov, ray=False, ours_threads=count
            )
            warmups[tag] = run_worker(
                sys.executable, "ours", st, work / f"{tag}.json", work / f"{tag}.log"
            )["process_total_s"]

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for i, seed in enumerate(seeds):
        # Rotate the order per seed, so a burst of load from other jobs hits every system.
        for name in systems[i % len(systems) :] + systems[: i % len(systems)]:
            tag = f"{name}_s{seed}"
            print(f"running {name} seed {seed} ({args.steps} steps) ...", flush=True)
            kind, count = split_system(name)
            extra: dict[str, Any] = {}
            if kind == "trl":
                assert trl_python is not None
                py, mode = str(trl_python), "trl"
                extra["trl_threads"] = count or threads["trl"][0]
            else:
                py, mode = sys.executable, "ours"
                if kind in threads:
                    extra["ours_threads"] = count or threads[kind][0]
                variant = name.partition("+")[2]
                extra["recipe_overrides"] = {**overrides, **variants.get(variant, {})}
            st = settings_file(
                tag,
                **extra,
                seed=seed,
                run_name=tag,
                ray=kind == "ours_ray",
                **{"async": kind in ("ours_async", "ours_ray")},
            )
            res = run_worker(py, mode, st, work / f"{tag}.json", work / f"{tag}.log")
            res["seed"] = seed
            res["loadavg_after"] = os.getloadavg()
            runs[name].append(res)
            print(
                f"  {res['samples'] / res['train_s']:.1f} samples/s, final eval reward "
                f"{res['curve'][-1]['reward']:.3f}",
                flush=True,
            )
    results = {
        name: {
            "summary": summarize(rs, args.target, one_process=split_system(name)[0] != "ours_ray"),
            "runs": rs,
        }
        for name, rs in runs.items()
    }
    add_speedups(results)
    bars = check_bars(args.setting, results)
    print_table(results, args)
    for name, bar in bars.items():
        verdict = "met" if bar["met"] else "NOT met"
        if name.startswith("async_reward"):
            print(
                f"bar ({args.setting}) {name}: async mean {bar['measured']:.3f} "
                f"{bar['needed']} (sync seeds {bar['sync_by_seed']}): {verdict}"
            )
            continue
        got = f"{bar['measured']:.2f}x" if bar["measured"] is not None else "not run"
        by = f" ({label(bar['by'])})" if bar["by"] and bar["by"] != name else ""
        what = "end to end (command to exit)" if name == "end_to_end" else label(name)
        print(
            f"bar ({args.setting}) {what}: >= {bar['needed']}x TRL at its best thread "
            f"count, measured {got}{by}: {verdict}"
        )
    if args.smoke:
        print("--smoke: results not written")
        return
    entry = {
        "config": vars(args) | {"model": "qwen2 h128 L2 vocab260 (demo recipe)"},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "note": "loadavg_start/_end, and loadavg_after in every run: other jobs on the "
            "machine show there",
        },
        "sft": {
            "eval_reward": sft["curve"][-1]["reward"],
            "process_total_s": sft["process_total_s"],
        },
        "compile_cache_warmup_s": warmups,
        "trl_reference": trl_reference(results),
        "bars": bars,
        "systems": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    key = args.setting or f"p{args.prompts}_t{args.max_new_tokens}"
    try:
        previous = json.loads(out.read_text())
    except (OSError, ValueError):
        previous = {}
    settings = previous.get("settings", {}) if previous.get("benchmark") == "e2e" else {}
    settings[key] = entry
    out.write_text(json.dumps({"benchmark": "e2e", "settings": settings}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
