"""MegatronPolicy in this process (a world of one, gloo): conformance, HF equivalence, converter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_core.errors import ConfigError, WeightSyncError
from rl_core.testing.policy import PolicyConformance, pack_sequences, random_batch, sft_loss
from rl_hf import HFPolicy
from rl_megatron.policy import MegatronPolicy


def _megatron(path: Path, **kw: object) -> MegatronPolicy:
    return MegatronPolicy(MegatronPolicy.Config(model_path=str(path), **kw))  # type: ignore[arg-type]


class TestMegatronPolicyConformance(PolicyConformance):
    """The standard Policy suite at TP=1, DP=1 (Qwen2, tied embeddings)."""

    @pytest.fixture
    def policy(self, model_dirs: dict[str, Path]) -> MegatronPolicy:
        return _megatron(model_dirs["qwen2"], lr=1e-2)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_hf_roundtrip_and_logprobs_match_reference(arch: str, model_dirs: dict[str, Path]) -> None:
    """HF -> Megatron -> HF is bitwise exact, and log-probs/entropy equal HFPolicy's within 1e-5."""
    path = model_dirs[arch]
    policy = _megatron(path)
    original = load_file(str(path / "model.safetensors"))
    exported = dict(policy.named_weights())
    expected_names = set(original) - ({"lm_head.weight"} if policy.weight_map.tied else set())
    assert set(exported) == expected_names
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name
    ref = HFPolicy(HFPolicy.Config(model_path=str(path)))
    batch = random_batch(
        policy.model_shape.vocab_size, [7, 1, 12, 4], seed=3, micro_batch_bounds=(0, 2, 4)
    )
    mine = policy.compute_logprobs(batch, with_entropy=True)
    theirs = ref.compute_logprobs(batch, with_entropy=True)
    assert mine.entropy is not None and theirs.entropy is not None
    torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.entropy, theirs.entropy, atol=1e-5, rtol=0)


def test_train_step_matches_reference(model_dirs: dict[str, Path]) -> None:
    """One SFT step (pad tokens included): same loss, grad norm and parameter update as HFPolicy."""
    path = model_dirs["llama"]
    kw = {"lr": 1e-3, "grad_clip": 1.0}
    policy, ref = _megatron(path, **kw), HFPolicy(HFPolicy.Config(model_path=str(path), **kw))  # type: ignore[arg-type]
    pad = policy.tokenizer.pad_token_id
    seqs = random_batch(policy.model_shape.vocab_size, [6, 9, 4, 8], seed=4)
    tokens = seqs.tokens.clone()
    tokens[[2, 11]] = pad  # HF's embedding gives the pad row no gradient from the lookup
    batch = pack_sequences(
        [tokens[int(a) : int(b)] for a, b in zip(seqs.cu_seqlens[:-1], seqs.cu_seqlens[1:])],
        micro_batch_bounds=(0, 1, 4),
    )
    before = {n: t.clone() for n, t in ref.named_weights()}
    m_mine, m_ref = policy.train_step(batch, sft_loss), ref.train_step(batch, sft_loss)
    assert m_mine["loss"] == pytest.approx(m_ref["loss"], rel=1e-5)
    assert m_mine["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
    assert m_ref["grad_norm"] > 1.0  # so clipping was exercised
    mine, theirs = dict(policy.named_weights()), dict(ref.named_weights())
    update = torch.cat([(theirs[n] - before[n]).abs().flatten() for n in theirs])
    diff = torch.cat([(mine[n] - theirs[n]).abs().flatten() for n in theirs])
    assert update.mean() > 1e-4
    assert diff.mean() <= 1e-3 * update.mean()
    assert float((diff > 1e-5).float().mean()) <= 1e-3


def test_load_weights_partial_fused_and_errors(model_dirs: dict[str, Path]) -> None:
    """Loading only ``q_proj`` keeps k/v of the fused qkv; bad names or shapes change nothing."""
    policy = _megatron(model_dirs["qwen2"])
    before = dict((n, t.clone()) for n, t in policy.named_weights())
    q_name = "model.layers.1.self_attn.q_proj.weight"
    new_q = torch.randn_like(before[q_name])
    policy.load_weights([(q_name, new_q)], version=3)
    after = dict(policy.named_weights())
    assert policy.version == 3 and torch.equal(after[q_name], new_q)
    for name in (
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
    ):
        assert torch.equal(after[name], before[name])
    with pytest.raises(WeightSyncError, match="unknown weight"):
        policy.load_weights([("model.layers.9.mlp.up_proj.weight", new_q)], version=4)
    with pytest.raises(WeightSyncError, match="has shape"):
        policy.load_weights([(q_name, new_q[:-1])], version=4)
    assert policy.version == 3


def test_config_errors_name_the_field(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Bad settings raise ConfigError naming the field and the fix."""
    with pytest.raises(ConfigError, match="model_path"):
        _megatron(tmp_path)
    with pytest.raises(ConfigError, match="megatron_args.hidden_size"):
        _megatron(model_dirs["qwen2"], megatron_args={"hidden_size": 8})
    with pytest.raises(ConfigError, match=r"policy\.grad_clip"):
        _megatron(model_dirs["qwen2"], megatron_args={"clip_grad": 0.5})
    with pytest.raises(ConfigError, match="Did you mean recompute_granularity"):
        _megatron(model_dirs["qwen2"], megatron_args={"recompute_granularty": "selective"})
    with pytest.raises(ConfigError, match="tp_size"):
        _megatron(model_dirs["qwen2"], tp_size=2)  # a world of one
    with pytest.raises(ConfigError, match="pp_size"):
        MegatronPolicy.Config(model_path="x", pp_size=0)


def test_megatron_args_pass_through(model_dirs: dict[str, Path]) -> None:
    """Valid options reach the owning megatron-core config objects."""
    policy = _megatron(
        model_dirs["qwen2"],
        megatron_args={
            "init_method_std": 0.01,
            "check_for_nan_in_grad": True,
            "log_num_zeros_in_grad": True,
        },
    )
    assert policy.tconfig.init_method_std == 0.01
    assert policy.model.ddp_config.check_for_nan_in_grad is True
    assert policy.optimizer.config.log_num_zeros_in_grad is True


@pytest.mark.gpu
def test_bf16_logprobs_close_to_reference(model_dirs: dict[str, Path]) -> None:
    """GPU only: bf16 parameters give log-probs close to the fp32 reference."""
    path = model_dirs["qwen2"]
    policy = _megatron(path, dtype="bfloat16")
    ref = HFPolicy(HFPolicy.Config(model_path=str(path)))
    batch = random_batch(policy.model_shape.vocab_size, [9, 5], seed=5)
    torch.testing.assert_close(
        policy.compute_logprobs(batch).logprobs,
        ref.compute_logprobs(batch).logprobs,
        atol=5e-2,
        rtol=0,
    )
