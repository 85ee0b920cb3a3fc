"""One rank of the two-process CPU job that ``test_distributed.py`` launches (not a test file).

Run as ``python _dist_worker.py OUT_DIR MODELS_JSON`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set. Both ranks go through the same scenarios (DP=2 with and
without the distributed optimizer, TP=2 for each model family, PP=2, a checkpoint reloaded across a
change of layout, PP=2, the critic at TP=2 and PP=2); rank 0 writes everything the tests compare to ``OUT_DIR/results.pt``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rl_core.algorithms import PolicyLoss, ValueLoss
from rl_core.errors import CheckpointError
from rl_core.testing.policy import random_batch, sft_loss
from rl_core.types import TrainBatch
from rl_megatron.critic import MegatronCritic
from rl_megatron.policy import MegatronPolicy

LENGTHS = [5, 8, 3, 6, 4, 7]
LR = 1e-3


def global_batch(vocab: int) -> TrainBatch:
    """The step's batch; ``loss_weights`` is the per-token mean over all six sequences."""
    return random_batch(vocab, LENGTHS, seed=11, micro_batch_bounds=(0, 2, 3, 6))


def dp_shard(batch: TrainBatch, dp_rank: int) -> TrainBatch:
    """Sequences 0-2 or 3-5 with the global loss weights, as two micro-batches."""
    half = dataclasses.replace(batch, micro_batch_bounds=(0, 3, 6)).micro_batches()[dp_rank]
    return dataclasses.replace(half, micro_batch_bounds=(0, 1, 3))


def rl_loss() -> PolicyLoss:
    """PPO clip-higher with an entropy bonus (needs entropy gradients) and a KL loss."""
    return PolicyLoss(
        PolicyLoss.Config(eps_clip_low=0.2, eps_clip_high=0.28, entropy_coef=0.01, kl_coef=0.1)
    )


def rl_batch(policy: MegatronPolicy) -> TrainBatch:
    """The step batch with random advantages and old/ref log-probs near the current ones."""
    batch = global_batch(policy.model_shape.vocab_size)
    logp_T = policy.compute_logprobs(batch).logprobs
    gen = torch.Generator().manual_seed(5)
    on_T = batch.loss_mask > 0
    noise = [0.1 * torch.randn(batch.num_tokens, generator=gen) for _ in range(3)]
    return dataclasses.replace(
        batch,
        advantages=batch.loss_mask * noise[0] * 10,
        old_logprobs=torch.where(on_T, logp_T + noise[1], 0.0),
        ref_logprobs=torch.where(on_T, logp_T + noise[2], 0.0),
    )


def value_loss() -> ValueLoss:
    """The critic's clipped value loss used by the critic scenarios."""
    return ValueLoss(ValueLoss.Config(clip=0.5))


def critic_targets(batch: TrainBatch, critic: Any) -> TrainBatch:
    """Returns of +1 / -1 by sequence parity around the critic's current values."""
    seq = batch.seq_index()
    returns_T = torch.where(seq % 2 == 0, 1.0, -1.0) * batch.loss_mask
    return dataclasses.replace(batch, returns=returns_T, old_values=critic.compute_values(batch))


def snapshot(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in policy.named_weights()}


def timed_steps(policy: MegatronPolicy, batch: TrainBatch, n: int = 3) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        policy.train_step(batch, sft_loss)
        times.append(time.perf_counter() - t0)
    return times


def gather_to_all(x: Any) -> list[Any]:
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, x)
    return out


def build(models: dict[str, str], arch: str, **kw: Any) -> MegatronPolicy:
    return MegatronPolicy(MegatronPolicy.Config(model_path=models[arch], lr=LR, **kw))


