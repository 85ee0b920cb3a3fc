"""Qwen3-MoE on MegatronPolicy: accuracy and step time per expert-parallel layout (CPU, gloo).

Run from the repository root (after ``source /work/wt/env.sh`` or with the packages installed)::

    python benchmarks/moe.py            # prints a table, writes benchmarks/results/moe.json

Layouts: EP=1 (one process), and in one 4-process launch of
``packages/rl-megatron/tests/_moe_worker.py``: EP=2 x DP=4 (distributed optimizer), EP=2 x
TP=2 (expert TP 2, sequence parallel), EP=2 x PP=2. Model: the tests' tiny Qwen3-MoE (2 layers,
8 experts, top-2, hidden 32). For each layout:

* ``logprob_max_abs_diff``: max |log-prob - reference| over the step batch (44 tokens), the
  reference being plain transformers ``Qwen3MoeForCausalLM`` per sequence in fp32;
* ``replay_logprob_max_abs_diff``: the same with random experts replayed, against transformers
  with its routers forced to them;
* ``sft_step_s`` / ``rl_step_s``: wall time of one SFT step and one RL step (PPO + entropy +
  KL, replaying routing) on rank 0 (two CPU cores shared by all processes: a relative figure).

The routing-replay mismatch figures (router choice and log-prob mismatch between a bf16/noisy
generator and the fp32 trainer, with and without replay) come from ``benchmarks/moe_replay.py``
when it exists (:func:`replay_section`); the section is skipped otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from rl_core.testing.modules import load_module

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "packages" / "rl-megatron" / "tests"
OUT = ROOT / "benchmarks" / "results" / "moe.json"


def _whole(parts: list[dict[str, Any]], name: str) -> torch.Tensor:
    by_dp = {p["dp_rank"]: p[name] for p in parts}
    return torch.cat([by_dp[d] for d in sorted(by_dp)])


def ep1_layout(w: ModuleType, model_dir: Path, hf: Any, ref: ModuleType) -> dict[str, Any]:
    """EP=1 in this process: the same batch, forced routing and steps as the worker."""
    from rl_core.testing.policy import sft_loss
    from rl_megatron.policy import MegatronPolicy

    policy = MegatronPolicy(
        MegatronPolicy.Config(model_path=str(model_dir), lr=w.LR, moe_aux_loss_coeff=0.0)
    )
    batch = w.step_batch(policy.model_shape.vocab_size, 1)
    forced = w.forced_routing(batch.num_tokens, policy._routing.num_layers, 2)
    logp_T = policy.compute_logprobs(batch).logprobs
    replay_T = policy.compute_logprobs(dataclasses.replace(batch, routed_experts=forced)).logprobs
    ref_T, _ = ref.hf_logprobs(hf, batch)
    ref_replay_T, _ = ref.hf_logprobs(hf, batch, forced)
    t0 = time.perf_counter()
    policy.train_step(batch, sft_loss)
    sft_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    policy.train_step(w.rl_batch(batch, logp_T, forced), w.rl_loss())
    rl_s = time.perf_counter() - t0
    return {
        "layout": "EP=1",
        "processes": 1,
        "logprob_max_abs_diff": float((logp_T - ref_T).abs().max()),
        "replay_logprob_max_abs_diff": float((replay_T - ref_replay_T).abs().max()),
        "sft_step_s": sft_s,
        "rl_step_s": rl_s,
    }


def parallel_layouts(w: ModuleType, model_dir: Path, hf: Any, ref: ModuleType) -> list[dict]:
    """The worker's 4-process layouts, compared with transformers here."""
    sys.path.insert(0, str(TESTS))
    from conftest import _launch_ranks

    names = {
        "ep2_dp4": "EP=2 x DP=4 (dist. opt.)",
        "ep2_tp2": "EP=2 x TP=2",
        "ep2_pp2": "EP=2 x PP=2",
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        ranks = _launch_ranks(
            [sys.executable, str(TESTS / "_moe_worker.py"), str(out), str(model_dir)],
            w.WORLD_SIZE,
            timeout=1200,
            check=False,
            log_dir=out,
        )
        if any(code for code, _ in ranks):
            raise SystemExit("moe worker failed:\n" + ranks[0][1][-3000:])
        res = torch.load(out / "results.pt", weights_only=False)
    rows = []
    for key in w.SCENARIOS:
        batch, forced = res[f"{key}/batch"], res[f"{key}/forced"]
        ref_T, _ = ref.hf_logprobs(hf, batch)
        ref_replay_T, _ = ref.hf_logprobs(hf, batch, forced)
        rows.append(
            {
                "layout": names[key],
                "processes": w.WORLD_SIZE,
                "logprob_max_abs_diff": float(
                    (_whole(res[f"{key}/logprob_parts"], "logprobs") - ref_T).abs().max()
                ),
                "replay_logprob_max_abs_diff": float(
                    (_whole(res[f"{key}/replay_parts"], "logprobs") - ref_replay_T).abs().max()
                ),
                "sft_step_s": res[f"{key}/sft_step_s"],
                "rl_step_s": res[f"{key}/rl_step_s"],
            }
        )
    return rows


def replay_section() -> dict[str, Any] | None:
    """Routing mismatch and log-prob mismatch with and without replay, from
    ``benchmarks/moe_replay.py`` (written separately) when present: its ``run()`` result."""
    path = ROOT / "benchmarks" / "moe_replay.py"
    if not path.is_file():
        return None
    module = load_module("_benchmarks_moe_replay", path)
    run = getattr(module, "run", None)
    return run() if callable(run) else None


def main() -> None:
    """Measure every layout, print the table, write :data:`OUT`."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    ref = load_module("_rl_megatron_tests_moe_reference", TESTS / "_moe_reference.py")
    w = load_module("_rl_megatron_tests_moe_worker", TESTS / "_moe_worker.py")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ref.build_qwen3_moe_model(Path(tmp) / "qwen3_moe")
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        rows = [ep1_layout(w, model_dir, hf, ref), *parallel_layouts(w, model_dir, hf, ref)]
    print(f"{'layout':28} {'procs':>5} {'max|dlogp|':>11} {'replay':>11} {'sft s':>7} {'rl s':>7}")
    for r in rows:
        print(
            f"{r['layout']:28} {r['processes']:>5} {r['logprob_max_abs_diff']:>11.2e} "
            f"{r['replay_logprob_max_abs_diff']:>11.2e} {r['sft_step_s']:>7.3f} {r['rl_step_s']:>7.3f}"
        )
    replay = replay_section()
    if replay is None:
        print("routing replay mismatch: skipped (benchmarks/moe_replay.py not present)")
    result = {
        "model": "tiny Qwen3-MoE: 2 layers, hidden 32, 8 experts, top-2, fp32",
        "batch": {"sequences": len(w.LENGTHS), "tokens": sum(w.LENGTHS)},
        "device": "CPU (gloo), one thread per process",
        "layouts": rows,
        "routing_replay": replay,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
