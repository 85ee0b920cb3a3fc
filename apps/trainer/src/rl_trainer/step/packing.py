"""Plan and pack: the order, micro-batch and data-parallel bounds of a step's rollouts
(FLOPs-balanced, under the token cap) and their packed batch, and the batch's per-token loss
weights. Used by the RL step (:mod:`rl_trainer.step.stages`), its PPO mini-batches
(:mod:`rl_trainer.step.ppo_updates`) and the SFT phase."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rl_buffer.balance import schedule_step
from rl_core.algorithms import compute_loss_weights
from rl_core.batching import pack_rollouts
from rl_core.types import Rollout, TrainBatch

__all__ = ["loss_weights", "plan", "plan_and_pack"]


def plan(
    rollouts: Sequence[Rollout], policy: Any, max_tokens_per_micro_batch: int
) -> tuple[list[int], tuple[int, ...], tuple[int, ...]]:
    """FLOPs-balanced plan (rl-buffer's scheduler) under the token cap: the order to pack the
    rollouts in, the micro-batch bounds and, with data-parallel policy ranks, the shard
    bounds (``()`` for one rank). Shards are packed one after the other in rank order. For a
    policy that ``shares_prefixes``, a group's samples (one ``prompt_uid``) share a
    micro-batch where the cap allows."""
    dp = int(getattr(policy, "data_parallel_size", 1))
    shares = bool(getattr(policy, "shares_prefixes", False))
    schedule = schedule_step(
        rollouts,
        dp_size=dp,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch,
        shape=policy.model_shape,
        prefix_groups=[r.prompt_uid for r in rollouts] if shares else None,
    )
    if dp == 1:
        return schedule.rank_samples(0), schedule.micro_batch_bounds(0), ()
    order: list[int] = []
    bounds: list[int] = [0]
    dp_bounds: list[int] = [0]
    for rank in range(dp):
        offset = len(order)
        order.extend(schedule.rank_samples(rank))
        bounds.extend(offset + b for b in schedule.micro_batch_bounds(rank)[1:])
        dp_bounds.append(len(order))
    return order, tuple(sorted(set(bounds))), tuple(dp_bounds)


def plan_and_pack(
    rollouts: Sequence[Rollout],
    policy: Any,
    max_tokens_per_micro_batch: int,
    *,
    mask_versions_below: int | None = None,
) -> tuple[TrainBatch, list[int]]:
    """Plan (:func:`plan`) and pack ``rollouts``: the batch, with its micro-batch and
    data-parallel shard bounds, and the order its sequences are in."""
    order, bounds, dp_bounds = plan(rollouts, policy, max_tokens_per_micro_batch)
    batch = pack_rollouts(
        [rollouts[i] for i in order],
        micro_batch_bounds=bounds,
        mask_versions_below=mask_versions_below,
    )
    batch.dp_bounds = dp_bounds
    return batch, order


def loss_weights(batch: TrainBatch, rollouts: Sequence[Rollout], alg: Any) -> torch.Tensor:
    """Per-token loss weights of ``batch`` (whose sequences are ``rollouts``, in order) under
    ``alg.aggregation`` (``algorithm`` section), on the loss mask's device."""
    return compute_loss_weights(
        batch.loss_mask,
        batch.cu_seqlens,
        mode=alg.aggregation,
        rollout_ids=[r.rollout_id for r in rollouts],
        constant=alg.aggregation_constant,
    ).to(batch.loss_mask.device)
