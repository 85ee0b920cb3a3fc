"""Peak memory of one training step at long packed context: chunked vs full-logits log-probs.

A model with SmolLM2-135M's shape (Llama: hidden 576, MLP 1536, 9 query / 3 key-value heads,
tied embeddings, vocabulary 49152) and random weights is built from its config (no download;
``--layers`` may be fewer than the real 30 to fit the machine, and the JSON says how many). One
training step of :class:`rl_hf.HFPolicy` on a packed batch of ``T`` tokens (sequences of
``--seq-len`` tokens) is measured: the log-prob + entropy pass with gradients, a policy-gradient
style loss on both, and backward (no optimizer step). Each configuration runs in its own
subprocess:

- CPU: the peak resident set size during the step minus the resident size just before it (the
  kernel's peak is reset first through ``/proc/self/clear_refs``, so model building does not
  count; ``ru_maxrss`` where that is unavailable);
- CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated`` during the step minus the
  memory allocated before it.

``chunked`` is ``logprob_chunk_tokens=1024``, ``unchunked`` is 0 (the model's own
``[T, V]`` logits). Where an unchunked case is skipped (``--max-unchunked``, to fit the host),
its value is extrapolated linearly from the measured ones and marked ``"extrapolated"``;
``--extrapolate`` adds lengths not run at all (both paths extrapolated, marked likewise).

Run: ``OMP_NUM_THREADS=1 python benchmarks/memory.py [--device cuda] [--layers 30]``. Writes
``benchmarks/results/memory.json`` (or ``--out``). Not a test.

This measures the log-prob pass's growth with context only (no optimizer step, no optimizer
state, the step's delta above the RSS before it). The whole full fine-tuning step's peak RSS per
configuration, beside the floor (weights + gradients + Adam state), is
``benchmarks/memory_floor.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smollm2 import SMOLLM2_135M, VOCAB, build_model

RESULTS = Path(__file__).with_name("results") / "memory.json"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_one(
    model_dir: str, tokens: int, chunk: int, seq_len: int, device: str, checkpointing: bool = False
) -> dict:
    """Peak bytes of one step (this process); see the module docstring."""
    import dataclasses
    import gc

    import torch

    from rl_core.testing.policy import random_batch
    from rl_hf import HFPolicy

    dtype = json.loads((Path(model_dir) / "config.json").read_text()).get("dtype", "float32")
    policy = HFPolicy(
        HFPolicy.Config(
            model_path=model_dir,
            device=device,
            dtype="bfloat16" if "bfloat16" in str(dtype) else "float32",
            logprob_chunk_tokens=chunk,
            activation_checkpointing=checkpointing,
        )
    )

    def step_inputs(n: int) -> tuple[Any, Any]:
        lengths = [seq_len] * (n // seq_len) + ([n % seq_len] if n % seq_len else [])
        batch = random_batch(VOCAB, lengths, seed=0)
        gen = torch.Generator().manual_seed(1)
        adv_T = torch.randn(batch.num_tokens, generator=gen) * batch.loss_mask
        batch = dataclasses.replace(batch, loss_weights=batch.loss_mask / batch.loss_mask.sum())
        return policy._on_device(batch), adv_T.to(policy.device)

    def step(batch: Any, adv_T: Any) -> None:
        logp_T, ent_T = policy._packed_logprobs(batch, with_entropy=True)
        weights_T = batch.loss_weights
        loss = -(logp_T * adv_T * weights_T).sum() - 0.01 * (ent_T * weights_T).sum()
        loss.backward()

    # Warm-up on a short batch: libraries' pages and kernels' workspaces are touched once
    # here, not counted in the step (gradients are dropped again, so the step allocates them).
    step(*step_inputs(min(tokens, 256)))
    policy.model.zero_grad(set_to_none=True)
    batch, adv_T = step_inputs(tokens)
    gc.collect()
    cuda = policy.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        reset = _reset_peak_rss()
        before = _rss_bytes() if reset else _peak_rss_bytes()
    start = time.perf_counter()
    step(batch, adv_T)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _peak_rss_bytes() - before
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "chunk": chunk, "peak_bytes": int(peak), "seconds": seconds}


def _run_child(model_dir: Path, tokens: int, chunk: int, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        f"{model_dir},{tokens},{chunk}",
        "--seq-len",
        str(args.seq_len),
        "--device",
        args.device,
    ] + (["--activation-checkpointing"] if args.activation_checkpointing else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"tokens": tokens, "chunk": chunk, "error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _extrapolate(points: list[tuple[int, int]], tokens: int) -> int:
    """Least-squares line through (tokens, bytes), evaluated at ``tokens``."""
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(b for _, b in points) / n
    sxx = sum((t - mx) ** 2 for t, _ in points)
    slope = sum((t - mx) * (b - my) for t, b in points) / sxx
    return int(my + slope * (tokens - mx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (SmolLM2-135M: 30)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--lengths", default="4096,16384,32768", help="packed tokens per step")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per packed sequence")
    ap.add_argument(
        "--max-unchunked",
        type=int,
        default=1 << 30,
        help="skip unchunked runs above this many tokens (extrapolated instead)",
    )
    ap.add_argument(
        "--extrapolate",
        default="",
        help="also report these lengths, extrapolated linearly from the measured ones",
    )
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute decoder layers in backward (both paths), so the LM head's logits are what "
        "differs; without it a deep model's activations dominate at long context",
    )
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        model_dir, tokens, chunk = args.one.split(",")
        res = measure_one(
            model_dir,
            int(tokens),
            int(chunk),
            args.seq_len,
            args.device,
            args.activation_checkpointing,
        )
        print(json.dumps(res))
        return

    lengths = [int(x) for x in args.lengths.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args.layers, args.dtype)
        for tokens in lengths:
            row: dict[str, Any] = {"tokens": tokens}
            for name, chunk in (("chunked", 1024), ("unchunked", 0)):
                if name == "unchunked" and tokens > args.max_unchunked:
                    continue
                res = _run_child(model_dir, tokens, chunk, args)
                if "error" in res:
                    print(f"{name} {tokens}: failed\n{res['error']}", file=sys.stderr)
                    row[f"{name}_error"] = res["error"][-300:]
                    continue
                row[f"{name}_bytes"] = res["peak_bytes"]
                row[f"{name}_seconds"] = round(res["seconds"], 2)
            rows.append(row)
    measured = [(r["tokens"], r["unchunked_bytes"]) for r in rows if "unchunked_bytes" in r]
    measured_c = [(r["tokens"], r["chunked_bytes"]) for r in rows if "chunked_bytes" in r]
    for tokens in [int(x) for x in args.extrapolate.split(",") if x]:
        if len(measured_c) >= 2:
            rows.append(
                {
                    "tokens": tokens,
                    "chunked_bytes": _extrapolate(measured_c, tokens),
                    "chunked_extrapolated": True,
                }
            )
    for r in rows:
        if "unchunked_bytes" not in r and len(measured) >= 2:
            r["unchunked_bytes"] = _extrapolate(measured, r["tokens"])
            r["unchunked_extrapolated"] = True
        if "unchunked_bytes" in r and "chunked_bytes" in r:
            r["ratio"] = round(r["chunked_bytes"] / r["unchunked_bytes"], 4)
    chunked = [
        (r["tokens"], r["chunked_bytes"])
        for r in rows
        if "chunked_bytes" in r and not r.get("chunked_extrapolated")
    ]
    per_token = [round(b / t) for t, b in chunked]
    result = {
        "what": "peak memory of one HFPolicy step (log-probs + entropy with grad, loss, "
        "backward; no optimizer step), chunked (1024 tokens) vs unchunked",
        "model": {**SMOLLM2_135M, "num_hidden_layers": args.layers, "weights": "random"},
        "layers_note": f"{args.layers} of SmolLM2-135M's 30 decoder layers",
        "dtype": args.dtype,
        "activation_checkpointing": args.activation_checkpointing,
        "device": args.device,
        "measure": "torch.cuda.max_memory_allocated - allocated before"
        if args.device.startswith("cuda")
        else "peak RSS (VmHWM, reset by clear_refs) - RSS before the step",
        "seq_len": args.seq_len,
        "host": platform.node(),
        "rows": rows,
        "chunked_bytes_per_token": per_token,
    }
    print(f"{'tokens':>7} {'chunked MB':>11} {'unchunked MB':>13} {'ratio':>6}")
    for r in rows:
        un = r.get("unchunked_bytes")
        mark = "*" if r.get("unchunked_extrapolated") else " "
        cmark = "*" if r.get("chunked_extrapolated") else " "
        print(
            f"{r['tokens']:>7} {r.get('chunked_bytes', 0) / 1e6:>10.0f}{cmark} "
            f"{(un or 0) / 1e6:>12.0f}{mark} {r.get('ratio', float('nan')):>6.3f}"
        )
    print("* extrapolated linearly from the measured lengths")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
