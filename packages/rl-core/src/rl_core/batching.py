"""Packing rollouts into padding-free :class:`~rl_core.types.TrainBatch` tensors.

Per-token data of a rollout covers its response (``[R]``); packing places it at the response
positions of the packed sequence and fills prompt positions with zeros (mask 0)::

    tokens      p0 p1 p2 r0 r1 r2 | q0 q1 s0 s1
    loss_mask    0  0  0  1  1  1 |  0  0  1  1
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rl_core.types import Rollout, TrainBatch

__all__ = [
    "gather_response",
    "pack_rollouts",
    "pack_sequences",
    "plan_micro_batches",
    "scatter_response",
]


def scatter_response(
    rollouts: Sequence[Rollout], values: Sequence[Sequence[float] | torch.Tensor]
) -> torch.Tensor:
    """Place per-response values ``[R_i]`` of each rollout at its response positions of the
    packed ``[T]`` layout (zeros at prompt positions)."""
    flat: list[float] = []
    tensors: list[torch.Tensor] = []
    for r, v in zip(rollouts, values, strict=True):
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else (len(v),)
        if shape != (r.response_length,):
            raise ValueError(
                f"Rollout {r.sample_id}: {shape} values for a response of "
                f"{r.response_length} tokens."
            )
        if isinstance(v, torch.Tensor):
            tensors.append(v)
        else:
            flat.extend(v)
    if not rollouts:
        return torch.zeros(0)
    # One tensor for all values and one masked write (no per-rollout tensors: this runs a
    # few times per step over every rollout).
    if tensors and flat:  # mixed tensors and sequences: keep each rollout's own values
        flat_R = torch.cat([torch.as_tensor(v, dtype=torch.float32) for v in values])
    elif tensors:
        flat_R = torch.cat(tensors).to(torch.float32)
    else:
        flat_R = torch.tensor(flat, dtype=torch.float32)
    out_T = torch.zeros(sum(len(r.tokens) for r in rollouts), dtype=torch.float32)
    out_T[_response_mask(rollouts)] = flat_R
    return out_T


def _response_mask(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """``[T]`` bool, True at the response positions of the rollouts packed in order."""
    lengths_N = torch.tensor([len(r.tokens) for r in rollouts], dtype=torch.int64)
    starts_N = torch.tensor([r.response_start for r in rollouts], dtype=torch.int64)
    seq_T = torch.repeat_interleave(torch.arange(len(rollouts)), lengths_N)
    first_N = torch.cumsum(lengths_N, 0) - lengths_N
    pos_T = torch.arange(int(lengths_N.sum())) - first_N[seq_T]
    return pos_T >= starts_N[seq_T]


def gather_response(rollouts: Sequence[Rollout], x_T: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of :func:`scatter_response`: each rollout's response slice ``[R_i]`` of a
    packed ``[T]`` tensor (rollouts in packing order)."""
    total = sum(len(r.tokens) for r in rollouts)
    if x_T.shape != (total,):
        raise ValueError(f"gather_response: got {tuple(x_T.shape)} for {total} packed tokens.")
    out, start = [], 0
    for r in rollouts:
        out.append(x_T[start + r.response_start : start + len(r.tokens)])
        start += len(r.tokens)
    return out


