"""The RL step as explicit stages (DESIGN §6). One RL step runs, in order::

    produce_round   generate + score + filter until P groups, buffer.put   (a round; async mode
                    runs it ahead in the pipeline)
    take_groups     buffer.take(P, min_version=version - max_staleness)    + staleness metrics
    plan_and_pack   FLOPs-balanced order, micro-batch and data-parallel bounds, packed batch
                    (:mod:`rl_trainer.step.packing`)
    rl_batch        + critic values -> rewards and advantages (GAE returns), loss weights,
                    reference / old log-probs
    train           policy.train_step (+ critic.train_step), once or per   + train metrics
                    PPO epoch and mini-batch (:mod:`rl_trainer.step.ppo_updates`)
    publish         transport.publish -> generator.update_weights          (checked version)

The pure stages take their inputs as arguments; the ones that drive the run's components
(``produce_round``, ``generate``, ``rl_batch``, ``train``, the publication) take the run's
typed state (:class:`~rl_trainer.run_state.RunState`) that holds them. Planning and packing
are :mod:`rl_trainer.step.packing`. A new stage (a teacher's log-probs, PPO epochs) is a function here called by
the RL phase (:mod:`rl_trainer.phases.rl`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rl_agents.resumable import ResumableGenerator
from rl_buffer.failures import RolloutStats
from rl_buffer.filters import filter_groups
from rl_buffer.rollout import (
    PartialStats,
    agent_metrics,
    generate_groups,
    generate_groups_resumable,
)
from rl_buffer.sampler import exhausted_error
from rl_core.algorithms.losses import PolicyLoss
from rl_core.algorithms.skipping import (
    metrics_over_trained,
    sequences_to_train,
    skip_blocker,
    zero_advantage_sequences,
)
from rl_core.batching import gather_response, scatter_response
from rl_core.errors import RLError
from rl_core.rewards.shaping import OverlongPenalty
from rl_core.types import AdvantageInputs, Group, Prompt, Rollout, SamplingParams, TrainBatch
from rl_trainer.build import component_name
from rl_trainer.step import lora, ppo_updates, routing, teacher
from rl_trainer.step.packing import loss_weights, plan_and_pack
from rl_trainer.step.pipeline import Weights

if TYPE_CHECKING:
    from rl_trainer.run_state import RunState

__all__ = [
    "advantages",
    "generate",
    "load_update",
    "produce_round",
    "publish",
    "publish_only",
    "resumable_generator",
    "rl_batch",
    "round_metrics",
    "serve",
    "sync_weights",
    "take_groups",
    "train",
]


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


# ----------------------------------------------------------------------------- produce
async def generate(
    run: RunState,
    prompts: Sequence[Prompt],
    sampling: SamplingParams,
    n_samples: int,
    seed_parts: tuple[Any, ...],
    stats: RolloutStats,
) -> list[Group]:
    """Sample ``n_samples`` rollouts per prompt on the run's current generator (a custom
    ``generate_fn`` of a round with partial rollouts gets it resumable:
    :func:`resumable_generator`); ``generate_fn`` failures are counted in ``stats``."""
    generator = run.models.generator
    if run.parts.generate_fn is not None and _partial(run):
        generator = resumable_generator(run)
    return await generate_groups(
        prompts,
        generator=generator,
        tokenizer=run.tokenizer,
        sampling=sampling,
        n_samples=n_samples,
        seed_parts=seed_parts,
        policy_version=run.models.policy.version,
        generate_fn=run.parts.generate_fn,
        stats=stats,
        generate_fn_name=component_name("rollout.generate_fn", run.config.rollout.generate_fn),
        return_routing=run.config.rollout.routing_replay != "off",
    )


def _partial(run: RunState) -> bool:
    """Whether rounds are interruptible by weight updates (``rl.partial_rollouts``, async)."""
    return run.config.rl.partial_rollouts and run.pipeline is not None


def resumable_generator(run: RunState) -> ResumableGenerator:
    """The run's generator behind :class:`~rl_agents.resumable.ResumableGenerator` on the
    rollout pipeline (one per generator and pipeline, so an agent server built on
    ``ctx.generator`` is kept across prompts): a custom ``generate_fn``'s in-flight turn is
    aborted by a weight release and resumed on the new weights."""
    wrapped = run.resumable_generator
    if (
        wrapped is None
        or wrapped.inner is not run.models.generator
        or wrapped.updates is not run.pipeline
    ):
        wrapped = ResumableGenerator(run.models.generator, run.pipeline)
        run.resumable_generator = wrapped
    return wrapped


async def produce_round(run: RunState, step: int) -> dict[str, Any]:
    """One rollout round: generate and score until the dynamic sampler holds
    ``prompts_per_step`` kept groups fresh enough for step ``step`` (surplus kept groups carry
    over to the next round), put them into the buffer, and return the round's metrics.

    User code that fails (reward, group reward, ``generate_fn``, filters) is counted in
    ``rollout/failed/<reason>`` and logged once per reason with its first cause; when every
    rollout of a round failed, the run stops at once with that report. In ``rl-train replay``
    the round's groups come from the dump instead (:mod:`rl_trainer.ops.replay`)."""
    if run.replay is not None:
        return run.replay.produce_round(run, step)
    cfg, parts = run.config.rollout, run.parts
    sampler = parts.sampler
    stats = RolloutStats()
    scored: list[Rollout] = []
    rl = run.config.rl
    stale = sampler.drop_older_than(
        run.train_version(step) - rl.max_staleness * rl.updates_per_step
    )
    gen_tokens, gen_time = 0, 0.0
    round_ = 0
    partial = PartialStats() if run.config.rl.partial_rollouts else None
    turns_before = None
    if partial is not None and parts.generate_fn is not None and run.pipeline is not None:
        turns_before = dataclasses.replace(resumable_generator(run).stats)
    while not sampler.full:
        prompts = parts.train_data.next_prompts(sampler.request_size())
        if run.sync.adapters_served:  # multi-LoRA: each prompt samples with its adapter
            lora.tag_prompts(cfg.adapter_key, run.models.policy.lora, prompts)
        t0 = time.perf_counter()
        seed_parts = (run.config.seed, "rl", step, round_)
        round_stats = RolloutStats()
        if partial is not None and run.pipeline is not None and parts.generate_fn is None:
            groups = await generate_groups_resumable(
                prompts,
                generator=run.models.generator,
                buffer=parts.buffer,
                sampling=cfg.sampling.to_params(),
                n_samples=cfg.n_samples,
                seed_parts=seed_parts,
                updates=run.pipeline,
                stats=partial,
                return_routing=cfg.routing_replay != "off",
            )
            round_stats.rollouts += sum(len(g.rollouts) for g in groups)
        else:
            groups = await generate(
                run, prompts, cfg.sampling.to_params(), cfg.n_samples, seed_parts, round_stats
            )
        gen_time += time.perf_counter() - t0
        if lora.multi(run.models.policy):  # ... and its rollouts train it
            lora.tag_prompts(cfg.adapter_key, run.models.policy.lora, prompts)
            lora.tag_groups(groups)
        gen_tokens += sum(r.response_length for g in groups for r in g.rollouts)
        await parts.scorer.score(groups, round_stats)
        _shape_rewards(run, groups)
        scored.extend(r for g in groups for r in g.rollouts)
        # Failed rollouts leave their group (groups may be uneven); the filters see the rest.
        for f in parts.filters:
            f.stats = round_stats
        sampler.add(filter_groups(groups, (), round_stats))
        round_ += 1
        where = f"step {step}, round {round_}"
        round_stats.check(where)
        run.failure_log.log(where, round_stats.rollouts, round_stats.failed, round_stats.first)
        stats.merge(round_stats)
        if round_ >= cfg.max_rounds and not sampler.full:
            raise exhausted_error(
                rounds=round_,
                kept=sampler.num_kept,
                wanted=cfg.prompts_per_step,
                n_samples=cfg.n_samples,
                step_counts=sampler.step_counts,
                rollouts=stats.rollouts,
                failed=stats.failed,
                first=stats.first,
                unusable=stats.dropped.get("no_valid_rollout", 0),
            )
    parts.buffer.put(sampler.pop_batch())
    record = round_metrics(scored, stats, stale, gen_tokens, gen_time, asked=stats.rollouts)
    record.update(sampler.last_step_metrics)
    record = _ordered(record, stats, stale, gen_tokens, gen_time)
    if turns_before is not None and partial is not None:  # a generate_fn's resumed turns
        now = resumable_generator(run).stats
        partial.interruptions = now.releases - turns_before.releases
        partial.resumed = now.interruptions - turns_before.interruptions
        partial.resumed_tokens = now.resumed_tokens - turns_before.resumed_tokens
    if partial is not None:
        record["rollout/partial_interruptions"] = partial.interruptions
        record["rollout/partial_resumed"] = partial.resumed
        record["rollout/partial_resumed_tokens"] = partial.resumed_tokens
    return record


