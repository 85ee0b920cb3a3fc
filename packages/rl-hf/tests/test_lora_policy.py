"""HFPolicy with LoRA (peft): the Policy conformance suite, the peft naming, merged weights,
adapter-only checkpoints with exact resume, and the base view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from transformers import AutoModelForCausalLM  # noqa: E402

from rl_core.errors import CheckpointError, ConfigError  # noqa: E402
from rl_core.lora import LoRAConfig, merge_adapter  # noqa: E402
from rl_core.testing.policy import PolicyConformance, random_batch, sft_loss  # noqa: E402
from rl_hf import HFPolicy, TinyModelSpec, build_tiny_model  # noqa: E402

LR = 1e-2
LORA = LoRAConfig(rank=4, alpha=8.0)


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


def _policy(path: Path, **kw) -> HFPolicy:
    return HFPolicy(HFPolicy.Config(model_path=str(path), lr=LR, lora=LORA, **kw))


class TestHFPolicyLoRA(PolicyConformance):
    """Qwen2 (biases, tied embeddings), every linear layer adapted, offload on."""

    supports_offload = True

    @pytest.fixture
    def policy(self, qwen_dir: Path) -> HFPolicy:
        return _policy(qwen_dir)


class TestHFPolicyLoRAChunkedCheckpointed(PolicyConformance):
    """Llama with attention-only adapters, chunked log-probs and activation checkpointing."""

    supports_offload = True

    @pytest.fixture
    def policy(self, llama_dir: Path) -> HFPolicy:
        lora = LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"))
        return HFPolicy(
            HFPolicy.Config(
                model_path=str(llama_dir),
                lr=1e-1,
                lora=lora,
                logprob_chunk_tokens=5,
                activation_checkpointing=True,
            )
        )


def _trained(path: Path, steps: int = 2, **kw) -> tuple[HFPolicy, object]:
    policy = _policy(path, **kw)
    batch = random_batch(policy.model_shape.vocab_size, [7, 5, 9], seed=3)
    for _ in range(steps):
        policy.train_step(batch, sft_loss)
    return policy, batch


def test_adapter_weights_are_peft_state_dict_and_only_they_train(qwen_dir: Path) -> None:
    policy, _ = _trained(qwen_dir)
    ours = dict(policy.named_adapter_weights())
    theirs = peft.get_peft_model_state_dict(policy._lora.peft)
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    trained = {id(p) for p in policy._params}
    assert trained == {id(t) for n, t in policy.model.named_parameters() if ".lora_" in n}
    assert all(".lora_" in n for n, p in policy.model.named_parameters() if p.requires_grad)


def test_named_weights_are_merged_in_hf_names(qwen_dir: Path) -> None:
    policy, _ = _trained(qwen_dir)
    merged = dict(policy.named_weights())
    base = AutoModelForCausalLM.from_pretrained(qwen_dir).state_dict()
    base.pop("lm_head.weight")  # tied
    assert list(merged) == list(base)
    expected = merge_adapter(base, dict(policy.named_adapter_weights()), LORA)
    assert len(expected) == 7 * 2  # every linear layer of both tiny layers
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected.get(name, base[name]), atol=0, rtol=0)
    changed = [n for n in expected if not torch.equal(merged[n], base[n])]
    assert changed, "the trained adapter did not change any merged weight"


def test_merged_weights_reproduce_the_adapted_model(qwen_dir: Path, tmp_path: Path) -> None:
    """A plain (full fine-tuning) policy on the merged weights scores like the LoRA policy."""
    policy, batch = _trained(qwen_dir)
    policy.save_merged(tmp_path / "merged")
    plain = HFPolicy(HFPolicy.Config(model_path=str(tmp_path / "merged"), lr=LR))
    torch.testing.assert_close(
        plain.compute_logprobs(batch).logprobs,
        policy.compute_logprobs(batch).logprobs,
        atol=1e-5,
        rtol=0,
    )
    fresh = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=LR))
    torch.testing.assert_close(
        fresh.compute_logprobs(batch).logprobs,
        policy.compute_base_logprobs(batch).logprobs,
        atol=0,
        rtol=0,
    )


def test_checkpoint_is_adapter_only_loads_in_peft_and_resumes_exactly(
    qwen_dir: Path, tmp_path: Path
) -> None:
    policy, batch = _trained(qwen_dir)
    policy.save(tmp_path / "ckpt")
    files = sorted(f.name for f in (tmp_path / "ckpt").iterdir())
    assert files == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "rl_lora_base.json",
        "rl_policy_state.pt",
    ]
    with torch.no_grad():
        pm = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(qwen_dir), tmp_path / "ckpt"
        )
        x = batch.tokens[None, :7]
        merged = AutoModelForCausalLM.from_pretrained(qwen_dir)
        merged.load_state_dict(dict(policy.named_weights()), strict=False)
        torch.testing.assert_close(pm(x).logits, merged(x).logits, atol=1e-5, rtol=0)
        plain = AutoModelForCausalLM.from_pretrained(qwen_dir)
        assert not torch.allclose(pm(x).logits, plain(x).logits, atol=1e-4)
    resumed = _policy(qwen_dir)
    resumed.load(tmp_path / "ckpt")
    assert resumed.version == policy.version
    for _ in range(2):
        m_a, m_b = policy.train_step(batch, sft_loss), resumed.train_step(batch, sft_loss)
        assert m_a == m_b
    for (n_a, a), (n_b, b) in zip(
        policy.named_adapter_weights(), resumed.named_adapter_weights(), strict=True
    ):
        assert n_a == n_b and torch.equal(a, b), n_a


def test_checkpoint_of_another_base_is_refused(
    qwen_dir: Path, llama_dir: Path, tmp_path: Path
) -> None:
    policy, _ = _trained(qwen_dir, steps=1)
    policy.save(tmp_path / "ckpt")
    # the same architecture, other weights: the checksum differs
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(arch="qwen2", num_layers=3))
    with pytest.raises(CheckpointError, match="trained on the base model"):
        _policy(other).load(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "rl_lora_base.json").read_text())
    assert meta["path"] == str(qwen_dir)
    with pytest.raises(CheckpointError, match="rank 4"):
        HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=LR, lora=LoRAConfig(rank=2))).load(
            tmp_path / "ckpt"
        )
    # a full-weights checkpoint is not an adapter checkpoint
    HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=LR)).save(tmp_path / "full")
    with pytest.raises(CheckpointError, match="rl_lora_base.json"):
        _policy(qwen_dir).load(tmp_path / "full")


def test_dropout_only_in_train_step(qwen_dir: Path) -> None:
    lora = LoRAConfig(rank=4, alpha=8.0, dropout=0.5)
    policy, batch = _trained(qwen_dir, steps=1)
    noisy = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=LR, lora=lora))
    noisy.load_weights(policy.named_adapter_weights(), version=1)
    first = noisy.compute_logprobs(batch).logprobs
    assert torch.equal(first, noisy.compute_logprobs(batch).logprobs)
    torch.testing.assert_close(first, policy.compute_logprobs(batch).logprobs, atol=1e-6, rtol=0)
    seen: list[torch.Tensor] = []

    def loss_fn(logp_T, mb, ent):
        seen.append(logp_T.detach())
        return sft_loss(logp_T, mb, ent)

    noisy.train_step(batch, loss_fn)
    assert not torch.allclose(seen[0], first, atol=1e-4), "dropout did not act in train_step"
    assert all(not m.training for m in noisy.model.modules() if "Dropout" in type(m).__name__)


def test_targets_that_match_nothing_and_no_adapter_are_named(qwen_dir: Path) -> None:
    with pytest.raises(ConfigError, match="policy.lora.target_modules"):
        HFPolicy(
            HFPolicy.Config(
                model_path=str(qwen_dir), lr=LR, lora=LoRAConfig(target_modules=("wq",))
            )
        )
    plain = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=LR))
    assert plain.lora is None
    with pytest.raises(ConfigError, match="policy.lora"):
        next(plain.named_adapter_weights())


def test_routing_replay_with_lora_on_a_moe_model(tmp_path: Path) -> None:
    """LoRA on the attention of a tiny Qwen3-MoE: the router is recorded and replayed through
    the adapted model, and the base view replays the same routing."""
    import dataclasses

    from rl_hf import TINY_MOE

    moe = build_tiny_model(tmp_path / "moe", TINY_MOE)
    lora = LoRAConfig(rank=2, target_modules=("q_proj", "v_proj"))
    policy = HFPolicy(HFPolicy.Config(model_path=str(moe), lr=5e-2, lora=lora))
    batch = random_batch(int(policy.model.config.vocab_size), [7, 12, 5], seed=3)
    policy.train_step(batch, sft_loss)
    own = policy.compute_logprobs(batch)
    assert own.routed_experts is not None
    other_TLK = ((own.routed_experts.long() + 1) % 8).to(own.routed_experts.dtype)
    same = policy.compute_logprobs(dataclasses.replace(batch, routed_experts=own.routed_experts))
    assert torch.equal(same.logprobs, own.logprobs)
    replayed = policy.compute_logprobs(dataclasses.replace(batch, routed_experts=other_TLK))
    assert not torch.allclose(replayed.logprobs, own.logprobs)  # the replayed experts ran
    base = policy.compute_base_logprobs(dataclasses.replace(batch, routed_experts=other_TLK))
    assert not torch.allclose(base.logprobs, replayed.logprobs)
    metrics = policy.train_step(dataclasses.replace(batch, routed_experts=other_TLK), sft_loss)
    assert torch.isfinite(torch.tensor(metrics["loss"]))


@pytest.mark.gpu
def test_lora_on_cuda_matches_cpu_and_offload_frees_the_adapter_state(qwen_dir: Path) -> None:
    """GPU only: a LoRA policy on CUDA gives the CPU policy's log-probs and step (fp32, same
    seed), and offload() frees its device memory down to what must stay, back bitwise."""
    cpu, gpu = _policy(qwen_dir), _policy(qwen_dir, device="cuda")
    batch = random_batch(cpu.model_shape.vocab_size, [9, 5, 7], seed=4)
    torch.testing.assert_close(
        gpu.compute_logprobs(batch).logprobs.cpu(),
        cpu.compute_logprobs(batch).logprobs,
        atol=1e-4,
        rtol=0,
    )
    cpu.train_step(batch, sft_loss)
    gpu.train_step(batch, sft_loss)
    mine = {n: t.cpu() for n, t in gpu.named_adapter_weights()}
    for name, tensor in cpu.named_adapter_weights():
        torch.testing.assert_close(mine[name], tensor, atol=1e-4, rtol=0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gpu.offload()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    assert after < before / 4, (before, after)
    gpu.onload()
    assert {n: t.cpu() for n, t in gpu.named_adapter_weights()}.keys() == mine.keys()
    for name, tensor in gpu.named_adapter_weights():
        assert torch.equal(tensor.cpu(), mine[name]), name
    gpu.train_step(batch, sft_loss)  # training goes on after the round trip
