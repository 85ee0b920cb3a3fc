"""Qwen3-MoE MegatronPolicy in one process (EP=1): conversion, log-probs, routing replay, the
load-balancing loss and the errors. The multi-process layouts are in test_moe_parallel.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.errors import ConfigError
from rl_core.testing.modules import load_module
from rl_core.testing.policy import random_batch, sft_loss

HERE = Path(__file__).parent


R = load_module("_rl_megatron_tests_moe_reference", HERE / "_moe_reference.py")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE with a dense first layer (``mlp_only_layers=[0]``) and two MoE layers."""
    return R.build_qwen3_moe_model(
        tmp_path_factory.mktemp("moe1") / "m", num_layers=3, mlp_only_layers=[0]
    )


@pytest.fixture(scope="module")
def policy(moe_dir: Path) -> Any:
    """MegatronPolicy on ``moe_dir`` at world 1 (no load-balancing loss)."""
    from rl_megatron.policy import MegatronPolicy

    return MegatronPolicy(
        MegatronPolicy.Config(model_path=str(moe_dir), lr=1e-3, moe_aux_loss_coeff=0.0)
    )


@pytest.fixture(scope="module")
def hf(moe_dir: Path) -> Any:
    """The same model in plain transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32)


def _batch(vocab: int) -> Any:
    return random_batch(vocab, [5, 8, 3, 6], seed=1, micro_batch_bounds=(0, 2, 4))


def test_model_shape_and_weights_round_trip(policy: Any, hf: Any) -> None:
    """``model_shape`` carries the experts; ``named_weights`` gives transformers' weights
    exactly, per expert under the checkpoint names; ``load_weights`` takes transformers'
    in-memory fused expert tensors."""
    from rl_megatron._moe import unfuse_hf_experts

    shape = policy.model_shape
    assert (shape.num_experts, shape.moe_top_k, shape.moe_ffn_hidden_size) == (8, 2, 16)
    assert shape.ffn_hidden_size == 64 and shape.num_layers == 3
    mine = {n: t.clone() for n, t in policy.named_weights()}
    theirs = unfuse_hf_experts(dict(hf.state_dict()))
    assert mine.keys() == theirs.keys()
    assert "model.layers.0.mlp.gate_proj.weight" in mine  # the dense layer
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in mine
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    fused = dict(hf.state_dict())
    bumped = fused["model.layers.1.mlp.experts.gate_up_proj"] + 1.0
    policy.load_weights(
        {"model.layers.1.mlp.experts.gate_up_proj": bumped}.items(), version=policy.version
    )
    now = dict(policy.named_weights())
    assert torch.equal(now["model.layers.1.mlp.experts.3.up_proj.weight"], bumped[3, 16:])
    policy.load_weights(fused.items(), version=policy.version)
    assert all(torch.equal(t, mine[n]) for n, t in policy.named_weights())


def test_logprobs_and_own_routing_match_transformers(policy: Any, hf: Any) -> None:
    """Log-probs equal a per-sequence transformers forward within 1e-5; ``routed_experts`` is
    its routers' top-k, ``[T, 2 MoE layers, 2]`` uint8."""
    batch = _batch(policy.model_shape.vocab_size)
    ref_T, own_TLK = R.hf_logprobs(hf, batch)
    out = policy.compute_logprobs(batch)
    torch.testing.assert_close(out.logprobs, ref_T, atol=1e-5, rtol=0)
    assert out.routed_experts.dtype == torch.uint8
    assert out.routed_experts.shape == (batch.num_tokens, 2, 2)
    assert torch.equal(out.routed_experts.long(), own_TLK)


