"""GPU numbers in one short run (``make bench-gpu``, under 8 minutes on one H100/H200).

Measured on a SmolLM2-135M model in bf16: the converted SmolLM2-135M-Instruct when
``rl-train convert --smollm2`` has written it (``$RL_MODELS_HOME``), else a random model of its
exact shape (30 layers; no download either way). Parts, each reported with the peak device
memory it reached (``torch.cuda.max_memory_allocated``, reset before the part):

- ``train_hf``: :class:`rl_hf.HFPolicy` optimizer steps (PPO loss, AdamW) on packed batches of
  ``--train-tokens`` tokens (sequences of ``--seq-len``): tokens/s and MFU, with
  ``6 * parameters * tokens`` FLOPs per step (attention's ``T^2`` term left out, so MFU is
  slightly under-stated) over the device's dense bf16 peak (H100/H200 SXM: 989 TFLOP/s);
- ``train_megatron``: the same on :class:`rl_megatron.MegatronPolicy` (TP=PP=DP=1), or the
  reason it could not run (e.g. megatron-core missing from the GPU environment);
- ``generate_hf``: :class:`rl_hf.HFGenerator` sampling ``--gen-requests`` requests of
  ``--gen-tokens`` new tokens each (EOS ignored): generated tokens/s;
- ``delta_apply``: the weight delta of one real optimizer step (XOR of the bf16 bytes, zstd,
  :mod:`rl_weightsync`'s codec), applied on the host and copied into the device's tensors:
  GB/s of model bytes, and the delta's size against the full model.

Without CUDA it prints one line and exits 0 (``--smoke`` runs every part on the CPU with a
one-layer model instead: the check ``make test`` runs). Writes
``benchmarks/results/gpu_<device>.json`` (or ``--out``) and prints a table.

Run: ``make bench-gpu`` or ``python benchmarks/gpu.py [--smoke] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _smollm2 import VOCAB, build_model

RESULTS = Path(__file__).with_name("results")
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "L40S": 362.0}
"""Dense bf16 peak of known devices (TFLOP/s), by a name fragment of the device."""


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of ``device_name`` (e.g. "NVIDIA H200"), ``None`` when unknown."""
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def model_dir(work: Path, layers: int, dtype: str) -> tuple[Path, str]:
    """The converted SmolLM2 if present (and ``layers`` is 30), else a random model of its shape
    with ``layers`` layers; and a label saying which."""
    if layers == 30:
        try:
            from rl_hf.convert import is_converted, models_home

            real = models_home() / "smollm2-135m-instruct"
            if is_converted(real):
                return real, "SmolLM2-135M-Instruct (converted)"
        except ImportError:
            pass
    out = build_model(work / f"smollm2_shape_{layers}l", layers, dtype)
    return out, f"random SmolLM2-135M shape, {layers} layers"


class Device:
    """Synchronisation and peak-memory bookkeeping of the device the parts run on."""

    def __init__(self, name: str) -> None:
        import torch

        self.torch = torch
        self.name = name
        self.cuda = name.startswith("cuda")

    def sync(self) -> None:
        """Wait for queued device work."""
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset_peak(self) -> None:
        """Start a part: free cached blocks and reset the peak counter."""
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gb(self) -> float | None:
        """Peak allocated device memory since :meth:`reset_peak` (GB), ``None`` on the CPU."""
        return self.torch.cuda.max_memory_allocated() / 1e9 if self.cuda else None


