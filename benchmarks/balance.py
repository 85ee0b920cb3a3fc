"""Data-parallel balancing benchmark: how evenly each method spreads one step's FLOPs over ranks.

For several length distributions, data-parallel sizes 2-64, token caps, two model shapes and two
step sizes it compares:

- ``round_robin``: sample ``i`` to rank ``i % dp``;
- ``token_balance``: balance token counts across ranks (our scheduler with cost = tokens);
- ``slime_pack_first``: slime's ``--balance-by-flops`` path: ``K = ceil(tokens / cap)``
  micro-batches partitioned by FLOPs with Karmarkar-Karp (may exceed the cap), the count aligned
  to a multiple of ``dp`` by splitting the largest bin, then whole micro-batches to ranks by
  equal-size Karmarkar-Karp;
- ``slime_first_fit``: slime's default dynamic batch with ``--balance-data``: first-fit packing
  in sample order under the cap, the same alignment, equal-size Karmarkar-Karp over bins;
- ``ours``: :func:`rl_buffer.balance.schedule_step` (sample-level balance, then packing).

All methods but the slime ones pack each rank with the same packer, so only the split differs.
``imbalance_flops`` = most loaded rank / ``max(total / dp, largest sample)`` (the lower bound).
Also reported: micro-batches per rank, micro-batches over the cap (with more than one sample),
and the scheduling time. A separate timing run schedules 10k samples.

Run: ``OMP_NUM_THREADS=1 python benchmarks/balance.py [--quick]``. Prints a table and writes
``benchmarks/results/balance.json`` (not with ``--quick``). Takes about 3 minutes on 2 busy
cores. Not a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import numpy as np

from rl_buffer.balance import (
    karmarkar_karp_partition,
    pack_micro_batches,
    schedule_step,
)
from rl_buffer.flops import estimate_flops_array
from rl_core.types import ModelShape

RESULTS = Path(__file__).with_name("results") / "balance.json"
WORSE = 1e-6
"""Relative margin above a baseline's imbalance that counts as worse."""

SHAPES = {
    "dense_8b": ModelShape(
        num_layers=36,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=12288,
        vocab_size=151936,
    ),
    "moe_30b_a3b": ModelShape(
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_size=6144,
        vocab_size=151936,
        num_experts=128,
        moe_top_k=8,
        moe_ffn_hidden_size=768,
    ),
}