def test_replay_matches_forced_transformers(policy: Any, hf: Any) -> None:
    """Replaying experts other than the router's own gives the log-probs of a transformers
    forward forced to them (within 1e-5; they differ from the free forward by more than 1e-3),
    and ``routed_experts`` still reports the router's own choice under the replay."""
    batch = _batch(policy.model_shape.vocab_size)
    free_T, own_TLK = R.hf_logprobs(hf, batch)
    forced = R.distinct_routing(own_TLK, 8)
    ref_T, own_forced_TLK = R.hf_logprobs(hf, batch, forced)
    replay = dataclasses.replace(batch, routed_experts=forced.to(torch.uint8))
    out = policy.compute_logprobs(replay)
    torch.testing.assert_close(out.logprobs, ref_T, atol=1e-5, rtol=0)
    assert float((ref_T - free_T).abs().max()) > 1e-3
    assert torch.equal(out.routed_experts.long(), own_forced_TLK)
    assert not torch.equal(out.routed_experts.long(), forced)


def test_replay_errors_name_the_field(policy: Any, model_dirs: dict[str, Path]) -> None:
    """Routing of the wrong shape, or for a dense model, raises ConfigError naming
    rollout.routing_replay."""
    from rl_megatron.policy import MegatronPolicy

    batch = _batch(policy.model_shape.vocab_size)
    wrong = torch.zeros(batch.num_tokens, 3, 2, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="rollout.routing_replay"):
        policy.compute_logprobs(dataclasses.replace(batch, routed_experts=wrong))
    dense = MegatronPolicy(MegatronPolicy.Config(model_path=str(model_dirs["qwen3"])))
    assert dense.model_shape.num_experts == 0
    dense_batch = _batch(dense.model_shape.vocab_size)
    routed = torch.zeros(dense_batch.num_tokens, 2, 2, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="rollout.routing_replay"):
        dense.train_step(dataclasses.replace(dense_batch, routed_experts=routed), sft_loss)
    assert dense.compute_logprobs(dense_batch).routed_experts is None


def test_expert_parallel_size_must_divide_experts(moe_dir: Path) -> None:
    """An expert-parallel size that does not divide the experts, or EP on a dense model,
    raises ConfigError naming policy.expert_model_parallel_size."""
    from transformers import AutoConfig

    from rl_megatron._moe import MoESettings
    from rl_megatron.convert import transformer_config_from_hf

    cfg = AutoConfig.from_pretrained(str(moe_dir))
    with pytest.raises(ConfigError, match="policy.expert_model_parallel_size: 3"):
        transformer_config_from_hf(cfg, moe=MoESettings(ep_size=3))
    dense = AutoConfig.for_model(
        "qwen3", num_hidden_layers=1, hidden_size=32, num_attention_heads=4
    )
    with pytest.raises(ConfigError, match="policy.expert_model_parallel_size"):
        transformer_config_from_hf(dense, moe=MoESettings(ep_size=2))


def test_load_balancing_loss_reaches_the_routers(moe_dir: Path, policy: Any) -> None:
    """With ``moe_aux_loss_coeff > 0`` one SFT step moves every router differently from the
    same step without it, and leaves the weights after the last router (the last layer's
    experts, the final norm, the LM head) as they are (the load-balancing loss depends on the
    router logits only)."""
    from rl_megatron.policy import MegatronPolicy

    batch = _batch(policy.model_shape.vocab_size)
    after = {}
    for coeff in (0.0, 0.5):
        p = MegatronPolicy(
            MegatronPolicy.Config(
                model_path=str(moe_dir), lr=1e-3, grad_clip=0.0, moe_aux_loss_coeff=coeff
            )
        )
        p.train_step(batch, sft_loss)
        after[coeff] = {n: t.clone() for n, t in p.named_weights()}
    same = {n for n in after[0.0] if torch.equal(after[0.0][n], after[0.5][n])}
    routers = {n for n in after[0.0] if n.endswith("mlp.gate.weight")}
    assert len(routers) == 2 and not routers & same
    tail = {n for n in after[0.0] if n.startswith("model.layers.2.mlp.experts.")}
    assert tail | {"lm_head.weight", "model.norm.weight"} <= same
