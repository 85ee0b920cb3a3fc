"""Which sequences of a step give the policy no gradient, so a trainer can leave them out of
the forward and backward passes without changing the update.

Under :class:`~rl_core.algorithms.losses.PolicyLoss` a token's policy-gradient term is
``-A_t * f(ratio_t)`` (PPO's clip, GSPO's sequence ratio, CISPO's clipped weight, each times a
mismatch weight): with ``A_t = 0`` on every trained token of a sequence, that sequence adds 0
to the loss and 0 to the gradient. It still counts in the step's aggregation (the number of
trained tokens, sequences or rollouts behind ``TrainBatch.loss_weights``), so a trainer that
skips it must compute the loss weights over the whole step first and keep them for the
sequences it trains: the remaining tokens then carry exactly the weights they had, and the
update is the same up to the order of floating-point reductions.

Other terms of the loss do give such a sequence gradient, and then nothing may be skipped:
an entropy bonus (``entropy_coef != 0``), a KL loss to a reference (``kl_coef > 0``), a
critic trained on the same batch, and several optimizer updates per step (PPO epochs or
mini-batches, whose split would change). :func:`skip_blocker` names the first that applies.

An optimizer step with a zero gradient is not a no-op (Adam's moments decay and its momentum
still moves the weights), so when every sequence is gradient-free a trainer keeps one (the
shortest, :func:`sequences_to_train`) and still takes the step.

Example::

    free_N = zero_advantage_sequences(batch.advantages, batch.loss_mask, batch.cu_seqlens)
    if skip_blocker(loss_cfg, critic=False, updates_per_step=1) is None:
        keep = sequences_to_train(free_N, seq_lens)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rl_core.algorithms._segments import check_cu_seqlens, segment_sum, seq_index

__all__ = [
    "WEIGHTED_MEAN_METRICS",
    "metrics_over_trained",
    "sequences_to_train",
    "skip_blocker",
    "zero_advantage_sequences",
]

WEIGHTED_MEAN_METRICS: frozenset[str] = frozenset(
    {
        "entropy",
        "kl",
        "ppo_kl",
        "pg_clipfrac",
        "pg_clipfrac_lower",
        "opsm_clipfrac",
        "mismatch",
        "tis_weight_mean",
        "tis_clipfrac",
        "tis_veto_frac",
    }
)
"""Step metrics of :class:`~rl_core.algorithms.losses.PolicyLoss` that are loss-weighted sums
``sum_t x_t w_t`` (means over the step when the weights sum to 1); ``loss``, ``pg_loss`` and
the gradient norm are exact under a skip and are not among them."""


def zero_advantage_sequences(
    advantages_T: torch.Tensor, loss_mask_T: torch.Tensor, cu_seqlens_N1: torch.Tensor
) -> list[bool]:
    """Per sequence ``[N]``: True when every trained token (``loss_mask > 0``) has advantage
    exactly 0 (a sequence with no trained token counts as gradient-free too)."""
    check_cu_seqlens(cu_seqlens_N1, int(loss_mask_T.shape[0]))
    n = int(cu_seqlens_N1.shape[0]) - 1
    nonzero_T = ((advantages_T != 0) & (loss_mask_T > 0)).double()
    count_N = segment_sum(nonzero_T, seq_index(cu_seqlens_N1), n)
    return [c == 0 for c in count_N.tolist()]


def skip_blocker(
    loss_config: Any, *, critic: bool, updates_per_step: int, teacher: bool = False
) -> str | None:
    """Why zero-advantage sequences still give gradient under these settings (the setting to
    change, as ``field = value``), or ``None`` when they give none and may be skipped.

    ``loss_config`` is a :class:`~rl_core.algorithms.losses.PolicyLoss.Config` (any object
    with ``entropy_coef`` and ``kl_coef``)."""
    if getattr(loss_config, "entropy_coef", 0.0) != 0:
        return f"loss.entropy_coef = {loss_config.entropy_coef} (an entropy bonus on every token)"
    if getattr(loss_config, "kl_coef", 0.0) > 0:
        return f"loss.kl_coef = {loss_config.kl_coef} (a KL loss on every token)"
    if critic:
        return "a critic (it trains on every sample)"
    if updates_per_step > 1:
        return f"{updates_per_step} updates per step (PPO epochs / mini-batches split the batch)"
    if teacher:
        return "a teacher (distillation shapes the advantages after they are computed)"
    return None


def metrics_over_trained(metrics: dict[str, float], kept_weight: float) -> dict[str, float]:
    """``metrics`` of a step that trained only part of its sequences, with each
    :data:`WEIGHTED_MEAN_METRICS` entry divided by ``kept_weight`` (the kept tokens' share of
    the step's loss weights, in (0, 1]): a weighted mean over the trained tokens instead of a
    sum that leaves the skipped ones out. Other entries are returned as they are."""
    if not 0 < kept_weight <= 1:
        raise ValueError(f"metrics_over_trained: kept_weight must be in (0, 1], got {kept_weight}.")
    return {
        k: (v / kept_weight if k in WEIGHTED_MEAN_METRICS and v is not None else v)
        for k, v in metrics.items()
    }


def sequences_to_train(
    gradient_free: Sequence[bool], seq_lens: Sequence[int], *, min_keep: int = 1
) -> list[int]:
    """Indices of the sequences to keep, in their order: every one that gives gradient, topped
    up with the shortest gradient-free ones to at least ``min_keep`` (so the optimizer still
    takes its step, and each of ``min_keep`` data-parallel ranks gets a sequence; a
    gradient-free sequence adds nothing to the update)."""
    if len(gradient_free) != len(seq_lens):
        raise ValueError(
            f"sequences_to_train: {len(gradient_free)} flags for {len(seq_lens)} sequences."
        )
    keep = [i for i, free in enumerate(gradient_free) if not free]
    missing = min(min_keep, len(seq_lens)) - len(keep)
    if missing > 0:
        free = sorted((i for i, f in enumerate(gradient_free) if f), key=lambda i: (seq_lens[i], i))
        keep = sorted(keep + free[:missing])
    return keep
