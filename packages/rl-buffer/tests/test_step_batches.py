"""rank_batches: a schedule_step plan becomes per-rank batches whose summed losses are the loss of
the whole step (weights normalised over the step, not per rank)."""

from __future__ import annotations

import random

import pytest
import torch

from rl_buffer import rank_batches, schedule_step
from rl_core.algorithms import PolicyLoss, compute_loss_weights
from rl_core.batching import pack_rollouts
from rl_core.errors import DataError
from rl_core.types import Rollout, TrainBatch


def _rollouts(n: int, seed: int = 0, fan_out: int = 1) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, resp = rng.randint(2, 9), rng.randint(1, 40)
        out.append(
            Rollout(
                prompt_uid=f"p{i // 4}",
                rollout_id=f"r{i // fan_out}",
                sample_id=f"s{i}",
                tokens=tuple(rng.randrange(50) for _ in range(prompt + resp)),
                response_start=prompt,
                loss_mask=tuple(int(rng.random() > 0.1) for _ in range(resp)),
                rollout_logprobs=tuple(-rng.random() for _ in range(resp)),
                versions=(0,) * resp,
                reward=rng.random(),
            )
        )
    return out


def _logprobs(batch: TrainBatch, table: dict[str, torch.Tensor]) -> torch.Tensor:
    """Stand-in for the current policy's log-probs: a fixed value per (sample, position)."""
    return torch.cat(
        [table[s][: int(n)] for s, n in zip(batch.sample_ids, batch.cu_seqlens.diff())]
    )


@pytest.mark.parametrize(
    ("aggregation", "constant", "fan_out"),
    [("token", None, 1), ("sequence", None, 1), ("rollout", None, 2), ("constant", 40.0, 1)],
)
def test_rank_losses_sum_to_the_whole_batch_loss(
    aggregation: str, constant: float | None, fan_out: int
) -> None:
    rollouts = _rollouts(23, fan_out=fan_out)
    g = torch.Generator().manual_seed(0)
    adv = [torch.randn(r.response_length, generator=g) for r in rollouts]
    table = {r.sample_id: -torch.rand(len(r.tokens), generator=g) for r in rollouts}
    old = {
        r.sample_id: t + 0.05 * torch.randn(t.shape, generator=g)
        for r, t in zip(rollouts, table.values())
    }
    loss_fn = PolicyLoss(PolicyLoss.Config(eps_clip_low=0.2, eps_clip_high=0.28))

    def loss(batch: TrainBatch) -> torch.Tensor:
        batch.old_logprobs = _logprobs(batch, old)
        return loss_fn(_logprobs(batch, table), batch).loss

    whole = pack_rollouts(rollouts, advantages=adv)
    whole.loss_weights = (
        compute_loss_weights(
            whole.loss_mask,
            whole.cu_seqlens,
            mode=aggregation,
            rollout_ids=[r.rollout_id for r in rollouts],
            constant=constant,
        )
        * whole.loss_mask
    )
    expected = loss(whole)

    plan = schedule_step(
        rollouts,
        dp_size=3,
        max_tokens_per_micro_batch=60,
        rollout_ids=[r.rollout_id for r in rollouts],
    )
    batches = rank_batches(
        rollouts, plan, advantages=adv, aggregation=aggregation, aggregation_constant=constant
    )
    assert len(batches) == 3
    assert sorted(s for b in batches for s in b.sample_ids) == sorted(r.sample_id for r in rollouts)
    total = torch.zeros((), dtype=torch.float64)
    for rank, b in enumerate(batches):
        assert list(b.sample_ids) == [rollouts[i].sample_id for i in plan.rank_samples(rank)]
        mbs = b.micro_batches()
        assert len(mbs) == plan.num_micro_batches
        for mb in mbs:
            assert sum(len(rollouts[int(s[1:])].tokens) for s in mb.sample_ids) <= 60
            total += loss(mb).double()
    torch.testing.assert_close(total, expected.double(), rtol=1e-5, atol=1e-6)

    # normalising per rank (each rank's own token mean) is not the step loss
    if aggregation == "token":
        per_rank = (
            sum(
                loss(
                    pack_rollouts(
                        [rollouts[i] for i in plan.rank_samples(r)],
                        advantages=[adv[i] for i in plan.rank_samples(r)],
                    )
                )
                for r in range(3)
            )
            / 3
        )
        assert abs(float(per_rank) - float(expected)) > 1e-4


def test_wrong_plan_refused() -> None:
    rollouts = _rollouts(6)
    plan = schedule_step(rollouts[:5], dp_size=2, max_tokens_per_micro_batch=100)
    with pytest.raises(DataError, match="6 rollouts.*same rollouts"):
        rank_batches(rollouts, plan)
    with pytest.raises(DataError, match="2 advantages for 5 rollouts"):
        rank_batches(rollouts[:5], plan, advantages=[[0.0], [0.0]])
    lonely = schedule_step(rollouts[:1], dp_size=2, max_tokens_per_micro_batch=100)
    with pytest.raises(DataError, match="rank 1 has no sample"):
        rank_batches(rollouts[:1], lonely)
