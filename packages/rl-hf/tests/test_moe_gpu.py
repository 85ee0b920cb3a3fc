"""GPU only: routing record and replay on CUDA, engine in bf16 and trainer in fp32 (the
measurable case of rl_hf's routing replay on the device it is meant for)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.routing import routing_mismatch
from rl_core.testing.policy import pack_sequences
from rl_core.types import GenerationRequest, SamplingParams
from rl_hf import TINY_MOE, HFGenerator, HFPolicy, build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_engine_fp32_trainer_replay_on_cuda(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "moe", TINY_MOE)
    gen = HFGenerator(HFGenerator.Config(model_path=str(path), device="cuda", dtype="bfloat16"))
    reqs = [
        GenerationRequest(
            request_id=f"r{i}",
            input_ids=tuple(range(3 + i, 20 + 2 * i)),
            sampling=SamplingParams(max_new_tokens=24, temperature=1.0, seed=i),
            return_routing=True,
        )
        for i in range(8)
    ]

    async def go():
        try:
            return await gen.generate(reqs)
        finally:
            await gen.close()

    results = asyncio.run(go())
    policy = HFPolicy(HFPolicy.Config(model_path=str(path), device="cuda"))
    seqs = [torch.tensor(r.input_ids + x.output_ids) for r, x in zip(reqs, results, strict=True)]
    batch = pack_sequences(seqs)
    engine_TLK = torch.cat([x.routed_experts for x in results])
    assert engine_TLK.shape == (batch.tokens.shape[0], TINY_MOE.num_layers, TINY_MOE.moe_top_k)
    plain = policy.compute_logprobs(batch)
    assert routing_mismatch(plain.routed_experts.cpu(), engine_TLK) < 0.5
    # Replaying the trainer's own routing changes nothing; replaying the engine's runs and
    # moves the log-probs only where the routing differs.
    own = policy.compute_logprobs(dataclasses.replace(batch, routed_experts=plain.routed_experts))
    assert torch.equal(own.logprobs, plain.logprobs)
    replay = policy.compute_logprobs(dataclasses.replace(batch, routed_experts=engine_TLK))
    assert torch.isfinite(replay.logprobs).all()
    # A training step with replay on CUDA.
    from rl_core.testing.policy import sft_loss

    metrics = policy.train_step(dataclasses.replace(batch, routed_experts=engine_TLK), sft_loss)
    assert metrics["grad_norm"] > 0
