"""Routing replay on a tiny Qwen3-MoE: how much the engine's routing and log-probs differ from the
trainer's, without and with replay.

The engine (``rl_hf.HFGenerator``) and the trainer (``rl_hf.HFPolicy``, float32) hold the same
weights. The engine is made to route differently on purpose, as a real inference kernel does:

- ``bf16``: the engine runs in bfloat16 (its router logits are rounded);
- ``noise``: float32 engine with Gaussian noise of std ``--noise`` on every router logit;
- ``bf16+noise``: both.

For each case the engine samples ``--prompts`` prompts x ``--samples`` samples with
``return_routing``, then the trainer computes log-probs of the same tokens once without replay and
once replaying the engine's routing. Reported:

- ``routing_mismatch``: fraction of (token, layer) pairs whose expert set the trainer's router
  picks differently from the engine, over the tokens that predict a response token (the
  positions whose routing directly yields a trained log-prob; each was run by the engine). With
  replay the experts used are the engine's, so the mismatch of the experts *used* is 0 by
  construction; the test asserts it from the policy's forward (see ``used_mismatch``);
- ``logprob_mismatch``: mean |trainer - engine| log-prob over response tokens;
- ``bytes_per_token``: the routing payload per token (``layers x top_k x itemsize``).

Run: ``python benchmarks/moe_replay.py`` (about 20 s on 2 CPU cores); writes
``benchmarks/results/moe_replay.json``. ``--model DIR`` measures a trained model instead (e.g. a
``moe_demo`` run's ``final_model``; its routing is sharper than the random tiny model's).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rl_core.routing import RoutingShape, routing_bytes_per_token, routing_mismatch
from rl_core.testing.policy import pack_sequences
from rl_core.types import GenerationRequest, SamplingParams
from rl_hf import TINY_MOE, HFGenerator, HFPolicy, build_tiny_model

RESULTS = Path(__file__).parent / "results" / "moe_replay.json"


def _measure(model_dir: Path, policy: HFPolicy, case: str, args: argparse.Namespace) -> dict:
    dtype = "bfloat16" if "bf16" in case else "float32"
    noise = args.noise if "noise" in case else 0.0
    gen = HFGenerator(
        HFGenerator.Config(model_path=str(model_dir), dtype=dtype, router_logit_noise_std=noise)
    )
    g = torch.Generator().manual_seed(args.seed)
    vocab = int(policy.model.config.vocab_size)
    reqs = []
    for p in range(args.prompts):
        prompt = tuple(torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist())
        for s in range(args.samples):
            reqs.append(
                GenerationRequest(
                    request_id=f"p{p}s{s}",
                    input_ids=prompt,
                    sampling=SamplingParams(
                        max_new_tokens=args.max_new_tokens, temperature=1.0, seed=p * 100 + s
                    ),
                    return_routing=True,
                )
            )

    async def run() -> list:
        try:
            return await gen.generate(reqs)
        finally:
            await gen.close()

    results = asyncio.run(run())
    seqs = [torch.tensor(r.input_ids + x.output_ids) for r, x in zip(reqs, results, strict=True)]
    batch = pack_sequences(seqs)
    engine_TLK = torch.cat([x.routed_experts for x in results])
    # Positions t whose output is the log-prob of a response token t + 1.
    predicts_T = torch.zeros(batch.tokens.shape[0], dtype=torch.bool)
    resp_T = torch.zeros_like(predicts_T)
    engine_lp = []
    cu = batch.cu_seqlens.tolist()
    for i, (req, res) in enumerate(zip(reqs, results, strict=True)):
        start = cu[i] + len(req.input_ids)
        resp_T[start : cu[i + 1]] = True
        predicts_T[start - 1 : cu[i + 1] - 1] = True
        engine_lp.extend(res.output_logprobs)
    engine_lp_R = torch.tensor(engine_lp)

    t0 = time.perf_counter()
    plain = policy.compute_logprobs(batch)
    t1 = time.perf_counter()
    replay_batch = dataclasses.replace(batch, routed_experts=engine_TLK)
    replay = policy.compute_logprobs(replay_batch)
    t2 = time.perf_counter()
    # The experts the trainer actually used under replay, read from its MoE layers' inputs.
    used: list[torch.Tensor] = []

    def grab(module: Any, inputs: Any, output: Any) -> None:
        used.append(inputs[1].detach())

    hooks = [layer.mlp.experts.register_forward_hook(grab) for layer in policy.model.model.layers]
    try:
        policy.compute_logprobs(replay_batch)
    finally:
        for h in hooks:
            h.remove()
    used_TLK = torch.stack(used, dim=1)
    shape = RoutingShape(
        num_layers=engine_TLK.shape[1],
        top_k=engine_TLK.shape[2],
        num_experts=int(policy.model.config.num_experts),
    )
    return {
        "case": case,
        "engine_dtype": dtype,
        "router_logit_noise_std": noise,
        "sequences": len(seqs),
        "response_tokens": int(resp_T.sum()),
        "routing_mismatch_no_replay": routing_mismatch(
            engine_TLK, plain.routed_experts, predicts_T
        ),
        "routing_mismatch_replay_used": routing_mismatch(engine_TLK, used_TLK, predicts_T),
        "logprob_mismatch_no_replay": float((plain.logprobs[resp_T] - engine_lp_R).abs().mean()),
        "logprob_mismatch_replay": float((replay.logprobs[resp_T] - engine_lp_R).abs().mean()),
        "logprob_max_abs_no_replay": float((plain.logprobs[resp_T] - engine_lp_R).abs().max()),
        "logprob_max_abs_replay": float((replay.logprobs[resp_T] - engine_lp_R).abs().max()),
        "bytes_per_token": routing_bytes_per_token(shape),
        "logprob_pass_s_no_replay": t1 - t0,
        "logprob_pass_s_replay": t2 - t1,
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--noise", type=float, default=0.5, help="router logit noise std")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a Qwen3-MoE directory (e.g. a moe_demo run's final_model); default: TINY_MOE, random",
    )
    return ap


def measure(args: argparse.Namespace) -> dict:
    """Run every case and print the table; the result (what :func:`main` writes)."""
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "moe", TINY_MOE)
        policy = HFPolicy(HFPolicy.Config(model_path=str(model_dir)))
        rows = [_measure(model_dir, policy, c, args) for c in ("bf16", "noise", "bf16+noise")]
    cfg = policy.model.config
    head = (
        f"{'case':<11} {'route mism':>10} {'(replay)':>9} {'|dlogp| no':>11} "
        f"{'|dlogp| replay':>15} {'bytes/tok':>9}"
    )
    print(
        f"Qwen3-MoE {args.model or 'TINY_MOE (random)'} ({cfg.num_experts} experts, "
        f"top-{cfg.num_experts_per_tok}, {cfg.num_hidden_layers} layers); trainer fp32"
    )
    print(head)
    for r in rows:
        print(
            f"{r['case']:<11} {r['routing_mismatch_no_replay']:>10.4f} "
            f"{r['routing_mismatch_replay_used']:>9.4f} {r['logprob_mismatch_no_replay']:>11.2e} "
            f"{r['logprob_mismatch_replay']:>15.2e} {r['bytes_per_token']:>9d}"
        )
    return {
        "model": str(args.model) if args.model else dataclasses.asdict(TINY_MOE),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "cases": rows,
    }


def run(argv: list[str] | None = None) -> dict:
    """Measure with the command-line defaults (or ``argv``) without writing a file: the
    routing-replay section of ``benchmarks/moe.py``."""
    return measure(_parser().parse_args(argv or []))


def main() -> None:
    """Run every case, print the table and write :data:`RESULTS` (``--out``)."""
    args = _parser().parse_args()
    out = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
