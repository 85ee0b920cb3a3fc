"""HFPolicy on a tiny Qwen3-MoE: the Policy conformance suite, model shape, and routing replay."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.errors import ConfigError, DataError
from rl_core.routing import routing_dtype, routing_mismatch
from rl_core.testing.policy import PolicyConformance, random_batch, sft_loss
from rl_hf import TINY_MOE, HFPolicy, TinyModelSpec, build_tiny_model
from rl_hf._moe import RouterTap

LR = 1e-2
LENGTHS = (7, 12, 5)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen3moe"), TINY_MOE)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(hidden_size=32))


@pytest.fixture
def policy(moe_dir: Path) -> HFPolicy:
    return HFPolicy(HFPolicy.Config(model_path=str(moe_dir), lr=LR))


class TestHFPolicyQwen3Moe(PolicyConformance):
    """The packed forward, training step and checkpoints on a mixture-of-experts model."""

    @pytest.fixture
    def policy(self, moe_dir: Path) -> HFPolicy:
        return HFPolicy(HFPolicy.Config(model_path=str(moe_dir), lr=LR))


def _batch(policy: HFPolicy, *, micro: tuple[int, ...] = ()):
    vocab = int(policy.model.config.vocab_size)
    return random_batch(vocab, LENGTHS, seed=3, micro_batch_bounds=micro)


def _other_routing(own_TLK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A valid routing that differs from ``own_TLK`` in every (token, layer) pair."""
    return ((own_TLK.long() + 1) % num_experts).to(own_TLK.dtype)


def test_model_shape_reads_the_moe_config(policy: HFPolicy) -> None:
    shape = policy.model_shape
    assert (shape.num_experts, shape.moe_top_k, shape.num_shared_experts) == (8, 2, 0)
    assert shape.moe_ffn_hidden_size == TINY_MOE.moe_intermediate_size
    assert shape.num_layers == TINY_MOE.num_layers


def test_logprob_output_carries_the_routers_own_choice(policy: HFPolicy) -> None:
    batch = _batch(policy, micro=(0, 1, 3))
    out = policy.compute_logprobs(batch)
    t = batch.tokens.shape[0]
    assert out.routed_experts is not None
    assert tuple(out.routed_experts.shape) == (t, TINY_MOE.num_layers, TINY_MOE.moe_top_k)
    assert out.routed_experts.dtype == routing_dtype(TINY_MOE.num_experts)
    # The same routing as stock transformers' router picks in an unpacked per-sequence forward.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy.config.model_path).eval()
    tap = RouterTap.attach(model)
    assert tap is not None
    cu = batch.cu_seqlens.tolist()
    for i in range(len(LENGTHS)):
        with torch.no_grad(), tap.recording() as rec:
            model(input_ids=batch.tokens[cu[i] : cu[i + 1]][None], use_cache=False)
        want_SLK = rec.routing().to(out.routed_experts.dtype)
        assert routing_mismatch(out.routed_experts[cu[i] : cu[i + 1]], want_SLK) == 0.0


def test_replaying_the_own_routing_changes_nothing(policy: HFPolicy) -> None:
    batch = _batch(policy, micro=(0, 2, 3))
    plain = policy.compute_logprobs(batch)
    replay = policy.compute_logprobs(
        dataclasses.replace(batch, routed_experts=plain.routed_experts)
    )
    assert torch.equal(plain.logprobs, replay.logprobs)
    assert torch.equal(plain.routed_experts, replay.routed_experts)


def test_replaying_other_experts_matches_a_forced_per_sequence_forward(
    policy: HFPolicy, moe_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    batch = _batch(policy)
    plain = policy.compute_logprobs(batch)
    forced_TLK = _other_routing(plain.routed_experts, TINY_MOE.num_experts)
    replay = policy.compute_logprobs(dataclasses.replace(batch, routed_experts=forced_TLK))
    assert (replay.logprobs - plain.logprobs).abs().max() > 1e-3
    # The router still reports its own choice, not the replayed one: in the first layer that
    # is the no-replay choice (later layers see hidden states the replay changed).
    assert torch.equal(replay.routed_experts[:, 0], plain.routed_experts[:, 0])
    assert routing_mismatch(replay.routed_experts[:, :1], forced_TLK[:, :1]) == 1.0

    # Independent oracle: stock transformers (sdpa, one sequence per forward), experts forced.
    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), attn_implementation="sdpa").eval()
    tap = RouterTap.attach(model)
    assert tap is not None
    cu = batch.cu_seqlens.tolist()
    for i in range(len(LENGTHS)):
        a, b = cu[i], cu[i + 1]
        seq_L = batch.tokens[a:b]
        with torch.no_grad(), tap.replaying(forced_TLK[a:b]):
            logits_LV = model(input_ids=seq_L[None], use_cache=False).logits[0]
        logp_LV = torch.log_softmax(logits_LV.float(), -1)
        want_L = logp_LV[:-1].gather(-1, seq_L[1:, None])[:, 0]
        torch.testing.assert_close(replay.logprobs[a + 1 : b], want_L, atol=1e-5, rtol=0)


def test_replay_sends_gradient_to_the_router_and_only_the_replayed_experts(
    policy: HFPolicy,
) -> None:
    batch = _batch(policy)
    t = batch.tokens.shape[0]
    # Every token of every layer goes to experts 0 and 1 only.
    forced_TLK = torch.tensor([0, 1], dtype=torch.uint8).expand(t, TINY_MOE.num_layers, 2)
    replay_batch = dataclasses.replace(batch, routed_experts=forced_TLK.contiguous())
    policy.model.zero_grad(set_to_none=True)
    logp_T, _ = policy._packed_logprobs(replay_batch, with_entropy=False)
    (-(logp_T * batch.loss_weights).sum()).backward()
    tap = policy._router_tap
    assert tap is not None
    for router in tap.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().max() > 0
    for layer in policy.model.model.layers:
        grad_E = layer.mlp.experts.gate_up_proj.grad.abs().flatten(1).amax(1)
        assert (grad_E[:2] > 0).all()
        assert (grad_E[2:] == 0).all()
    policy.model.zero_grad(set_to_none=True)
    before = [r.weight.detach().clone() for r in tap.routers]
    metrics = policy.train_step(replay_batch, sft_loss)
    assert metrics["grad_norm"] > 0
    assert all((r.weight - w).abs().max() > 0 for r, w in zip(tap.routers, before, strict=True))


def test_replay_with_a_wrong_shape_is_a_data_error(policy: HFPolicy) -> None:
    batch = _batch(policy)
    t = batch.tokens.shape[0]
    bad = torch.zeros(t, TINY_MOE.num_layers + 1, TINY_MOE.moe_top_k, dtype=torch.uint8)
    with pytest.raises(DataError, match="different model"):
        policy.compute_logprobs(dataclasses.replace(batch, routed_experts=bad))
    too_big = torch.full((t, TINY_MOE.num_layers, TINY_MOE.moe_top_k), 9, dtype=torch.uint8)
    with pytest.raises(DataError, match="expert 9"):
        policy.compute_logprobs(dataclasses.replace(batch, routed_experts=too_big))


def test_dense_policy_refuses_routing(dense_dir: Path) -> None:
    policy = HFPolicy(HFPolicy.Config(model_path=str(dense_dir)))
    batch = random_batch(int(policy.model.config.vocab_size), (4, 5))
    assert policy.compute_logprobs(batch).routed_experts is None
    routing = torch.zeros(9, 2, 2, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="rollout.routing_replay"):
        policy.compute_logprobs(dataclasses.replace(batch, routed_experts=routing))
