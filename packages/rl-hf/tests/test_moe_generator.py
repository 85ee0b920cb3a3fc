"""HFGenerator on a tiny Qwen3-MoE: generation, the routing record, router-logit noise."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.errors import ConfigError
from rl_core.routing import routing_dtype, routing_mismatch
from rl_core.testing.policy import pack_sequences
from rl_core.types import GenerationRequest, GenerationResult, SamplingParams
from rl_hf import TINY_MOE, HFGenerator, HFPolicy, TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen3moe"), TINY_MOE)


@pytest.fixture(scope="module")
def policy(moe_dir: Path) -> HFPolicy:
    return HFPolicy(HFPolicy.Config(model_path=str(moe_dir)))


def _requests(routing: bool = True) -> list[GenerationRequest]:
    # Different prompt lengths (left padding), a shared prompt (one prefill for two rows) and
    # different lengths (rows end at different steps, the batch is compacted).
    prompts = [tuple(range(3, 9)), tuple(range(5, 16)), tuple(range(3, 9)), (7, 8, 9)]
    return [
        GenerationRequest(
            request_id=f"r{i}",
            input_ids=p,
            sampling=SamplingParams(max_new_tokens=4 + 3 * i, seed=i, temperature=1.0),
            return_routing=routing and i != 3,
        )
        for i, p in enumerate(prompts)
    ]


def _generate(gen: HFGenerator, reqs: list[GenerationRequest]) -> list[GenerationResult]:
    async def go() -> list[GenerationResult]:
        try:
            return await gen.generate(reqs)
        finally:
            await gen.close()

    return asyncio.run(go())


def _policy_routing(policy: HFPolicy, reqs, results) -> list[torch.Tensor]:
    seqs = [torch.tensor(r.input_ids + x.output_ids) for r, x in zip(reqs, results, strict=True)]
    batch = pack_sequences(seqs)
    own = policy.compute_logprobs(batch).routed_experts
    cu = batch.cu_seqlens.tolist()
    return [own[cu[i] : cu[i + 1]] for i in range(len(seqs))]


def test_routing_record_is_the_routers_choice_for_every_token(
    moe_dir: Path, policy: HFPolicy
) -> None:
    reqs = _requests()
    gen = HFGenerator(HFGenerator.Config(model_path=str(moe_dir), compact_fraction=0.25))
    results = _generate(gen, reqs)
    own = _policy_routing(policy, reqs, results)
    for req, res, own_SLK in zip(reqs, results, own, strict=True):
        if not req.return_routing:
            assert res.routed_experts is None
            continue
        routed = res.routed_experts
        assert routed is not None
        n = len(req.input_ids) + len(res.output_ids)
        assert tuple(routed.shape) == (n, TINY_MOE.num_layers, TINY_MOE.moe_top_k)
        assert routed.dtype == routing_dtype(TINY_MOE.num_experts)
        # The last sampled token never ran through the model: its row repeats the one before.
        assert torch.equal(routed[-1], routed[-2])
        # Every token the engine ran (prompt included) was routed as the trainer routes it (fp32,
        # same weights): the record is the router's own top-k, not something recomputed.
        assert routing_mismatch(routed[:-1], own_SLK[:-1]) == 0.0


def test_router_noise_changes_the_engine_routing(moe_dir: Path, policy: HFPolicy) -> None:
    reqs = _requests()
    cfg = HFGenerator.Config(model_path=str(moe_dir), router_logit_noise_std=1.0)
    results = _generate(HFGenerator(cfg), reqs)
    own = _policy_routing(policy, reqs, results)
    mism = [
        routing_mismatch(res.routed_experts[:-1], own_SLK[:-1])
        for req, res, own_SLK in zip(reqs, results, own, strict=True)
        if req.return_routing
    ]
    assert max(mism) > 0.05


def test_dense_model_refuses_routing_and_noise(tmp_path: Path) -> None:
    dense = build_tiny_model(tmp_path / "dense", TinyModelSpec(hidden_size=32))
    gen = HFGenerator(HFGenerator.Config(model_path=str(dense)))
    with pytest.raises(ConfigError, match="rollout.routing_replay"):
        _generate(gen, _requests()[:1])
    with pytest.raises(ConfigError, match="router_logit_noise_std"):
        HFGenerator(HFGenerator.Config(model_path=str(dense), router_logit_noise_std=0.5))