def lengths(dist: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Sequence lengths (prompt + response tokens) of one step."""
    if dist == "uniform":
        x = rng.integers(256, 8192, n)
    elif dist == "lognormal":
        x = np.exp(rng.normal(np.log(1000), 1.0, n))
        x = np.clip(x, 32, 32768)
    elif dist == "bimodal":
        long = rng.random(n) < 0.2
        x = np.where(long, rng.normal(12000, 2000, n), rng.normal(400, 100, n))
        x = np.clip(x, 32, 32768)
    elif dist == "rl_responses":
        # prompts of 100-600 tokens; responses log-normal with a spike at the 8k length limit
        prompt = rng.integers(100, 600, n)
        resp = np.clip(np.exp(rng.normal(np.log(1500), 0.8, n)), 16, 8192)
        resp = np.where(rng.random(n) < 0.2, 8192, resp)
        x = prompt + resp
    else:
        raise ValueError(dist)
    return np.asarray(x, dtype=np.int64)


# -- methods: each returns (rank of every sample, micro-batches per rank, micro-batches over cap)


def _pack_ranks(rank_of: np.ndarray, tok: np.ndarray, dp: int, cap: int) -> tuple[int, int]:
    per = [np.flatnonzero(rank_of == r).tolist() for r in range(dp)]
    free = [pack_micro_batches(ix, tok, cap) for ix in per]
    k = max(len(b) for b in free)
    packed = [pack_micro_batches(ix, tok, cap, num_bins=k) for ix in per]
    over = sum(1 for bins in packed for b in bins if len(b) > 1 and tok[b].sum() > cap)
    return k, over


def round_robin(tok, flops, dp, cap, shape):
    """(a) Sample ``i`` to rank ``i % dp``, then the common packer."""
    rank_of = np.arange(len(tok)) % dp
    return (rank_of, *_pack_ranks(rank_of, tok, dp, cap))


def token_balance(tok, flops, dp, cap, shape):
    """(b) Balance token counts (our scheduler with cost = tokens)."""
    plan = schedule_step(tok, dp_size=dp, max_tokens_per_micro_batch=cap, costs=tok)
    return _plan_result(plan, len(tok), tok, cap)


def ours(tok, flops, dp, cap, shape):
    """(d) :func:`schedule_step` on estimated FLOPs."""
    plan = schedule_step(tok, dp_size=dp, max_tokens_per_micro_batch=cap, shape=shape)
    return _plan_result(plan, len(tok), tok, cap)


def _plan_result(plan, n, tok, cap):
    rank_of = np.empty(n, dtype=np.int64)
    for r in range(plan.dp_size):
        rank_of[plan.rank_samples(r)] = r
    over = sum(
        1 for bins in plan.micro_batches for b in bins if len(b) > 1 and tok[list(b)].sum() > cap
    )
    return rank_of, plan.num_micro_batches, over


def _align_and_distribute(bins: list[list[int]], tok, flops, dp):
    """slime: split the largest multi-sample bin (token-balanced halves) until the bin count is a
    multiple of dp, then equal-size Karmarkar-Karp of bin FLOPs onto ranks."""
    while len(bins) % dp:
        multi = [j for j, b in enumerate(bins) if len(b) > 1]
        if not multi:
            bins.append([])
            continue
        j = max(multi, key=lambda j: tok[bins[j]].sum())
        big = sorted(bins.pop(j), key=lambda i: -tok[i])
        halves, hl = [[], []], [0, 0]
        for i in big:
            h = 0 if hl[0] <= hl[1] else 1
            halves[h].append(i)
            hl[h] += tok[i]
        bins += halves
    bin_flops = np.array([flops[b].sum() if b else 0.0 for b in bins])
    bin_rank = karmarkar_karp_partition(bin_flops, dp, equal_size=True)
    rank_of = np.empty(len(tok), dtype=np.int64)
    for b, r in zip(bins, bin_rank):
        rank_of[b] = r
    return rank_of, len(bins) // dp


def slime_pack_first(tok, flops, dp, cap, shape):
    """(c) slime ``--balance-by-flops``: KK of FLOPs into ``ceil(tokens / cap)`` bins (cap not
    enforced), align to ``dp``, equal-size KK of bins onto ranks."""
    k = max(1, int(-(-tok.sum() // cap)))
    assign = karmarkar_karp_partition(flops, k)
    bins = [np.flatnonzero(assign == b).tolist() for b in range(k)]
    bins = [b for b in bins if b]
    over = sum(1 for b in bins if len(b) > 1 and tok[b].sum() > cap)
    rank_of, per_rank = _align_and_distribute(bins, tok, flops, dp)
    return rank_of, per_rank, over


def slime_first_fit(tok, flops, dp, cap, shape):
    """(c') slime default dynamic batch: first fit in sample order under the cap, align,
    equal-size KK of bins onto ranks."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i, t in enumerate(tok.tolist()):
        for j, load in enumerate(loads):
            if load + t <= cap:
                bins[j].append(i)
                loads[j] += t
                break
        else:
            bins.append([i])
            loads.append(t)
    rank_of, per_rank = _align_and_distribute(bins, tok, flops, dp)
    return rank_of, per_rank, 0


METHODS = {
    "round_robin": round_robin,
    "token_balance": token_balance,
    "slime_first_fit": slime_first_fit,
    "slime_pack_first": slime_pack_first,
    "ours": ours,
}


def run_case(dist, n, dp, cap, shape_name, seed):
    """Every method on one generated step; imbalance against the lower bound."""
    rng = np.random.default_rng(seed)
    tok = lengths(dist, n, rng)
    shape = SHAPES[shape_name]
    flops = estimate_flops_array(tok, shape)
    lower = max(flops.sum() / dp, flops.max())
    out = {"dist": dist, "n": n, "dp": dp, "cap": cap, "shape": shape_name, "methods": {}}
    for name, fn in METHODS.items():
        t0 = time.perf_counter()
        rank_of, per_rank, over = fn(tok, flops, dp, cap, shape)
        dt = time.perf_counter() - t0
        loads = np.bincount(rank_of, weights=flops, minlength=dp)
        assert np.array_equal(np.sort(np.bincount(rank_of, minlength=dp).cumsum())[-1:], [n])
        out["methods"][name] = {
            "imbalance_flops": float(loads.max() / lower),
            "micro_batches_per_rank": int(per_rank),
            "micro_batches_over_cap": int(over),
            "time_ms": dt * 1e3,
        }
    return out


def timing(n: int, dp: int, reps: int = 5) -> dict:
    """Best-of-``reps`` wall time of :func:`schedule_step` on ``n`` log-normal samples."""
    rng = np.random.default_rng(123)
    tok = lengths("lognormal", n, rng)
    best = np.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        plan = schedule_step(
            tok, dp_size=dp, max_tokens_per_micro_batch=16384, shape=SHAPES["dense_8b"]
        )
        best = min(best, time.perf_counter() - t0)
    return {"n": n, "dp": dp, "best_ms": best * 1e3, "imbalance_flops": plan.imbalance}


def main() -> None:
    """Run all cases, print the table, write the JSON results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases, nothing written (smoke run)")
    args = ap.parse_args()
    # over-cap samples are expected in the long-tail cases; their per-call warning is noise here
    logging.getLogger("rl_buffer.balance").setLevel(logging.ERROR)
    dists = ["uniform", "lognormal", "bimodal", "rl_responses"]
    dps = [2, 8, 64] if args.quick else [2, 4, 8, 16, 32, 64]
    caps = [16384] if args.quick else [16384, 32768]
    ns = [256] if args.quick else [256, 2048]
    shapes = ["dense_8b"] if args.quick else list(SHAPES)
    cases = []
    seed = 0
    for shape in shapes:
        for dist in dists:
            for n in ns:
                for dp in dps:
                    for cap in caps:
                        cases.append(run_case(dist, n, dp, cap, shape, seed))
                        seed += 1

    summary = {}
    for name in METHODS:
        imb = np.array([c["methods"][name]["imbalance_flops"] for c in cases])
        t = np.array([c["methods"][name]["time_ms"] for c in cases])
        summary[name] = {
            "median_imbalance": float(np.median(imb)),
            "p90_imbalance": float(np.quantile(imb, 0.9)),
            "max_imbalance": float(imb.max()),
            "median_time_ms": float(np.median(t)),
            "cases_over_cap": int(
                sum(c["methods"][name]["micro_batches_over_cap"] > 0 for c in cases)
            ),
        }
    # "worse" = more than one part per million above the baseline (smaller differences are the
    # floating-point noise of where the local search stops)
    for base in ("token_balance", "slime_pack_first", "slime_first_fit", "round_robin"):
        excess = [
            c["methods"]["ours"]["imbalance_flops"] / c["methods"][base]["imbalance_flops"] - 1
            for c in cases
        ]
        summary["ours"][f"cases_worse_than_{base}"] = int(sum(e > WORSE for e in excess))
        summary["ours"][f"max_excess_over_{base}"] = float(max(excess))
    timings = [timing(10_000, dp) for dp in (8, 64)]

    print(f"{len(cases)} cases: dists {dists}, n {ns}, dp {dps}, caps {caps}, shapes {shapes}")
    print(f"{'method':18} {'median':>9} {'p90':>9} {'max':>9} {'t_med ms':>9} {'over-cap':>9}")
    for name, s in summary.items():
        print(
            f"{name:18} {s['median_imbalance']:9.4f} {s['p90_imbalance']:9.4f} "
            f"{s['max_imbalance']:9.4f} {s['median_time_ms']:9.2f} {s['cases_over_cap']:9d}"
        )
    print(
        f"ours worse (by > {WORSE:g}) than: "
        + ", ".join(
            f"{k.removeprefix('cases_worse_than_')} {v}"
            for k, v in summary["ours"].items()
            if k.startswith("cases_worse_than_")
        )
    )
    print("per dp (median imbalance):")
    for dp in dps:
        row = [c for c in cases if c["dp"] == dp]
        print(
            f"  dp={dp:3d} "
            + " ".join(
                f"{name}={np.median([c['methods'][name]['imbalance_flops'] for c in row]):.4f}"
                for name in METHODS
            )
        )
    for t in timings:
        print(
            f"schedule {t['n']} samples, dp={t['dp']}: {t['best_ms']:.1f} ms "
            f"(best of 5), imbalance {t['imbalance_flops']:.6f}"
        )
    if args.quick:
        print("--quick: smoke run, results not written")
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": {"python": platform.python_version(), "platform": platform.platform()},
                "lower_bound": "max(total_flops / dp, largest sample flops)",
                "summary": summary,
                "timing_10k": timings,
                "cases": cases,
            },
            indent=1,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
