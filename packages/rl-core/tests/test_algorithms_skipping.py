"""Leaving zero-advantage sequences out of the loss changes neither the loss nor the gradient
of the others, as long as the loss weights are the whole step's; other loss terms block it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_core.algorithms import (
    PolicyLoss,
    compute_loss_weights,
    metrics_over_trained,
    sequences_to_train,
    skip_blocker,
    zero_advantage_sequences,
)
from rl_core.types import TrainBatch

CU = [0, 5, 9, 16, 20, 26]


def _step_batch(seed: int) -> TrainBatch:
    """Five sequences; the 2nd and 4th have advantage 0 on every token (an all-equal group)."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor(CU)
    n = CU[-1]
    mask = (torch.rand(n, generator=g) > 0.2).float()
    mask[cu[:-1]] = 0.0
    adv = torch.randn(n, generator=g) * mask
    for s in (1, 3):
        adv[CU[s] : CU[s + 1]] = 0.0
    return TrainBatch(
        tokens=torch.arange(n),
        cu_seqlens=cu,
        loss_mask=mask,
        loss_weights=compute_loss_weights(mask, cu, mode="sequence"),
        advantages=adv,
        old_logprobs=-torch.rand(n, generator=g),
        rollout_logprobs=-torch.rand(n, generator=g),
    )


def _subset(batch: TrainBatch, keep: list[int]) -> tuple[TrainBatch, torch.Tensor]:
    """The kept sequences with the WHOLE step's weights, and their token indices."""
    cu = batch.cu_seqlens.tolist()
    idx = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in keep])
    lens = [cu[i + 1] - cu[i] for i in keep]
    return (
        TrainBatch(
            tokens=batch.tokens[idx],
            cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
            loss_mask=batch.loss_mask[idx],
            loss_weights=batch.loss_weights[idx],
            advantages=batch.advantages[idx],
            old_logprobs=batch.old_logprobs[idx],
            rollout_logprobs=batch.rollout_logprobs[idx],
        ),
        idx,
    )


@pytest.mark.parametrize(
    "config",
    [
        PolicyLoss.Config(),
        PolicyLoss.Config(variant="gspo"),
        PolicyLoss.Config(variant="cispo", correction="tis"),
        PolicyLoss.Config(dual_clip_c=3.0, correction="mis", correction_level="sequence"),
    ],
)
def test_skipped_sequences_change_neither_loss_nor_gradient(config: PolicyLoss.Config) -> None:
    batch = _step_batch(3)
    free = zero_advantage_sequences(batch.advantages, batch.loss_mask, batch.cu_seqlens)
    assert free == [False, True, False, True, False]
    keep = sequences_to_train(free, [CU[i + 1] - CU[i] for i in range(5)])
    assert keep == [0, 2, 4]
    loss_fn = PolicyLoss(config)
    logp = (-torch.rand(CU[-1], generator=torch.Generator().manual_seed(7))).requires_grad_(True)
    whole = loss_fn(logp, batch)
    whole.loss.backward()
    grad_whole = logp.grad.clone()
    logp.grad = None
    part, idx = _subset(batch, keep)
    out = loss_fn(logp[idx], part)
    out.loss.backward()
    torch.testing.assert_close(out.loss, whole.loss)
    torch.testing.assert_close(logp.grad, grad_whole)
    # the skipped tokens had no gradient in the whole batch either
    skipped = torch.ones(CU[-1], dtype=torch.bool)
    skipped[idx] = False
    assert torch.all(grad_whole[skipped] == 0)


def test_the_weights_must_be_the_whole_steps() -> None:
    """Recomputing the weights over the kept sequences alone would change the update: the skip
    is only exact with the step's weights (which is what a trainer must keep)."""
    batch = _step_batch(3)
    keep = [0, 2, 4]
    part, idx = _subset(batch, keep)
    part.loss_weights = compute_loss_weights(part.loss_mask, part.cu_seqlens, mode="sequence")
    logp = -torch.rand(CU[-1], generator=torch.Generator().manual_seed(7))
    loss_fn = PolicyLoss()
    assert not torch.allclose(loss_fn(logp[idx], part).loss, loss_fn(logp, batch).loss)


