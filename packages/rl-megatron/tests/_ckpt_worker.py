"""One rank of the two-process CPU job that ``test_checkpoint.py`` launches (not a test file).

Run as ``python _ckpt_worker.py OUT_DIR MODELS_JSON`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set; ``OUT_DIR/w1_plain`` must hold a checkpoint saved by a
world of one. Scenarios (each "step" is one SFT step on the batch of ``_dist_worker``):

* TP=2 (plain Adam) and DP=2 (distributed optimizer): two steps, save, a third step; a freshly
  built policy loads the checkpoint and takes the third step again.
* Resharding: the resumed TP=2 policy loads the world-of-one checkpoint and steps; a PP=2
  policy loads the TP=2 checkpoint, steps, saves, steps; a TP=2 policy loads that PP=2
  checkpoint and steps.
* Distributed optimizer at PP=2 (tied embedding in a DDP bucket of its own): a PP=2 policy
  loads the DP=2 checkpoint, steps, saves, steps; a fresh PP=2 policy and a TP=2 policy load that
  checkpoint and step. The same save without :mod:`rl_megatron.checkpoint`'s bucket-padding
  workaround must be refused.
* Refusal: the TP=2 plain-Adam policy asked to load the distributed-optimizer checkpoint.
* The critic at TP=2: two value steps, save, a third; a fresh critic loads and steps again.

Rank 0 writes the results to ``OUT_DIR/results.pt``; the tests compare them with each other and
with world-of-one runs in the test process.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from _dist_worker import critic_targets, dp_shard, global_batch, snapshot, value_loss

from rl_core.errors import CheckpointError
from rl_core.testing.policy import sft_loss
from rl_megatron import checkpoint as rl_checkpoint
from rl_megatron.critic import MegatronCritic
from rl_megatron.policy import MegatronPolicy

LR = 1e-3


def unpadded_buckets(policy: MegatronPolicy) -> int:
    """How many of this rank's DDP buckets are followed by another bucket and end in padding,
    which megatron-core 0.16.1's ``get_parameter_state_dp_zero`` drops."""
    optimizers = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    buckets = [b for opt in optimizers for buf in opt.buffers for b in buf.buckets[:-1]]
    return sum(1 for b in buckets if b.numel_unpadded < b.grad_data.numel())


@contextlib.contextmanager
def without_bucket_padding_fix() -> Iterator[None]:
    """megatron-core's own ``fully_reshardable`` gathering, without our padding workaround."""
    fix = rl_checkpoint._dp_zero_state_keeps_bucket_padding
    rl_checkpoint._dp_zero_state_keeps_bucket_padding = lambda _opt: contextlib.nullcontext()
    try:
        yield
    finally:
        rl_checkpoint._dp_zero_state_keeps_bucket_padding = fix


class Job:
    """The worker's shared state: where to write, which models, the results so far."""

    def __init__(self, out_dir: Path, models: dict[str, str]) -> None:
        self.out_dir, self.models = out_dir, models
        self.res: dict[str, Any] = {}

    def build(self, **kw: Any) -> MegatronPolicy:
        return MegatronPolicy(MegatronPolicy.Config(model_path=self.models["qwen2"], lr=LR, **kw))

    def step(self, policy: MegatronPolicy, key: str) -> None:
        batch = global_batch(policy.model_shape.vocab_size)
        if policy.layout.dp_size > 1:
            batch = dp_shard(batch, policy.layout.dp_rank)
        self.res[f"{key}/metrics"] = policy.train_step(batch, sft_loss)
        self.res[f"{key}/weights"] = snapshot(policy)
        self.res[f"{key}/version"] = policy.version

    def build_critic(self) -> MegatronCritic:
        return MegatronCritic(
            MegatronCritic.Config(model_path=self.models["qwen2"], lr=1e-2, tp_size=2)
        )

    def critic_step(self, critic: MegatronCritic, key: str) -> None:
        batch = global_batch(critic.model_shape.vocab_size)
        self.res[f"{key}/metrics"] = critic.train_step(critic_targets(batch, critic), value_loss())
        self.res[f"{key}/values"] = critic.compute_values(batch)


