"""HFPolicy: the Policy conformance suite on tiny qwen2 and llama models, plus HF-specific tests."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.errors import CheckpointError, ConfigError, WeightSyncError
from rl_core.testing.policy import (
    PolicyConformance,
    pack_sequences,
    random_batch,
    sft_loss,
)
from rl_hf import HFPolicy, TinyModelSpec, build_tiny_model
from rl_hf._packed_attention import PackingInfo
from rl_hf.policy import token_logprobs

LR = 1e-2


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(arch="qwen2"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(
        arch="llama",
        hidden_size=32,
        num_heads=4,
        num_kv_heads=1,
        intermediate_size=64,
        tie_word_embeddings=False,
        seed=1,
    )
    return build_tiny_model(tmp_path_factory.mktemp("llama"), spec)


class TestHFPolicyQwen2(PolicyConformance):
    supports_offload = True

    @pytest.fixture
    def policy(self, qwen_dir: Path) -> HFPolicy:
        return HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=LR))


class TestHFPolicyLlama(PolicyConformance):
    @pytest.fixture
    def policy(self, llama_dir: Path) -> HFPolicy:
        return HFPolicy(HFPolicy.Config(model_path=str(llama_dir), lr=LR, grad_clip=0.0))


class TestHFPolicyEagerTemperature(PolicyConformance):
    """The transformers-eager attention path (its own packed mask) with a sampling temperature."""

    @pytest.fixture
    def policy(self, qwen_dir: Path) -> HFPolicy:
        return HFPolicy(
            HFPolicy.Config(
                model_path=str(qwen_dir), lr=LR, attn_implementation="eager", temperature=0.7
            )
        )


# ------------------------------------------------------------------------------ HF-specific


def _unpacked_logprobs(model: torch.nn.Module, seq_L: torch.Tensor, temperature: float = 1.0):
    with torch.no_grad():
        logits_LV = model(input_ids=seq_L[None], use_cache=False).logits[0] / temperature
    logp_LV = torch.log_softmax(logits_LV.double(), -1)
    out_L = torch.zeros(seq_L.shape[0], dtype=torch.float64)
    out_L[1:] = logp_LV[:-1].gather(-1, seq_L[1:, None])[:, 0]
    return out_L.float(), logp_LV


def test_packed_logprobs_match_stock_transformers(qwen_dir: Path) -> None:
    """Packed log-probs (both attention layouts) equal per-sequence stock-transformers log-probs."""
    from transformers import AutoModelForCausalLM

    policy = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir)))
    ref = AutoModelForCausalLM.from_pretrained(str(qwen_dir), attn_implementation="eager").eval()
    # One long and many short sequences, so "auto" picks the mask layout, plus a balanced batch.
    for lengths in ([40, 1, 2, 3, 2, 1, 2], [9, 11, 7, 10]):
        batch = random_batch(260, lengths, seed=len(lengths))
        logp_T = policy.compute_logprobs(batch).logprobs
        for i in range(len(lengths)):
            a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
            expected_L, _ = _unpacked_logprobs(ref, batch.tokens[a:b])
            torch.testing.assert_close(logp_T[a:b], expected_L, atol=1e-5, rtol=0)


def test_packing_layouts_agree(qwen_dir: Path) -> None:
    """The padded and the block-mask attention layouts give the same logits."""
    policy = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir)))
    batch = random_batch(260, [6, 1, 9, 4], seed=11)
    pos_T = batch.position_ids()
    lengths_N = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
    out = {}
    for mode in ("pad", "mask"):
        info = PackingInfo.build(batch.seq_index(), pos_T, lengths_N, mode=mode)
        assert info.mode == mode
        with torch.no_grad():
            out[mode] = policy.model(
                input_ids=batch.tokens[None],
                position_ids=pos_T[None],
                use_cache=False,
                rl_packing=info,
            ).logits
    torch.testing.assert_close(out["pad"], out["mask"], atol=1e-5, rtol=0)
    auto = PackingInfo.build(batch.seq_index(), pos_T, lengths_N)
    assert auto.mode == "pad"  # 4 * 9^2 = 324 <= 20^2 = 400


def test_temperature_scales_logits(qwen_dir: Path) -> None:
    """Log-probs and entropy are those of softmax(logits / temperature)."""
    from transformers import AutoModelForCausalLM

    temp = 0.5
    policy = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), temperature=temp))
    plain = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir)))
    ref = AutoModelForCausalLM.from_pretrained(str(qwen_dir)).eval()
    batch = random_batch(260, [12], seed=12)
    out = policy.compute_logprobs(batch, with_entropy=True)
    expected_T, logp_TV = _unpacked_logprobs(ref, batch.tokens, temperature=temp)
    torch.testing.assert_close(out.logprobs, expected_T, atol=1e-5, rtol=0)
    entropy_T = torch.zeros(12, dtype=torch.float64)
    entropy_T[1:] = -(logp_TV.exp() * logp_TV).sum(-1)[:-1]
    assert out.entropy is not None
    torch.testing.assert_close(out.entropy, entropy_T.float(), atol=1e-5, rtol=0)
    assert not torch.allclose(out.logprobs, plain.compute_logprobs(batch).logprobs, atol=1e-3)


def test_token_logprobs_hand_computed() -> None:
    """token_logprobs on a 3-token, 2-word example: shift, zero at starts, entropy of ln 2."""
    logits_TV = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0]])
    tokens_T = torch.tensor([1, 0, 1])
    starts_T = torch.tensor([True, False, True])  # two sequences: [1, 0] and [1]
    logp_T, ent_T = token_logprobs(logits_TV, tokens_T, starts_T, with_entropy=True)
    torch.testing.assert_close(logp_T, torch.tensor([0.0, math.log(0.5), 0.0]))
    assert ent_T is not None
    torch.testing.assert_close(ent_T, torch.tensor([0.0, math.log(2.0), 0.0]))


def test_saved_dir_loads_with_transformers(qwen_dir: Path, tmp_path: Path) -> None:
    """save() writes a directory stock transformers loads, with the policy's logits and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=LR))
    batch = random_batch(260, [10, 6], seed=13)
    policy.train_step(batch, sft_loss)
    policy.save(tmp_path / "out", with_optimizer=False)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert model.config._attn_implementation == "sdpa"
    logp_T = policy.compute_logprobs(batch).logprobs
    for i in range(2):
        a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        expected_L, _ = _unpacked_logprobs(model, batch.tokens[a:b])
        torch.testing.assert_close(logp_T[a:b], expected_L, atol=1e-5, rtol=0)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok.encode("héllo") == policy.tokenizer.encode("héllo")
    with pytest.raises(CheckpointError, match="with_optimizer=False"):
        policy.load(tmp_path / "out", with_optimizer=True)


