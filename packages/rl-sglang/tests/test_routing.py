"""Mixture-of-experts routing from a real CPU SGLang server (``--enable-return-routed-experts``):
a tiny Qwen3-MoE served by SGLang, its recorded routing checked against transformers' router on
the same weights. One server for the module (about a minute to start)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from rl_core.routing import routing_mismatch
from rl_core.types import GenerationRequest, SamplingParams
from rl_sglang import SGLangGenerator

P = (5, 17, 42, 99, 3, 120, 64, 7, 250, 31, 11, 2)


@pytest.fixture(scope="module")
def moe_model(tiny_moe: Path) -> Path:
    """The tiny Qwen3-MoE checkpoint."""
    return tiny_moe


@pytest.fixture(scope="module")
def moe_gen(
    sglang_python: str,
    moe_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    sglang_forked_start: Callable[[], contextlib.AbstractContextManager[None]],
) -> Iterator[SGLangGenerator]:
    """A generator owning one CPU server of the MoE model with routing capture on (its
    scheduler forked from the launcher: root conftest's ``sglang_forked_start``)."""
    with sglang_forked_start():
        gen = SGLangGenerator(
            SGLangGenerator.Config(
                model_path=str(moe_model),
                python=sglang_python,
                log_dir=str(tmp_path_factory.mktemp("sglang-moe-logs")),
                server_args={"log_level": "warning", "max_total_tokens": 4096},
                capture_routing=True,
                health_interval_s=0,
            )
        )
    yield gen
    asyncio.run(gen.close())


def _hf_routing(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """``[S, L, K]`` top-k experts of transformers' router for every token of ``tokens``."""
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    return torch.stack([torch.topk(lg.float(), k, dim=-1).indices for lg in out.router_logits], 1)


def test_routing_covers_every_token_and_equals_hf_router(
    moe_gen: SGLangGenerator, moe_model: Path
) -> None:
    """Every result carries ``[P + R, L, K]`` uint8 expert ids (the last row repeats the one
    before: the last sampled token never ran), a request without ``return_routing`` carries none,
    and the recorded routing equals transformers' router top-k on the same weights for every
    (token, layer) of the prompt and the response."""
    assert moe_gen.supports_routing
    reqs = [
        GenerationRequest(
            request_id=f"r{i}",
            input_ids=P[: 4 + 2 * i],
            sampling=SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=()),
            return_routing=True,
        )
        for i in range(4)
    ]
    plain = GenerationRequest(
        request_id="plain", input_ids=P, sampling=SamplingParams(max_new_tokens=4)
    )
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(moe_model), dtype=torch.float32).eval()
    *results, no_routing = asyncio.run(moe_gen.generate([*reqs, plain]))
    assert no_routing.routed_experts is None
    mismatches = []
    for req, res in zip(reqs, results):
        tokens = list(req.input_ids + res.output_ids)
        r_SLK = res.routed_experts
        assert r_SLK is not None and r_SLK.dtype == torch.uint8
        assert tuple(r_SLK.shape) == (len(tokens), 2, 2)
        assert torch.equal(r_SLK[-1], r_SLK[-2])
        hf_SLK = _hf_routing(hf, tokens)
        # the last token never ran in SGLang: compare the rows the engine computed
        mismatches.append(routing_mismatch(r_SLK[:-1], hf_SLK[:-1]))
    print(f"routing mismatch SGLang-CPU vs HF router per request: {mismatches}")
    assert max(mismatches) == 0.0
    # The engine serves the model itself, not only its routers: the sampled tokens' log-probs
    # equal transformers' (an untied lm_head the engine left at random init was 4.6 nats off).
    diffs = []
    for req, res in zip(reqs, results):
        tokens = torch.tensor([list(req.input_ids + res.output_ids)])
        with torch.no_grad():
            logp_SV = torch.log_softmax(hf(tokens).logits[0].float(), -1)
        p, out = len(req.input_ids), torch.tensor(res.output_ids)
        hf_R = logp_SV[p - 1 : p - 1 + len(out)].gather(-1, out[:, None])[:, 0]
        diffs.append(float((hf_R - torch.tensor(res.output_logprobs)).abs().max()))
    print(f"max |logp SGLang-CPU - HF| per request: {diffs}")
    assert max(diffs) < 1e-3


