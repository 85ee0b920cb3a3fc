"""``HFGenerator.generate`` with ``fast_decode`` on and off, on the demo-size model.

The model is the demo recipe's (qwen2, hidden 128, 2 layers, 4 heads / 2 kv heads, MLP 512,
vocab 260, random weights). Two GRPO-shaped batches: 32 prompts x 8 samples = 256 rows x 12 new
tokens, and 8 prompts x 8 samples = 64 rows x 8 new tokens; prompts of 16-32 random tokens
(left-padded), temperature 0.7, EOS disabled so every row makes all its tokens. One thread.
Trials alternate on/off (the order flips each trial) so a shared machine's drift hits both;
the table gives medians of the whole ``generate`` call, of its prefill and decode phases
(``last_batch_stats``: ``prefill_s`` includes packing the prompts and the per-row state) and
tokens/s of the call.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/fast_decode.py [--trials 7]

Prints a table and writes ``benchmarks/results/fast_decode.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    """Run the benchmark and write the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fast_decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from rl_core.types import GenerationRequest, SamplingParams
    from rl_hf import TinyModelSpec, build_tiny_model
    from rl_hf.generator import HFGenerator

    spec = TinyModelSpec(
        hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "demo", spec)
        gens = {
            fast: HFGenerator(
                HFGenerator.Config(
                    model_path=str(path), max_batch_size=256, fast_decode=fast, stop_on_eos=False
                )
            )
            for fast in (True, False)
        }
    assert gens[True]._lean is not None
    rng = random.Random(0)

    def batch(prompts: int, samples: int, new: int) -> list[GenerationRequest]:
        ids = [
            tuple(rng.randrange(3, 250) for _ in range(rng.randint(16, 32))) for _ in range(prompts)
        ]
        return [
            GenerationRequest(
                request_id=f"p{p}s{s}",
                input_ids=ids[p],
                sampling=SamplingParams(temperature=0.7, max_new_tokens=new, seed=p * 100 + s),
            )
            for p in range(prompts)
            for s in range(samples)
        ]

    def timed(gen: Any, reqs: list[GenerationRequest]) -> tuple[float, dict, list[Any]]:
        async def go() -> Any:
            return await gen.generate(reqs)

        gen.last_batch_stats = {}
        t0 = time.perf_counter()
        res = asyncio.run(go())
        elapsed = time.perf_counter() - t0
        while "decode_s" not in gen.last_batch_stats:  # set just after the last row is posted
            time.sleep(0.001)
        return elapsed, gen.last_batch_stats, res

    rows = []
    for prompts, samples, new in ((32, 8, 12), (8, 8, 8)):
        reqs = batch(prompts, samples, new)
        for fast in (True, False):  # warm-up
            timed(gens[fast], reqs)
        call: dict[bool, list[float]] = {True: [], False: []}
        dec: dict[bool, list[float]] = {True: [], False: []}
        pre: dict[bool, list[float]] = {True: [], False: []}
        outs: dict[bool, Any] = {}
        for trial in range(args.trials):
            for fast in (True, False) if trial % 2 == 0 else (False, True):
                c, stats, outs[fast] = timed(gens[fast], reqs)
                call[fast].append(c)
                dec[fast].append(stats["decode_s"])
                pre[fast].append(stats["prefill_s"])
        same = [r.output_ids for r in outs[True]] == [r.output_ids for r in outs[False]]
        n_tok = len(reqs) * new
        for fast in (True, False):
            med = statistics.median(call[fast])
            rows.append(
                {
                    "rows": len(reqs),
                    "new_tokens": new,
                    "fast_decode": fast,
                    "call_ms": 1e3 * med,
                    "prefill_ms": 1e3 * statistics.median(pre[fast]),
                    "decode_ms": 1e3 * statistics.median(dec[fast]),
                    "tokens_per_s": n_tok / med,
                    "trials_ms": [round(1e3 * x, 2) for x in call[fast]],
                    "same_tokens": same,
                }
            )

    print(
        f"{'rows':>5} {'new':>4} {'fast':>5} {'call ms':>9} {'prefill ms':>11} {'decode ms':>10} "
        f"{'tok/s':>8}"
    )
    for r in rows:
        print(
            f"{r['rows']:>5} {r['new_tokens']:>4} {r['fast_decode']!s:>5} {r['call_ms']:>9.1f} "
            f"{r['prefill_ms']:>11.1f} {r['decode_ms']:>10.1f} {r['tokens_per_s']:>8.0f}"
        )
    for size in sorted({r["rows"] for r in rows}, reverse=True):
        on, off = (
            next(r for r in rows if r["rows"] == size and r["fast_decode"] is f)
            for f in (True, False)
        )
        print(
            f"{size} rows: call {off['call_ms'] / on['call_ms']:.2f}x, prefill "
            f"{off['prefill_ms'] / on['prefill_ms']:.2f}x, decode "
            f"{off['decode_ms'] / on['decode_ms']:.2f}x faster; same tokens: {on['same_tokens']}"
        )
    out = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "trials": args.trials,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
