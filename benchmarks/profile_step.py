"""Where the time of one RL step goes: the embedded default (HFPolicy + HFGenerator, demo recipe,
local runtime), synchronous and asynchronous, at two batch sizes.

Settings (the demo's tiny qwen2 after its 30-step SFT warm-up, ``use_reference: false`` and
``kl_coef: 0`` as in ``benchmarks/e2e.py``):

- ``small``: 8 prompts x 8 samples (64 samples/step), 8 new tokens;
- ``demo``: 32 prompts x 8 samples (256 samples/step), 12 new tokens (the demo setting).

For each setting and mode the trainer runs ``--warmup`` steps, then ``--steps`` measured steps,
then one more step under ``torch.profiler`` (excluded from the timings). Every stage function the
step calls is wrapped by a timer that books wall seconds and *thread* CPU seconds
(``time.thread_time``: the generator's worker thread and the trainer thread are booked apart) and
opens a ``record_function`` range, so the op table of the profiled step groups ops by phase.

Timers (``ms per step``; nested ones are included in their parents):

- step: ``rl_step`` (the whole step; process CPU from ``perf/step_cpu_s``);
- rollout: ``produce_round`` > ``gen.run_batch`` (worker thread) > ``gen.prefill``,
  ``gen.decode_step`` (model forward of one token), ``gen.sample`` (``_sample_rows``),
  ``gen.emit`` (results to Python); ``score`` (reward);
- between phases: ``take_groups``, ``after_take`` (dumps/traces), ``emit`` (metrics/logging),
  ``sync_weights`` / ``serve`` (weight publish through the in-process transport),
  ``weights_copy`` (the CPU copy async mode releases);
- train: ``train`` > ``rl_batch`` > ``plan_and_pack``, ``advantages``, ``loss_weights``;
  ``train_step`` > ``forward`` (model), ``logprobs`` (log-prob/entropy from the logits),
  ``loss``, ``backward``, ``clip_grad``, ``optimizer``.

``--py-spy SETTING:MODE`` re-runs one case under ``py-spy record`` (speedscope format, Python
frames only) and adds the sampled shares of the key frames per thread to the JSON.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/profile_step.py                 # ~2 min
    OMP_NUM_THREADS=1 python benchmarks/profile_step.py --py-spy demo:async --py-spy small:sync

Writes ``benchmarks/results/profile_step.json`` (``--out``) with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SETTINGS = {
    "small": {"prompts_per_step": 8, "n_samples": 8, "max_new_tokens": 8},
    "demo": {"prompts_per_step": 32, "n_samples": 8, "max_new_tokens": 12},
}


class Timers:
    """Wall and thread-CPU seconds per named region (thread-safe, nesting allowed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.on = False
        self.acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])

    @contextlib.contextmanager
    def region(self, name: str) -> Any:
        """Time the block as ``name`` (and label it for torch.profiler)."""
        import torch

        w0, c0 = time.perf_counter(), time.thread_time()
        with torch.profiler.record_function(name):
            try:
                yield
            finally:
                w, c = time.perf_counter() - w0, time.thread_time() - c0
                if self.on:
                    with self.lock:
                        a = self.acc[name]
                        a[0] += w
                        a[1] += c
                        a[2] += 1

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        """Replace ``obj.attr`` (a function or coroutine function) by a timed version."""
        fn = getattr(obj, attr)
        if asyncio.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapped(*a: Any, **k: Any) -> Any:
                w0 = time.perf_counter()
                try:
                    return await fn(*a, **k)
                finally:  # coroutines hop threads/tasks: wall only
                    if self.on:
                        with self.lock:
                            acc = self.acc[name]
                            acc[0] += time.perf_counter() - w0
                            acc[2] += 1

            setattr(obj, attr, awrapped)
            return

        @functools.wraps(fn)
        def wrapped(*a: Any, **k: Any) -> Any:
            with self.region(name):
                return fn(*a, **k)

        setattr(obj, attr, wrapped)


def _sft(work: Path) -> Path:
    """The demo's SFT warm-up (30 steps), cached in ``work/sft``."""
    model = work / "sft" / "sft_model"
    if (model / "config.json").is_file():
        return model
    from _e2e_worker import run_ours

    settings = {
        "work_dir": str(work),
        "seed": 1,
        "prompts_per_step": 32,
        "n_samples": 8,
        "max_new_tokens": 12,
        "temperature": 0.7,
        "lr": 3e-4,
        "eps_low": 0.2,
        "eps_high": 0.28,
        "eval_every": 10,
        "sft_steps": 30,
        "async": False,
    }
    run_ours(settings, str(work / "sft.json"), sft_only=True)
    return model


