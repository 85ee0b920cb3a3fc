"""rl-buffer: balance one optimizer step over data-parallel ranks, then train each rank's
micro-batches with loss weights normalised over the WHOLE step.

``schedule_step`` splits the step's rollouts over 4 ranks (equal estimated FLOPs) and into
micro-batches of at most 256 tokens; ``rank_batches`` packs each rank's share into a
``TrainBatch`` whose ``loss_weights`` come from the whole step, so the ranks' summed losses are the
whole batch's loss (sum the gradients over ranks, do not average them).

    OMP_NUM_THREADS=1 python examples/buffer_rank_batches.py
"""

from __future__ import annotations

import random

import torch

from rl_buffer import rank_batches, schedule_step
from rl_core.algorithms import PolicyLoss, compute_loss_weights
from rl_core.batching import pack_rollouts
from rl_core.types import ModelShape, Rollout, TrainBatch


def rollouts(n: int, seed: int = 0) -> list[Rollout]:
    """``n`` rollouts with prompts of 8-32 and responses of 4-200 tokens, in groups of 4."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, response = rng.randint(8, 32), rng.randint(4, 200)
        out.append(
            Rollout(
                prompt_uid=f"prompt-{i // 4}",
                rollout_id=f"r{i}",
                sample_id=f"s{i}",
                tokens=tuple(rng.randrange(1000) for _ in range(prompt + response)),
                response_start=prompt,
                loss_mask=(1,) * response,
                rollout_logprobs=tuple(-rng.random() for _ in range(response)),
                versions=(0,) * response,
                reward=rng.random(),
            )
        )
    return out


def main() -> None:
    """Plan, pack per rank, and check the summed per-rank loss against the whole batch's."""
    step = rollouts(32)
    advantages = [torch.full((r.response_length,), r.reward - 0.5) for r in step]
    shape = ModelShape(  # FLOPs estimate of the model being trained (here a 0.5B-like one)
        num_layers=24,
        hidden_size=896,
        num_attention_heads=14,
        num_kv_heads=2,
        head_dim=64,
        ffn_hidden_size=4864,
        vocab_size=151936,
    )
    plan = schedule_step(step, dp_size=4, max_tokens_per_micro_batch=256, shape=shape)
    batches = rank_batches(step, plan, advantages=advantages, aggregation="token")
    print(
        f"imbalance {plan.imbalance:.3f} (1.0 is perfect), {plan.num_micro_batches} "
        "micro-batches per rank"
    )

    # Stand-in for the policy's current log-probs: the sampler's, shifted a little per token.
    def current_logprobs(batch: TrainBatch) -> torch.Tensor:
        return batch.rollout_logprobs + 0.01 * torch.sin(batch.tokens.float())

    loss_fn = PolicyLoss(PolicyLoss.Config())
    total = 0.0
    for rank, batch in enumerate(batches):
        rank_loss = 0.0
        for mb in batch.micro_batches():  # each one forward/backward on this rank
            mb.old_logprobs = mb.rollout_logprobs
            rank_loss += float(loss_fn(current_logprobs(mb), mb).loss)
        total += rank_loss
        print(
            f"rank {rank}: {batch.num_sequences} samples, {batch.num_tokens} tokens, "
            f"weight {float(batch.loss_weights.sum()):.3f} of the step, loss {rank_loss:+.5f}"
        )

    whole = pack_rollouts(step, advantages=advantages)
    whole.loss_weights = compute_loss_weights(whole.loss_mask, whole.cu_seqlens, mode="token")
    whole.old_logprobs = whole.rollout_logprobs
    expected = float(loss_fn(current_logprobs(whole), whole).loss)
    assert abs(total - expected) < 1e-6, (total, expected)
    print(f"sum over ranks {total:+.6f} == whole-batch loss {expected:+.6f}")


if __name__ == "__main__":
    main()
