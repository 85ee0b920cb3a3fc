"""SGLang weight push for SmolLM2-135M: seconds per push of every tensor to one CPU server.

The ``inprocess`` weight transport (the trainer's default) hands the new weights to
``SGLangGenerator.load_weights``; ``tensor_push`` picks how they reach the server:

- ``file`` (the default for servers on this host): one safetensors file written to a private
  ``/dev/shm`` directory, loaded by the server with ``/update_weights_from_disk``;
- ``inline`` (the only path before): pickled, base64 in the JSON body of
  ``/update_weights_from_tensor``.

One server is launched (``log_level: warning``); a generator attached to it per mode pushes a
perturbed copy of the model (new values every push, so every tensor changes), the modes
interleaved, ``--pushes`` times each. Parts: ``client_s`` is the client-side encoding alone
(safetensors write for ``file``, pickle + base64 for ``inline``) timed separately on the same
tensors, ``rest_s`` = push - client (HTTP, server-side decode/load, cache flush). After the last
push of each mode, the server's teacher-forced log-probs of a fixed chat prompt are compared with
transformers' on the pushed weights (``max_abs_logprob_diff``; fp32 server) and with the base
model's (``changed_by``), so a push that left a tensor stale shows.

``trainer_runs`` (skip with ``--no-trainer``): ``rl-train run smollm2_math`` with
``generator: {type: sglang}`` and the default ``inprocess`` transport for 3 RL steps (2 prompts x
4 samples, no eval), once per mode: the trainer's own ``perf/sync_time`` (publish, verify and
push) and ``perf/step_time`` per step.

Run: ``OMP_NUM_THREADS=1 python benchmarks/sglang_push.py [--pushes 3]``. Needs the SGLang venv
(``make sglang-env``) and the converted model (``make real-model``). Writes
``benchmarks/results/sglang_push_smollm2.json``. About 3 GB RSS for the server, 2 GB here;
2-4 minutes on two cores, plus 1-4 minutes per trainer run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from _results import write_results
from safetensors.torch import load_file, save_file

from rl_sglang import SGLangGenerator, _cpu_support

RESULTS = Path(__file__).with_name("results") / "sglang_push_smollm2.json"
MODEL = Path.home() / ".cache" / "rl-models" / "smollm2-135m-instruct"
MODES = ("file", "inline")


def perturbed(base: dict[str, torch.Tensor], seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every tensor plus N(0, 1e-3) noise (new values each seed)."""
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 1e-3 * torch.randn(t.shape, generator=g)) for n, t in base.items()]


def client_seconds(mode: str, named: list[tuple[str, torch.Tensor]]) -> float:
    """The client-side encoding of ``mode`` alone, on ``named``."""
    t0 = time.perf_counter()
    if mode == "file":
        with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
            save_file(dict(named), os.path.join(d, "model.safetensors"))
            return time.perf_counter() - t0
    blob = base64.b64encode(pickle.dumps(named, protocol=4)).decode()
    del blob
    return time.perf_counter() - t0


