"""PPO epochs and mini-batches: several optimizer steps per rollout batch.

The ``train`` stage (:func:`rl_trainer.step.stages.train`) builds one packed batch of the step's
groups (:func:`rl_trainer.step.stages.rl_batch`): advantages (and GAE returns) over the whole batch,
so group baselines and batch whitening see every rollout, and the old log-probs (and critic
values) of the policy before any update. This module then runs::

    for epoch in range(rl.ppo_epochs):
        for mini_batch in mini_batches:         # rl.mini_batches_per_step, whole groups each
            policy.train_step(mini_batch)       # (+ critic.train_step(mini_batch))

Each mini-batch holds whole groups (prompts), consecutive in the order the buffer returned
them, and is re-planned on its own (FLOPs-balanced order, ``rl.max_tokens_per_micro_batch``
micro-batches, data-parallel shards); its loss weights are the step's aggregation
(``algorithm.aggregation``) computed over the mini-batch alone, so each optimizer step
minimises a mean over its own tokens (sequences, rollouts), as verl and slime do. The mini-batches
are the same in every epoch (no reshuffling), so runs stay reproducible.

From the second update on, the policy differs from the one that computed the old log-probs:
the importance ratio moves away from 1 and the clip range acts; the step reports the mean over
its updates of the loss, gradient norm, clip fraction and ``ppo_kl`` and the number of updates
(``train/optimizer_steps``). With one epoch and one mini-batch this is exactly one
``train_step`` on the batch ``rl_batch`` built, as before.

Versions: every optimizer step is a policy version (:attr:`rl_core.interfaces.Policy.version`),
so an RL step advances the policy by ``rl.updates_per_step`` versions; the trainer's version
arithmetic (:meth:`rl_trainer.run_state.RunState.train_version`, the rollout pipeline, staleness) counts
RL steps of that many versions each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from rl_core.algorithms.skipping import WEIGHTED_MEAN_METRICS
from rl_core.errors import RLError
from rl_core.types import Group, Rollout, TrainBatch
from rl_trainer.step.packing import loss_weights, plan

if TYPE_CHECKING:
    from rl_trainer.assembly import Components
    from rl_trainer.config import TrainerConfig
    from rl_trainer.run_state import PhaseModels

__all__ = ["mini_batches", "optimize", "take_sequences"]


def take_sequences(
    batch: TrainBatch,
    seq_index: Sequence[int],
    *,
    micro_batch_bounds: tuple[int, ...] = (),
    dp_bounds: tuple[int, ...] = (),
) -> TrainBatch:
    """The sequences ``seq_index`` of ``batch``, in that order, as a new packed batch with the
    given micro-batch and data-parallel bounds.

    Every per-token tensor field (first dimension ``T``: tokens, masks, weights, advantages,
    log-probs, values, routing, and any field added later) is gathered; ``cu_seqlens`` and
    ``sample_ids`` and ``adapters`` follow the sequences; other fields are kept as they are.
    """
    cu_N1 = batch.cu_seqlens.to("cpu")
    t = batch.num_tokens
    spans = [(int(cu_N1[i]), int(cu_N1[i + 1])) for i in seq_index]
    idx_T = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in spans])
    idx_T = idx_T.to(batch.tokens.device)
    lengths = torch.tensor([b - a for a, b in spans], dtype=torch.int64)
    new_cu = torch.zeros(len(spans) + 1, dtype=batch.cu_seqlens.dtype)
    new_cu[1:] = torch.cumsum(lengths, 0)
    changes: dict[str, Any] = {
        "cu_seqlens": new_cu.to(batch.cu_seqlens.device),
        "sample_ids": tuple(batch.sample_ids[i] for i in seq_index) if batch.sample_ids else (),
        "adapters": tuple(batch.adapters[i] for i in seq_index) if batch.adapters else (),
        "micro_batch_bounds": tuple(micro_batch_bounds),
        "dp_bounds": tuple(dp_bounds),
    }
    for f in dataclasses.fields(batch):
        if f.name in changes:
            continue
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == t:
            changes[f.name] = value[idx_T.to(value.device)]
    return dataclasses.replace(batch, **changes)


def mini_batches(
    cfg: TrainerConfig, policy: Any, batch: TrainBatch, groups: Sequence[Group]
) -> list[TrainBatch]:
    """``batch`` split into ``rl.mini_batches_per_step`` mini-batches of whole groups (module
    docstring), each re-planned for ``policy`` and with its own loss weights; ``[batch]`` for
    one."""
    n = cfg.rl.mini_batches_per_step
    if n == 1:
        return [batch]
    if len(groups) % n:
        raise RLError(
            f"rl.mini_batches_per_step: {n} does not divide the step's {len(groups)} groups; "
            "set rollout.prompts_per_step to a multiple of it."
        )
    position = {sid: i for i, sid in enumerate(batch.sample_ids)}
    if len(position) != batch.num_sequences:
        raise RLError(
            "rl.mini_batches_per_step: the step's rollouts do not have unique sample ids, so "
            "the batch cannot be split by group; use rl.mini_batches_per_step: 1 with this "
            "rollout function."
        )
    alg = cfg.algorithm
    per = len(groups) // n
    out = []
    for j in range(n):
        rollouts: list[Rollout] = [r for g in groups[j * per : (j + 1) * per] for r in g.rollouts]
        order, bounds, dp_bounds = plan(rollouts, policy, cfg.rl.max_tokens_per_micro_batch)
        rollouts = [rollouts[i] for i in order]
        mb = take_sequences(
            batch,
            [position[r.sample_id] for r in rollouts],
            micro_batch_bounds=bounds,
            dp_bounds=dp_bounds,
        )
        mb.loss_weights = loss_weights(mb, rollouts, alg)
        out.append(mb)
    return out


def per_token_means(
    record: dict[str, float], batch: TrainBatch, aggregation: str
) -> dict[str, float]:
    """``record`` (one ``train_step``'s metrics on ``batch``) with the loss-weighted means
    (:data:`rl_core.algorithms.skipping.WEIGHTED_MEAN_METRICS`) as per-token means (the losses
    report them as ``sum_t x_t w_t``): under ``aggregation: constant`` every loss token weighs the same
    ``1 / (constant * sequences)``, so dividing the weighted sum by the weights' sum gives the
    plain mean over the loss tokens; other aggregations are returned unchanged."""
    if aggregation != "constant":
        return record
    total = float((batch.loss_weights.double() * batch.loss_mask.double()).sum())
    if total <= 0:
        return record
    return {k: (v / total if k in WEIGHTED_MEAN_METRICS else v) for k, v in record.items()}


def _mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the updates that reported it (a single update: its values)."""
    if len(records) == 1:
        return dict(records[0])
    keys = dict.fromkeys(k for r in records for k in r)
    out: dict[str, float] = {}
    for k in keys:
        values = [float(r[k]) for r in records if k in r]
        out[k] = sum(values) / len(values)
    if "lr" in records[-1]:
        out["lr"] = float(records[-1]["lr"])  # the rate of the last update
    return out


def optimize(
    cfg: TrainerConfig,
    models: PhaseModels,
    parts: Components,
    batch: TrainBatch,
    groups: Sequence[Group],
) -> tuple[dict[str, float], dict[str, float] | None, int]:
    """Run the step's updates (module docstring) of ``models.policy`` (and ``models.critic``)
    with ``parts``' losses on ``batch``, built from ``groups`` by ``rl_batch``; returns the
    policy's and the critic's (``None`` without one) metrics, each the mean over the updates,
    and the number of optimizer steps taken."""
    policy, critic_model = models.policy, models.critic
    assert policy is not None
    minis = mini_batches(cfg, policy, batch, groups)
    policy_records: list[dict[str, float]] = []
    critic_records: list[dict[str, float]] = []
    for _epoch in range(cfg.rl.ppo_epochs):
        for mb in minis:
            record = policy.train_step(mb, parts.loss_fn)
            policy_records.append(per_token_means(record, mb, cfg.algorithm.aggregation))
            if critic_model is not None:
                critic_records.append(critic_model.train_step(mb, parts.value_loss_fn))
    critic = _mean_metrics(critic_records) if critic_records else None
    return _mean_metrics(policy_records), critic, len(policy_records)
