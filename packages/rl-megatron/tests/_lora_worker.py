"""One rank of the two-process CPU job that ``test_lora_parallel.py`` launches (not a test file).

Run as ``python _lora_worker.py OUT_DIR JOB_JSON`` (``{"models": {arch: path}, "adapters":
{arch: path}}``) with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. Both
ranks build MegatronPolicy with ``policy.lora`` from the same peft adapter at TP=2, PP=2 and DP=2
(distributed optimizer) and go through the same scenarios; rank 0 writes what the tests compare
with transformers + peft to ``OUT_DIR/results.pt``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

from rl_core.lora import LoRAConfig
from rl_core.testing.policy import random_batch, sft_loss
from rl_core.types import TrainBatch
from rl_megatron.policy import MegatronPolicy

LENGTHS = [5, 8, 3, 6, 4, 7]
LR = 1e-3
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 4, 8.0


def global_batch(vocab: int) -> TrainBatch:
    """The step's batch; ``loss_weights`` is the per-token mean over all six sequences."""
    return random_batch(vocab, LENGTHS, seed=11, micro_batch_bounds=(0, 2, 3, 6))


def dp_shard(batch: TrainBatch, dp_rank: int) -> TrainBatch:
    """Sequences 0-2 or 3-5 with the global loss weights, as two micro-batches."""
    half = dataclasses.replace(batch, micro_batch_bounds=(0, 3, 6)).micro_batches()[dp_rank]
    return dataclasses.replace(half, micro_batch_bounds=(0, 1, 3))


def gather_to_all(x: Any) -> list[Any]:
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, x)
    return out


def adapter(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in policy.named_adapter_weights()}


def scenario(res: dict[str, Any], job: dict[str, Any], out_dir: Path, arch: str, **kw: Any) -> None:
    """Log-probs (adapter on and off), adapter and merged tensors, one step, optimizer state,
    and an exact resume from a checkpoint."""
    layout = "_".join(f"{k.split('_')[0]}{v}" for k, v in kw.items() if k.endswith("size"))
    key = f"{layout}_{arch}" + ("_distopt" if kw.get("use_distributed_optimizer") else "")
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    policy = MegatronPolicy(
        MegatronPolicy.Config(
            model_path=job["models"][arch],
            lr=LR,
            lora=lora,
            lora_init=job["adapters"][arch],
            **kw,
        )
    )
    batch = global_batch(policy.model_shape.vocab_size)
    dp = policy.layout.dp_size
    mine = dp_shard(batch, policy.layout.dp_rank) if dp > 1 else batch
    lp = policy.compute_logprobs(mine).logprobs
    base = policy.compute_base_logprobs(mine).logprobs
    if dp > 1:
        lp = torch.cat(gather_to_all(lp))
        base = torch.cat(gather_to_all(base))
    res[f"{key}/logprobs"], res[f"{key}/base_logprobs"] = lp, base
    res[f"{key}/ranks_equal"] = dp > 1 or all(torch.equal(t, lp) for t in gather_to_all(lp))
    res[f"{key}/adapter"] = adapter(policy)
    res[f"{key}/merged"] = {n: t.clone() for n, t in policy.named_weights()}
    res[f"{key}/metrics"] = policy.train_step(mine, sft_loss)
    res[f"{key}/adapter_after"] = adapter(policy)
    states = sum(len(opt.optimizer.state) for opt in policy.optimizer.chained_optimizers)
    trainable = sum(p.numel() for p in policy.module.parameters() if p.requires_grad)
    res[f"{key}/optimizer_states"] = gather_to_all(states)
    res[f"{key}/trainable_numel"] = gather_to_all(trainable)
    ckpt = out_dir / f"ckpt_{key}"
    policy.save(ckpt)
    policy.train_step(mine, sft_loss)
    second = adapter(policy)
    policy.load(ckpt)
    policy.train_step(mine, sft_loss)
    again = adapter(policy)
    res[f"{key}/resume_max_diff"] = max(float((second[n] - again[n]).abs().max()) for n in second)
    res[f"{key}/second"] = second
    del policy
    gc.collect()


def relayout(res: dict[str, Any], job: dict[str, Any], out_dir: Path) -> None:
    """The TP=2 adapter checkpoint (with its optimizer state) loaded at PP=2: same adapter,
    and the next step as the TP=2 policy's."""
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    policy = MegatronPolicy(
        MegatronPolicy.Config(model_path=job["models"]["qwen2"], lr=LR, lora=lora, pp_size=2)
    )
    policy.load(out_dir / "ckpt_tp2_qwen2")
    res["relayout/loaded"] = adapter(policy)
    policy.train_step(global_batch(policy.model_shape.vocab_size), sft_loss)
    res["relayout/second"] = adapter(policy)
    del policy
    gc.collect()


def main() -> None:
    out_dir, job = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    scenario(res, job, out_dir, "qwen2", tp_size=2)
    scenario(res, job, out_dir, "qwen3", tp_size=2)
    scenario(res, job, out_dir, "qwen2", pp_size=2)
    scenario(res, job, out_dir, "llama", pp_size=2)
    scenario(res, job, out_dir, "qwen2", dp_size=2, use_distributed_optimizer=True)
    relayout(res, job, out_dir)
    if torch.distributed.get_rank() == 0:
        torch.save(res, out_dir / "results.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
