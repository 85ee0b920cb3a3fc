"""Prefix-aware micro-batch planning: how many tokens the model runs on, and the train phase's
time, when a step is cut into several micro-batches.

``HFPolicy`` computes the prompt that sequences of one micro-batch share once
(``share_prefix``). The trainer's plan (``rl_trainer.step.packing.plan``) either packs a rank's
samples one by one (``token``: token balance only, the planner before prefix groups) or keeps
each GRPO group in one micro-batch (``grouped``: ``rl_buffer.schedule_step(prefix_groups=...)``,
what a policy with ``shares_prefixes`` gets). Each case is the demo recipe without its SFT
warm-up (every response runs to 12 new tokens, ~4400 tokens a step), ``rl.steps`` RL steps at
one torch thread, ``use_reference`` on, at several ``rl.max_tokens_per_micro_batch`` caps; each
run is a fresh process, and the plans alternate within each round.

Reported per cap and plan: the model forwards (micro-batch calls of the packed forward, policy
and reference), packed tokens ``T`` and the tokens the model ran on ``C`` (one copy of each shared
prompt), and the train phase's mean seconds per step after step 2 (``perf/train_time``).

Run: ``OMP_NUM_THREADS=1 python benchmarks/prefix_plan.py [--quick]``: prints a table and writes
``benchmarks/results/prefix_plan.json`` (not with ``--quick``). About 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results

RESULTS = Path(__file__).with_name("results") / "prefix_plan.json"
PLANS = ("token", "grouped")


def run_case(plan: str, cap: int, steps: int, work: Path) -> dict[str, Any]:
    """One training run in this process (the worker side): the counts and timings."""
    import rl_hf._packed_attention as packed
    import rl_trainer.step.packing as stages
    from rl_core.config import load_config_file
    from rl_trainer.cli import recipe_path
    from rl_trainer.config import load_trainer_config
    from rl_trainer.loop import Trainer

    count = {"forwards": 0, "packed_tokens": 0, "model_tokens": 0}
    original = packed.packed_inputs

    def counting(batch: Any, device: Any, **kw: Any) -> Any:
        pos_T, kwargs, expand_T = original(batch, device, **kw)
        count["forwards"] += 1
        count["packed_tokens"] += int(pos_T.shape[0])
        count["model_tokens"] += int(kwargs["position_ids"].shape[1])
        return pos_T, kwargs, expand_T

    packed.packed_inputs = counting  # HFPolicy imports it at call time
    if plan == "token":
        schedule = stages.schedule_step

        def token_only(*args: Any, prefix_groups: Any = None, **kw: Any) -> Any:
            return schedule(*args, **kw)

        stages.schedule_step = token_only
    rec = load_config_file(recipe_path("demo"))
    rec["run_dir"] = str(work / f"{plan}_{cap}")
    rec["threads"] = 1
    rec["sft"]["steps"] = 0
    rec["rl"]["steps"] = steps
    rec["rl"]["max_tokens_per_micro_batch"] = cap
    # whole GRPO groups: the zero-advantage skip would leave some samples out and change what
    # is planned (this measures the planner, not the skip)
    rec["rl"]["skip_zero_advantage"] = False
    rec["eval"] = {"every": 0}
    rec["checkpoint"] = {"every": 0, "keep": 1}
    rec["logging"] = {"tensorboard": False, "progress": False}
    records = Trainer(load_trainer_config(rec)).run()
    rl = [r for r in records if r.get("phase") == "rl" and r.get("step", 0) > 0]
    train = [float(r["perf/train_time"]) for r in rl][2:]
    return {
        "plan": plan,
        "cap": cap,
        "steps": len(rl),
        **count,
        "model_token_share": count["model_tokens"] / max(1, count["packed_tokens"]),
        "train_s_per_step": sum(train) / max(1, len(train)),
    }


def main() -> None:
    """Run every cap and plan in alternating fresh processes, print the table, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", default="512,1024,4096")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4 steps, one round, cap 512; no JSON")
    ap.add_argument(
        "--worker", nargs=4, metavar=("PLAN", "CAP", "STEPS", "WORK"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.worker:
        plan, cap, steps, work = args.worker
        print(json.dumps(run_case(plan, int(cap), int(steps), Path(work))))
        return
    caps = [512] if args.quick else [int(c) for c in args.caps.split(",")]
    steps, rounds = (4, 1) if args.quick else (args.steps, args.rounds)
    load_before = os.getloadavg()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="prefix_plan_"))
    try:
        for r in range(rounds):
            for cap in caps:
                for plan in PLANS:
                    out = subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--worker",
                            plan,
                            str(cap),
                            str(steps),
                            str(work),
                        ],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    if out.returncode != 0:
                        raise SystemExit(f"{plan} cap {cap} failed:\n{out.stderr[-3000:]}")
                    rows.append({"round": r, **json.loads(out.stdout.strip().splitlines()[-1])})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"demo recipe without SFT, {steps} RL steps, 1 thread, {rounds} round(s)")
    print(f"{'cap':>6} {'plan':>8} {'forwards':>9} {'model/packed':>13} {'train s/step':>13}")
    for cap in caps:
        for plan in PLANS:
            mine = [x for x in rows if x["cap"] == cap and x["plan"] == plan]
            times = ", ".join(f"{x['train_s_per_step']:.3f}" for x in mine)
            print(
                f"{cap:>6} {plan:>8} {mine[0]['forwards']:>9} "
                f"{mine[0]['model_token_share']:>13.3f} {times:>13}"
            )
    if args.quick:
        print("--quick: smoke run, results not written")
        return
    write_results(
        RESULTS,
        {
            "benchmark": "prefix_plan",
            "setting": "demo recipe, sft.steps 0, threads 1, eval off",
            "steps": steps,
            "rounds": rounds,
            "rows": rows,
        },
        load_before,
    )


if __name__ == "__main__":
    main()
