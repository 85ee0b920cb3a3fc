"""Extreme log-ratios: every ratio-based loss and correction stays finite (issue #24).

A log-ratio of 100 overflows ``exp`` in float32; unclamped, the PPO loss is ``0 * inf = NaN`` on
a zero advantage (every all-equal GRPO group) and its gradient is NaN on a positive one, so one
such token poisons the whole step. The log-ratio is clamped to
``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` before every ``exp``; inside that range the clamp must
not change a single bit.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.algorithms import (
    CORRECTION_LEVELS,
    KL_KINDS,
    DistillationLoss,
    PolicyLoss,
    importance_weights,
    kl_estimate,
)
from rl_core.algorithms import correction as correction_module
from rl_core.algorithms import kl as kl_module
from rl_core.algorithms import losses as losses_module
from rl_core.algorithms.correction import LOG_RATIO_BOUND
from rl_core.types import TrainBatch

T = torch.tensor

# Loss configurations that exp a log-ratio: every variant, with and without the clip extras.
VARIANTS = {
    "ppo": PolicyLoss.Config(),
    "ppo_dual_clip": PolicyLoss.Config(dual_clip_c=3.0),
    "ppo_clip_higher": PolicyLoss.Config(eps_clip_high=0.28),
    "gspo": PolicyLoss.Config(variant="gspo"),
    "cispo": PolicyLoss.Config(variant="cispo"),
}
CORRECTIONS = [(mode, level) for mode in ("tis", "mis", "icepop") for level in CORRECTION_LEVELS]
ADVANTAGES = {"all_equal_group": 0.0, "positive": 1.0, "negative": -1.0}

# Two sequences of 4 tokens; the first token of each is prompt (masked out).
CU = [0, 4, 8]
MASK = [0.0, 1, 1, 1, 0, 1, 1, 1]
LOGP = [0.0, -0.5, -1.0, -2.0, 0.0, -0.7, -1.3, -0.2]


def _batch(adv: float, **logprobs: list[float]) -> TrainBatch:
    mask_T = T(MASK)
    return TrainBatch(
        tokens=torch.arange(len(MASK)),
        cu_seqlens=T(CU),
        loss_mask=mask_T,
        loss_weights=mask_T / mask_T.sum(),
        advantages=mask_T * adv,
        **{k: T(v) for k, v in logprobs.items()},
    )


def _shifted(values: list[float], by: float) -> list[float]:
    return [v - by for v in values]


def _loss_and_grad(cfg: PolicyLoss.Config, batch: TrainBatch, loss_cls=PolicyLoss):
    logp_T = T(LOGP).requires_grad_(True)
    out = loss_cls(cfg)(logp_T, batch, None)
    out.loss.backward()
    return out, logp_T.grad


def _assert_finite(out, grad_T: torch.Tensor) -> None:
    assert math.isfinite(out.loss.item()), out.loss
    assert torch.isfinite(grad_T).all(), grad_T
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics


def test_the_bound_is_below_float32_overflow() -> None:
    assert 0 < LOG_RATIO_BOUND < math.log(torch.finfo(torch.float32).max)
    assert math.isfinite(torch.exp(T(LOG_RATIO_BOUND)).item())


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("adv", ADVANTAGES.values(), ids=ADVANTAGES.keys())
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANTS.keys())
def test_policy_loss_finite_at_extreme_log_ratio(variant: str, adv: float, log_ratio: float):
    # old = logp - log_ratio on every trained token: rho = exp(+-100)
    batch = _batch(adv, old_logprobs=_shifted(LOGP, log_ratio))
    out, grad_T = _loss_and_grad(VARIANTS[variant], batch)
    _assert_finite(out, grad_T)


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("adv", ADVANTAGES.values(), ids=ADVANTAGES.keys())
@pytest.mark.parametrize(("mode", "level"), CORRECTIONS)
def test_correction_finite_at_extreme_log_ratio(mode: str, level: str, adv: float, log_ratio):
    # the trainer's old log-probs are 100 nats away from the engine's, and from the new ones
    old = _shifted(LOGP, log_ratio)
    batch = _batch(adv, old_logprobs=old, rollout_logprobs=_shifted(old, log_ratio))
    cfg = PolicyLoss.Config(correction=mode, correction_level=level, correction_clip_high=5.0)
    out, grad_T = _loss_and_grad(cfg, batch)
    _assert_finite(out, grad_T)
    w = importance_weights(
        T(old), T(_shifted(old, log_ratio)), T(MASK), T(CU), mode=mode, level=level
    )
    for t in (w.weights_T, w.raw_T, w.clipped_T):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_loss_finite_at_extreme_log_ratio(kind: str, log_ratio: float) -> None:
    batch = _batch(0.0, ref_logprobs=_shifted(LOGP, log_ratio))
    out, grad_T = _loss_and_grad(PolicyLoss.Config(kl_coef=0.1, kl_type=kind), batch)
    _assert_finite(out, grad_T)
    x_T = T([log_ratio, -log_ratio, 0.5]).requires_grad_(True)
    kl_T = kl_estimate(x_T, torch.zeros(3), kind)
    kl_T.sum().backward()
    assert torch.isfinite(kl_T).all() and torch.isfinite(x_T.grad).all()


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("adv", ADVANTAGES.values(), ids=ADVANTAGES.keys())
def test_distillation_finite_at_extreme_log_ratio(adv: float, log_ratio: float) -> None:
    batch = _batch(
        adv, old_logprobs=_shifted(LOGP, log_ratio), ref_logprobs=_shifted(LOGP, -log_ratio)
    )
    cfg = DistillationLoss.Config(policy=PolicyLoss.Config(correction="none"))
    out, grad_T = _loss_and_grad(cfg, batch, DistillationLoss)
    _assert_finite(out, grad_T)


@pytest.mark.parametrize("log_ratio", [100.0, -100.0, float("inf")])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANTS.keys())
def test_one_extreme_token_does_not_change_the_other_gradients(variant: str, log_ratio: float):
    # sequence 0 holds one extreme token; sequence 1 is ordinary. With fixed loss weights,
    # sequence 1's gradient must equal its gradient when the extreme token is masked out.
    old = [0.0, -0.5 - log_ratio, -1.1, -1.8, 0.0, -0.9, -1.0, -0.3]
    adv = [0.0, 1.0, 1.0, 1.0, 0.0, -1.0, -1.0, -1.0]
    weights_T = T(MASK) / 6

    def grads(mask: list[float]) -> torch.Tensor:
        batch = TrainBatch(
            tokens=torch.arange(8),
            cu_seqlens=T(CU),
            loss_mask=T(mask),
            loss_weights=weights_T * T(mask),
            advantages=T(adv),
            old_logprobs=T(old),
        )
        return _loss_and_grad(VARIANTS[variant], batch)[1]

    with_extreme_T = grads(MASK)
    without_T = grads([0.0, 0, 1, 1, 0, 1, 1, 1])
    assert torch.isfinite(with_extreme_T).all()
    torch.testing.assert_close(with_extreme_T[4:], without_T[4:], rtol=0, atol=0)
    if variant != "gspo":  # GSPO shares one ratio per sequence
        torch.testing.assert_close(with_extreme_T[2:4], without_T[2:4], rtol=0, atol=0)


# -- inside the bound, the clamp changes nothing ---------------------------------------------

_ALL_CONFIGS = [
    *VARIANTS.values(),
    *(
        PolicyLoss.Config(correction=m, correction_level=lv, correction_clip_high=3.0)
        for m, lv in CORRECTIONS
    ),
    *(PolicyLoss.Config(kl_coef=0.1, kl_type=k) for k in KL_KINDS),
]
_log_ratios = st.lists(
    st.floats(-LOG_RATIO_BOUND / 4, LOG_RATIO_BOUND / 4, width=32), min_size=8, max_size=8
)


def _run_all(batch: TrainBatch) -> list[torch.Tensor]:
    results = []
    for cfg in _ALL_CONFIGS:
        out, grad_T = _loss_and_grad(cfg, batch)
        results += [out.loss.detach(), grad_T]
    w = importance_weights(
        batch.old_logprobs,
        batch.rollout_logprobs,
        batch.loss_mask,
        batch.cu_seqlens,
        mode="tis",
        level="sequence",
    )
    return [*results, w.raw_T, kl_estimate(T(LOGP), batch.ref_logprobs, "k3")]


@settings(max_examples=25, deadline=None)
@given(
    ratio=_log_ratios,
    mismatch=_log_ratios,
    ref=_log_ratios,
    adv=st.floats(-3, 3, width=32),
)
def test_clamp_is_bitwise_identity_inside_the_bound(ratio, mismatch, ref, adv) -> None:
    # GSPO's sequence mean and the sequence-level weight sum 3 log-ratios: at most 3/4 of the bound
    old = [p - r for p, r in zip(LOGP, ratio)]
    batch = _batch(
        adv,
        old_logprobs=old,
        rollout_logprobs=[o - m for o, m in zip(old, mismatch)],
        ref_logprobs=[p - r for p, r in zip(LOGP, ref)],
    )
    clamped = _run_all(batch)
    with pytest.MonkeyPatch.context() as mp:  # the computations without any clamp
        for module in (correction_module, kl_module, losses_module):
            mp.setattr(module, "clamp_log_ratio", lambda x: x)
        unclamped = _run_all(dataclasses.replace(batch))
    for a, b in zip(clamped, unclamped, strict=True):
        assert torch.equal(a, b), (a, b)
