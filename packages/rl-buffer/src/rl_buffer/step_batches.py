"""Per-rank training batches of one optimizer step, from a :class:`~rl_buffer.balance.SchedulePlan`.

:func:`schedule_step` says which samples each data-parallel rank trains on and how they split into
micro-batches; :func:`rank_batches` turns that plan into one packed
:class:`~rl_core.types.TrainBatch` per rank, its ``micro_batch_bounds`` set from the plan and its
``loss_weights`` computed over the WHOLE step (:func:`rl_core.algorithms.compute_loss_weights`),
so the losses of all ranks' micro-batches sum to the loss of the whole batch (data-parallel
gradients are then summed, not averaged)::

    plan = schedule_step(rollouts, dp_size=world, max_tokens_per_micro_batch=4096)
    mine = rank_batches(rollouts, plan, advantages=adv, aggregation="token")[rank]
    for mb in mine.micro_batches():
        loss_fn(policy_logprobs(mb), mb).loss.backward()
    # all-reduce (SUM) the gradients over ranks, then step

Normalising per rank instead (each rank's token mean) weights a short rank's tokens more than a
long rank's and is not the whole-batch loss; this function is the way to avoid that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rl_buffer.balance import SchedulePlan
from rl_core.algorithms.aggregation import compute_loss_weights
from rl_core.batching import pack_rollouts
from rl_core.errors import DataError
from rl_core.types import Rollout, TrainBatch

__all__ = ["rank_batches"]


def rank_batches(
    rollouts: Sequence[Rollout],
    plan: SchedulePlan,
    *,
    advantages: Sequence[Sequence[float] | torch.Tensor] | None = None,
    aggregation: str = "token",
    aggregation_constant: float | None = None,
    mask_versions_below: int | None = None,
) -> list[TrainBatch]:
    """One :class:`~rl_core.types.TrainBatch` per rank of ``plan``, loss weights over the step.

    Args:
        rollouts: the step's samples, in the order ``plan`` was scheduled on (its indices point
            into this list).
        plan: :func:`~rl_buffer.balance.schedule_step`'s plan for exactly these rollouts.
        advantages: per rollout ``[R_i]`` (same order as ``rollouts``); zeros when omitted.
        aggregation: loss aggregation, one of
            :data:`rl_core.algorithms.AGGREGATION_MODES` (``token``, ``sequence``, ``rollout``,
            ``constant``), applied to the whole step.
        aggregation_constant: the divisor of ``constant`` aggregation.
        mask_versions_below: zero the loss mask on tokens of an older policy version (see
            :func:`rl_core.batching.pack_rollouts`).

    Returns:
        ``plan.dp_size`` batches; batch ``r`` holds rank ``r``'s samples in its micro-batch
        order (``batch.sample_ids`` names them), ``micro_batch_bounds`` from the plan (iterate
        with ``batch.micro_batches()``), and ``loss_weights`` such that
        ``sum over ranks and micro-batches of sum_t x_t * w_t`` is the whole step's loss.

    Raises:
        DataError: ``plan`` does not list every index of ``rollouts`` exactly once, a rank has
            no sample, or ``advantages`` has another length than ``rollouts``.
    """
    n = len(rollouts)
    order = [i for rank in range(plan.dp_size) for i in plan.rank_samples(rank)]
    if sorted(order) != list(range(n)):
        seen = set(order)
        odd = sorted({i for i in order if order.count(i) > 1} | (set(range(n)) - seen))
        bad = odd or sorted(seen - set(range(n)))
        raise DataError(
            f"rank_batches: the plan covers sample indices {len(order)} times ({len(seen)} "
            f"distinct) but there are {n} rollouts (e.g. index {bad[:3]} is missing, repeated or "
            "out of range); schedule_step the same rollouts, in the same order, you pass here"
        )
    empty = [r for r in range(plan.dp_size) if not plan.rank_samples(r)]
    if empty:
        raise DataError(
            f"rank_batches: rank {empty[0]} has no sample ({n} rollouts over {plan.dp_size} "
            "ranks); schedule at least one sample (or fan-out unit) per rank"
        )
    if advantages is not None and len(advantages) != n:
        raise DataError(
            f"rank_batches: {len(advantages)} advantages for {n} rollouts; give one [R_i] per "
            "rollout, in the rollouts' order"
        )
    ordered = [rollouts[i] for i in order]
    bounds: list[int] = [0]
    dp_bounds: list[int] = [0]
    for rank in range(plan.dp_size):
        offset = dp_bounds[-1]
        bounds.extend(offset + b for b in plan.micro_batch_bounds(rank)[1:])
        dp_bounds.append(offset + len(plan.rank_samples(rank)))
    batch = pack_rollouts(
        ordered,
        advantages=[advantages[i] for i in order] if advantages is not None else None,
        micro_batch_bounds=tuple(bounds),
        mask_versions_below=mask_versions_below,
    )
    weights_T = compute_loss_weights(
        batch.loss_mask,
        batch.cu_seqlens,
        mode=aggregation,
        rollout_ids=[r.rollout_id for r in ordered],
        constant=aggregation_constant,
    )
    batch = dataclasses.replace(
        batch, loss_weights=weights_T * batch.loss_mask, dp_bounds=tuple(dp_bounds)
    )
    return [batch.shard(rank) for rank in range(plan.dp_size)]