def _timed(fn: Callable[[], Any], dev: Device, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    dev.sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        dev.sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _train_batch(tokens: int, seq_len: int, seed: int) -> Any:
    import torch

    from rl_core.algorithms import compute_loss_weights
    from rl_core.testing.policy import random_batch

    lengths = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    batch = random_batch(VOCAB, lengths, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    adv_T = torch.randn(batch.num_tokens, generator=gen) * batch.loss_mask
    weights_T = compute_loss_weights(batch.loss_mask, batch.cu_seqlens, mode="token")
    return dataclasses.replace(batch, advantages=adv_T, loss_weights=weights_T)


def train_part(policy: Any, args: argparse.Namespace, dev: Device, peak: float | None) -> dict:
    """Optimizer steps of ``policy``: tokens/s, MFU, peak memory."""
    from rl_core.algorithms import PolicyLoss

    n_params = sum(p.numel() for p in policy.model.parameters())
    batch = _train_batch(args.train_tokens, args.seq_len, seed=0)
    loss_fn = PolicyLoss()
    seconds = _timed(lambda: policy.train_step(batch, loss_fn), dev, args.repeats)
    tokens_per_s = batch.num_tokens / seconds
    tflops = 6 * n_params * tokens_per_s / 1e12
    return {
        "parameters": n_params,
        "tokens_per_step": batch.num_tokens,
        "step_s": seconds,
        "tokens_per_s": tokens_per_s,
        "model_tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_memory_gb": dev.peak_gb(),
    }


def run_train_hf(path: Path, args: argparse.Namespace, dev: Device, peak: float | None) -> dict:
    """``train_hf``: the HF policy in bf16 (fp32 on the CPU smoke run)."""
    from rl_hf import HFPolicy

    dev.reset_peak()
    policy = HFPolicy(
        HFPolicy.Config(
            model_path=str(path), device=dev.name, dtype=args.dtype, logprob_chunk_tokens=4096
        )
    )
    try:
        return train_part(policy, args, dev, peak)
    finally:
        del policy


def run_train_megatron(
    path: Path, args: argparse.Namespace, dev: Device, peak: float | None
) -> dict:
    """``train_megatron``: the Megatron-core policy, or why it could not run."""
    try:
        from rl_megatron import MegatronPolicy
    except ImportError as e:
        return {"skipped": f"rl_megatron/megatron-core not importable: {e}"}
    dev.reset_peak()
    try:
        policy = MegatronPolicy(MegatronPolicy.Config(model_path=str(path), dtype=args.dtype))
    except Exception as e:  # a benchmark reports what failed and goes on
        return {"skipped": f"MegatronPolicy could not start: {type(e).__name__}: {e}"[:500]}
    try:
        return train_part(policy, args, dev, peak)
    finally:
        del policy


def run_generate(path: Path, args: argparse.Namespace, dev: Device) -> dict:
    """``generate_hf``: sampled tokens/s of the HF generator (EOS ignored)."""
    from rl_core.types import GenerationRequest, SamplingParams
    from rl_hf import HFGenerator

    dev.reset_peak()
    gen = HFGenerator(
        HFGenerator.Config(
            model_path=str(path),
            device=dev.name,
            dtype=args.dtype,
            max_batch_size=args.gen_requests,
            stop_on_eos=False,
        )
    )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.gen_tokens, seed=0)
    requests = [
        GenerationRequest(
            request_id=f"r{i}", input_ids=tuple(range(10 + i, 42 + i)), sampling=sampling
        )
        for i in range(args.gen_requests)
    ]
    produced = []

    def once() -> None:
        results = asyncio.run(gen.generate(requests))
        produced.append(sum(len(r.output_ids) for r in results))

    seconds = _timed(once, dev, args.repeats)
    out = {
        "requests": args.gen_requests,
        "new_tokens_per_request": args.gen_tokens,
        "generated_tokens": produced[-1],
        "seconds": seconds,
        "tokens_per_s": produced[-1] / seconds,
        "peak_memory_gb": dev.peak_gb(),
    }
    return out


def run_delta(path: Path, args: argparse.Namespace, dev: Device) -> dict:
    """``delta_apply``: one real step's bf16 XOR delta, applied on the host and copied to the
    device tensors; GB/s of model bytes."""
    import numpy as np
    import torch

    from rl_core.algorithms import PolicyLoss
    from rl_hf import HFPolicy
    from rl_weightsync._codec import decode_delta, encode_delta

    dev.reset_peak()
    policy = HFPolicy(HFPolicy.Config(model_path=str(path), device=dev.name, dtype=args.dtype))

    def host_bytes() -> dict[str, np.ndarray]:
        return {
            n: t.detach().to("cpu", torch.bfloat16).reshape(-1).view(torch.uint8).numpy().copy()
            for n, t in policy.named_weights()
        }

    old = host_bytes()
    policy.train_step(_train_batch(min(args.train_tokens, 2048), args.seq_len, 3), PolicyLoss())
    new = host_bytes()
    blobs = {n: encode_delta(old[n], new[n], itemsize=2, encoding="xor") for n in old}
    targets = {n: torch.from_numpy(old[n].copy()).view(torch.bfloat16).to(dev.name) for n in old}
    work = {n: old[n].copy() for n in old}

    def apply() -> None:
        for n, blob in blobs.items():
            buf = work[n]
            np.copyto(buf, old[n])
            if blob is not None:
                decode_delta(buf, blob, itemsize=2, encoding="xor", out=buf)
            targets[n].copy_(torch.from_numpy(buf).view(torch.bfloat16), non_blocking=False)

    seconds = _timed(apply, dev, args.repeats)
    model_bytes = sum(a.nbytes for a in old.values())
    ok = all(torch.equal(targets[n].cpu().view(torch.uint8), torch.from_numpy(new[n])) for n in new)
    return {
        "model_gb": model_bytes / 1e9,
        "delta_gb": sum(len(b) for b in blobs.values() if b is not None) / 1e9,
        "apply_s": seconds,
        "apply_gb_per_s": model_bytes / 1e9 / seconds,
        "applied_equals_new": ok,
        "peak_memory_gb": dev.peak_gb(),
    }


def table(result: dict) -> str:
    """The printed summary of ``result``."""
    rows = [f"{'part':16s} {'figure':>22s}  {'peak GB':>8s}  detail"]
    for part, r in result["parts"].items():
        pk = r.get("peak_memory_gb")
        pk_s = f"{pk:8.2f}" if pk is not None else f"{'-':>8s}"
        if "skipped" in r:
            rows.append(f"{part:16s} {'skipped':>22s}  {pk_s}  {r['skipped'][:80]}")
        elif part.startswith("train"):
            mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
            fig = f"{r['tokens_per_s']:,.0f} tok/s"
            rows.append(f"{part:16s} {fig:>22s}  {pk_s}  {r['step_s']:.3f} s/step{mfu}")
        elif part == "generate_hf":
            fig = f"{r['tokens_per_s']:,.0f} tok/s"
            rows.append(
                f"{part:16s} {fig:>22s}  {pk_s}  {r['requests']} x {r['new_tokens_per_request']}"
            )
        else:
            fig = f"{r['apply_gb_per_s']:.2f} GB/s"
            ratio = r["delta_gb"] / r["model_gb"]
            rows.append(f"{part:16s} {fig:>22s}  {pk_s}  delta/full {ratio:.3f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Command line; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="every part on the CPU, 1 layer")
    ap.add_argument("--train-tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--gen-requests", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="train_hf,train_megatron,generate_hf,delta_apply")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    if args.smoke:
        device, layers, args.dtype = "cpu", 1, "float32"
        args.train_tokens, args.seq_len = 256, 64
        args.gen_requests, args.gen_tokens, args.repeats = 4, 8, 1
    elif not torch.cuda.is_available():
        print("bench-gpu: no CUDA device (torch.cuda.is_available() is False); nothing measured.")
        return 0
    else:
        device, layers, args.dtype = "cuda", 30, "bfloat16"
    dev = Device(device)
    name = torch.cuda.get_device_name(0) if dev.cuda else platform.processor() or "cpu"
    peak = peak_tflops(name) if dev.cuda else None
    parts = [p for p in args.parts.split(",") if p]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path, label = model_dir(Path(tmp), layers, args.dtype)
        result: dict[str, Any] = {
            "device": name,
            "model": label,
            "dtype": args.dtype,
            "peak_bf16_tflops": peak,
            "torch": torch.__version__,
            "parts": {},
        }
        runners = {
            "train_hf": lambda: run_train_hf(path, args, dev, peak),
            "train_megatron": lambda: run_train_megatron(path, args, dev, peak),
            "generate_hf": lambda: run_generate(path, args, dev),
            "delta_apply": lambda: run_delta(path, args, dev),
        }
        for part in parts:
            if part not in runners:
                print(f"--parts: unknown {part!r}; choose from {', '.join(runners)}")
                return 2
            t0 = time.perf_counter()
            result["parts"][part] = runners[part]()
            result["parts"][part]["wall_s"] = time.perf_counter() - t0
    result["total_wall_s"] = time.perf_counter() - t_start
    print(table(result))
    print(f"total {result['total_wall_s']:.1f} s on {name}")
    out = args.out or RESULTS / f"gpu_{'smoke' if args.smoke else name.split()[-1].lower()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
