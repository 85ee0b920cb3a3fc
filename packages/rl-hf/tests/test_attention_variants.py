"""Models whose attention is more than causal. Sliding windows (Mistral on every layer, Qwen2's
sliding layers): HFPolicy's packed attention gives the model's own log-probs in both packed
layouts, with and without shared prefixes, and HFGenerator (fast decode or not) generates the
model's own greedy tokens with log-probs the policy reproduces. Logit soft-capping (Gemma 2)
and attention sinks (gpt-oss) are refused under ``sdpa``; ``eager`` is exact."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.errors import ConfigError
from rl_core.testing.policy import shared_prompt_batch
from rl_core.types import GenerationRequest, SamplingParams, TrainBatch
from rl_hf import HFGenerator, HFPolicy, build_tiny_model
from rl_hf import _packed_attention as packed

VOCAB = 260  # the tiny tokenizer's
WINDOW = 5


def _model_dir(root: Path, model_type: str, **extra: Any) -> Path:
    """A random 2-layer model of ``model_type`` with the tiny tokenizer (vocabulary 260)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    build_tiny_model(root)  # the tokenizer files; the model is replaced
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    return root


def _own_logprobs(path: Path, batch) -> torch.Tensor:
    """Each sequence through the model alone (eager attention, its own masks): log-probs [T]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    out = []
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for a, b in itertools.pairwise(cu):
            seq = batch.tokens[a:b]
            logp = torch.log_softmax(model(input_ids=seq[None]).logits[0].float(), -1)
            out.append(torch.cat([torch.zeros(1), logp[:-1].gather(1, seq[1:, None])[:, 0]]))
    return torch.cat(out)


SLIDING = [
    ("mistral", {"sliding_window": WINDOW}),
    (
        "qwen2",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": WINDOW,
            "use_sliding_window": True,
        },
    ),
    (
        "gemma3_text",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 16,
        },
    ),
]


@pytest.mark.parametrize(
    ("model_type", "extra"), SLIDING, ids=["mistral", "qwen2-mixed-layers", "gemma3"]
)
@pytest.mark.parametrize("fast", [True, False], ids=["fast-decode", "transformers"])
def test_generator_with_sliding_windows_decodes_as_the_model(
    tmp_path: Path, model_type: str, extra: dict, fast: bool
) -> None:
    """Prompts of 6-8 tokens and 10 new ones (past the 5-token window), batched with padding:
    greedy tokens are those of the model run on the whole sequence at every step, and sampled
    tokens' log-probs are the policy's (Mistral failed here before: the cache trimmed itself to
    the window while the generator's own causal mask did not)."""
    path = _model_dir(tmp_path / model_type, model_type, **extra)
    prompts = [tuple(range(10 + i, 16 + 2 * i)) for i in range(3)]

    async def run(temperature: float) -> list:
        gen = HFGenerator(HFGenerator.Config(model_path=str(path), fast_decode=fast, seed=3))
        try:
            return await gen.generate(
                [
                    GenerationRequest(
                        request_id=f"r{i}",
                        input_ids=p,
                        sampling=SamplingParams(temperature=temperature, max_new_tokens=10),
                    )
                    for i, p in enumerate(prompts)
                ]
            )
        finally:
            await gen.close()

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    for prompt, res in zip(prompts, asyncio.run(run(0.0)), strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(10):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert res.output_ids == tuple(ids[len(prompt) :])
    sampled = asyncio.run(run(1.0))
    seqs = [torch.tensor(p + r.output_ids) for p, r in zip(prompts, sampled, strict=True)]
    lengths = torch.tensor([len(x) for x in seqs])
    cu_N1 = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    mask_T = torch.cat([torch.cat([torch.zeros(len(p)), torch.ones(10)]) for p in prompts])
    batch = TrainBatch(
        tokens=torch.cat(seqs),
        cu_seqlens=cu_N1,
        loss_mask=mask_T,
        loss_weights=mask_T / mask_T.sum(),
        advantages=mask_T,
    )
    logp_T = HFPolicy(HFPolicy.Config(model_path=str(path))).compute_logprobs(batch).logprobs
    engine_R = torch.tensor([x for r in sampled for x in r.output_logprobs])
    torch.testing.assert_close(logp_T[mask_T > 0], engine_R, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("model_type", "extra"), SLIDING, ids=["mistral", "qwen2-mixed-layers", "gemma3"]
)
@pytest.mark.parametrize("mode", ["pad", "mask"])
@pytest.mark.parametrize("share", [False, True], ids=["unshared", "shared"])
def test_sliding_window_logprobs_are_the_model_s_own(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model_type: str,
    extra: dict,
    mode: str,
    share: bool,
) -> None:
    path = _model_dir(tmp_path / model_type, model_type, **extra)
    build = packed.PackingInfo.build
    monkeypatch.setattr(
        packed.PackingInfo,
        "build",
        staticmethod(lambda *a, **kw: build(*a, **{**kw, "mode": mode})),
    )
    batch = shared_prompt_batch(
        VOCAB, [(6, [9, 4, 12]), (3, [14]), (8, [2, 10])], seed=1
    )  # up to 17 > 5
    policy = HFPolicy(HFPolicy.Config(model_path=str(path), share_prefix=share))
    got = policy.compute_logprobs(batch).logprobs
    want = _own_logprobs(path, batch)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    # the window matters here: full causal attention gives other log-probs
    from transformers import AttentionInterface

    def windowless(*args: Any, **kw: Any) -> Any:
        kw.pop("sliding_window", None)
        return packed.packed_sdpa_forward(*args, **kw)

    AttentionInterface.register(packed.ATTN_NAME, windowless)
    try:
        full = policy.compute_logprobs(batch).logprobs
    finally:
        packed.register_packed_attention()
    assert (full - want).abs().max() > 1e-3


def test_attention_sinks_are_refused_under_sdpa(tmp_path: Path) -> None:
    """gpt-oss (attention sinks): transformers refuses the packed attention at load; the error
    is a ConfigError naming the fix."""
    path = _model_dir(
        tmp_path / "gpt_oss",
        "gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    with pytest.raises(
        ConfigError, match="does not support an attention.*attn_implementation: eager"
    ):
        HFPolicy(HFPolicy.Config(model_path=str(path)))


def test_soft_capped_attention_is_refused_under_sdpa_and_exact_under_eager(tmp_path: Path) -> None:
    path = _model_dir(
        tmp_path / "gemma2",
        "gemma2",
        attn_logit_softcapping=5.0,
        final_logit_softcapping=None,
        sliding_window=64,
        query_pre_attn_scalar=16,
    )
    with pytest.raises(ConfigError, match="attn_implementation: eager"):
        HFPolicy(HFPolicy.Config(model_path=str(path)))
    with pytest.raises(ConfigError, match="generator.attn_implementation: eager"):
        HFGenerator(HFGenerator.Config(model_path=str(path)))
    batch = shared_prompt_batch(VOCAB, [(6, [9, 4]), (3, [7])], seed=2)
    policy = HFPolicy(HFPolicy.Config(model_path=str(path), attn_implementation="eager"))
    got = policy.compute_logprobs(batch).logprobs
    torch.testing.assert_close(got, _own_logprobs(path, batch), atol=2e-5, rtol=0)
    gen = HFGenerator(HFGenerator.Config(model_path=str(path), attn_implementation="eager"))
    prompt = (11, 12, 13, 14, 15)
    request = GenerationRequest(
        request_id="r", input_ids=prompt, sampling=SamplingParams(temperature=0.0, max_new_tokens=6)
    )
    (res,) = asyncio.run(gen.generate([request]))
    asyncio.run(gen.close())
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(policy.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert res.output_ids == tuple(ids[len(prompt) :])