def same_layout(job: Job) -> MegatronPolicy:
    """TP=2 plain Adam and DP=2 distributed Adam: save after two steps, resume the third.

    Returns the resumed TP=2 policy. (A policy is only usable until a policy of another layout
    is built in the process: that rebuilds Megatron's parallel state, so each layout below gets
    a freshly built policy.)
    """
    res, out_dir = job.res, job.out_dir
    for key, kw in (("dp2d", {"use_distributed_optimizer": True}), ("tp2", {"tp_size": 2})):
        policy = job.build(**kw)
        job.step(policy, f"{key}/step1")
        job.step(policy, f"{key}/step2")
        t0 = time.perf_counter()
        policy.save(out_dir / f"ck_{key}", with_optimizer=True)
        res[f"{key}/save_s"] = time.perf_counter() - t0
        job.step(policy, f"{key}/step3")
        del policy
        gc.collect()
        policy = job.build(**kw)
        t0 = time.perf_counter()
        policy.load(out_dir / f"ck_{key}", with_optimizer=True)
        res[f"{key}/load_s"] = time.perf_counter() - t0
        res[f"{key}/loaded_version"] = policy.version
        job.step(policy, f"{key}/resumed")
        if key == "tp2":
            tp2 = policy
        else:
            del policy
            gc.collect()
    return tp2


def resharding(job: Job, tp2: MegatronPolicy) -> None:
    """The loaded TP=2 policy loads the world-of-one checkpoint (and refuses the distributed
    optimizer's); TP=2 -> PP=2 -> TP=2."""
    res, out_dir = job.res, job.out_dir
    tp2.load(out_dir / "w1_plain", with_optimizer=True)  # a world-of-one checkpoint
    job.step(tp2, "w1_to_tp2")
    try:
        tp2.load(out_dir / "ck_dp2d", with_optimizer=True)
        res["refused_distopt"] = ""
    except CheckpointError as exc:
        res["refused_distopt"] = str(exc)
    del tp2
    gc.collect()

    pp2 = job.build(pp_size=2)
    pp2.load(out_dir / "ck_tp2", with_optimizer=True)
    job.step(pp2, "tp2_to_pp2")
    pp2.save(out_dir / "ck_pp2", with_optimizer=True)
    job.step(pp2, "pp2/step4")
    del pp2
    gc.collect()
    tp2 = job.build(tp_size=2)
    tp2.load(out_dir / "ck_pp2", with_optimizer=True)
    job.step(tp2, "pp2_to_tp2")
    del tp2
    gc.collect()


def distopt_at_pp2(job: Job) -> None:
    """PP=2 with the distributed optimizer: the tied embedding gets a DDP bucket of its own (the
    layout megatron-core 0.16.1 saved shifted by the padding of the bucket before it)."""
    res, out_dir = job.res, job.out_dir
    pp2d = job.build(pp_size=2, use_distributed_optimizer=True)
    pp2d.load(out_dir / "ck_dp2d", with_optimizer=True)
    job.step(pp2d, "dp2d_to_pp2d")
    pp2d.save(out_dir / "ck_pp2d", with_optimizer=True)
    job.step(pp2d, "pp2d/step4")
    res["pp2d/unpadded_buckets"] = unpadded_buckets(pp2d)
    with without_bucket_padding_fix():
        try:
            pp2d.save(out_dir / "ck_pp2d_unfixed", with_optimizer=True)
            res["pp2d/refused_unfixed"] = ""
        except CheckpointError as exc:
            res["pp2d/refused_unfixed"] = str(exc)
    del pp2d
    gc.collect()
    pp2d = job.build(pp_size=2, use_distributed_optimizer=True)
    pp2d.load(out_dir / "ck_pp2d", with_optimizer=True)
    job.step(pp2d, "pp2d/resumed")
    del pp2d
    gc.collect()
    tp2d = job.build(tp_size=2, use_distributed_optimizer=True)
    tp2d.load(out_dir / "ck_pp2d", with_optimizer=True)
    job.step(tp2d, "pp2d_to_tp2d")
    del tp2d
    gc.collect()


def critic_at_tp2(job: Job) -> None:
    """The critic at TP=2: two value steps, save, a third; a fresh critic resumes it."""
    critic = job.build_critic()
    job.critic_step(critic, "critic/step1")
    job.critic_step(critic, "critic/step2")
    critic.save(job.out_dir / "ck_critic", with_optimizer=True)
    job.critic_step(critic, "critic/step3")
    del critic
    gc.collect()
    critic = job.build_critic()
    critic.load(job.out_dir / "ck_critic", with_optimizer=True)
    job.critic_step(critic, "critic/resumed")
    del critic
    gc.collect()


def main() -> None:
    job = Job(Path(sys.argv[1]), json.loads(sys.argv[2]))
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    resharding(job, same_layout(job))
    distopt_at_pp2(job)
    critic_at_tp2(job)
    job.res["job_s"] = time.perf_counter() - t_start
    if torch.distributed.get_rank() == 0:
        torch.save(job.res, job.out_dir / "results.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