def dp2_scenarios(res: dict[str, Any], models: dict[str, str], out_dir: Path) -> None:
    """DP=2, plain and distributed Adam: log-probs, a step, and (distributed) exact resume."""
    for dist_opt in (False, True):
        key = f"dp2_distopt{int(dist_opt)}"
        policy = build(models, "qwen2", use_distributed_optimizer=dist_opt)
        assert policy.layout.dp_size == 2 and policy.layout.tp_size == 1
        batch = global_batch(policy.model_shape.vocab_size)
        shard = dp_shard(batch, policy.layout.dp_rank)
        lp = policy.compute_logprobs(shard, with_entropy=True)
        parts = gather_to_all((lp.logprobs, lp.entropy))
        res[f"{key}/logprobs"] = torch.cat([p[0] for p in parts])
        res[f"{key}/entropy"] = torch.cat([p[1] for p in parts])
        t0 = time.perf_counter()
        res[f"{key}/metrics"] = policy.train_step(shard, sft_loss)
        res[f"{key}/first_step_s"] = time.perf_counter() - t0
        res[f"{key}/metrics_all_ranks"] = gather_to_all(res[f"{key}/metrics"])
        res[f"{key}/weights"] = snapshot(policy)
        if dist_opt:
            # Resume exactness: save after step 1, step, reload, step again.
            policy.save(out_dir / "ckpt_dp2_distopt", with_optimizer=True)
            policy.train_step(shard, sft_loss)
            second = snapshot(policy)
            policy.load(out_dir / "ckpt_dp2_distopt", with_optimizer=True)
            res[f"{key}/reload_version"] = policy.version
            policy.train_step(shard, sft_loss)
            again = snapshot(policy)
            res[f"{key}/resume_max_diff"] = max(
                float((second[n] - again[n]).abs().max()) for n in second
            )
        else:
            policy.save(out_dir / "ckpt_dp2", with_optimizer=True)
        res[f"{key}/step_s"] = timed_steps(policy, shard)
        del policy
        gc.collect()


def tp2_scenarios(res: dict[str, Any], models: dict[str, str], out_dir: Path) -> None:
    """TP=2 on each architecture: export, log-probs, a step."""
    for arch in ("qwen2", "llama", "qwen3"):
        key = f"tp2_{arch}"
        policy = build(models, arch, tp_size=2)
        assert policy.layout.tp_size == 2 and policy.layout.dp_size == 1
        res[f"{key}/exported"] = snapshot(policy)
        batch = global_batch(policy.model_shape.vocab_size)
        lp = policy.compute_logprobs(batch, with_entropy=True)
        res[f"{key}/logprobs"], res[f"{key}/entropy"] = lp.logprobs, lp.entropy
        other = gather_to_all(lp.logprobs)
        res[f"{key}/tp_ranks_equal"] = bool(torch.equal(other[0], other[1]))
        if arch != "qwen3":
            t0 = time.perf_counter()
            res[f"{key}/metrics"] = policy.train_step(batch, sft_loss)
            res[f"{key}/first_step_s"] = time.perf_counter() - t0
            res[f"{key}/weights"] = snapshot(policy)
            res[f"{key}/step_s"] = timed_steps(policy, batch)
        del policy
        gc.collect()


def pp2_scenarios(res: dict[str, Any], models: dict[str, str], out_dir: Path) -> None:
    """PP=2: export, log-probs, a step, and (tied qwen2) exact resume."""
    for arch in ("qwen2", "llama"):
        key = f"pp2_{arch}"
        policy = build(models, arch, pp_size=2)
        assert policy.layout.pp_size == 2 and policy.layout.dp_size == 1
        res[f"{key}/exported"] = snapshot(policy)
        batch = global_batch(policy.model_shape.vocab_size)
        lp = policy.compute_logprobs(batch, with_entropy=True)
        res[f"{key}/logprobs"], res[f"{key}/entropy"] = lp.logprobs, lp.entropy
        other = gather_to_all(lp.logprobs)
        res[f"{key}/tp_ranks_equal"] = bool(torch.equal(other[0], other[1]))
        t0 = time.perf_counter()
        res[f"{key}/metrics"] = policy.train_step(batch, sft_loss)
        res[f"{key}/first_step_s"] = time.perf_counter() - t0
        res[f"{key}/weights"] = snapshot(policy)
        if arch == "qwen2":  # tied embeddings split over the two stages: resume exactly
            policy.save(out_dir / "ckpt_pp2", with_optimizer=True)
            policy.train_step(batch, sft_loss)
            second = snapshot(policy)
            policy.load(out_dir / "ckpt_pp2", with_optimizer=True)
            policy.train_step(batch, sft_loss)
            again = snapshot(policy)
            res["pp2/resume_max_diff"] = max(
                float((second[n] - again[n]).abs().max()) for n in second
            )
        res[f"{key}/step_s"] = timed_steps(policy, batch)
        del policy
        gc.collect()


