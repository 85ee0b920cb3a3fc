"""FLOPs of one sequence through a decoder-only transformer, from :class:`~rl_core.types.ModelShape`.

Counted per layer (a multiply-add is 2 FLOPs; ``L`` tokens, width ``h``, ``q`` query heads,
``k`` key/value heads, head width ``d``):

- attention projections: Q ``2·L·h·q·d``, K and V ``2·2·L·h·k·d`` (grouped-query attention),
  output ``2·L·q·d·h``;
- attention core, causal: token ``i`` attends to ``i+1`` positions, ``L(L+1)/2`` query-key pairs
  in all; ``QKᵀ`` and ``AV`` cost ``2·q·d`` each per pair, so ``2·q·d·L(L+1)``;
- MLP, SwiGLU (gate, up, down): ``6·L·h·f``. In an MoE layer (``num_experts > 0``) a token
  goes through ``moe_top_k`` routed experts plus ``num_shared_experts`` shared ones, each
  ``6·L·h·f_e`` (``f_e = moe_ffn_hidden_size or ffn_hidden_size``), plus the router
  ``2·L·h·E``; every layer is counted as MoE when ``num_experts > 0``;

plus the LM head ``2·L·h·V`` (the embedding lookup is free). Training (forward + backward) is
three forward passes. Norms, activations, softmax and rotary embeddings are ignored (they are
a small fraction and do not change the balance).

The cost is ``a·L + b·L(L+1)`` with constants from the shape (:func:`flops_coefficients`), so
whole arrays of lengths are estimated at once with :func:`estimate_flops_array`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rl_core.types import ModelShape

__all__ = ["estimate_flops", "estimate_flops_array", "flops_coefficients"]


def flops_coefficients(shape: ModelShape, *, training: bool = True) -> tuple[float, float]:
    """``(a, b)`` such that one sequence of ``L`` tokens costs ``a·L + b·L(L+1)`` FLOPs."""
    h, q, k, d = shape.hidden_size, shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    proj = 2 * h * q * d + 2 * 2 * h * k * d + 2 * q * d * h
    if shape.num_experts > 0:
        fe = shape.moe_ffn_hidden_size or shape.ffn_hidden_size
        mlp = 6 * h * fe * (shape.moe_top_k + shape.num_shared_experts) + 2 * h * shape.num_experts
    else:
        mlp = 6 * h * shape.ffn_hidden_size
    linear = shape.num_layers * (proj + mlp) + 2 * h * shape.vocab_size
    quadratic = shape.num_layers * 2 * q * d
    mult = 3 if training else 1
    return float(mult * linear), float(mult * quadratic)


def estimate_flops(seq_len: int, shape: ModelShape, *, training: bool = True) -> float:
    """FLOPs of one sequence of ``seq_len`` tokens (forward, or forward + backward when
    ``training``); see the module docstring for what is counted."""
    if seq_len < 0:
        raise ValueError(f"estimate_flops: seq_len must be >= 0, got {seq_len}.")
    a, b = flops_coefficients(shape, training=training)
    return a * seq_len + b * seq_len * (seq_len + 1)


def estimate_flops_array(
    seq_lens: Sequence[int] | np.ndarray, shape: ModelShape, *, training: bool = True
) -> np.ndarray:
    """:func:`estimate_flops` of every length, as a float64 array."""
    a, b = flops_coefficients(shape, training=training)
    n = np.asarray(seq_lens, dtype=np.float64)
    return a * n + b * n * (n + 1)
