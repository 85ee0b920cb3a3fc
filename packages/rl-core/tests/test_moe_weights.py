"""rl_core.moe_weights: transformers' fused expert tensors split into per-expert names."""

from __future__ import annotations

import torch

from rl_core.moe_weights import has_fused_experts, unfuse_expert_tensors


def test_unfuse_splits_gate_up_and_down_per_expert_and_passes_the_rest() -> None:
    e, f, h = 3, 2, 4
    gate_up_EXH = torch.arange(e * 2 * f * h, dtype=torch.float32).reshape(e, 2 * f, h)
    down_EHF = -torch.arange(e * h * f, dtype=torch.float32).reshape(e, h, f)
    router = torch.ones(e, h)
    named = [
        ("model.layers.1.mlp.gate.weight", router),
        ("model.layers.1.mlp.experts.gate_up_proj", gate_up_EXH),
        ("model.layers.1.mlp.experts.down_proj", down_EHF),
    ]
    assert has_fused_experts(n for n, _ in named)
    out = dict(unfuse_expert_tensors(named))
    first = next(iter(out))
    assert first == "model.layers.1.mlp.gate.weight" and out[first] is router
    assert len(out) == 1 + 3 * e
    for i in range(e):
        p = f"model.layers.1.mlp.experts.{i}."
        assert torch.equal(out[p + "gate_proj.weight"], gate_up_EXH[i, :f])
        assert torch.equal(out[p + "up_proj.weight"], gate_up_EXH[i, f:])
        assert torch.equal(out[p + "down_proj.weight"], down_EHF[i])
    assert not has_fused_experts(out)