def run_case(
    work: Path,
    setting: str,
    mode: str,
    warmup: int,
    steps: int,
    profile: bool,
    *,
    instrument: bool = True,
    overrides: dict[str, Any] | None = None,
) -> dict:
    """One setting and mode: timers per step over the measured steps, and the op table."""
    import torch
    from _e2e_worker import _recipe

    import rl_hf.generator as gen_mod
    import rl_hf.policy as pol_mod
    from rl_trainer.config import load_trainer_config
    from rl_trainer.loop import Trainer
    from rl_trainer.phases import rl as rl_phase
    from rl_trainer.step import stages

    sft = _sft(work)
    s = SETTINGS[setting]
    settings = {
        "seed": 1,
        "temperature": 0.7,
        "lr": 3e-4,
        "eps_low": 0.2,
        "eps_high": 0.28,
        "eval_every": 10_000,
        **s,
        "recipe_overrides": overrides or {},
    }
    run_dir = work / f"{setting}_{mode}"
    total = warmup + steps + (1 if profile else 0)
    rec = _recipe(
        settings,
        run_dir,
        **{
            "model.path": str(sft),
            "model.init": None,
            "sft.steps": 0,
            "rl.steps": total,
            "rl.async_generation": mode == "async",
            "rl.max_staleness": 1,
        },
    )
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    T = Timers()
    if not instrument:  # under py-spy: only the step clock, no wrappers in the stacks
        T.wrap = lambda *a, **k: None  # type: ignore[method-assign]
    records: list[dict[str, Any]] = []
    op_table: list[dict[str, Any]] = []
    prof_state: dict[str, Any] = {}

    class ProfTrainer(Trainer):
        """Trainer whose emitted records are kept, and whose RL models get timed once built."""

        def _init(self, config: Any) -> None:
            super()._init(config)
            emit = self.run_state.emit  # the run's records go through RunState.emit

            def timed_emit(r: dict[str, Any]) -> None:
                with T.region("emit"):
                    emit(r)
                records.append(dict(r))

            self.run_state.emit = timed_emit  # type: ignore[method-assign]

    # Module-level stage functions (looked up at call time by their callers).
    for name in ("produce_round", "take_groups", "rl_batch", "plan_and_pack", "advantages"):
        T.wrap(stages, name, name)
    T.wrap(stages, "loss_weights", "loss_weights")
    T.wrap(stages, "sync_weights", "sync_weights")
    T.wrap(stages, "serve", "serve")
    T.wrap(rl_phase, "_weights_copy", "weights_copy")
    T.wrap(rl_phase.samples, "after_take", "after_take")
    T.wrap(gen_mod, "_sample_rows", "gen.sample")
    T.wrap(gen_mod, "_emit", "gen.emit")
    T.wrap(gen_mod.HFGenerator, "_run_batch", "gen.run_batch")
    T.wrap(gen_mod.HFGenerator, "_prefill", "gen.prefill")
    T.wrap(gen_mod.HFGenerator, "_decode_step", "gen.decode_step")
    T.wrap(pol_mod, "token_logprobs", "logprobs")
    T.wrap(pol_mod.HFPolicy, "train_step", "train_step")
    T.wrap(torch.autograd, "backward", "backward")
    T.wrap(torch.nn.utils, "clip_grad_norm_", "clip_grad")

    orig_train = stages.train

    def train(run: Any, groups: Any) -> Any:
        step = run.counters.rl_step + 1
        if profile and step == total:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as tprof

            with tprof(activities=[ProfilerActivity.CPU]) as p, T.region("train"):
                out = orig_train(run, groups)
            prof_state["table"] = p.key_averages()
            return out
        with T.region("train"):
            return orig_train(run, groups)

    stages.train = train
    orig_step = rl_phase.rl_step
    t_meas: dict[str, float] = {}

    async def rl_step(trainer: Any) -> Any:
        step = trainer.counters.rl_step + 1
        if step == warmup + 1:  # measured steps start
            T.on = True
            t_meas["w0"], t_meas["c0"] = time.perf_counter(), time.process_time()
            if not prof_state.get("wrapped"):
                pol = trainer.models.policy
                T.wrap(pol.model, "forward", "forward")
                T.wrap(pol.optimizer, "step", "optimizer")
                loss_fn = trainer.parts.loss_fn
                trainer.parts.loss_fn = _TimedLoss(loss_fn, T)
                T.wrap(trainer.parts.scorer, "score", "score")
                prof_state["wrapped"] = True
        if step == warmup + steps + 1:
            T.on = False
            t_meas["w1"], t_meas["c1"] = time.perf_counter(), time.process_time()
        if T.on:
            w0 = time.perf_counter()
            out = await orig_step(trainer)
            with T.lock:
                a = T.acc["rl_step"]
                a[0] += time.perf_counter() - w0
                a[2] += 1
            return out
        return await orig_step(trainer)

    rl_phase.rl_step = rl_step
    try:
        trainer = ProfTrainer(load_trainer_config(rec))
        trainer.run()
    finally:
        stages.train = orig_train
        rl_phase.rl_step = orig_step
    if "w1" not in t_meas:
        t_meas["w1"], t_meas["c1"] = time.perf_counter(), time.process_time()
    rl_recs = [r for r in records if r.get("phase") == "rl" and warmup < r.get("step", 0)]
    rl_recs = [r for r in rl_recs if r["step"] <= warmup + steps]
    n_samples = s["prompts_per_step"] * s["n_samples"]
    wall = t_meas["w1"] - t_meas["w0"]
    cpu = t_meas["c1"] - t_meas["c0"]
    timers = {
        k: {
            "ms_per_step": 1000 * v[0] / steps,
            "cpu_ms_per_step": 1000 * v[1] / steps,
            "calls_per_step": v[2] / steps,
        }
        for k, v in sorted(T.acc.items(), key=lambda kv: -kv[1][0])
    }
    if "table" in prof_state:
        rows = sorted(prof_state["table"], key=lambda e: -e.self_cpu_time_total)
        total_self = sum(e.self_cpu_time_total for e in rows) or 1.0
        for e in rows[:25]:
            op_table.append(
                {
                    "op": e.key,
                    "self_ms": e.self_cpu_time_total / 1000,
                    "self_share": e.self_cpu_time_total / total_self,
                    "total_ms": e.cpu_time_total / 1000,
                    "calls": e.count,
                }
            )
        # The phase ranges (our record_function labels) with their inclusive times.
        phases = {
            e.key: e.cpu_time_total / 1000
            for e in prof_state["table"]
            if e.key in T.acc or e.key in ("forward", "optimizer", "loss", "score", "train")
        }
    else:
        phases = {}
    return {
        "setting": setting,
        "mode": mode,
        "samples_per_step": n_samples,
        "steps_measured": steps,
        "wall_s_per_step": wall / steps,
        "process_cpu_s_per_step": cpu / steps,
        "samples_per_s": n_samples * steps / wall,
        "samples_per_cpu_s": n_samples * steps / cpu,
        "perf_means": {
            k: sum(float(r.get(k) or 0.0) for r in rl_recs) / max(len(rl_recs), 1)
            for k in (
                "perf/step_time",
                "perf/step_cpu_s",
                "perf/gen_time",
                "perf/train_time",
                "perf/sync_time",
                "perf/rollout_wait",
            )
        },
        "reward_mean": [r.get("rollout/reward_mean") for r in rl_recs],
        "timers": timers,
        "profiled_train_step_ms": phases,
        "top_ops": op_table,
        "loadavg": os.getloadavg(),
    }