def test_all_free_keeps_the_shortest_so_the_optimizer_still_steps() -> None:
    assert sequences_to_train([True, True, True], [7, 3, 3]) == [1]
    assert sequences_to_train([], []) == []
    # data-parallel ranks each need a sequence: top up with the shortest free ones
    assert sequences_to_train([True, False, True, True], [5, 9, 2, 4], min_keep=3) == [1, 2, 3]
    assert sequences_to_train([True, True], [5, 2], min_keep=4) == [0, 1]
    with pytest.raises(ValueError, match="2 flags for 1 sequences"):
        sequences_to_train([True, False], [4])


def test_a_sequence_without_trained_tokens_is_free() -> None:
    mask = torch.tensor([0.0, 1, 1, 0, 0, 0])
    adv = torch.tensor([0.0, 0.5, 0, 0, 0.0, 0])
    assert zero_advantage_sequences(adv, mask, torch.tensor([0, 3, 6])) == [False, True]


@pytest.mark.parametrize(
    ("kwargs", "blocked_by"),
    [
        ({"entropy_coef": 0.01}, "entropy_coef"),
        ({"kl_coef": 0.1}, "kl_coef"),
    ],
)
def test_terms_that_give_gradient_block_the_skip(kwargs: dict, blocked_by: str) -> None:
    cfg = PolicyLoss.Config(**kwargs)
    assert blocked_by in skip_blocker(cfg, critic=False, updates_per_step=1)
    batch = _step_batch(3)
    batch.ref_logprobs = -torch.rand(CU[-1])
    logp = (-torch.rand(CU[-1])).requires_grad_(True)
    entropy = torch.rand(CU[-1]).requires_grad_(True)
    PolicyLoss(cfg)(logp, batch, entropy).loss.backward()
    free_tokens = torch.arange(CU[1], CU[2])  # sequence 1: advantage 0 everywhere
    on = batch.loss_mask[free_tokens] > 0
    grad = entropy.grad if blocked_by == "entropy_coef" else logp.grad
    assert torch.any(grad[free_tokens][on] != 0)  # so skipping it would change the update


def test_blockers_outside_the_loss() -> None:
    cfg = PolicyLoss.Config()
    assert skip_blocker(cfg, critic=False, updates_per_step=1) is None
    assert "critic" in skip_blocker(cfg, critic=True, updates_per_step=1)
    assert "2 updates per step" in skip_blocker(cfg, critic=False, updates_per_step=2)
    assert "teacher" in skip_blocker(cfg, critic=False, updates_per_step=1, teacher=True)


def test_metrics_over_trained_are_means_over_the_kept_tokens() -> None:
    """The weighted-mean metrics of a skipped step equal those of the kept sequences alone
    (their own weights renormalised), and exact ones (loss) are untouched."""
    batch = _step_batch(3)
    keep = [0, 2, 4]
    part, idx = _subset(batch, keep)
    kept_weight = float(part.loss_weights.sum())
    logp = -torch.rand(CU[-1], generator=torch.Generator().manual_seed(7))
    entropy = torch.rand(CU[-1], generator=torch.Generator().manual_seed(8))
    loss_fn = PolicyLoss(PolicyLoss.Config(correction="tis"))
    skipped = loss_fn(logp[idx], part, entropy[idx]).metrics
    renorm = dataclasses.replace(part, loss_weights=part.loss_weights / kept_weight)
    alone = loss_fn(logp[idx], renorm, entropy[idx]).metrics
    fixed = metrics_over_trained(skipped, kept_weight)
    for k in ("entropy", "ppo_kl", "pg_clipfrac", "mismatch", "tis_weight_mean"):
        assert fixed[k] == pytest.approx(alone[k], rel=1e-5), k
    assert fixed["pg_loss"] == skipped["pg_loss"]
    with pytest.raises(ValueError, match="kept_weight"):
        metrics_over_trained(skipped, 0.0)
