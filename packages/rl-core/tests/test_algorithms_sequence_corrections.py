"""Sequence-level corrections slime added: off-policy sequence masking (OPSM), the correction
veto and the unbiased KL loss; every number is computed by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.algorithms import PolicyLoss, compute_loss_weights, importance_weights
from rl_core.errors import ConfigError
from rl_core.types import TrainBatch

T = torch.tensor

# Three sequences (first token of each unmasked): 0..3, 4..6, 7..9; 7 trained tokens, weight 1/7.
CU = [0, 4, 7, 10]
MASK = [0.0, 1, 1, 1, 0, 1, 1, 0, 1, 1]
ADV = [0.0, -1, -1, -1, 0, -1, -1, 0, 1, 1]
# old - new per token: seq 0 [0.3, 0.1, 0.2] (mean 0.2), seq 1 [0.05, 0.05] (mean 0.05),
# seq 2 [0.5, 0.5] (mean 0.5, but a positive advantage).
OLD = [0.0, -1.0, -1.0, -1.0, 0.0, -1.0, -1.0, 0.0, -1.0, -1.0]
NEW = [0.0, -1.3, -1.1, -1.2, 0.0, -1.05, -1.05, 0.0, -1.5, -1.5]
# No clipping anywhere (ratio range [0.1, 11]): L_t = -A_t rho_t, rho_t = exp(new - old).
NO_CLIP = {"eps_clip_low": 0.9, "eps_clip_high": 10.0}


def _batch(**kw) -> TrainBatch:
    mask_T, cu_N1 = T(MASK), T(CU)
    return TrainBatch(
        tokens=torch.arange(len(MASK)),
        cu_seqlens=cu_N1,
        loss_mask=mask_T,
        loss_weights=compute_loss_weights(mask_T, cu_N1, mode="token"),
        advantages=T(ADV),
        **{k: T(v) for k, v in kw.items()},
    )


def _leaf(values: list[float]) -> torch.Tensor:
    return T(values, dtype=torch.float32).requires_grad_(True)


def test_opsm_drops_negative_advantage_sequences_that_drifted() -> None:
    logp = _leaf(NEW)
    loss_fn = PolicyLoss(PolicyLoss.Config(opsm_delta=0.1, **NO_CLIP))
    out = loss_fn(logp, _batch(old_logprobs=OLD), None)
    # seq 0: A < 0 and D = 0.2 > 0.1 -> dropped; seq 1: D = 0.05 -> kept; seq 2: A > 0 -> kept
    want = (2 * math.exp(-0.05) - 2 * math.exp(-0.5)) / 7
    assert out.loss.item() == pytest.approx(want, abs=1e-6)
    assert out.metrics["opsm_clipfrac"] == pytest.approx(3 / 7, abs=1e-6)
    out.loss.backward()
    # dL/dlogp_t = -A_t rho_t w_t on kept tokens, exactly 0 on the dropped sequence
    kept1, kept2 = math.exp(-0.05) / 7, -math.exp(-0.5) / 7
    g = [0.0, 0.0, 0.0, 0.0, 0.0, kept1, kept1, 0.0, kept2, kept2]
    torch.testing.assert_close(logp.grad, T(g), atol=1e-6, rtol=0)


def test_opsm_off_and_below_threshold_change_nothing() -> None:
    batch = _batch(old_logprobs=OLD)
    plain = PolicyLoss(PolicyLoss.Config(**NO_CLIP))(_leaf(NEW), batch, None)
    want = (math.exp(-0.3) + math.exp(-0.1) + math.exp(-0.2) + 2 * math.exp(-0.05)) / 7
    want -= 2 * math.exp(-0.5) / 7
    assert plain.loss.item() == pytest.approx(want, abs=1e-6)
    assert "opsm_clipfrac" not in plain.metrics
    loose = PolicyLoss(PolicyLoss.Config(opsm_delta=0.25, **NO_CLIP))(_leaf(NEW), batch, None)
    assert loose.loss.item() == pytest.approx(want, abs=1e-6)  # D = 0.2 <= 0.25: kept
    assert loose.metrics["opsm_clipfrac"] == 0.0


def test_opsm_against_rollout_logprobs_works_on_policy() -> None:
    # No old log-probs (on-policy: old = sg(logp), ratio 1); the engine's log-probs are OLD.
    logp = _leaf(NEW)
    cfg = PolicyLoss.Config(opsm_delta=0.1, opsm_reference="rollout")
    out = PolicyLoss(cfg)(logp, _batch(rollout_logprobs=OLD), None)
    # ratio 1 everywhere: L_t = -A_t; seq 0 dropped -> (1 + 1 - 1 - 1) / 7 = 0
    assert out.loss.item() == pytest.approx(0.0, abs=1e-7)
    assert out.metrics["opsm_clipfrac"] == pytest.approx(3 / 7, abs=1e-6)
    # with reference "old" the gap is 0 on-policy: nothing is dropped
    same = PolicyLoss(PolicyLoss.Config(opsm_delta=0.1))(_leaf(NEW), _batch(), None)
    assert same.metrics["opsm_clipfrac"] == 0.0
    with pytest.raises(ConfigError, match="opsm_reference.*rollout_logprobs"):
        PolicyLoss(cfg)(_leaf(NEW), _batch(), None)


def test_opsm_config_errors() -> None:
    with pytest.raises(ConfigError, match="opsm_delta"):
        PolicyLoss.Config(opsm_delta=-1.0)
    with pytest.raises(ConfigError, match="opsm_reference"):
        PolicyLoss.Config(opsm_delta=0.1, opsm_reference="engine")  # type: ignore[arg-type]


# Correction veto on the fixture of test_algorithms_correction: raw token ratios
# [., 1.221403, 1, 0.332871, ., 2.013753, 0.904837] over sequences 0..3 and 4..6.
C_MASK = T([0.0, 1, 1, 1, 0, 1, 1])
C_CU = T([0, 4, 7])
C_OLD = T([0.0, -1.0, -0.5, -2.0, 0.0, -0.3, -0.2])
C_ROLL = T([0.0, -1.2, -0.5, -0.9, 0.0, -1.0, -0.1])


def test_veto_drops_the_whole_sequence_of_a_low_ratio_token() -> None:
    w = importance_weights(C_OLD, C_ROLL, C_MASK, C_CU, mode="tis", clip_high=2.0, veto=0.5)
    # seq 0 holds 0.332871 < 0.5: all its tokens get 0; seq 1 truncated as usual (2.0, 0.904837)
    torch.testing.assert_close(w.weights_T, T([0, 0, 0, 0, 0, 2.0, 0.904837]), atol=1e-5, rtol=0)
    torch.testing.assert_close(w.vetoed_T, T([0.0, 1, 1, 1, 0, 0, 0]))
    torch.testing.assert_close(w.clipped_T, T([0.0, 1, 1, 1, 0, 1, 0]))
    # a veto below every ratio changes nothing
    low = importance_weights(C_OLD, C_ROLL, C_MASK, C_CU, mode="tis", veto=0.3)
    plain = importance_weights(C_OLD, C_ROLL, C_MASK, C_CU, mode="tis")
    torch.testing.assert_close(low.weights_T, plain.weights_T)
    assert plain.vetoed_T is None


def test_veto_in_the_loss_and_its_errors() -> None:
    batch = TrainBatch(
        tokens=torch.arange(7),
        cu_seqlens=C_CU,
        loss_mask=C_MASK,
        loss_weights=compute_loss_weights(C_MASK, C_CU, mode="token"),
        advantages=T([0.0, 1, 1, 1, 0, 1, 1]),
        old_logprobs=C_OLD,
        rollout_logprobs=C_ROLL,
    )
    cfg = PolicyLoss.Config(correction="tis", correction_veto=0.5)
    out = PolicyLoss(cfg)(C_OLD.clone().requires_grad_(True), batch, None)
    # ratio 1, A = 1: L_t = -w_t; (-2.0 - 0.904837) / 5
    assert out.loss.item() == pytest.approx(-(2.0 + 0.904837) / 5, abs=1e-5)
    assert out.metrics["tis_veto_frac"] == pytest.approx(3 / 5)
    with pytest.raises(ConfigError, match="correction_veto.*needs a correction"):
        PolicyLoss.Config(correction_veto=0.5)
    with pytest.raises(ConfigError, match="correction_veto"):
        PolicyLoss.Config(correction="tis", correction_veto=1.5)


def test_unbiased_kl_weights_the_kl_by_the_ratio() -> None:
    # one sequence, 2 trained tokens (weight 1/2); k1 KL = logp - ref = [1, -1];
    # rho = exp(logp - old) = [e^0.5, 1] -> KL metric (e^0.5 - 1) / 2
    batch = TrainBatch(
        tokens=torch.arange(3),
        cu_seqlens=T([0, 3]),
        loss_mask=T([0.0, 1, 1]),
        loss_weights=T([0.0, 0.5, 0.5]),
        advantages=T([0.0, 0, 0]),
        old_logprobs=T([0.0, -1.5, -2.0]),
        ref_logprobs=T([0.0, -2.0, -1.0]),
    )
    logp = _leaf([0.0, -1.0, -2.0])
    cfg = PolicyLoss.Config(kl_coef=1.0, kl_type="k1", kl_unbiased=True)
    out = PolicyLoss(cfg)(logp, batch, None)
    assert out.metrics["kl"] == pytest.approx((math.exp(0.5) - 1) / 2, abs=1e-6)
    out.loss.backward()
    # d/dlogp [rho (logp - ref)] = rho (logp - ref) + rho = rho (1 + logp - ref), times 1/2
    want = [0.0, math.exp(0.5) * 2 / 2, 0.0]
    torch.testing.assert_close(logp.grad, T(want), atol=1e-6, rtol=0)
    biased = PolicyLoss(PolicyLoss.Config(kl_coef=1.0, kl_type="k1"))(_leaf([0, -1.0, -2]), batch)
    assert biased.metrics["kl"] == pytest.approx(0.0, abs=1e-7)