class _TimedLoss:
    """A loss function timed as ``loss`` (keeps ``requires_entropy`` and other attributes)."""

    def __init__(self, fn: Any, timers: Timers) -> None:
        self._fn, self._t = fn, timers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)

    def __call__(self, *a: Any, **k: Any) -> Any:
        with self._t.region("loss"):
            return self._fn(*a, **k)


KEY_FRAMES = (
    "_prefill",
    "_decode_step",
    "_sample_rows",
    "_emit",
    "_row_state",
    "_pack_prompts",
    "_decode",
    "train_step",
    "_packed_logprobs",
    "token_logprobs",
    "backward",
    "step",
    "clip_grad_norm_",
    "rl_batch",
    "plan_and_pack",
    "pack_rollouts",
    "advantages",
    "loss_weights",
    "produce_round",
    "generate_groups",
    "score",
    "take_groups",
    "after_take",
    "emit",
    "sync_weights",
    "serve",
    "publish",
    "_weights_copy",
)


RL_ROOTS = frozenset({"rl_step", "_run_batch", "train"})


def summarize_speedscope(path: Path) -> dict[str, Any]:
    """Per thread: samples, the top self frames and the inclusive share of the key frames,
    over the samples of the RL phase only (stacks under ``rl_step`` or the generator's
    ``_run_batch``; the imports, the SFT check and the step-0 eval outside it are left out)."""
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    for f in frames:  # "HFGenerator._prefill" -> "_prefill"
        f["short"] = f["name"].rsplit(".", 1)[-1]
    out: dict[str, Any] = {}
    for prof in data["profiles"]:
        samples, weights = prof["samples"], prof.get("weights") or [1] * len(prof["samples"])
        total = float(
            sum(
                w
                for st, w in zip(samples, weights, strict=False)
                if {frames[i]["short"] for i in st} & RL_ROOTS
            )
        )
        if total == 0:
            continue
        self_w: dict[str, float] = defaultdict(float)
        incl: dict[str, float] = defaultdict(float)
        for stack, w in zip(samples, weights, strict=False):
            names = {frames[i]["short"] for i in stack}
            if not stack or not names & RL_ROOTS:
                continue
            leaf = frames[stack[-1]]
            self_w[f"{leaf['name']} ({Path(leaf.get('file', '')).name}:{leaf.get('line', 0)})"] += w
            for name in names & set(KEY_FRAMES):
                incl[name] += w
        out[prof["name"]] = {
            "seconds": total,
            "top_self": [
                {"frame": k, "share": v / total}
                for k, v in sorted(self_w.items(), key=lambda kv: -kv[1])[:15]
            ],
            "inclusive_share": {
                k: v / total for k, v in sorted(incl.items(), key=lambda kv: -kv[1])
            },
        }
    return out


