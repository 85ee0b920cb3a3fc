"""One rank of the expert-parallel CPU job that ``test_moe_parallel.py`` launches (not a test).

Run as ``python _moe_worker.py OUT_DIR MODEL_DIR`` with ``RANK``, ``WORLD_SIZE`` (4),
``MASTER_ADDR`` and ``MASTER_PORT`` set. Every rank goes through the layouts of
:data:`SCENARIOS` in order (a tiny Qwen3-MoE, 8 experts, top-2); for each one it

1. computes log-probs, entropy and the router's own choice of its data-parallel shard,
2. computes them again replaying :func:`forced_routing` (random experts, mostly not the
   router's own),
3. runs an SFT step (free routing) and then an RL step (PPO + entropy + KL) replaying the
   forced routing, exporting ``named_weights()`` after each,
4. computes the log-probs after the two steps and saves a checkpoint (weights only);

a layout with ``save_step1`` also saves a checkpoint with the optimizer state after its SFT
step, and a layout with ``resume_from`` then loads that checkpoint (written at the other
layout) into a fresh policy and takes the RL step again. Rank 0 writes everything, with the
batches used and per-step wall times, to ``OUT_DIR/results.pt``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rl_core.algorithms import PolicyLoss
from rl_core.testing.policy import random_batch, sft_loss
from rl_core.types import TrainBatch

LENGTHS = [5, 8, 3, 6, 4, 7, 5, 6]
"""Sequence lengths of the step batch (44 tokens)."""
MICRO_BATCH_BOUNDS = (0, 1, 2, 3, 4, 5, 6, 7, 8)
"""One sequence per micro-batch (so every data-parallel shard has at least two)."""
LR = 1e-3
"""Learning rate of the policy (and of the reference in the test)."""
NUM_EXPERTS = 8
"""Experts of the tiny model (see ``_moe_reference.build_qwen3_moe_model``)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """One layout of the launch (data parallel = world / (tp * pp))."""

    tp_size: int = 1
    """Tensor-parallel size (sequence parallel with MoE)."""
    pp_size: int = 1
    """Pipeline-parallel size."""
    ep_size: int = 2
    """Expert-parallel size."""
    etp_size: int = 0
    """Expert tensor-parallel size (0 = tp_size)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer."""
    save_step1: bool = False
    """Also save a checkpoint with the optimizer state after the SFT step."""
    resume_from: str = ""
    """Scenario whose step-1 checkpoint a fresh policy at this layout loads (then the RL step)."""

    def config_fields(self) -> dict[str, Any]:
        """The ``MegatronPolicy.Config`` fields of this layout."""
        return {
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "expert_model_parallel_size": self.ep_size,
            "expert_tensor_parallel_size": self.etp_size,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "moe_aux_loss_coeff": 0.0,
        }


SCENARIOS: dict[str, Scenario] = {
    "ep2_dp4": Scenario(use_distributed_optimizer=True, save_step1=True),
    "ep2_tp2": Scenario(tp_size=2, use_distributed_optimizer=True, resume_from="ep2_dp4"),
    "ep2_pp2": Scenario(pp_size=2),
}
"""Name -> layout, run in this order by every rank of one 4-rank launch: EP=2 over four
data-parallel replicas (expert data parallel 2) with the distributed optimizer; EP=2 x TP=2
(expert TP 2, sequence parallel) resuming from ``ep2_dp4``'s distributed checkpoint; EP=2 x
PP=2."""
WORLD_SIZE = 4
"""Ranks of the launch."""


def step_batch(vocab: int, dp_size: int) -> TrainBatch:
    """The step's whole batch, in ``dp_size`` shards along micro-batch bounds."""
    batch = random_batch(vocab, LENGTHS, seed=11, micro_batch_bounds=MICRO_BATCH_BOUNDS)
    n = batch.num_sequences
    bounds = tuple(i * n // dp_size for i in range(dp_size + 1))
    return dataclasses.replace(batch, dp_bounds=bounds) if dp_size > 1 else batch


def forced_routing(num_tokens: int, num_layers: int, top_k: int) -> torch.Tensor:
    """``[T, L, K]`` uint8: random distinct experts per token and layer (fixed seed)."""
    gen = torch.Generator().manual_seed(23)
    rows = [
        torch.randperm(NUM_EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens * num_layers)
    ]
    return torch.stack(rows).reshape(num_tokens, num_layers, top_k).to(torch.uint8)


def rl_loss() -> PolicyLoss:
    """PPO clip-higher with an entropy bonus and a KL loss (as the dense combined test)."""
    return PolicyLoss(
        PolicyLoss.Config(eps_clip_low=0.2, eps_clip_high=0.28, entropy_coef=0.01, kl_coef=0.1)
    )


def rl_batch(batch: TrainBatch, logp_T: torch.Tensor, routing_TLK: torch.Tensor) -> TrainBatch:
    """``batch`` with random advantages, old/ref log-probs near ``logp_T`` and ``routing_TLK``."""
    gen = torch.Generator().manual_seed(5)
    on_T = batch.loss_mask > 0
    noise = [0.1 * torch.randn(batch.num_tokens, generator=gen) for _ in range(3)]
    return dataclasses.replace(
        batch,
        advantages=batch.loss_mask * noise[0] * 10,
        old_logprobs=torch.where(on_T, logp_T + noise[1], 0.0),
        ref_logprobs=torch.where(on_T, logp_T + noise[2], 0.0),
        routed_experts=routing_TLK,
    )


def gather_to_all(x: Any) -> list[Any]:
    """``x`` of every rank, in global rank order, on every rank."""
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, x)
    return out


