"""Segment helpers for packed, padding-free tensors (private).

A packed batch concatenates ``N`` sequences into ``[T]`` tensors; ``cu_seqlens [N+1]`` marks their
bounds. A list of ``N`` ragged tensors ``[R_i]`` is handled the same way after ``torch.cat``.
Everything here is vectorised: no Python loop runs per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rl_core.errors import DataError


def check_cu_seqlens(cu_seqlens_N1: torch.Tensor, num_tokens: int) -> None:
    """Raise :class:`DataError` unless ``cu_seqlens`` starts at 0, never decreases and ends at T."""
    if cu_seqlens_N1.dim() != 1 or cu_seqlens_N1.numel() < 1:
        raise DataError(
            f"cu_seqlens: expected a 1-D tensor [N+1], got shape {tuple(cu_seqlens_N1.shape)}."
        )
    if int(cu_seqlens_N1[0]) != 0 or int(cu_seqlens_N1[-1]) != num_tokens:
        raise DataError(
            f"cu_seqlens: must start at 0 and end at the token count {num_tokens}, got "
            f"{int(cu_seqlens_N1[0])}..{int(cu_seqlens_N1[-1])}."
        )
    if bool((cu_seqlens_N1[1:] < cu_seqlens_N1[:-1]).any()):
        raise DataError("cu_seqlens: must be non-decreasing (cumulative sequence lengths).")


def seq_index(cu_seqlens_N1: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64 index of the sequence each packed token belongs to."""
    lengths_N = (cu_seqlens_N1[1:] - cu_seqlens_N1[:-1]).long()
    return torch.repeat_interleave(
        torch.arange(lengths_N.numel(), device=cu_seqlens_N1.device), lengths_N
    )


def segment_sum(x_T: torch.Tensor, seq_index_T: torch.Tensor, num_segments: int) -> torch.Tensor:
    """``[N]`` per-sequence sums of ``x_T`` (differentiable)."""
    out_N = torch.zeros(num_segments, dtype=x_T.dtype, device=x_T.device)
    return out_N.index_add(0, seq_index_T, x_T)


def ragged_lengths(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Lengths ``R_i`` of a list of 1-D tensors."""
    return [int(t.shape[0]) for t in tensors]


def compact(
    x_T: torch.Tensor, mask_T: torch.Tensor, seq_T: torch.Tensor, num_seqs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the masked tokens of each sequence into a left-aligned ``[N, L]`` matrix.

    Returns ``(x_NL, valid_NL, rows_K, cols_K)`` where ``K`` is the number of masked tokens,
    ``L`` the largest per-sequence count, and ``x_NL[rows_K, cols_K]`` are the masked entries of
    ``x_T`` in order. Use :func:`uncompact` to scatter a result back.
    """
    on_T = mask_T > 0
    rows_K = seq_T[on_T]
    counts_N = torch.zeros(num_seqs, dtype=torch.long, device=x_T.device).index_add(
        0, rows_K, torch.ones_like(rows_K)
    )
    starts_N = torch.cumsum(counts_N, 0) - counts_N
    cols_K = torch.arange(rows_K.numel(), device=x_T.device) - starts_N[rows_K]
    width = int(counts_N.max()) if num_seqs > 0 and rows_K.numel() > 0 else 0
    x_NL = torch.zeros(num_seqs, width, dtype=x_T.dtype, device=x_T.device)
    valid_NL = torch.zeros(num_seqs, width, dtype=torch.bool, device=x_T.device)
    x_NL[rows_K, cols_K] = x_T[on_T]
    valid_NL[rows_K, cols_K] = True
    return x_NL, valid_NL, rows_K, cols_K


def uncompact(
    x_NL: torch.Tensor, mask_T: torch.Tensor, rows_K: torch.Tensor, cols_K: torch.Tensor
) -> torch.Tensor:
    """Inverse of :func:`compact`: ``[T]`` with the masked positions filled, 0 elsewhere."""
    out_T = torch.zeros(mask_T.shape[0], dtype=x_NL.dtype, device=x_NL.device)
    out_T[mask_T > 0] = x_NL[rows_K, cols_K]
    return out_T


def discounted_cumsum(x_NL: torch.Tensor, discount: float, chunk: int = 128) -> torch.Tensor:
    """Reverse discounted sum along the last dim: ``y_t = sum_{l>=0} discount**l * x_{t+l}``.

    Runs as a chunked scan: inside a chunk of ``chunk`` steps a small upper-triangular matrix of
    powers does the work; the carry from later chunks is added with one more power. Powers never
    exceed ``chunk``, so long sequences do not overflow or underflow.
    """
    n, length = x_NL.shape
    if length == 0:
        return x_NL.clone()
    c = min(chunk, length)
    idx = torch.arange(c, device=x_NL.device, dtype=x_NL.dtype)
    # powers_CC[i, j] = discount**(j - i) for j >= i, else 0
    expo_CC = idx[None, :] - idx[:, None]
    powers_CC = torch.where(
        expo_CC >= 0, torch.as_tensor(discount, dtype=x_NL.dtype) ** expo_CC.clamp_min(0), 0.0
    )
    out_NL = torch.empty_like(x_NL)
    carry_N = torch.zeros(n, dtype=x_NL.dtype, device=x_NL.device)
    for end in range(length, 0, -c):
        start = max(0, end - c)
        w = end - start
        block_NW = x_NL[:, start:end]
        # y_i = sum_j discount**(j-i) x_j  +  discount**(w-i) * carry
        tail_W = torch.as_tensor(discount, dtype=x_NL.dtype) ** (w - idx[:w])
        y_NW = block_NW @ powers_CC[:w, :w].T + carry_N[:, None] * tail_W[None, :]
        out_NL[:, start:end] = y_NW
        carry_N = y_NW[:, 0]
    return out_NL
