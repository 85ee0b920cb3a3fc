"""Loss aggregation as per-token weights.

A :class:`~rl_core.types.TrainBatch` carries ``loss_weights [T]``: the step loss is
``sum_t x_t * w_t`` summed over every micro-batch and data-parallel rank. Folding the aggregation
into weights makes micro-batch and rank splits exact: each token's weight is fixed before the
split, from step-wide counts.

With ``m_t`` the loss mask, ``M_i = sum_{t in i} m_t`` the masked tokens of sequence ``i``:

- ``token``: ``w_t = m_t / sum_t m_t`` (mean over all trained tokens of the step);
- ``sequence``: ``w_t = m_t / (M_i * num_seqs)`` (mean over sequences of each one's token mean);
- ``rollout``: fan-out siblings that share a ``rollout_id`` count as one:
  ``w_t = m_t / (D_r * num_rollouts)`` with ``D_r`` the masked tokens of *all* siblings of
  rollout ``r``. Without fan-out this equals ``sequence``;
- ``constant``: Dr.GRPO's ``w_t = m_t / (constant * num_seqs)`` (e.g. ``constant`` = the maximum
  response length), which removes the length bias of per-sequence means.

Counts default to the tensors given. A caller that computes weights per rank passes the
step-wide ``global_tokens`` / ``global_sequences`` / ``global_rollouts`` (and, for ``rollout``,
``rollout_tokens`` when siblings of one rollout sit on different ranks). A sequence (or rollout)
with no masked token gets weight 0 but still counts in ``num_seqs`` (``num_rollouts``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch

from rl_core.algorithms._segments import check_cu_seqlens, segment_sum, seq_index
from rl_core.errors import ConfigError, DataError

__all__ = ["AGGREGATION_MODES", "compute_loss_weights", "rollout_token_counts"]

AGGREGATION_MODES: tuple[str, ...] = ("token", "sequence", "rollout", "constant")
"""Names accepted by :func:`compute_loss_weights`."""


def _ids_list(rollout_ids: Sequence[Hashable] | torch.Tensor, n: int) -> list[Hashable]:
    ids = rollout_ids.tolist() if isinstance(rollout_ids, torch.Tensor) else list(rollout_ids)
    if len(ids) != n:
        raise DataError(
            f"rollout_ids: {len(ids)} ids for {n} sequences; give one rollout id per sequence."
        )
    return ids


def rollout_token_counts(
    loss_mask_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    rollout_ids: Sequence[Hashable] | torch.Tensor,
) -> dict[Hashable, float]:
    """Masked-token count ``D_r`` of each rollout id, summed over its fan-out siblings.

    Compute this over the whole step (or sum the dicts of all ranks) and pass it as
    ``rollout_tokens`` when siblings may be split across ranks.
    """
    check_cu_seqlens(cu_seqlens_N1, int(loss_mask_T.shape[0]))
    n = int(cu_seqlens_N1.shape[0]) - 1
    ids = _ids_list(rollout_ids, n)
    per_seq_N = segment_sum((loss_mask_T > 0).double(), seq_index(cu_seqlens_N1), n)
    out: dict[Hashable, float] = {}
    for rid, count in zip(ids, per_seq_N.tolist()):
        out[rid] = out.get(rid, 0.0) + count
    return out


def compute_loss_weights(
    loss_mask_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor,
    *,
    mode: str,
    rollout_ids: Sequence[Hashable] | torch.Tensor | None = None,
    global_tokens: float | None = None,
    global_sequences: int | None = None,
    global_rollouts: int | None = None,
    constant: float | None = None,
    rollout_tokens: Mapping[Hashable, float] | None = None,
) -> torch.Tensor:
    """Per-token loss weights ``[T]`` (float32, 0 off the mask) for the aggregation ``mode``.

    Args:
        loss_mask_T: ``[T]`` 1 on trained tokens.
        cu_seqlens_N1: ``[N+1]`` cumulative sequence lengths.
        mode: one of :data:`AGGREGATION_MODES` (see the module docstring).
        rollout_ids: ``[N]`` rollout id per sequence (``Rollout.rollout_id``); needed for ``rollout``.
        global_tokens: step-wide masked-token count for ``token`` (default: this batch's).
        global_sequences: step-wide sequence count for ``sequence`` / ``constant`` (default ``N``).
        global_rollouts: step-wide distinct rollout count for ``rollout`` (default: this batch's).
        constant: the divisor of ``constant`` mode (> 0).
        rollout_tokens: step-wide ``D_r`` per rollout id for ``rollout`` (default: from this batch);
            see :func:`rollout_token_counts`.
    """
    if mode not in AGGREGATION_MODES:
        raise ConfigError(
            f"loss aggregation mode: unknown {mode!r}; choose one of {', '.join(AGGREGATION_MODES)}."
        )
    num_tokens = int(loss_mask_T.shape[0])
    check_cu_seqlens(cu_seqlens_N1, num_tokens)
    n = int(cu_seqlens_N1.shape[0]) - 1
    m_T = (loss_mask_T > 0).to(torch.float64)
    seq_T = seq_index(cu_seqlens_N1)

    if mode == "token":
        total = float(m_T.sum()) if global_tokens is None else float(global_tokens)
        w_T = m_T / total if total > 0 else torch.zeros_like(m_T)
        return w_T.float()

    num_seqs = n if global_sequences is None else int(global_sequences)
    if mode == "sequence":
        denom_N = segment_sum(m_T, seq_T, n) * max(num_seqs, 1)
    elif mode == "constant":
        if constant is None or constant <= 0:
            raise ConfigError(
                f"loss aggregation 'constant': constant must be a number > 0 (e.g. the maximum "
                f"response length), got {constant!r}."
            )
        denom_N = torch.full(
            (n,), float(constant) * max(num_seqs, 1), dtype=torch.float64, device=m_T.device
        )
    else:  # rollout
        if rollout_ids is None:
            raise ConfigError(
                "loss aggregation 'rollout' needs rollout_ids (one Rollout.rollout_id per "
                "sequence); pass them or use mode 'sequence'."
            )
        ids = _ids_list(rollout_ids, n)
        counts = (
            rollout_token_counts(loss_mask_T, cu_seqlens_N1, ids)
            if rollout_tokens is None
            else rollout_tokens
        )
        missing = [rid for rid in ids if rid not in counts]
        if missing:
            raise DataError(f"rollout_tokens: no count for rollout id {missing[0]!r}.")
        num_rollouts = len(set(ids)) if global_rollouts is None else int(global_rollouts)
        d_N = torch.tensor(
            [float(counts[rid]) for rid in ids], dtype=torch.float64, device=m_T.device
        )
        denom_N = d_N * max(num_rollouts, 1)

    denom_T = denom_N[seq_T]
    w_T = torch.where(denom_T > 0, m_T / denom_T.clamp_min(1e-300), 0.0)
    return w_T.float()
