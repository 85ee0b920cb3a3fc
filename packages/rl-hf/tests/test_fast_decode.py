"""The lean prefill and decode step (``rl_hf._fast_decode``) against the transformers forward.

Every test runs the same :class:`HFGenerator` batch twice, ``fast_decode`` on and off, and
compares the logits of the prefill and of every decode step (recorded from ``_prefill`` and
``_decode_step``), the sampled tokens
and their log-probs. The batches mix left-padded prompts of different lengths, GRPO groups that
share a prompt (one prefill, expanded) and rows with different ``max_new_tokens`` (the batch
and its cache are compacted mid-way).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rl_core.types import GenerationRequest, GenerationResult, SamplingParams
from rl_hf import _fast_decode
from rl_hf._fast_decode import LeanCache, LeanDecoder, unsupported_reason
from rl_hf.generator import HFGenerator
from rl_hf.tokenizer import build_tokenizer

TOK = build_tokenizer()


def _model(arch: str, attn: str = "sdpa", seed: int = 0, **extra: Any) -> Any:
    """A random 2-layer model of ``arch`` with grouped-query attention (4 query, 2 kv heads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        arch,
        vocab_size=len(TOK),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=arch != "llama",
        eos_token_id=TOK.eos_token_id,
        pad_token_id=TOK.pad_token_id,
        **extra,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
        with torch.no_grad():  # non-trivial norms and biases, so a missed term shows
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.3 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def _requests(n_new: int = 10) -> list[GenerationRequest]:
    """Three prompts of lengths 3, 7 and 5; the first two are groups of 3 and 2 samples; the
    rows stop at different lengths, so the batch is compacted."""
    prompts = [(5, 17, 40), (9, 33, 2, 71, 80, 12, 6), (50, 51, 52, 53, 54)]
    rows = [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4), (2, 5)]
    return [
        GenerationRequest(
            request_id=f"r{i}",
            input_ids=prompts[p],
            sampling=SamplingParams(
                temperature=0.7, seed=100 + i, max_new_tokens=n_new - 3 * (i % 3)
            ),
        )
        for p, i in rows
    ]


def _run(
    model: Any, reqs: list[GenerationRequest], fast: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[GenerationResult], list[torch.Tensor], int]:
    """Generate ``reqs`` in one batch; returns the results, the logits of the prefill and of
    every decode step, and the number of lean steps taken."""
    gen = HFGenerator(
        HFGenerator.Config(
            model_path="unused", max_batch_size=64, fast_decode=fast, stop_on_eos=False
        ),
        model=model,
        tokenizer=TOK,
    )
    logits: list[torch.Tensor] = []
    lean_steps = [0]
    orig_step, orig_decode_step = LeanCache.step, HFGenerator._decode_step
    orig_prefill = HFGenerator._prefill

    def step(self: LeanCache, *a: Any) -> torch.Tensor:
        lean_steps[0] += 1
        return orig_step(self, *a)

    def decode_step(self: HFGenerator, *a: Any) -> torch.Tensor:
        out = orig_decode_step(self, *a)
        logits.append(out.clone())
        return out

    def prefill(self: HFGenerator, *a: Any) -> torch.Tensor:
        out = orig_prefill(self, *a)
        logits.append(out.clone())
        return out

    monkeypatch.setattr(LeanCache, "step", step)
    monkeypatch.setattr(HFGenerator, "_prefill", prefill)
    monkeypatch.setattr(HFGenerator, "_decode_step", decode_step)

    async def go() -> list[GenerationResult]:
        try:
            return await gen.generate(reqs)
        finally:
            await gen.close()

    try:
        return asyncio.run(go()), logits, lean_steps[0]
    finally:
        monkeypatch.undo()


def _assert_same(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """fast_decode on (taking lean steps) and off give the same logits, tokens and log-probs."""
    reqs = _requests()
    on, logits_on, n_on = _run(model, reqs, True, monkeypatch)
    off, logits_off, n_off = _run(model, reqs, False, monkeypatch)
    assert n_off == 0
    assert n_on > 0
    assert len(logits_on) == len(logits_off) > 0
    for t, (a, b) in enumerate(zip(logits_on, logits_off, strict=True)):
        assert a.shape == b.shape, f"step {t}"
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m, t=t: f"step {t}: {m}")
    for r_on, r_off in zip(on, off, strict=True):
        assert r_on.output_ids == r_off.output_ids
        assert r_on.finish_reason == r_off.finish_reason
        torch.testing.assert_close(
            torch.tensor(r_on.output_logprobs),
            torch.tensor(r_off.output_logprobs),
            atol=1e-5,
            rtol=0,
        )
    # the batch was compacted: the last steps have fewer rows than the first
    assert logits_on[-1].shape[0] < logits_on[0].shape[0]


