"""Rollout throughput: the reference generator, SGLang (CPU) and transformers' ``model.generate``.

One GRPO-shaped batch: 16 chat prompts x 8 samples x 32 new tokens (temperature 1, no top-k/top-p,
exactly 32 tokens per sample: EOS is disabled in both), on the same tiny random model, one thread.
Both sides return per-token log-probs: ``HFGenerator`` natively, ``generate`` through
``output_scores`` plus a ``log_softmax`` gather (counted in its time).

Rows:
- ``HFGenerator (1 call)``: one ``generate`` call with all 128 requests;
- ``HFGenerator (128 calls)``: 128 concurrent single-request calls (how a ``GenerateFn`` uses it);
- ``SGLang CPU (1 server)``: ``SGLangGenerator`` on one real SGLang 0.5.23 server (CPU, stub CUDA
  driver, torch-native attention, float32, ``ignore_eos``), all 128 requests in one call over
  HTTP (token ids in, token ids and log-probs out). Its CPU time is spent in the server
  processes, so the ``CPU s`` column (this process only) is not comparable and left empty;
- ``transformers generate``: ``model.generate(do_sample=True, output_scores=True, ...)``.

The server takes about a minute to start (not timed). ``--no-sglang`` skips its row (e.g. where
``packages/rl-sglang/scripts/setup_sglang_env.sh`` has not been run).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/rollout.py [--hidden 64] [--trials 5] [--no-sglang]

Prints a table and writes ``benchmarks/results/rollout.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    """Run the benchmark and write the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=64, help="model width (2 layers)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-sglang", action="store_true", help="skip the SGLang row")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollout.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from rl_core.types import GenerationRequest, SamplingParams
    from rl_hf import TinyModelSpec, build_tiny_model
    from rl_hf._hf import quiet_progress
    from rl_hf.generator import HFGenerator

    tmp = tempfile.mkdtemp(prefix="rollout_bench_")
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_heads=max(1, args.hidden // 16),
        num_kv_heads=max(1, args.hidden // 32),
        intermediate_size=2 * args.hidden,
    )
    path = build_tiny_model(Path(tmp) / "model", spec)
    gen = HFGenerator(
        HFGenerator.Config(model_path=str(path), max_batch_size=1024, stop_on_eos=False)
    )
    tok = gen.tokenizer
    with quiet_progress():
        hf_model = AutoModelForCausalLM.from_pretrained(path).eval()

    topics = [
        "add 17 and 25",
        "name a prime",
        "spell cat",
        "reverse abc",
        "count to five",
        "what is 3*7",
        "say hi",
        "capital of France",
        "sort 3 1 2",
        "double 21",
        "is 9 odd",
        "a colour",
        "an animal",
        "2+2=",
        "first letter of dog",
        "negate 4",
    ]
    prompts = []
    for i in range(args.prompts):
        text = tok.apply_chat_template(
            [{"role": "user", "content": topics[i % len(topics)]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts.append(tok.encode(text, add_special_tokens=False))
    n = args.prompts * args.samples
    T = args.new_tokens
    reqs = [
        GenerationRequest(
            request_id=f"p{i // args.samples}-s{i % args.samples}",
            input_ids=tuple(prompts[i // args.samples]),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=T, seed=i),
        )
        for i in range(n)
    ]

    sgl = None
    if not args.no_sglang:
        from rl_sglang import SGLangGenerator

        sgl = SGLangGenerator(
            SGLangGenerator.Config(
                model_path=str(path),
                stop_on_eos=False,
                max_concurrency=1024,
                health_interval_s=0,
                server_args={"log_level": "warning"},
            )
        )

    def run_sglang() -> int:
        assert sgl is not None
        res = asyncio.run(sgl.generate(reqs))
        return sum(len(r.output_ids) for r in res)

    def run_ours_one_call() -> int:
        res = asyncio.run(gen.generate(reqs))
        return sum(len(r.output_ids) for r in res)

    def run_ours_many_calls() -> int:
        async def go() -> list[Any]:
            return await asyncio.gather(*(gen.generate([q]) for q in reqs))

        return sum(len(r.output_ids) for (r,) in asyncio.run(go()))

    # transformers generate: left-padded batch of all samples.
    L = max(len(p) for p in prompts)
    ids_BL = torch.full((n, L), tok.pad_token_id, dtype=torch.long)
    mask_BL = torch.zeros((n, L), dtype=torch.long)
    for i in range(n):
        p = prompts[i // args.samples]
        ids_BL[i, L - len(p) :] = torch.tensor(p)
        mask_BL[i, L - len(p) :] = 1

    def run_hf_generate() -> int:
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=ids_BL,
                attention_mask=mask_BL,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=T,
                min_new_tokens=T,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id,
            )
            new_BT = out.sequences[:, L:]
            scores_BTV = torch.stack(out.scores, 1)
            logp_BT = torch.log_softmax(scores_BTV.float(), -1).gather(2, new_BT[..., None])[..., 0]
            _ = logp_BT.tolist(), new_BT.tolist()
        return int(new_BT.numel())

    rows = []
    for name, fn in [
        ("HFGenerator (1 call)", run_ours_one_call),
        (
            "HFGenerator (128 calls)" if n == 128 else f"HFGenerator ({n} calls)",
            run_ours_many_calls,
        ),
        *([("SGLang CPU (1 server)", run_sglang)] if sgl is not None else []),
        ("transformers generate", run_hf_generate),
    ]:
        fn()  # warm-up
        times, cpu, tokens = [], [], 0
        for _ in range(args.trials):
            t0, c0 = time.perf_counter(), time.process_time()
            tokens = fn()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        med = statistics.median(times)
        rows.append(
            {
                "name": name,
                "tokens": tokens,
                "median_s": med,
                "best_s": min(times),
                "tokens_per_s_median": tokens / med,
                "tokens_per_s_best": tokens / min(times),
                "times_s": times,
                "cpu_s_median": None if fn is run_sglang else statistics.median(cpu),
                "cpu_s_best": None if fn is run_sglang else min(cpu),
            }
        )

    base = next(r for r in rows if r["name"] == "transformers generate")["median_s"]
    print(
        f"\nGRPO batch: {args.prompts} prompts x {args.samples} samples x {T} new tokens; "
        f"qwen2 h{args.hidden} 2 layers, vocab 260, {args.threads} thread(s), {args.trials} trials"
    )
    print(
        f"{'generator':<26}{'s/batch (median)':>18}{'best':>9}{'tok/s (median)':>16}"
        f"{'tok/s (best)':>14}{'CPU s (best)':>14}{'speed-up':>10}"
    )
    for r in rows:
        cpu_s = "" if r["cpu_s_best"] is None else f"{r['cpu_s_best']:.4f}"
        print(
            f"{r['name']:<26}{r['median_s']:>18.4f}{r['best_s']:>9.4f}"
            f"{r['tokens_per_s_median']:>16.0f}{r['tokens_per_s_best']:>14.0f}"
            f"{cpu_s:>14}{base / r['median_s']:>9.2f}x"
        )
    print("speed-up: median wall seconds of transformers generate / those of the row. CPU s is")
    print("process CPU time, less sensitive than wall time to other jobs on a shared machine")
    print("(empty for SGLang: its work runs in the server processes).")
    result = {
        "benchmark": "rollout",
        "config": vars(args) | {"model": f"qwen2 h{args.hidden} L2 vocab260"},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "loadavg": os.getloadavg(),
        },
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    asyncio.run(gen.close())
    if sgl is not None:
        asyncio.run(sgl.close())


if __name__ == "__main__":
    main()
