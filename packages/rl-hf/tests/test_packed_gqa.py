"""Grouped-query attention in the packed SDPA path: the kernel reads each key/value head for its
query heads (``enable_gqa``) instead of a repeated copy, with the values of the repeated copy."""

from __future__ import annotations

import pytest
import torch

from rl_hf import _packed_attention as packed


def _padded_info(lengths: list[int]) -> packed.PackingInfo:
    seq_T = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    pos_T = torch.cat([torch.arange(n) for n in lengths])
    return packed.PackingInfo.build(seq_T, pos_T, torch.tensor(lengths), mode="pad")


def _attend(q, k, v, info):
    out, _ = packed.packed_sdpa_forward(
        torch.nn.Module(), q, k, v, None, scaling=q.shape[-1] ** -0.5, rl_packing=info
    )
    return out


@pytest.mark.parametrize("n_rep", [2, 4])
def test_gqa_matches_attention_over_repeated_key_value_heads(n_rep: int) -> None:
    torch.manual_seed(0)
    lengths = [5, 9, 3, 7]
    info = _padded_info(lengths)
    assert info.mode == "pad"
    t, kv_heads, d = sum(lengths), 2, 16
    q = torch.randn(1, kv_heads * n_rep, t, d, requires_grad=True)
    k = torch.randn(1, kv_heads, t, d, requires_grad=True)
    v = torch.randn(1, kv_heads, t, d, requires_grad=True)
    g = torch.randn(1, t, kv_heads * n_rep, d)
    out = _attend(q, k, v, info)
    grads = torch.autograd.grad(out, (q, k, v), g)
    # the reference: the same path with the key/value heads repeated beforehand (n_rep = 1)
    k_rep = k.repeat_interleave(n_rep, dim=1)
    v_rep = v.repeat_interleave(n_rep, dim=1)
    ref = _attend(q, k_rep, v_rep, info)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    assert torch.equal(out, ref)
    if n_rep == 2:  # the demo's and the tests' models: bitwise, gradients included
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    else:  # the key/value gradients sum n_rep heads: the order may differ by rounding
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