@pytest.mark.parametrize(
    ("arch", "attn", "dtype"),
    [
        ("qwen2", "sdpa", torch.float32),
        ("llama", "sdpa", torch.float32),
        ("qwen3", "sdpa", torch.float32),
        ("mistral", "sdpa", torch.float32),
        ("qwen2", "eager", torch.float32),
        ("qwen3", "sdpa", torch.bfloat16),
    ],
)
def test_lean_step_matches_transformers(
    arch: str, attn: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-step logits within 1e-5, same tokens and log-probs, on each family (GQA, biases on
    qwen2, q/k norms on qwen3) under both attention implementations, and in bfloat16 (where
    the norms run transformers' composite, not ``F.rms_norm``)."""
    extra = {"sliding_window": None} if arch == "mistral" else {}
    model = _model(arch, attn, **extra).to(dtype)
    assert unsupported_reason(model) is None
    _assert_same(model, monkeypatch)


def test_llama_with_biases_gelu_and_scaled_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's optional attention / MLP biases, another activation (the MLP's own ``act_fn``)
    and a length-independent rope scaling."""
    model = _model(
        "llama",
        attention_bias=True,
        mlp_bias=True,
        hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    )
    assert model.model.layers[0].mlp.up_proj.bias is not None
    _assert_same(model, monkeypatch)


def test_updated_weights_are_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights copied in place between batches (load_weights) reach the lean step."""
    model = _model("qwen2")
    before, _, _ = _run(model, _requests(), True, monkeypatch)
    new = _model("qwen2", seed=1).state_dict()
    gen = HFGenerator(HFGenerator.Config(model_path="unused"), model=model, tokenizer=TOK)
    gen.load_weights(new.items(), version=1)
    after, _, _ = _run(model, _requests(), True, monkeypatch)
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    _assert_same(model, monkeypatch)


def test_mistral_window_shorter_than_the_batch_is_refused() -> None:
    """A Mistral window the batch's sequences outgrow gets no lean cache (the transformers
    path runs that batch); a window they fit in is full attention and qualifies."""
    model = _model("mistral", sliding_window=8)
    dec = LeanDecoder.build(model)
    assert dec is not None and dec.fits(8) and not dec.fits(9)
    assert dec.cache(prompt_len=6, steps=3) is None
    assert isinstance(dec.cache(prompt_len=6, steps=2), LeanCache)


def test_models_that_do_not_qualify() -> None:
    """Other families, sliding-window layers and length-dependent rope are refused."""
    from transformers import AutoModelForCausalLM

    from rl_hf import TINY_MOE
    from rl_hf.tiny import tiny_model_config

    moe = AutoModelForCausalLM.from_config(tiny_model_config(TINY_MOE, TOK))
    assert "qwen3_moe" in (unsupported_reason(moe) or "")
    sliding = _model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding" in (unsupported_reason(sliding) or "")
    dyn = _model(
        "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    )
    assert "dynamic" in (unsupported_reason(dyn) or "")
    gen = HFGenerator(HFGenerator.Config(model_path="unused"), model=moe, tokenizer=TOK)
    assert gen._lean is None


def test_rms_norm_is_bitwise_transformers_in_float32() -> None:
    """``F.rms_norm`` (the lean step's float32 norm) equals transformers' RMSNorm module."""
    model = _model("qwen2")
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(7, 64) * 3
    assert torch.equal(_fast_decode._norm(x, norm.weight, norm.variance_epsilon), norm(x))
    xb, nb = x.bfloat16(), norm.to(torch.bfloat16)
    assert torch.equal(_fast_decode._norm(xb, nb.weight, nb.variance_epsilon), nb(xb))


def test_adapted_model_takes_the_transformers_path() -> None:
    """Once peft wraps the projections (a LoRA adapter is served) the lean step is refused,
    even by a decoder built before; ``HFGenerator`` then decodes through transformers."""
    peft = pytest.importorskip("peft")
    model = _model("qwen2")
    dec = LeanDecoder.build(model)
    assert dec is not None
    peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert "adapters" in (unsupported_reason(model) or "")
    assert dec.cache(prompt_len=3, steps=2) is None


def test_hooked_model_takes_the_transformers_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward hook on any module (someone counting or editing its calls) sends the batch
    through transformers, where the hook fires; removed, the lean step runs again."""
    model = _model("qwen2")
    calls = [0]
    handle = model.model.layers[1].mlp.register_forward_hook(
        lambda *_: calls.__setitem__(0, calls[0] + 1)
    )
    _, logits, lean_steps = _run(model, _requests(), True, monkeypatch)
    assert lean_steps == 0 and calls[0] == len(logits)
    handle.remove()
    _, _, lean_steps = _run(model, _requests(), True, monkeypatch)
    assert lean_steps > 0 and calls[0] == len(logits)