def rl_loss_scenarios(res: dict[str, Any], models: dict[str, str], out_dir: Path) -> None:
    """An RL loss (PPO clip + entropy bonus + KL) at TP=2 and PP=2."""
    for layout in ("tp", "pp"):
        policy = build(models, "qwen2", **{f"{layout}_size": 2})
        batch = rl_batch(policy)
        res[f"{layout}2_rl/batch"] = batch
        res[f"{layout}2_rl/metrics"] = policy.train_step(batch, rl_loss())
        res[f"{layout}2_rl/weights"] = snapshot(policy)
        del policy
        gc.collect()


def tp2_distopt_resume(res: dict[str, Any], models: dict[str, str], out_dir: Path) -> None:
    """TP=2 + distributed optimizer: save, resume exactly."""
    policy = build(models, "llama", tp_size=2, use_distributed_optimizer=True)
    batch = global_batch(policy.model_shape.vocab_size)
    policy.train_step(batch, sft_loss)
    policy.save(out_dir / "ckpt_tp2", with_optimizer=True)
    policy.train_step(batch, sft_loss)
    second = snapshot(policy)
    policy.load(out_dir / "ckpt_tp2", with_optimizer=True)
    policy.train_step(batch, sft_loss)
    again = snapshot(policy)
    res["tp2_distopt/resume_max_diff"] = max(
        float((second[n] - again[n]).abs().max()) for n in second
    )
    del policy
    gc.collect()


def relayout_scenario(res: dict[str, Any], models: dict[str, str], out_dir: Path) -> None:
    """Layout change: the DP=2 checkpoint loaded at TP=2."""
    policy = build(models, "qwen2", tp_size=2)
    try:
        policy.load(out_dir / "ckpt_dp2", with_optimizer=True)
        res["relayout/optimizer_refused"] = False
    except CheckpointError:
        res["relayout/optimizer_refused"] = True
    policy.load(out_dir / "ckpt_dp2", with_optimizer=False)
    res["relayout/version"] = policy.version
    res["relayout/logprobs"] = policy.compute_logprobs(
        global_batch(policy.model_shape.vocab_size)
    ).logprobs

    del policy
    gc.collect()


def critic_scenarios(res: dict[str, Any], models: dict[str, str], out_dir: Path) -> None:
    """The critic (value head) at TP=2 and PP=2: two value steps."""
    for layout in ("tp", "pp"):
        critic = MegatronCritic(
            MegatronCritic.Config(model_path=models["qwen2"], lr=1e-2, **{f"{layout}_size": 2})
        )
        batch = global_batch(critic.model_shape.vocab_size)
        steps = [critic.train_step(critic_targets(batch, critic), value_loss()) for _ in range(2)]
        res[f"critic_{layout}2/metrics"] = steps
        values = critic.compute_values(batch)
        res[f"critic_{layout}2/values"] = values
        res[f"critic_{layout}2/ranks_equal"] = bool(torch.equal(*gather_to_all(values)))
        del critic
        gc.collect()


def main() -> None:
    out_dir, models = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    for scenario in (
        dp2_scenarios,
        tp2_scenarios,
        pp2_scenarios,
        rl_loss_scenarios,
        tp2_distopt_resume,
        relayout_scenario,
        critic_scenarios,
    ):
        scenario(res, models, out_dir)

    if torch.distributed.get_rank() == 0:
        torch.save(res, out_dir / "results.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