def test_resume_is_bitwise_exact(qwen_dir: Path, tmp_path: Path) -> None:
    """save -> load into a fresh policy -> train_step equals continuing without the round trip."""
    cfg = HFPolicy.Config(model_path=str(qwen_dir), lr=LR, warmup_steps=3, weight_decay=0.1)
    batch = random_batch(260, [10, 7, 5], seed=14, micro_batch_bounds=(0, 1, 3))
    policy = HFPolicy(cfg)
    for _ in range(2):
        policy.train_step(batch, sft_loss)
    policy.save(tmp_path / "ckpt")
    cont = policy.train_step(batch, sft_loss)
    fresh = HFPolicy(cfg)
    fresh.load(tmp_path / "ckpt")
    assert fresh.version == 2
    resumed = fresh.train_step(batch, sft_loss)
    assert resumed == cont
    assert cont["lr"] == pytest.approx(LR)  # warmup: steps 0, 1, 2 use lr/3, 2lr/3, lr
    for (n1, t1), (n2, t2) in zip(policy.named_weights(), fresh.named_weights(), strict=True):
        assert n1 == n2 and torch.equal(t1, t2), n1


def test_warmup_and_grad_clip(qwen_dir: Path) -> None:
    """lr ramps linearly over warmup_steps then stays; clipping bounds the update, not grad_norm."""
    policy = HFPolicy(
        HFPolicy.Config(
            model_path=str(qwen_dir),
            lr=0.4,
            warmup_steps=4,
            grad_clip=1e-3,
            adam_beta1=0.0,
            adam_beta2=0.0,
        )
    )
    batch = random_batch(260, [10, 7], seed=15)
    lrs, norms = [], []
    for _ in range(5):
        m = policy.train_step(batch, sft_loss)
        lrs.append(m["lr"])
        norms.append(m["grad_norm"])
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    assert min(norms) > 1e-3  # reported before clipping


