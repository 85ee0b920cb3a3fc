"""One rank of the CPU jobs that ``test_combined_parallel.py`` launches (not a test).

Run as ``python _combined_worker.py OUT_DIR MODELS_JSON`` with ``RANK``, ``WORLD_SIZE`` (a key of
:data:`LAUNCHES`: 4 or 8), ``MASTER_ADDR`` and ``MASTER_PORT`` set. Every rank goes through the
layouts of ``LAUNCHES[WORLD_SIZE]`` in order: at 4 ranks TP=2 x DP=2 with the distributed
optimizer, TP=2 x PP=2, PP=2 x DP=2 with the distributed optimizer; at 8 ranks TP=2 x PP=2 x DP=2
with the distributed optimizer. For each one it

1. computes log-probs and entropy of its data-parallel shard of the step batch,
2. runs an SFT step and then an RL step (PPO clip-higher + entropy bonus + KL) on its shard,
3. exports ``named_weights()`` after each step,
4. computes the log-probs after the two steps and saves a checkpoint (weights only).

A layout with :attr:`Scenario.resume` also saves a checkpoint with the optimizer state after
the SFT step (``ckpt_<key>_step1``, megatron-core ``torch_dist``) and, after step 4, builds a
fresh policy at the same layout, loads that checkpoint and takes the RL step again.

Per-rank values are gathered to every rank; rank 0 writes them to ``OUT_DIR/results.pt`` under
``"<scenario>/<what>"`` keys, together with the exact batches used, so the test can replay the
same steps with :class:`~rl_hf.HFPolicy`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rl_core.algorithms import PolicyLoss
from rl_core.testing.policy import random_batch, sft_loss
from rl_core.types import TrainBatch

if TYPE_CHECKING:
    from rl_megatron.policy import MegatronPolicy

LENGTHS = [5, 8, 3, 6, 4, 7]
"""Sequence lengths of the step batch (33 tokens)."""
MICRO_BATCH_BOUNDS = (0, 2, 3, 5, 6)
"""Two micro-batches per data-parallel shard (so the 1F1B schedule has two in flight)."""
LR = 1e-3
"""Learning rate of the policy (and of the reference in the test)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """One parallel layout of a launch: which tiny model, which ``MegatronPolicy.Config``."""

    model: str
    """Name of the tiny model in ``conftest.model_dirs``."""
    tp_size: int = 1
    """Tensor-parallel size."""
    pp_size: int = 1
    """Pipeline-parallel size (the data-parallel size is what the world size leaves)."""
    use_distributed_optimizer: bool = False
    """Shard the Adam state over the data-parallel ranks (Megatron's distributed optimizer)."""
    resume: bool = False
    """Also save with the optimizer state after the SFT step, and resume from it (see the
    module docstring)."""

    def config_fields(self) -> dict[str, Any]:
        """The ``MegatronPolicy.Config`` fields this layout sets (besides path and LR)."""
        return {
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "use_distributed_optimizer": self.use_distributed_optimizer,
        }

    def sizes(self, world_size: int) -> tuple[int, int, int]:
        """``(tp, pp, dp)`` sizes at ``world_size`` ranks."""
        return self.tp_size, self.pp_size, world_size // (self.tp_size * self.pp_size)


LAUNCHES: dict[int, dict[str, Scenario]] = {
    4: {
        "tp2_dp2": Scenario(model="qwen3", tp_size=2, use_distributed_optimizer=True),
        "tp2_pp2": Scenario(model="qwen2", tp_size=2, pp_size=2),
        "pp2_dp2": Scenario(model="llama", pp_size=2, use_distributed_optimizer=True),
    },
    8: {
        "tp2_pp2_dp2": Scenario(
            model="qwen2", tp_size=2, pp_size=2, use_distributed_optimizer=True, resume=True
        ),
    },
}
"""World size -> scenario name -> layout; one launch per world size. Qwen3 has QK-norm, Qwen2
q/k/v biases and tied embeddings (split over the two pipeline stages, and at 8 ranks also over
two replicas with a sharded optimizer), Llama untied embeddings; all have 2 layers, 4 query and
2 key/value heads."""


