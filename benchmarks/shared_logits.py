"""Log-probs from the compact row of shared prefixes on the full-logits path, at a real
vocabulary size.

With ``HFPolicy.Config.share_prefix`` the model runs on a compact row of ``C`` tokens (each
group's prompt once). ``compact`` (the policy today) scores the LM head's ``[C, V]`` logits in
place: log-sum-exp and entropy once per compact row, gathered per packed token
(``token_logprobs(..., rows_T=expand_T)``). ``expanded`` (the policy before) first copies them
to ``[T, V]`` with ``index_select`` and scores every packed token's row. Case: a random qwen2
(hidden 128, 2 layers, vocabulary 32 000), 8 groups x 8 samples, 96 prompt + 32 response tokens
(``T`` = 8192, ``C`` = 2816), one ``compute_logprobs`` with entropy and one ``train_step`` per
iteration, 1 torch thread, each variant a fresh process, variants alternating per round.

Run: ``OMP_NUM_THREADS=1 python benchmarks/shared_logits.py [--quick]``: prints a table and
writes ``benchmarks/results/shared_logits.json`` (not with ``--quick``). About 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_results

RESULTS = Path(__file__).with_name("results") / "shared_logits.json"
VARIANTS = ("expanded", "compact")
VOCAB, GROUPS, SAMPLES, PROMPT, RESPONSE = 32_000, 8, 8, 96, 32


def build_model(path: Path) -> None:
    """A random 32k-vocabulary qwen2 with the tiny tokenizer's files (ids stay below 260)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rl_hf import build_tiny_model

    build_tiny_model(path)  # tokenizer files; the model is replaced below
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def run_variant(variant: str, model: Path, iters: int) -> dict[str, Any]:
    """The worker: ``iters`` iterations of one variant; seconds per iteration and peak RSS."""
    import torch

    import rl_hf.policy as hf_policy
    from rl_core.batching import pack_sequences
    from rl_core.testing.policy import sft_loss
    from rl_hf import HFPolicy

    torch.set_num_threads(1)
    if variant == "expanded":
        score = hf_policy.token_logprobs

        def expanded(logits: Any, tokens: Any, starts: Any, *, rows_T: Any = None, **kw: Any):
            if rows_T is not None:
                logits = logits.index_select(0, rows_T)
            return score(logits, tokens, starts, **kw)

        hf_policy.token_logprobs = expanded
    policy = HFPolicy(HFPolicy.Config(model_path=str(model), lr=1e-4))
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(GROUPS):
        prompt = torch.randint(0, VOCAB, (PROMPT,), generator=gen)
        for _ in range(SAMPLES):
            seqs.append(torch.cat([prompt, torch.randint(0, VOCAB, (RESPONSE,), generator=gen)]))
    batch = pack_sequences(seqs)
    mask_T = torch.zeros_like(batch.loss_mask)
    for start in batch.cu_seqlens[:-1].tolist():
        mask_T[start + PROMPT : start + PROMPT + RESPONSE] = 1.0
    batch.loss_mask, batch.loss_weights, batch.advantages = mask_T, mask_T / mask_T.sum(), mask_T
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = policy.compute_logprobs(batch, with_entropy=True)
        metrics = policy.train_step(batch, sft_loss)
        times.append(time.perf_counter() - t0)
    return {
        "variant": variant,
        "tokens": int(batch.tokens.shape[0]),
        "s_per_iter": times,
        "logp_sum": float(out.logprobs.sum()),
        "loss": float(metrics["loss"]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    """Run both variants in alternating fresh processes, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="one round of 2 iterations; no JSON")
    ap.add_argument(
        "--worker", nargs=3, metavar=("VARIANT", "MODEL", "ITERS"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.worker:
        variant, model, iters = args.worker
        print(json.dumps(run_variant(variant, Path(model), int(iters))))
        return
    rounds, iters = (1, 2) if args.quick else (args.rounds, args.iters)
    load_before = os.getloadavg()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="shared_logits_") as tmp:
        model = Path(tmp) / "model"
        build_model(model)
        for r in range(rounds):
            for variant in VARIANTS:
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", variant, str(model), str(iters)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if out.returncode != 0:
                    raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
                rows.append({"round": r, **json.loads(out.stdout.strip().splitlines()[-1])})
    skip = min(2, iters - 1)  # the first iterations warm up allocators
    print(f"vocab {VOCAB}, {GROUPS}x{SAMPLES} samples, {PROMPT}+{RESPONSE} tokens, 1 thread")
    print(f"{'variant':>9} {'s/iter (median after warm-up), per round':>42} {'peak RSS MB':>12}")
    for variant in VARIANTS:
        mine = [x for x in rows if x["variant"] == variant]
        med = [sorted(x["s_per_iter"][skip:])[len(x["s_per_iter"][skip:]) // 2] for x in mine]
        for x, m in zip(mine, med):
            x["s_per_iter_median"] = m
        print(
            f"{variant:>9} {', '.join(f'{m:.2f}' for m in med):>42} "
            f"{max(x['peak_rss_mb'] for x in mine):>12.0f}"
        )
    if args.quick:
        print("--quick: smoke run, results not written")
        return
    write_results(
        RESULTS,
        {
            "benchmark": "shared_logits",
            "case": {
                "vocab": VOCAB,
                "groups": GROUPS,
                "samples": SAMPLES,
                "prompt": PROMPT,
                "response": RESPONSE,
            },
            "rows": rows,
        },
        load_before,
    )


if __name__ == "__main__":
    main()