def test_named_weights_tied_and_untied(qwen_dir: Path, llama_dir: Path) -> None:
    """Tied models omit lm_head.weight (as their safetensors files do); untied ones carry it."""
    from safetensors.torch import load_file

    for path, tied in ((qwen_dir, True), (llama_dir, False)):
        policy = HFPolicy(HFPolicy.Config(model_path=str(path)))
        names = [n for n, _ in policy.named_weights()]
        assert ("lm_head.weight" in names) is (not tied)
        assert sorted(names) == sorted(load_file(str(path / "model.safetensors")))
        assert policy.model_shape.tied_embeddings is tied


def test_load_weights_tied_lm_head_and_errors(qwen_dir: Path) -> None:
    """A tied model takes lm_head.weight into the shared matrix; bad names/shapes change nothing."""
    policy = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir)))
    emb = dict(policy.named_weights())["model.embed_tokens.weight"].clone()
    policy.load_weights([("lm_head.weight", emb * 2)], version=3)
    assert torch.equal(dict(policy.named_weights())["model.embed_tokens.weight"], emb * 2)
    assert policy.weight_version == 3
    before = {n: t.clone() for n, t in policy.named_weights()}
    with pytest.raises(WeightSyncError, match="unknown weight"):
        policy.load_weights(
            [
                ("model.norm.weight", before["model.norm.weight"] + 1),
                ("nope.weight", torch.zeros(1)),
            ],
            version=4,
        )
    with pytest.raises(WeightSyncError, match="shape"):
        policy.load_weights([("model.norm.weight", torch.zeros(3))], version=4)
    assert policy.weight_version == 3
    for name, tensor in policy.named_weights():
        assert torch.equal(tensor, before[name]), name


def test_model_shape_from_config(llama_dir: Path) -> None:
    """model_shape reads the HF config (GQA with one kv head, untied)."""
    shape = HFPolicy(HFPolicy.Config(model_path=str(llama_dir))).model_shape
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads) == (2, 32, 4)
    assert (shape.num_kv_heads, shape.head_dim, shape.ffn_hidden_size) == (1, 8, 64)
    assert (shape.vocab_size, shape.num_experts, shape.tied_embeddings) == (260, 0, False)