def snapshot(policy: Any) -> dict[str, torch.Tensor]:
    """A copy of ``named_weights()`` (collective)."""
    return {n: t.detach().clone() for n, t in policy.named_weights()}


def build_policy(model_path: str, scenario: Scenario) -> Any:
    """A fresh ``MegatronPolicy`` at ``scenario``'s layout (collective)."""
    from rl_megatron.policy import MegatronPolicy

    return MegatronPolicy(
        MegatronPolicy.Config(model_path=model_path, lr=LR, **scenario.config_fields())
    )


def run_scenario(
    key: str, model_path: str, scenario: Scenario, out_dir: Path, res: dict[str, Any]
) -> None:
    """Everything one layout contributes to ``res`` (see the module docstring)."""
    t_start = time.perf_counter()
    policy = build_policy(model_path, scenario)
    res[f"{key}/build_s"] = time.perf_counter() - t_start
    lay = policy.layout
    ranks = {"dp_rank": lay.dp_rank}
    res[f"{key}/sizes"] = (lay.tp_size, lay.pp_size, lay.dp_size, lay.ep_size, lay.etp_size)
    shape = policy.model_shape
    res[f"{key}/model_shape"] = shape
    batch = step_batch(shape.vocab_size, lay.dp_size)
    layers = policy._routing.num_layers
    forced_TLK = forced_routing(batch.num_tokens, layers, shape.moe_top_k)
    batch_r = dataclasses.replace(batch, routed_experts=forced_TLK)
    res[f"{key}/batch"] = batch
    res[f"{key}/forced"] = forced_TLK
    shard = batch.shard(lay.dp_rank)

    t0 = time.perf_counter()
    out = policy.compute_logprobs(shard, with_entropy=True)
    res[f"{key}/logprobs_s"] = time.perf_counter() - t0
    res[f"{key}/logprob_parts"] = gather_to_all(
        {**ranks, "logprobs": out.logprobs, "entropy": out.entropy, "routed": out.routed_experts}
    )
    out_r = policy.compute_logprobs(batch_r.shard(lay.dp_rank))
    res[f"{key}/replay_parts"] = gather_to_all(
        {**ranks, "logprobs": out_r.logprobs, "routed": out_r.routed_experts}
    )

    t0 = time.perf_counter()
    res[f"{key}/sft_metrics"] = gather_to_all(policy.train_step(shard, sft_loss))
    res[f"{key}/sft_step_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    res[f"{key}/sft_weights"] = gather_to_all(snapshot(policy))
    res[f"{key}/export_s"] = time.perf_counter() - t0
    if scenario.save_step1:
        t0 = time.perf_counter()
        policy.save(out_dir / f"ckpt_{key}_step1", with_optimizer=True)
        res[f"{key}/save_with_optimizer_s"] = time.perf_counter() - t0

    rl = rl_batch(batch, policy_logprobs_whole(res, key), forced_TLK)
    res[f"{key}/rl_batch"] = rl
    t0 = time.perf_counter()
    res[f"{key}/rl_metrics"] = gather_to_all(policy.train_step(rl.shard(lay.dp_rank), rl_loss()))
    res[f"{key}/rl_step_s"] = time.perf_counter() - t0
    res[f"{key}/rl_weights"] = gather_to_all(snapshot(policy))
    after = policy.compute_logprobs(shard)
    res[f"{key}/after_parts"] = gather_to_all({**ranks, "logprobs": after.logprobs})
    t0 = time.perf_counter()
    policy.save(out_dir / f"ckpt_{key}", with_optimizer=False)
    res[f"{key}/save_s"] = time.perf_counter() - t0
    del policy
    gc.collect()

    if scenario.resume_from:
        src = scenario.resume_from
        policy = build_policy(model_path, scenario)
        policy.load(out_dir / f"ckpt_{src}_step1", with_optimizer=True)
        res[f"{key}/resumed_version"] = policy.version
        # The source layout's RL batch, in this layout's data-parallel shards.
        rl_src = dataclasses.replace(res[f"{src}/rl_batch"], dp_bounds=batch.dp_bounds)
        res[f"{key}/resumed_rl_metrics"] = gather_to_all(
            policy.train_step(rl_src.shard(lay.dp_rank), rl_loss())
        )
        res[f"{key}/resumed_rl_weights"] = gather_to_all(snapshot(policy))
        del policy
        gc.collect()
    res[f"{key}/scenario_s"] = time.perf_counter() - t_start


def policy_logprobs_whole(res: dict[str, Any], key: str) -> torch.Tensor:
    """The whole batch's initial log-probs from the per-rank shards (data-parallel order)."""
    by_dp = {p["dp_rank"]: p["logprobs"] for p in res[f"{key}/logprob_parts"]}
    return torch.cat([by_dp[d] for d in sorted(by_dp)])


def main() -> None:
    """Run the scenarios on this rank; rank 0 writes ``results.pt``."""
    out_dir, model_path = Path(sys.argv[1]), sys.argv[2]
    if int(os.environ["WORLD_SIZE"]) != WORLD_SIZE:
        raise SystemExit(f"WORLD_SIZE must be {WORLD_SIZE}.")
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    res: dict[str, Any] = {}
    only = os.environ.get("RL_MOE_SCENARIOS")
    for key, scenario in SCENARIOS.items():
        if only and key not in only.split(","):
            continue
        run_scenario(key, model_path, scenario, out_dir, res)
    res["_job_s"] = time.perf_counter() - t_start
    if torch.distributed.get_rank() == 0:
        torch.save(res, out_dir / "results.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