def test_tied_qwen_moe_checkpoint_is_refused(tmp_path: Path) -> None:
    """SGLang 0.5.23 never ties the Qwen-MoE lm_head: a tied checkpoint is refused up front
    with the field and the fix; an untied one (and a dense tied model) passes."""
    import json

    from rl_core.errors import ConfigError
    from rl_sglang._routing import check_servable

    def model(**cfg) -> Path:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    with pytest.raises(ConfigError, match=r"model_path.*tie_word_embeddings=false"):
        check_servable(model(model_type="qwen3_moe", tie_word_embeddings=True))
    check_servable(model(model_type="qwen3_moe", tie_word_embeddings=False))
    check_servable(model(model_type="qwen2", tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="qwen3_moe"):
        SGLangGenerator(
            SGLangGenerator.Config(
                model_path=str(model(model_type="qwen3_moe", tie_word_embeddings=True))
            )
        )


def test_prefix_cached_prompt_tokens_keep_their_routing(moe_gen: SGLangGenerator) -> None:
    """A second request with the same prompt is served from the prefix cache and still gets
    routing for every prompt token, equal to the first request's."""
    req = GenerationRequest(
        request_id="a",
        input_ids=P,
        sampling=SamplingParams(max_new_tokens=3, temperature=0.0),
        return_routing=True,
    )
    first = asyncio.run(moe_gen.generate([req]))[0]
    again = asyncio.run(moe_gen.generate([req]))[0]
    assert first.routed_experts is not None and again.routed_experts is not None
    n = len(P)
    assert torch.equal(first.routed_experts[:n], again.routed_experts[:n])
    assert again.routed_experts.shape[0] == n + len(again.output_ids)


def test_routing_requests_bypass_the_router(moe_gen: SGLangGenerator) -> None:
    """Behind sglang-router (which drops ``return_routed_experts`` from what it forwards),
    requests asking for routing still get it, equal to the direct answer; others go through the
    router."""
    gen = SGLangGenerator(
        SGLangGenerator.Config(
            server_urls=tuple(moe_gen.server_urls),
            python=moe_gen.python,
            use_router=True,
            health_interval_s=0,
        )
    )
    try:
        assert gen.router_url is not None and gen.supports_routing
        req = GenerationRequest(
            request_id="via-router",
            input_ids=P,
            sampling=SamplingParams(max_new_tokens=4, temperature=0.0),
            return_routing=True,
        )
        (routed,) = asyncio.run(gen.generate([req]))
        (direct,) = asyncio.run(moe_gen.generate([req]))
        assert routed.routed_experts is not None and direct.routed_experts is not None
        assert routed.output_ids == direct.output_ids
        assert torch.equal(routed.routed_experts, direct.routed_experts)
        plain = GenerationRequest(request_id="plain", input_ids=P)
        assert asyncio.run(gen.generate([plain]))[0].routed_experts is None
    finally:
        asyncio.run(gen.close())


def test_fused_expert_weights_reach_the_served_experts(
    moe_gen: SGLangGenerator, moe_model: Path, tmp_path: Path
) -> None:
    """A policy's weights in transformers' in-memory naming (fused ``experts.gate_up_proj`` /
    ``down_proj``, as HFPolicy.named_weights yields them) update the served experts: after
    perturbing every expert, the engine's log-probs equal transformers' on the new weights
    (SGLang alone skips fused names with a warning; the experts then stay stale). A disk
    checkpoint with fused names is refused up front."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from rl_core.errors import WeightSyncError

    hf = AutoModelForCausalLM.from_pretrained(str(moe_model), dtype=torch.float32).eval()
    gen_ = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".mlp.experts." in name:
                p.add_(torch.randn(p.shape, generator=gen_) * 0.5)
    state = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    moe_gen.load_weights(state.items(), version=7)
    req = GenerationRequest(
        request_id="fused",
        input_ids=P,
        sampling=SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=()),
    )
    (res,) = asyncio.run(moe_gen.generate([req]))
    assert res.weight_version == 7
    tokens = torch.tensor([list(P + res.output_ids)])
    with torch.no_grad():
        logp_SV = torch.log_softmax(hf(tokens).logits[0].float(), -1)
    out = torch.tensor(res.output_ids)
    hf_R = logp_SV[len(P) - 1 : len(P) - 1 + len(out)].gather(-1, out[:, None])[:, 0]
    diff = float((hf_R - torch.tensor(res.output_logprobs)).abs().max())
    print(f"max |logp SGLang - HF| after a fused-expert update: {diff:.2e}")
    assert diff < 1e-3
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightSyncError, match="fused MoE expert tensors"):
        moe_gen.load_weights_from_disk(str(tmp_path), version=8)
    assert moe_gen.weight_version == 7