def test_config_errors(tmp_path: Path) -> None:
    """Bad settings raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=r"policy\.model_path"):
        HFPolicy(HFPolicy.Config(model_path=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match=r"policy\.temperature"):
        HFPolicy.Config(model_path="x", temperature=0.0)
    with pytest.raises(ConfigError, match=r"policy\.grad_clip"):
        HFPolicy.Config(model_path="x", grad_clip=-1.0)
    no_tok = build_tiny_model(tmp_path / "no_tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / name).unlink()
    with pytest.raises(ConfigError, match="no tokenizer files"):
        HFPolicy(HFPolicy.Config(model_path=str(no_tok)))
    with pytest.raises(CheckpointError, match="not a policy checkpoint"):
        HFPolicy(HFPolicy.Config(model_path=str(build_tiny_model(tmp_path / "m")))).load(
            tmp_path / "m"
        )


def test_bfloat16_policy(qwen_dir: Path) -> None:
    """dtype=bfloat16 runs: finite log-probs close to float32 ones, a finite train step."""
    bf = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), dtype="bfloat16", lr=LR))
    fp = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir)))
    batch = random_batch(260, [9, 6], seed=16)
    logp_bf = bf.compute_logprobs(batch).logprobs
    assert logp_bf.dtype == torch.float32
    torch.testing.assert_close(logp_bf, fp.compute_logprobs(batch).logprobs, atol=0.05, rtol=0)
    assert math.isfinite(bf.train_step(batch, sft_loss)["loss"])


def test_entropy_passed_when_loss_needs_it(qwen_dir: Path) -> None:
    """A loss function with requires_entropy=True gets the entropy [T] (with gradients); else None."""
    policy = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=LR))
    batch = random_batch(260, [8, 5], seed=17)
    seen: list[torch.Tensor | None] = []

    def loss(logp_T, mb, ent_T):
        seen.append(ent_T)
        out = sft_loss(logp_T, mb, ent_T)
        if ent_T is not None:
            out.loss = out.loss - 0.01 * (ent_T * mb.loss_weights).sum()
        return out

    policy.train_step(batch, loss)
    loss.requires_entropy = True  # type: ignore[attr-defined]
    policy.train_step(batch, loss)
    assert seen[0] is None
    assert seen[1] is not None and seen[1].shape == (13,) and seen[1].requires_grad


def test_empty_loss_weights_skip_backward(qwen_dir: Path) -> None:
    """A loss without gradients (nothing to train on) leaves weights unchanged, grad_norm 0."""
    policy = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=LR))
    batch = pack_sequences([[1, 2, 3]])
    before = {n: t.clone() for n, t in policy.named_weights()}

    def no_grad_loss(logp_T, mb, ent_T):
        from rl_core.types import LossOutput

        return LossOutput(loss=torch.zeros(()))

    metrics = policy.train_step(batch, no_grad_loss)
    assert metrics["grad_norm"] == 0.0 and policy.version == 1
    for name, tensor in policy.named_weights():
        assert torch.equal(tensor, before[name]), name


# ------------------------------------------------------------------------------ tiny models


def test_tiny_model_is_deterministic(tmp_path: Path) -> None:
    """The same spec gives bitwise-identical weights; another seed gives different ones; the
    caller's RNG state is untouched."""
    from safetensors.torch import load_file

    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = load_file(str(build_tiny_model(tmp_path / "a") / "model.safetensors"))
    assert torch.equal(torch.random.get_rng_state(), state)
    b = load_file(str(build_tiny_model(tmp_path / "b") / "model.safetensors"))
    c = load_file(
        str(build_tiny_model(tmp_path / "c", TinyModelSpec(seed=1)) / "model.safetensors")
    )
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert all(t.dtype == torch.float32 for t in a.values())


def test_tiny_model_directory(tmp_path: Path) -> None:
    """The directory loads with stock transformers: config from the spec, tokenizer ids match."""
    from transformers import AutoConfig, AutoTokenizer

    spec = TinyModelSpec(
        arch="llama",
        hidden_size=48,
        num_heads=6,
        num_kv_heads=3,
        intermediate_size=96,
        num_layers=3,
        max_position_embeddings=512,
    )
    path = build_tiny_model(tmp_path / "m", spec)
    cfg = AutoConfig.from_pretrained(str(path))
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 48, 3)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (6, 3, 8)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.vocab_size) == (96, 512, 260)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert (cfg.eos_token_id, cfg.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)


def test_tiny_model_spec_errors() -> None:
    """Impossible head layouts and unknown architectures raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match="hidden_size"):
        TinyModelSpec(hidden_size=30, num_heads=4)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        TinyModelSpec(num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match="arch"):
        TinyModelSpec(arch="gpt2")  # type: ignore[arg-type]


def test_non_finite_gradient_skips_the_update(qwen_dir: Path) -> None:
    """A NaN loss leaves the weights unchanged, reports skipped_step=1 and still bumps the version."""
    policy = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=LR))
    batch = random_batch(260, [6, 5], seed=18)
    before = {n: t.clone() for n, t in policy.named_weights()}

    def nan_loss(logp_T, mb, ent_T):
        out = sft_loss(logp_T, mb, ent_T)
        out.loss = out.loss * float("nan")
        return out

    metrics = policy.train_step(batch, nan_loss)
    assert metrics["skipped_step"] == 1.0 and math.isnan(metrics["grad_norm"])
    assert policy.version == 1
    for name, tensor in policy.named_weights():
        assert torch.equal(tensor, before[name]), name
    assert policy.train_step(batch, sft_loss)["skipped_step"] == 0.0
