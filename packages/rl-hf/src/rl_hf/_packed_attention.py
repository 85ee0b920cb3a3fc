"""Padding-free packed attention for Hugging Face causal LMs (used by ``HFPolicy``).

Tensor-name legend: ``T`` packed tokens, ``N`` sequences, ``L`` longest sequence, ``H`` query
heads, ``K`` key/value heads, ``D`` head width.

The model runs on ``input_ids [1, T]`` (sequences concatenated) with ``position_ids [1, T]`` reset
to 0 at every sequence start. Attention must not cross sequences. Two exact ways:

- ``"pad"``: scatter q/k/v into a padded ``[N, L]`` layout, run causal SDPA (``is_causal=True``,
  no mask tensor, so the fast kernel is used), gather the outputs back. Padding sits after the
  valid tokens of every row, so causal attention of a valid query never reaches it. Cost
  ``N * L^2`` per head.
- ``"mask"``: SDPA on ``[1, T]`` with a block-diagonal causal boolean mask ``[T, T]``. Cost
  ``T^2`` per head; wins when one long sequence is packed with many short ones.

:class:`PackingInfo` picks the cheaper one per micro-batch. The attention function is registered
in transformers' ``AttentionInterface`` as :data:`ATTN_NAME`; because that name has no mask
function, transformers builds no mask of its own (no ``[T, T]`` work outside attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_core.errors import RLError

__all__ = ["ATTN_NAME", "PackingInfo", "register_packed_attention"]

ATTN_NAME = "rl_packed_sdpa"
"""Name under which the packed attention is registered in transformers."""


@dataclass(frozen=True, slots=True)
class PackingInfo:
    """Index tensors describing one packed micro-batch, built once per forward."""

    flat_index_T: torch.Tensor
    """``[T]`` int64 row-major index ``seq * L + pos`` of each token in the padded ``[N, L]``."""
    num_seqs: int
    """``N``."""
    max_len: int
    """``L``."""
    mode: str
    """``"pad"`` or ``"mask"``."""
    mask_TT: torch.Tensor | None
    """``[T, T]`` bool block-diagonal causal mask (``"mask"`` mode only; True = attend)."""

    @staticmethod
    def build(
        seq_index_T: torch.Tensor,
        position_ids_T: torch.Tensor,
        lengths_N: torch.Tensor,
        *,
        mode: str = "auto",
    ) -> PackingInfo:
        """Index tensors for sequences of ``lengths_N`` packed as ``seq_index_T`` / ``position_ids_T``.

        ``mode="auto"`` picks the layout with fewer attention scores (``N*L^2`` vs ``T^2``).
        """
        n = int(lengths_N.shape[0])
        max_len = int(lengths_N.max()) if n else 0
        t = int(seq_index_T.shape[0])
        if mode == "auto":
            mode = "pad" if n * max_len * max_len <= t * t else "mask"
        mask_TT = None
        if mode == "mask":
            same_TT = seq_index_T[:, None] == seq_index_T[None, :]
            causal_TT = position_ids_T[:, None] >= position_ids_T[None, :]
            mask_TT = same_TT & causal_TT
        flat_index_T = seq_index_T * max_len + position_ids_T
        return PackingInfo(
            flat_index_T=flat_index_T, num_seqs=n, max_len=max_len, mode=mode, mask_TT=mask_TT
        )


def _repeat_kv(x_BKLD: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x_BKLD
    b, k, length, d = x_BKLD.shape
    return x_BKLD[:, :, None].expand(b, k, n_rep, length, d).reshape(b, k * n_rep, length, d)


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T, D]``, ``key/value [1, K, T, D]`` ->
    ``[1, T, H, D]``, attending only within each packed sequence.

    Needs ``rl_packing=PackingInfo`` among the model's forward kwargs.
    """
    info: PackingInfo | None = kwargs.get("rl_packing")
    if info is None:
        raise RLError(
            f"attention implementation {ATTN_NAME!r} serves only HFPolicy's packed forward (it "
            "needs the rl_packing kwarg); load the model with attn_implementation='sdpa' for "
            "other uses."
        )
    q_1HTD, k_1KTD, v_1KTD = query, key, value
    n_rep = q_1HTD.shape[1] // k_1KTD.shape[1]
    if info.mode == "mask":
        out_1HTD = torch.nn.functional.scaled_dot_product_attention(
            q_1HTD,
            _repeat_kv(k_1KTD, n_rep),
            _repeat_kv(v_1KTD, n_rep),
            attn_mask=info.mask_TT,
            dropout_p=dropout,
            scale=scaling,
        )
        return out_1HTD.transpose(1, 2), None

    n, length = info.num_seqs, info.max_len
    idx_T = info.flat_index_T

    def to_padded(x_1XTD: torch.Tensor) -> torch.Tensor:
        x_TXD = x_1XTD[0].transpose(0, 1)
        h, d = x_TXD.shape[1], x_TXD.shape[2]
        pad_SXD = x_TXD.new_zeros(n * length, h, d).index_copy(0, idx_T, x_TXD)
        return pad_SXD.view(n, length, h, d).transpose(1, 2)  # [N, X, L, D]

    q_NHLD = to_padded(q_1HTD)
    k_NHLD = _repeat_kv(to_padded(k_1KTD), n_rep)
    v_NHLD = _repeat_kv(to_padded(v_1KTD), n_rep)
    out_NHLD = torch.nn.functional.scaled_dot_product_attention(
        q_NHLD, k_NHLD, v_NHLD, dropout_p=dropout, scale=scaling, is_causal=True
    )
    out_SHD = out_NHLD.transpose(1, 2).reshape(n * length, out_NHLD.shape[1], out_NHLD.shape[3])
    return out_SHD.index_select(0, idx_T)[None], None


def register_packed_attention() -> None:
    """Register :func:`packed_sdpa_forward` under :data:`ATTN_NAME` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, packed_sdpa_forward)