def main() -> None:
    """Run the cases (or one case under py-spy) and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="small,demo")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-torch-profile", action="store_true")
    ap.add_argument("--py-spy", action="append", default=[], help="SETTING:MODE under py-spy")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override (as benchmarks/e2e.py --set), e.g. policy.compile_model=true",
    )
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "profile_step.json"))
    ap.add_argument("--case-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    home = Path(os.environ.get("RL_BENCH_HOME", Path.home() / ".cache" / "rl-bench"))
    work = Path(args.work_dir or home / "profile").resolve()
    work.mkdir(parents=True, exist_ok=True)
    from _e2e_worker import parse_overrides

    overrides = parse_overrides(args.set)
    if args.case_out:  # one case, for py-spy: no torch profiler
        (setting, mode) = args.settings, args.modes
        res = run_case(
            work,
            setting,
            mode,
            args.warmup,
            args.steps,
            profile=False,
            instrument=False,
            overrides=overrides,
        )
        Path(args.case_out).write_text(json.dumps(res))
        return
    _sft(work)
    cases = []
    for setting in args.settings.split(","):
        for mode in args.modes.split(","):
            print(f"{setting} {mode} ...", flush=True)
            res = run_case(
                work,
                setting,
                mode,
                args.warmup,
                args.steps,
                profile=not args.no_torch_profile,
                overrides=overrides,
            )
            print(
                f"  {res['wall_s_per_step'] * 1000:.0f} ms/step wall, "
                f"{res['process_cpu_s_per_step'] * 1000:.0f} ms CPU, "
                f"{res['samples_per_cpu_s']:.0f} samples/CPU-s, load {res['loadavg'][0]:.1f}",
                flush=True,
            )
            cases.append(res)
    spy = {}
    pyspy = Path(sys.executable).parent / "py-spy"
    for case in args.py_spy:
        setting, mode = case.split(":")
        ss = work / f"pyspy_{setting}_{mode}.speedscope.json"
        cmd = [
            str(pyspy), "record", "--format", "speedscope", "-r", "250", "-o", str(ss), "--",
            sys.executable, __file__, "--settings", setting, "--modes", mode,
            "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--case-out", str(work / "pyspy_case.json"), "--work-dir", str(work),
            *(f"--set={item}" for item in args.set),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        spy[case] = summarize_speedscope(ss)
    out = {
        "benchmark": "profile_step",
        "model": "qwen2 h128 L2 vocab260 (demo recipe) after 30 SFT steps",
        "settings": SETTINGS,
        "recipe_overrides": overrides,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_end": os.getloadavg(),
            "note": "shared machine: CPU seconds are the comparable figure, wall is not",
        },
        "cases": cases,
        "py_spy": spy,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