def _shape_rewards(run: RunState, groups: Sequence[Group]) -> None:
    """Reward shaping of training rollouts (``rollout.overlong_penalty``), before filters."""
    cfg = run.config.rollout
    if cfg.overlong_penalty is None:
        return
    shaping = OverlongPenalty(cfg.overlong_penalty, max_length=cfg.sampling.max_new_tokens)
    shaping.apply(r for g in groups for r in g.rollouts)


def round_metrics(
    all_scored: Sequence[Rollout],
    stats: RolloutStats,
    stale: int,
    gen_tokens: int,
    gen_time: float,
    *,
    asked: int | None = None,
) -> dict[str, Any]:
    """A round's reward and response metrics (``rollout/*``) over every rollout of the round.

    One convention with eval (:meth:`rl_trainer.ops.evaluation.EvalSet.metrics`): a failed rollout
    (its reward raised, hung, returned no number, or generation failed) scores 0 in
    ``rollout/reward_mean`` and ``rollout/reward_std``; ``rollout/failed_fraction`` is the
    share of the ``asked`` rollouts (default: those given) that failed, and
    ``rollout/reward_mean_scored`` the mean over the scored ones alone (what the advantages
    see)."""
    scored = [r for r in all_scored if r.reward is not None]
    record: dict[str, Any] = {}
    rewards = [float(r.reward) for r in scored]
    total = max(asked or 0, len(all_scored))
    with_failed = rewards + [0.0] * (total - len(rewards))
    record["rollout/reward_mean"] = _mean(with_failed)
    record["rollout/reward_std"] = float(np.std(with_failed)) if with_failed else float("nan")
    record["rollout/reward_mean_scored"] = _mean(rewards)
    record["rollout/failed_fraction"] = (total - len(rewards)) / total if total else 0.0
    for key in sorted({k for r in scored for k in r.reward_info} - {"reward"}):
        record[f"rollout/{key}_mean"] = _mean(
            [r.reward_info[key] for r in scored if key in r.reward_info]
        )
    record["rollout/response_len_mean"] = _mean([r.response_length for r in all_scored])
    record["rollout/truncated_frac"] = _mean([float(r.status == "truncated") for r in all_scored])
    record.update(agent_metrics(all_scored))  # agent sessions' turns, tool calls, ... (if any)
    return record