def step_batch(vocab: int, dp_size: int) -> TrainBatch:
    """The step's whole batch, planned into ``dp_size`` shards of three sequences each (as the
    trainer does: shard bounds are micro-batch bounds, ``loss_weights`` over the whole batch)."""
    batch = random_batch(vocab, LENGTHS, seed=11, micro_batch_bounds=MICRO_BATCH_BOUNDS)
    if dp_size == 1:
        return batch
    n = batch.num_sequences
    return dataclasses.replace(batch, dp_bounds=tuple(i * n // dp_size for i in range(dp_size + 1)))


def rl_loss() -> PolicyLoss:
    """PPO clip-higher with an entropy bonus (needs entropy gradients) and a KL loss."""
    return PolicyLoss(
        PolicyLoss.Config(eps_clip_low=0.2, eps_clip_high=0.28, entropy_coef=0.01, kl_coef=0.1)
    )


def rl_batch(batch: TrainBatch, logp_T: torch.Tensor) -> TrainBatch:
    """``batch`` with random advantages and old/ref log-probs near ``logp_T`` (whole batch)."""
    gen = torch.Generator().manual_seed(5)
    on_T = batch.loss_mask > 0
    noise = [0.1 * torch.randn(batch.num_tokens, generator=gen) for _ in range(3)]
    return dataclasses.replace(
        batch,
        advantages=batch.loss_mask * noise[0] * 10,
        old_logprobs=torch.where(on_T, logp_T + noise[1], 0.0),
        ref_logprobs=torch.where(on_T, logp_T + noise[2], 0.0),
    )


def gather_to_all(x: Any) -> list[Any]:
    """``x`` of every rank, in global rank order, on every rank."""
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, x)
    return out


def snapshot(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    """A copy of ``named_weights()`` (collective)."""
    return {n: t.detach().clone() for n, t in policy.named_weights()}


def whole_batch_values(parts: list[dict[str, Any]], name: str) -> torch.Tensor:
    """Concatenate per-shard ``[T]`` tensors in data-parallel rank order (one rank per shard)."""
    by_dp = {p["dp_rank"]: p[name] for p in parts}
    return torch.cat([by_dp[d] for d in sorted(by_dp)])


def build_policy(model_path: str, scenario: Scenario) -> MegatronPolicy:
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
    lay = policy.layout
    ranks = {"tp_rank": lay.tp_rank, "pp_rank": lay.pp_rank, "dp_rank": lay.dp_rank}
    res[f"{key}/sizes"] = (lay.tp_size, lay.pp_size, lay.dp_size)
    res[f"{key}/model_path"] = model_path
    batch = step_batch(policy.model_shape.vocab_size, lay.dp_size)
    shard = batch.shard(lay.dp_rank)
    res[f"{key}/batch"] = batch

    lp = policy.compute_logprobs(shard, with_entropy=True)
    parts = gather_to_all({**ranks, "logprobs": lp.logprobs, "entropy": lp.entropy})
    res[f"{key}/logprob_parts"] = parts

    t0 = time.perf_counter()
    metrics = policy.train_step(shard, sft_loss)
    res[f"{key}/sft_step_s"] = time.perf_counter() - t0
    res[f"{key}/sft_metrics"] = gather_to_all(metrics)
    res[f"{key}/sft_weights"] = gather_to_all(snapshot(policy))
    if scenario.resume:
        t0 = time.perf_counter()
        policy.save(out_dir / f"ckpt_{key}_step1", with_optimizer=True)
        res[f"{key}/save_with_optimizer_s"] = time.perf_counter() - t0

    rl = rl_batch(batch, whole_batch_values(parts, "logprobs"))
    res[f"{key}/rl_batch"] = rl
    t0 = time.perf_counter()
    metrics = policy.train_step(rl.shard(lay.dp_rank), rl_loss())
    res[f"{key}/rl_step_s"] = time.perf_counter() - t0
    res[f"{key}/rl_metrics"] = gather_to_all(metrics)
    res[f"{key}/rl_weights"] = gather_to_all(snapshot(policy))

    after = policy.compute_logprobs(shard)
    res[f"{key}/after_parts"] = gather_to_all({**ranks, "logprobs": after.logprobs})
    policy.save(out_dir / f"ckpt_{key}", with_optimizer=False)
    res[f"{key}/version"] = policy.version
    del policy
    gc.collect()

    if scenario.resume:
        policy = build_policy(model_path, scenario)
        t0 = time.perf_counter()
        policy.load(out_dir / f"ckpt_{key}_step1", with_optimizer=True)
        res[f"{key}/load_with_optimizer_s"] = time.perf_counter() - t0
        res[f"{key}/resumed_version"] = policy.version
        res[f"{key}/loaded_weights"] = gather_to_all(snapshot(policy))
        metrics = policy.train_step(rl.shard(lay.dp_rank), rl_loss())
        res[f"{key}/resumed_rl_metrics"] = gather_to_all(metrics)
        res[f"{key}/resumed_rl_weights"] = gather_to_all(snapshot(policy))
        del policy
        gc.collect()
    res[f"{key}/scenario_s"] = time.perf_counter() - t_start


def main() -> None:
    """Run the scenarios of this world size on this rank; rank 0 writes ``results.pt``."""
    out_dir, models = Path(sys.argv[1]), json.loads(sys.argv[2])
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size not in LAUNCHES:
        raise SystemExit(
            f"WORLD_SIZE={world_size}: no layouts for it; use one of {list(LAUNCHES)}."
        )
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    res: dict[str, Any] = {}
    for key, scenario in LAUNCHES[world_size].items():
        run_scenario(key, models[scenario.model], scenario, out_dir, res)
    res["_job_s"] = time.perf_counter() - t_start
    if torch.distributed.get_rank() == 0:
        torch.save(res, out_dir / "results.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
