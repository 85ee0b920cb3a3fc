"""HFGenerator takes MoE weights under per-expert checkpoint names (as MegatronPolicy sends them)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_core.errors import WeightSyncError
from rl_hf import TINY_MOE, HFGenerator, build_tiny_model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe"), TINY_MOE)


def _per_expert(model) -> list[tuple[str, torch.Tensor]]:
    """The model's weights with every fused expert tensor split into checkpoint names."""
    out = []
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out.append((f"{prefix}.{e}.gate_proj.weight", t[e, :half].clone()))
                out.append((f"{prefix}.{e}.up_proj.weight", t[e, half:].clone()))
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            out += [(f"{prefix}.{e}.down_proj.weight", t[e].clone()) for e in range(t.shape[0])]
        else:
            out.append((name, t.clone()))
    return out


def test_per_expert_names_load_into_the_fused_experts(moe_dir):
    gen = HFGenerator(HFGenerator.Config(model_path=str(moe_dir)))
    other = AutoModelForCausalLM.from_pretrained(str(moe_dir))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    gen.load_weights(_per_expert(other), version=3)
    want = other.state_dict()
    for name, t in gen.model.state_dict().items():
        assert torch.equal(t, want[name]), name
    assert gen.weight_version == 3


def test_a_partial_expert_update_keeps_the_others(moe_dir):
    gen = HFGenerator(HFGenerator.Config(model_path=str(moe_dir)))
    name = next(n for n in gen.model.state_dict() if n.endswith("experts.gate_up_proj"))
    before = gen.model.state_dict()[name].clone()
    half = before.shape[1] // 2
    prefix = name[: -len(".gate_up_proj")]
    new_up = torch.full_like(before[1, half:], 0.5)
    gen.load_weights([(f"{prefix}.1.up_proj.weight", new_up)], version=1)
    after = gen.model.state_dict()[name]
    assert torch.equal(after[1, half:], new_up)
    assert torch.equal(after[1, :half], before[1, :half]) and torch.equal(after[0], before[0])


def test_a_wrong_expert_shape_is_a_weight_sync_error(moe_dir):
    gen = HFGenerator(HFGenerator.Config(model_path=str(moe_dir)))
    name = next(n for n in gen.model.state_dict() if n.endswith("experts.down_proj"))
    prefix = name[: -len(".down_proj")]
    with pytest.raises(WeightSyncError, match="different architecture"):
        gen.load_weights([(f"{prefix}.0.down_proj.weight", torch.zeros(3, 3))], version=1)
