"""Golden numbers for the FLOPs estimate, computed by hand for a tiny shape."""

from __future__ import annotations

import numpy as np
import pytest

from rl_buffer.flops import estimate_flops, estimate_flops_array, flops_coefficients
from rl_core.types import ModelShape

# 2 layers, width 8, 4 query heads and 2 kv heads of width 2, SwiGLU width 16, vocab 10
DENSE = ModelShape(
    num_layers=2,
    hidden_size=8,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=2,
    ffn_hidden_size=16,
    vocab_size=10,
)


def test_dense_golden_number():
    L = 3
    q_proj = 2 * L * 8 * (4 * 2)  # 384
    kv_proj = 2 * 2 * L * 8 * (2 * 2)  # 384: grouped-query K and V
    o_proj = 2 * L * (4 * 2) * 8  # 384
    pairs = 1 + 2 + 3  # causal query-key pairs
    attn = 2 * 2 * (4 * 2) * pairs  # QK^T and AV, 2 FLOPs per MAC: 192
    mlp = 3 * 2 * L * 8 * 16  # gate, up, down: 2304
    head = 2 * L * 8 * 10  # LM head: 480
    forward = 2 * (q_proj + kv_proj + o_proj + attn + mlp) + head
    assert forward == 7776
    assert estimate_flops(L, DENSE, training=False) == 7776
    assert estimate_flops(L, DENSE) == 3 * 7776 == 23328


def test_moe_golden_number():
    moe = ModelShape(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=2,
        ffn_hidden_size=16,
        vocab_size=10,
        num_experts=4,
        moe_top_k=2,
        num_shared_experts=1,
        moe_ffn_hidden_size=6,
    )
    L = 3
    experts = (2 + 1) * 3 * 2 * L * 8 * 6  # top-2 routed + 1 shared expert of width 6: 2592
    router = 2 * L * 8 * 4  # 192
    per_layer = 384 + 384 + 384 + 192 + experts + router
    assert estimate_flops(L, moe, training=False) == 2 * per_layer + 480 == 8736


def test_gqa_costs_less_than_mha_and_attention_is_quadratic():
    mha = ModelShape(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=4,
        num_kv_heads=4,
        head_dim=2,
        ffn_hidden_size=16,
        vocab_size=10,
    )
    # K and V projections double from 2 to 4 kv heads: + 2 layers * 384 forward
    assert estimate_flops(3, mha, training=False) - estimate_flops(3, DENSE, training=False) == 768
    a, b = flops_coefficients(DENSE, training=False)
    assert b == 2 * 2 * (4 * 2)  # layers * 2 * q * d per causal pair
    assert a == 2 * (128 + 128 + 128 + 768) + 160  # per token: Q, KV, O, MLP per layer; head
    # second difference of a*L + b*L(L+1) is 2b
    f = [estimate_flops(n, DENSE, training=False) for n in (10, 11, 12)]
    assert f[2] - 2 * f[1] + f[0] == 2 * b


def test_array_matches_scalar_and_bad_length():
    lens = np.array([0, 1, 7, 300, 4096])
    np.testing.assert_array_equal(
        estimate_flops_array(lens, DENSE), [estimate_flops(int(n), DENSE) for n in lens]
    )
    assert estimate_flops(0, DENSE) == 0
    with pytest.raises(ValueError):
        estimate_flops(-1, DENSE)