def _ordered(
    record: dict[str, Any], stats: RolloutStats, stale: int, gen_tokens: int, gen_time: float
) -> dict[str, Any]:
    """The round's drop, failure and generation metrics after the reward and sampler ones."""
    for reason, n in stats.dropped.items():
        record[f"rollout/dropped/{reason}"] = n
    for reason, n in stats.failed.items():
        record[f"rollout/failed/{reason}"] = n
    record["rollout/stale_dropped"] = stale
    record["perf/rollout_tokens_per_s"] = gen_tokens / gen_time if gen_time > 0 else float("nan")
    record["perf/gen_time"] = gen_time
    return record


# ----------------------------------------------------------------------------- take
def take_groups(
    buffer: Any,
    *,
    n: int,
    version: int,
    max_staleness: int,
    versions_per_step: int = 1,
    wait_for_more: bool = False,
) -> tuple[list[Group], dict[str, float]]:
    """This step's ``n`` groups from the buffer (never older than ``max_staleness`` RL steps,
    ``versions_per_step`` versions each, behind ``version``: the buffer drops a group holding
    any older token, counted in ``rollout/stale_dropped_at_take``) and their staleness metrics
    (in RL steps). Too few fresh groups raise, or with ``wait_for_more`` (continuous mode)
    return ``([], {"rollout/stale_dropped_at_take": k})`` so the caller waits for a round."""
    held = len(buffer)
    groups = buffer.take(n, min_version=version - max_staleness * versions_per_step)
    dropped = held - len(buffer) - (len(groups) if groups is not None else 0)
    if groups is None and wait_for_more:
        return [], {"rollout/stale_dropped_at_take": dropped}
    if groups is None:
        raise RLError(
            f"buffer: {held} groups held but fewer than {n} within rl.max_staleness="
            f"{max_staleness} of policy version {version}; rounds must put "
            "fresh groups (is another writer using the buffer?)."
        )
    k = versions_per_step
    ages = [(version - v) // k for g in groups for r in g.rollouts for v in r.versions]
    lag = [version - r.min_version for g in groups for r in g.rollouts if r.versions]
    spans = [len(set(r.versions)) > 1 for g in groups for r in g.rollouts]
    return groups, {
        "rollout/stale_dropped_at_take": dropped,
        "rollout/groups_kept": len(groups),
        "rollout/off_policy_frac": _mean([float(a > 0) for a in lag]),
        "rollout/multi_version_frac": _mean([float(x) for x in spans]),
        "rollout/staleness_mean": _mean(ages),
        "rollout/staleness_max": max(ages, default=0),
    }


# ----------------------------------------------------------------------------- advantages
def advantages(
    advantage_fn: Any,
    rollouts: Sequence[Rollout],
    group_index: Sequence[int],
    values: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-rollout advantages ``[R_i]`` from the rewards and, with a critic's ``values``, GAE
    returns ``[R_i]``.

    One prompt, many samples: rollouts of a group that share a ``rollout_id`` (siblings: a
    sub-agent's trajectory, a compacted context) are one episode. Without a critic the
    estimator sees one entry per episode (its siblings' mean reward, their masks end to end),
    so a group's baseline counts each episode once however many samples it split into, and
    every sibling gets its episode's advantage. With a critic, each sample keeps its own values
    and GAE runs per sample.
    """
    if values is None:
        episodes: dict[tuple[int, str], list[int]] = {}
        for i, (r, g) in enumerate(zip(rollouts, group_index, strict=True)):
            episodes.setdefault((g, r.rollout_id), []).append(i)
        if len(episodes) < len(rollouts):
            return _episode_advantages(advantage_fn, rollouts, list(episodes.items())), None
    # the masks as views of one tensor: one conversion instead of one per rollout
    lengths = [len(r.loss_mask) for r in rollouts]
    masks_T = torch.tensor([m for r in rollouts for m in r.loss_mask], dtype=torch.float32)
    inputs = AdvantageInputs(
        rewards=torch.tensor([float(r.reward) for r in rollouts], dtype=torch.float32),
        group_index=torch.tensor(list(group_index), dtype=torch.int64),
        response_mask=list(torch.split(masks_T, lengths)),
        values=values,
    )
    if values is not None:
        adv, returns = advantage_fn.advantages_and_returns(inputs)
        return list(adv), list(returns)
    return list(advantage_fn(inputs)), None


def _episode_advantages(
    advantage_fn: Any,
    rollouts: Sequence[Rollout],
    episodes: list[tuple[tuple[int, str], list[int]]],
) -> list[torch.Tensor]:
    """Advantages computed per episode (see :func:`advantages`), split back to its samples."""
    masks = [torch.tensor(r.loss_mask, dtype=torch.float32) for r in rollouts]
    inputs = AdvantageInputs(
        rewards=torch.tensor(
            [sum(float(rollouts[i].reward) for i in ix) / len(ix) for _, ix in episodes],
            dtype=torch.float32,
        ),
        group_index=torch.tensor([g for (g, _), _ in episodes], dtype=torch.int64),
        response_mask=[torch.cat([masks[i] for i in ix]) for _, ix in episodes],
    )
    out: list[torch.Tensor] = [torch.empty(0)] * len(rollouts)
    for (_, ix), adv in zip(episodes, advantage_fn(inputs), strict=True):
        for i, part in zip(ix, torch.split(adv, [len(masks[i]) for i in ix]), strict=True):
            out[i] = part
    return out


def rl_batch(
    run: RunState, groups: Sequence[Group], metrics: dict[str, Any] | None = None
) -> TrainBatch:
    """The packed training batch of ``groups``: planned and packed, then critic values,
    advantages (and returns), loss weights, reference and old log-probs, and with a teacher
    the distillation-shaped advantages (:mod:`rl_trainer.step.teacher`); stage metrics go into
    ``metrics`` when given."""
    cfg = run.config
    alg = cfg.algorithm
    policy = run.models.policy
    rollouts = [r for g in groups for r in g.rollouts]
    group_index = [gi for gi, g in enumerate(groups) for _ in g.rollouts]
    keep = cfg.rl.mask_older_than
    batch, order = plan_and_pack(
        rollouts,
        policy,
        cfg.rl.max_tokens_per_micro_batch,
        mask_versions_below=(
            policy.version - keep * cfg.rl.updates_per_step if keep is not None else None
        ),
    )
    rollouts, group_index = [rollouts[i] for i in order], [group_index[i] for i in order]
    values = None
    if run.models.critic is not None:
        batch.old_values = run.models.critic.compute_values(batch)
        values = gather_response(rollouts, batch.old_values)
    adv, returns = advantages(run.parts.advantage_fn, rollouts, group_index, values)
    batch.advantages = scatter_response(rollouts, adv) * batch.loss_mask
    if returns is not None:
        batch.returns = scatter_response(rollouts, returns) * batch.loss_mask
    batch.loss_weights = loss_weights(batch, rollouts, alg)
    if cfg.rl.skip_zero_advantage and len(rollouts) > 1:
        batch = _without_gradient_free(run, batch, rollouts, metrics)
    # The engine's routing stays on the batch; the policies see it only under replay.
    mode = cfg.rollout.routing_replay
    if run.models.reference is not None:
        batch.ref_logprobs = run.models.reference.compute_logprobs(
            routing.for_policy(batch, mode)
        ).logprobs
    if run.models.teacher is not None:
        distill_metrics = teacher.distill(cfg, run.models.teacher, policy, batch)
        if metrics is not None:
            metrics.update(distill_metrics)
    # One optimizer step per batch: the policy before the step is the current one, so old
    # log-probs equal the live ones and the loss uses those (detached); no extra forward.
    # Tokens sampled by an older policy (stale rounds, surplus groups the dynamic sampler
    # carries over) differ from it as the behaviour policy: `train/mismatch` measures that
    # against the rollout log-probs and `algorithm.loss.correction: tis` corrects it.
    # Several updates per batch (PPO epochs, mini-batches) need them from before the first.
    # A teacher that had the policy score the student's tokens set them already.
    needed = alg.recompute_old_logprobs or cfg.rl.updates_per_step > 1
    if needed and batch.old_logprobs is None:
        batch.old_logprobs = policy.compute_logprobs(routing.for_policy(batch, mode)).logprobs
    return batch


def _without_gradient_free(
    run: RunState,
    batch: TrainBatch,
    rollouts: Sequence[Rollout],
    metrics: dict[str, Any] | None,
) -> TrainBatch:
    """``batch`` without the samples that give the policy no gradient (advantage 0 on every
    trained token; :mod:`rl_core.algorithms.skipping`), re-planned and packed, each kept token
    with the loss weight and advantage it had in the whole step; ``batch`` itself when nothing
    can be skipped. Records ``train/skipped_samples_frac``, ``train/skipped_tokens_frac`` and
    the kept share of the loss weights (``_kept_weight``, for :func:`train`) in ``metrics``."""
    cfg = run.config
    loss_fn = run.parts.loss_fn
    if not isinstance(loss_fn, PolicyLoss):  # another loss may give such samples gradient
        return batch
    blocker = skip_blocker(
        loss_fn.config,
        critic=run.models.critic is not None,
        updates_per_step=cfg.rl.updates_per_step,
        teacher=run.models.teacher is not None,
    )
    if blocker is not None:
        return batch
    free = zero_advantage_sequences(batch.advantages, batch.loss_mask, batch.cu_seqlens)
    lens = batch.cu_seqlens.diff().tolist()
    # every data-parallel rank needs a sequence (its collectives run with the others')
    dp = int(getattr(run.models.policy, "data_parallel_size", 1))
    keep = sequences_to_train(free, lens, min_keep=max(1, dp))
    if len(keep) == len(rollouts):
        if metrics is not None:
            metrics.update({"train/skipped_samples_frac": 0.0, "train/skipped_tokens_frac": 0.0})
        return batch
    cu = batch.cu_seqlens.tolist()
    weights = {i: batch.loss_weights[cu[i] : cu[i + 1]] for i in keep}
    adv = {i: batch.advantages[cu[i] : cu[i + 1]] for i in keep}
    keep_m = cfg.rl.mask_older_than
    policy = run.models.policy
    kept, order = plan_and_pack(
        [rollouts[i] for i in keep],
        policy,
        cfg.rl.max_tokens_per_micro_batch,
        mask_versions_below=(
            policy.version - keep_m * cfg.rl.updates_per_step if keep_m is not None else None
        ),
    )
    kept.loss_weights = torch.cat([weights[keep[j]] for j in order])
    kept.advantages = torch.cat([adv[keep[j]] for j in order])
    if metrics is not None:
        metrics["train/skipped_samples_frac"] = 1 - len(keep) / len(rollouts)
        metrics["train/skipped_tokens_frac"] = 1 - kept.num_tokens / batch.num_tokens
        total = float(batch.loss_weights.sum())
        metrics["_kept_weight"] = float(kept.loss_weights.sum()) / total if total > 0 else 1.0
    return kept


# ----------------------------------------------------------------------------- train
def train(run: RunState, groups: Sequence[Group]) -> dict[str, Any]:
    """Build the batch of ``groups`` (:func:`rl_batch`) and take one optimizer step of the
    policy (and the critic), or one per PPO epoch and mini-batch
    (:func:`rl_trainer.step.ppo_updates.optimize`); returns the train metrics. Torch only: in async
    mode it runs in the trainer thread."""
    t0 = time.perf_counter()
    stage_record: dict[str, Any] = {}
    batch = rl_batch(run, groups, stage_record)
    rcfg = run.config.rollout
    routing_record: dict[str, float] = {}
    if rcfg.routing_replay != "off":
        batch, routing_record = routing.routing_step(
            run.models.policy,
            batch,
            mode=rcfg.routing_replay,
            step=run.counters.rl_step + 1,
            no_replay_every=rcfg.routing_no_replay_every,
        )
    # one optimizer step, or rl.ppo_epochs x rl.mini_batches_per_step (metrics: their means)
    m, cm, n_updates = ppo_updates.optimize(run.config, run.models, run.parts, batch, groups)
    kept_weight = stage_record.pop("_kept_weight", None)
    # under `constant` aggregation optimize() already divides the per-token metrics by the
    # trained batch's weight sum (ppo_updates.per_token_means): means over the trained tokens
    if kept_weight and run.config.algorithm.aggregation != "constant":
        m = metrics_over_trained(m, kept_weight)
    critic_record: dict[str, Any] = {}
    if cm is not None:
        critic_record = {
            "critic/loss": cm["loss"],
            "critic/grad_norm": cm["grad_norm"],
            "critic/value_mean": cm["value_mean"],
            "critic/value_error": cm["value_error"],
            "critic/clipfrac": cm["value_clipfrac"],
        }
    train_time = time.perf_counter() - t0
    record: dict[str, Any] = {
        "train/loss": m["loss"],
        "train/grad_norm": m["grad_norm"],
        # the KL to the reference model only; the policy's move over the step is train/ppo_kl
        "train/kl": m.get("kl"),
        "train/entropy": m.get("entropy"),
    }
    for k in (
        "pg_clipfrac",
        "ppo_kl",
        "mismatch",
        "tis_weight_mean",
        "tis_clipfrac",
        "tis_veto_frac",
        "opsm_clipfrac",
        "lr",
    ):
        if k in m:
            record[f"train/{k}"] = m[k]
    record["train/optimizer_steps"] = n_updates
    record.update(critic_record)
    record.update(stage_record)
    # The global batch varies when a rollout function returns several samples per episode.
    record["train/samples"] = sum(len(g.rollouts) for g in groups)
    record["train/episodes"] = len(
        {(i, r.rollout_id) for i, g in enumerate(groups) for r in g.rollouts}
    )
    record.update(routing_record)
    record.update(lora.adapter_metrics(groups, m))
    record["perf/train_time"] = train_time
    record["perf/train_tokens_per_s"] = batch.num_tokens / train_time
    return record


# ----------------------------------------------------------------------------- publish
def publish_only(run: RunState, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
    """Publish ``weights`` as ``version`` through the weight transport; the update to load
    (the colocated hand-over loads it only after the generator has its memory back)."""
    if run.runtime is not None:  # ray: policy rank 0 publishes what it holds
        return run.runtime.publish(version, weights)
    return lora.mark_update(
        run.sync, run.models.policy, run.sync.transport.publish(version, weights)
    )


async def load_update(run: RunState, version: int, update: Any) -> None:
    """Have the generator load a published ``update`` of ``version`` (checked)."""
    await run.models.generator.update_weights(update, run.sync.receiver)
    if run.models.generator.weight_version != version:
        raise RLError(
            f"generator serves version {run.models.generator.weight_version} after an update to "
            f"{version}; the weight transport did not apply it."
        )
    lora.served(
        run.sync,
        run.models.policy,
        run.parts.eval_sets,
        run.config.rollout.adapter_key,
        update,
    )


async def publish(run: RunState, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Publish ``weights`` as ``version`` and have the generator load them (checked)."""
    await load_update(run, version, publish_only(run, version, weights))


async def sync_weights(run: RunState) -> float:
    """Bring the generator to the policy's current weights; returns the seconds it took."""
    t0 = time.perf_counter()
    await publish(
        run,
        run.models.policy.version,
        lora.policy_weights(run.models.policy, run.sync.adapter_sync),
    )
    return time.perf_counter() - t0


async def serve(run: RunState, version: int, weights: Weights | None) -> None:
    """Bring the generator to ``version`` for a rollout round (async mode): publish the copy
    the trainer released, or the live policy when it holds exactly ``version``."""
    if run.models.generator.weight_version >= version:
        return
    if weights is None:
        if run.models.policy.version != version:
            raise RLError(
                f"weights of version {version} were not kept (policy is at "
                f"{run.models.policy.version}); this is a bug in the rollout pipeline."
            )
        weights = lora.policy_weights(run.models.policy, run.sync.adapter_sync)
    await publish(run, version, weights)