def served_logprobs(url: str, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs of ``ids[1:]`` from the server."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])


def reference_logprobs(model_dir: Path, weights: dict[str, torch.Tensor], ids: list[int]):
    """transformers' teacher-forced log-probs of ``ids[1:]`` with ``weights`` (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp


def trainer_run(mode: str, model: Path, steps: int = 3) -> dict[str, list[float]]:
    """``steps`` RL steps of ``smollm2_math`` on one SGLang server with ``tensor_push: mode``:
    the trainer's ``perf/sync_time`` and ``perf/step_time`` per step, and the 1-minute load
    average at the start."""
    gen = (
        "{type: sglang, num_servers: 1, max_concurrency: 64, "
        f"tensor_push: {mode}, server_args: {{log_level: warning}}}}"
    )
    with tempfile.TemporaryDirectory(prefix="sglang-push-run-") as run_dir:
        sets = {
            "run_dir": run_dir,
            "model.path": str(model),
            "rl.steps": str(steps),
            "eval.every": "0",
            "rollout.prompts_per_step": "2",
            "rollout.n_samples": "4",
            "logging.progress": "false",
            "generator": gen,
        }
        cmd = [sys.executable, "-m", "rl_trainer.cli", "run", "smollm2_math", "--no-report"]
        cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        load = os.getloadavg()[0]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(
                f"trainer run ({mode}) failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        rows = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/sync_time" in r]
    return {
        "sync_s": [round(r["perf/sync_time"], 2) for r in rows],
        "step_s": [round(r["perf/step_time"], 2) for r in rows],
        "loadavg_1m_start": [round(load, 2)],
    }


def main() -> None:
    """Launch one server, push ``--pushes`` times per mode (interleaved), print and write."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-trainer", action="store_true", help="skip the trainer runs")
    args = ap.parse_args()
    load_before = os.getloadavg()
    base = load_file(str(args.model / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.model))
    ids = list(
        tok.apply_chat_template(
            [{"role": "user", "content": "What is 7 plus 5? Answer briefly."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    t0 = time.perf_counter()
    owner = SGLangGenerator(
        SGLangGenerator.Config(
            model_path=str(args.model),
            python=str(_cpu_support.default_python()),
            log_dir=tempfile.mkdtemp(prefix="sglang-push-logs-"),
            server_args={"log_level": "warning"},
            health_interval_s=0,
        )
    )
    start_s = time.perf_counter() - t0
    url = owner.server_urls[0]
    gens = {
        m: SGLangGenerator(
            SGLangGenerator.Config(server_urls=(url,), health_interval_s=0, tensor_push=m)
        )
        for m in MODES
    }
    rows: dict[str, dict[str, list[float]]] = {
        m: {"push_s": [], "client_s": [], "loadavg_1m": []} for m in MODES
    }
    checks: dict[str, dict[str, float]] = {}
    version = 0
    try:
        base_lp = served_logprobs(url, ids)
        for i in range(args.pushes):
            for m in MODES:
                version += 1
                named = perturbed(base, seed=version)
                rows[m]["loadavg_1m"].append(os.getloadavg()[0])
                t = time.perf_counter()
                gens[m].load_weights(named, version=version)
                rows[m]["push_s"].append(time.perf_counter() - t)
                rows[m]["client_s"].append(client_seconds(m, named))
                print(
                    f"push {i + 1} {m:6s} {rows[m]['push_s'][-1]:7.2f} s "
                    f"(client {rows[m]['client_s'][-1]:.2f} s, load {rows[m]['loadavg_1m'][-1]:.1f})",
                    flush=True,
                )
                if i == args.pushes - 1:
                    got = served_logprobs(url, ids)
                    ref = reference_logprobs(args.model, dict(named), ids)
                    checks[m] = {
                        "max_abs_logprob_diff": float((got - ref).abs().max()),
                        "changed_by": float((got - base_lp).abs().max()),
                        "tokens": len(ids) - 1,
                    }
                del named
    finally:
        for g in gens.values():
            asyncio.run(g.close())
        asyncio.run(owner.close())
    modes = {}
    for m in MODES:
        r = rows[m]
        push, client = statistics.median(r["push_s"]), statistics.median(r["client_s"])
        modes[m] = {
            **{k: [round(x, 3) for x in v] for k, v in r.items()},
            "median_push_s": round(push, 3),
            "median_client_s": round(client, 3),
            "median_rest_s": round(push - client, 3),
            **checks[m],
        }
    print(f"\nSmolLM2-135M, {len(base)} tensors, {nbytes / 1e6:.0f} MB fp32, one CPU server")
    print(f"{'mode':8s} {'push s':>8s} {'client s':>9s} {'rest s':>8s} {'max |dlp|':>10s}")
    for m, r in modes.items():
        print(
            f"{m:8s} {r['median_push_s']:8.2f} {r['median_client_s']:9.2f} "
            f"{r['median_rest_s']:8.2f} {r['max_abs_logprob_diff']:10.2e}"
        )
    speedup = modes["inline"]["median_push_s"] / modes["file"]["median_push_s"]
    print(f"file is {speedup:.1f}x faster than inline")
    runs = {} if args.no_trainer else {m: trainer_run(m, args.model) for m in MODES}
    for m, r in runs.items():
        print(f"trainer, tensor_push {m}: sync {r['sync_s']} s, step {r['step_s']} s")
    write_results(
        args.out,
        {
            "model": str(args.model),
            "tensors": len(base),
            "bytes": nbytes,
            "dtype": "float32",
            "pushes_per_mode": args.pushes,
            "server_start_s": round(start_s, 1),
            "modes": modes,
            "inline_over_file": round(speedup, 2),
            "trainer_runs": runs,
        },
        load_before,
    )


if __name__ == "__main__":
    main()