def pack_rollouts(
    rollouts: Sequence[Rollout],
    *,
    advantages: Sequence[Sequence[float] | torch.Tensor] | None = None,
    loss_weights: torch.Tensor | None = None,
    micro_batch_bounds: Sequence[int] = (),
    mask_versions_below: int | None = None,
) -> TrainBatch:
    """Pack rollouts (in the given order) into one :class:`TrainBatch`.

    ``advantages``: per rollout ``[R_i]`` (zeros when omitted, e.g. for SFT). ``loss_weights``:
    ``[T]`` from :func:`rl_core.algorithms.aggregation.compute_loss_weights`; when omitted it is
    the token mean over the loss mask. A rollout's ``metadata[SEQUENCE_ADAPTER_KEY]``
    (:mod:`rl_core.lora`, multi-LoRA) becomes its ``TrainBatch.adapters`` entry.
    ``mask_versions_below``: zero the loss mask on tokens
    produced by a policy version older than this (off-policy masking for partial rollouts).
    """
    if not rollouts:
        raise ValueError("pack_rollouts: no rollouts to pack.")
    lengths = [len(r.tokens) for r in rollouts]
    cu_N1 = torch.zeros(len(rollouts) + 1, dtype=torch.int64)
    cu_N1[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tokens_T = torch.tensor([t for r in rollouts for t in r.tokens], dtype=torch.int64)
    mask_T = scatter_response(rollouts, [r.loss_mask for r in rollouts])
    versions_T = torch.tensor(
        [v for r in rollouts for v in ((-1,) * r.response_start + tuple(r.versions))],
        dtype=torch.int64,
    )
    # The first token of a sequence has no log-prob: never train on it.
    mask_T[cu_N1[:-1]] = 0.0
    if mask_versions_below is not None:
        mask_T = mask_T * ((versions_T < 0) | (versions_T >= mask_versions_below)).float()
    rollout_logp_T = scatter_response(rollouts, [r.rollout_logprobs for r in rollouts])
    adv_T = (
        scatter_response(rollouts, advantages) * mask_T
        if advantages is not None
        else torch.zeros_like(mask_T)
    )
    if loss_weights is None:
        loss_weights = mask_T / mask_T.sum().clamp(min=1.0)
    routed = [r.routed_experts for r in rollouts]
    if any(x is not None for x in routed) and not all(x is not None for x in routed):
        missing = next(r.sample_id for r in rollouts if r.routed_experts is None)
        raise ValueError(
            f"pack_rollouts: rollout {missing} has no routed_experts but others in the batch do; "
            "with routing replay every rollout of a step must carry its routing."
        )
    from rl_core.lora import SEQUENCE_ADAPTER_KEY

    adapters = tuple(r.metadata.get(SEQUENCE_ADAPTER_KEY) for r in rollouts)
    return TrainBatch(
        tokens=tokens_T,
        cu_seqlens=cu_N1,
        loss_mask=mask_T,
        loss_weights=loss_weights * mask_T,
        advantages=adv_T,
        rollout_logprobs=rollout_logp_T,
        versions=versions_T,
        routed_experts=torch.cat(routed) if routed[0] is not None else None,
        sample_ids=tuple(r.sample_id for r in rollouts),
        adapters=adapters if any(a is not None for a in adapters) else (),
        micro_batch_bounds=tuple(micro_batch_bounds),
    )


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> tuple[int, ...]:
    """Bounds ``[0, k1, ..., N]`` of consecutive micro-batches of at most ``max_tokens`` tokens
    each (a single longer sequence gets a micro-batch of its own)."""
    bounds = [0]
    acc = 0
    for i, n in enumerate(lengths):
        if acc and acc + n > max_tokens:
            bounds.append(i)
            acc = 0
        acc += n
    bounds.append(len(lengths))
    return tuple(bounds)


def pack_sequences(
    seqs: Sequence[torch.Tensor] | Sequence[Sequence[int]],
    *,
    micro_batch_bounds: tuple[int, ...] = (),
    advantages: float = 1.0,
) -> TrainBatch:
    """Pack plain token sequences into a :class:`TrainBatch` (tests, compile warm-ups).

    Every token but the first of each sequence is trained on (``loss_mask`` 1); ``loss_weights``
    is the mask divided by the number of masked tokens (per-token mean); ``advantages`` is the
    given constant on masked tokens.
    """
    tensors = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in seqs]
    lengths_N = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
    cu_N1 = torch.zeros(len(tensors) + 1, dtype=torch.int64)
    cu_N1[1:] = lengths_N.cumsum(0)
    tokens_T = torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.int64)
    mask_T = torch.ones(tokens_T.shape[0], dtype=torch.float32)
    mask_T[cu_N1[:-1][lengths_N > 0]] = 0.0
    weights_T = mask_T / mask_T.sum().clamp_min(1.0)
    return TrainBatch(
        tokens=tokens_T,
        cu_seqlens=cu_N1,
        loss_mask=mask_T,
        loss_weights=weights_T,
        advantages=mask_T * advantages,
        micro_batch_bounds=micro_batch_bounds,
    )
