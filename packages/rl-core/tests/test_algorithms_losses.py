"""Policy, SFT, distillation and value losses: hand-computed values, gradients, splits."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rl_core.algorithms import (
    LOSSES,
    DistillationLoss,
    PolicyLoss,
    SFTLoss,
    compute_loss_weights,
    distillation_advantages,
    value_loss,
)
from rl_core.errors import ConfigError
from rl_core.interfaces import LossFn
from rl_core.types import TrainBatch

T = torch.tensor


def _batch(cu: list[int], mask: list[float], adv: list[float], **kw) -> TrainBatch:
    mask_T = T(mask)
    weights = kw.pop("loss_weights", None)
    cu_N1 = T(cu)
    if weights is None:
        weights = compute_loss_weights(mask_T, cu_N1, mode="token")
    fields = {k: (T(v) if isinstance(v, list) else v) for k, v in kw.items()}
    return TrainBatch(
        tokens=torch.arange(len(mask)),
        cu_seqlens=cu_N1,
        loss_mask=mask_T,
        loss_weights=weights,
        advantages=T(adv),
        **fields,
    )


def _leaf(values: list[float]) -> torch.Tensor:
    return T(values, dtype=torch.float32).requires_grad_(True)


# One sequence: 4 trained tokens, token-mean weights 1/4, eps 0.2.
# log ratio [., 0.5, -0.5, 0.1, -0.4] -> ratio [., 1.648721, 0.606531, 1.105171, 0.670320]
# A = [., 1, 1, -1, -1]
#   t1: A>0, ratio > 1.2 -> clipped, loss -1.2, no gradient
#   t2: A>0, ratio < 0.8 -> unclipped (pessimistic), loss -0.606531, grad -A*ratio*w
#   t3: A<0, ratio in range -> loss 1.105171
#   t4: A<0, ratio < 0.8 -> clipped, loss 0.8, no gradient
OLD = [0.0, -1.0, -1.0, -1.0, -1.0]
NEW = [0.0, -0.5, -1.5, -0.9, -1.4]
PPO_BATCH = _batch([0, 5], [0, 1, 1, 1, 1], [0, 1, 1, -1, -1], old_logprobs=OLD)


def test_ppo_clip_value_metrics_and_gradient() -> None:
    logp = _leaf(NEW)
    out = PolicyLoss()(logp, PPO_BATCH, None)
    # (-1.2 - 0.606531 + 1.105171 + 0.8) / 4
    assert out.loss.item() == pytest.approx(0.024660, abs=1e-5)
    assert out.metrics["pg_loss"] == pytest.approx(0.024660, abs=1e-5)
    assert out.metrics["pg_clipfrac"] == pytest.approx(0.5)
    # mean(old - new) = -(0.5 - 0.5 + 0.1 - 0.4) / 4
    assert out.metrics["ppo_kl"] == pytest.approx(0.075, abs=1e-6)
    out.loss.backward()
    want = [0.0, 0.0, -0.606531 / 4, 1.105171 / 4, 0.0]
    torch.testing.assert_close(logp.grad, T(want), atol=1e-5, rtol=0)


def test_clip_higher_is_asymmetric() -> None:
    logp = _leaf(NEW)
    out = PolicyLoss(PolicyLoss.Config(eps_clip_low=0.2, eps_clip_high=0.7))(logp, PPO_BATCH, None)
    # t1 ratio 1.6487 < 1.7 is no longer clipped: loss -1.648721, grad -1.648721 / 4
    assert out.loss.item() == pytest.approx((-1.648721 - 0.606531 + 1.105171 + 0.8) / 4, abs=1e-5)
    assert out.metrics["pg_clipfrac"] == pytest.approx(0.25)
    out.loss.backward()
    assert float(logp.grad[1]) == pytest.approx(-1.648721 / 4, abs=1e-5)


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    # one token, A = -1, ratio exp(1.5) = 4.481689: clip loss max(4.4817, 1.2) = 4.4817;
    # dual clip c = 3: min(3, 4.4817) = 3, constant -> zero gradient
    batch = _batch([0, 2], [0, 1], [0, -1], old_logprobs=[0.0, -2.0])
    logp = _leaf([0.0, -0.5])
    plain = PolicyLoss()(logp, batch, None)
    assert plain.loss.item() == pytest.approx(4.481689, abs=1e-5)
    logp = _leaf([0.0, -0.5])
    out = PolicyLoss(PolicyLoss.Config(dual_clip_c=3.0))(logp, batch, None)
    assert out.loss.item() == pytest.approx(3.0)
    assert out.metrics["pg_clipfrac_lower"] == pytest.approx(1.0)
    out.loss.backward()
    assert float(logp.grad[1]) == 0.0
    # a positive advantage is not affected by the dual clip
    pos = dataclasses.replace(batch, advantages=T([0.0, 1.0]))
    assert PolicyLoss(PolicyLoss.Config(dual_clip_c=3.0))(logp, pos, None).loss.item() == (
        pytest.approx(-1.2)
    )


def test_on_policy_ratio_one_gradient_is_minus_advantage_times_weight() -> None:
    torch.manual_seed(0)
    mask = [0.0, 1, 1, 0, 1, 1, 1]
    cu = T([0, 3, 7])
    # sequence mean: seq 0 has 2 trained tokens -> w 1/(2*2); seq 1 has 3 -> w 1/(3*2)
    weights = compute_loss_weights(T(mask), cu, mode="sequence")
    adv = [0.0, 0.7, 0.7, 0.0, -0.3, -0.3, -0.3]
    batch = _batch([0, 3, 7], mask, adv, loss_weights=weights)  # old_logprobs None
    logp = (torch.randn(7) - 2).requires_grad_(True)
    out = PolicyLoss()(logp, batch, None)
    # ratio == 1 everywhere: loss = -sum A w = -(2 * 0.7/4 - 3 * 0.3/6) = -0.2
    assert out.loss.item() == pytest.approx(-0.2, abs=1e-6)
    assert out.metrics["pg_clipfrac"] == 0.0
    out.loss.backward()
    torch.testing.assert_close(logp.grad, -T(adv) * weights)


def test_gspo_uses_the_sequence_mean_ratio() -> None:
    # seq 0: log ratios [0.3, -0.1, 0.4], mean 0.2, s = 1.221403, A = 1 -> clipped at 1.2 (3 tokens)
    # seq 1: log ratios [0.1, -0.3], mean -0.1, s = 0.904837, A = -1 -> loss 0.904837 (2 tokens)
    # token weights 1/5: loss = (3 * -1.2 + 2 * 0.904837) / 5 = -0.358065
    old = [0.0, -1.0, -1.0, -1.0, 0.0, -1.0, -1.0]
    new = [0.0, -0.7, -1.1, -0.6, 0.0, -0.9, -1.3]
    batch = _batch([0, 4, 7], [0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, -1, -1], old_logprobs=old)
    logp = _leaf(new)
    out = PolicyLoss(PolicyLoss.Config(variant="gspo"))(logp, batch, None)
    assert out.loss.item() == pytest.approx(-0.358065, abs=1e-5)
    assert out.metrics["pg_clipfrac"] == pytest.approx(0.6)
    out.loss.backward()
    # seq 0 clipped: no gradient. seq 1: d/dlogp_t [2 * (1/5) * s] = (2/5) * s / 2 = s / 5
    want = [0.0, 0.0, 0.0, 0.0, 0.0, 0.180967, 0.180967]
    torch.testing.assert_close(logp.grad, T(want), atol=1e-5, rtol=0)


def test_cispo_gradient_flows_through_clipped_tokens() -> None:
    # log ratios [0.5, -0.5] -> ratios 1.6487, 0.6065, both outside [0.8, 1.2]; A = 1, w = 1/2
    # loss = -(1.2 * logp1 + 0.8 * logp2) / 2 = -(1.2 * -1 + 0.8 * -2) / 2 = 1.4
    batch = _batch([0, 3], [0, 1, 1], [0, 1, 1], old_logprobs=[0.0, -1.5, -1.5])
    logp = _leaf([0.0, -1.0, -2.0])
    out = PolicyLoss(PolicyLoss.Config(variant="cispo"))(logp, batch, None)
    assert out.loss.item() == pytest.approx(1.4, abs=1e-5)
    assert out.metrics["pg_clipfrac"] == pytest.approx(1.0)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, T([0.0, -0.6, -0.4]), atol=1e-6, rtol=0)
    # PPO on the same tokens: the A>0, ratio>1.2 token gets no gradient
    logp_ppo = _leaf([0.0, -1.0, -2.0])
    PolicyLoss()(logp_ppo, batch, None).loss.backward()
    assert float(logp_ppo.grad[1]) == 0.0


def test_entropy_bonus_and_kl_loss() -> None:
    # on-policy, A = 0: pg loss 0. w = 1/2 on two tokens.
    # entropy [., 1.0, 3.0] -> metric 2.0; bonus -0.1 * 2.0 = -0.2
    # k1 KL = logp - ref = [., 0.5, -0.1] -> metric 0.2; + 0.5 * 0.2 = 0.1
    batch = _batch([0, 3], [0, 1, 1], [0, 0, 0], ref_logprobs=[0.0, -1.5, -1.9])
    logp = _leaf([0.0, -1.0, -2.0])
    cfg = PolicyLoss.Config(entropy_coef=0.1, kl_coef=0.5, kl_type="k1")
    out = PolicyLoss(cfg)(logp, batch, T([9.0, 1.0, 3.0]))
    assert out.metrics["entropy"] == pytest.approx(2.0)
    assert out.metrics["kl"] == pytest.approx(0.2, abs=1e-6)
    assert out.loss.item() == pytest.approx(-0.2 + 0.1, abs=1e-6)
    out.loss.backward()
    # gradient: pg term -A w = 0; KL k1 term 0.5 * w = 0.25 per trained token
    torch.testing.assert_close(logp.grad, T([0.0, 0.25, 0.25]))


def test_missing_inputs_raise_clear_errors() -> None:
    batch = _batch([0, 2], [0, 1], [0, 1])
    logp = _leaf([0.0, -1.0])
    with pytest.raises(ConfigError, match=r"kl_coef.*ref_logprobs"):
        PolicyLoss(PolicyLoss.Config(kl_coef=0.1))(logp, batch, None)
    with pytest.raises(ConfigError, match=r"entropy_coef"):
        PolicyLoss(PolicyLoss.Config(entropy_coef=0.1))(logp, batch, None)
    with pytest.raises(ConfigError, match=r"correction.*rollout_logprobs"):
        PolicyLoss(PolicyLoss.Config(correction="tis"))(logp, batch, None)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"variant": "grpo"}, "variant.*ppo, gspo, cispo"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"kl_type": "k4"}, "kl_type.*low_var_kl"),
        ({"correction": "is"}, "correction.*tis"),
        ({"correction_level": "batch"}, "correction_level"),
        ({"eps_clip_low": -0.1}, "eps_clip"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PolicyLoss.Config(**kwargs)


def test_tis_correction_in_the_loss() -> None:
    # on-policy (old = logp), A = 1, w = 1/2; log(old/rollout) = [0.2, 0.7] -> raw 1.221403, 2.013753
    # TIS [0, 2] -> weights 1.221403, 2.0; loss = -(1.221403 + 2.0) / 2 = -1.610701
    batch = _batch(
        [0, 3],
        [0, 1, 1],
        [0, 1, 1],
        old_logprobs=[0.0, -1.0, -0.3],
        rollout_logprobs=[0.0, -1.2, -1.0],
    )
    logp = _leaf([0.0, -1.0, -0.3])
    out = PolicyLoss(PolicyLoss.Config(correction="tis"))(logp, batch, None)
    assert out.loss.item() == pytest.approx(-1.610701, abs=1e-5)
    assert out.metrics["tis_weight_mean"] == pytest.approx(1.610701, abs=1e-5)
    assert out.metrics["tis_clipfrac"] == pytest.approx(0.5)
    assert out.metrics["mismatch"] == pytest.approx(0.45, abs=1e-6)  # (0.2 + 0.7) / 2
    out.loss.backward()
    torch.testing.assert_close(logp.grad, T([0.0, -0.610701, -1.0]), atol=1e-5, rtol=0)
    # the mismatch metric is reported even without correction
    plain = PolicyLoss()(logp, batch, None)
    assert plain.metrics["mismatch"] == pytest.approx(0.45, abs=1e-6)
    assert "tis_clipfrac" not in plain.metrics


@pytest.mark.parametrize(
    "config",
    [
        PolicyLoss.Config(),
        PolicyLoss.Config(variant="gspo", kl_coef=0.1, entropy_coef=0.01),
        PolicyLoss.Config(variant="cispo", correction="mis", correction_level="sequence"),
        PolicyLoss.Config(dual_clip_c=3.0, correction="tis", correction_level="geometric"),
    ],
)
def test_micro_batch_split_sums_to_the_whole_batch(config: PolicyLoss.Config) -> None:
    """Loss, gradient and metrics summed over micro-batches equal those of the whole batch."""
    torch.manual_seed(1)
    cu = T([0, 5, 9, 16, 20])
    n_tok = 20
    mask = (torch.rand(n_tok) > 0.3).float()
    mask[cu[:-1]] = 0.0
    weights = compute_loss_weights(mask, cu, mode="rollout", rollout_ids=["a", "b", "a", "c"])
    batch = TrainBatch(
        tokens=torch.arange(n_tok),
        cu_seqlens=cu,
        loss_mask=mask,
        loss_weights=weights,
        advantages=torch.randn(n_tok) * mask,
        old_logprobs=-torch.rand(n_tok),
        ref_logprobs=-torch.rand(n_tok),
        rollout_logprobs=-torch.rand(n_tok),
        micro_batch_bounds=(0, 1, 3, 4),
    )
    loss_fn = PolicyLoss(config)
    entropy = torch.rand(n_tok)
    logp = (-torch.rand(n_tok)).requires_grad_(True)
    whole = loss_fn(logp, batch, entropy)
    whole.loss.backward()
    grad_whole = logp.grad.clone()
    logp.grad = None
    parts, metrics = [], {}
    for mb in batch.micro_batches():
        t0 = int(torch.nonzero(batch.tokens == mb.tokens[0])[0])
        sl = slice(t0, t0 + mb.num_tokens)
        out = loss_fn(logp[sl], mb, entropy[sl])
        parts.append(out.loss)
        for k, v in out.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + v
    total = torch.stack(parts).sum()
    total.backward()
    torch.testing.assert_close(total, whole.loss)
    torch.testing.assert_close(logp.grad, grad_whole)
    assert metrics.keys() == whole.metrics.keys()
    for k, v in whole.metrics.items():
        assert metrics[k] == pytest.approx(v, abs=1e-6), k


def test_sft_loss() -> None:
    # -(-1 - 2 - 0.5) / 3
    batch = _batch([0, 4], [0, 1, 1, 1], [0, 0, 0, 0])
    logp = _leaf([0.0, -1.0, -2.0, -0.5])
    out = SFTLoss()(logp, batch, None)
    assert out.loss.item() == pytest.approx(3.5 / 3)
    assert out.metrics["sft_loss"] == pytest.approx(3.5 / 3)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, -T([0.0, 1, 1, 1]) / 3)


def test_distillation_shapes_advantages_with_reverse_kl() -> None:
    # A = 0.5; old - teacher = [-1 + 1.5, -2 + 1] = [0.5, -1]
    # shaped A = 0.5 - [0.5, -1] = [0, 1.5]; on-policy loss = -(0 + 1.5) / 2 = -0.75
    adv = [0.0, 0.5, 0.5]
    shaped = distillation_advantages(T(adv), T([0.0, -1, -2]), T([0.0, -1.5, -1]), T([0.0, 1, 1]))
    torch.testing.assert_close(shaped, T([0.0, 0.0, 1.5]))
    batch = _batch([0, 3], [0, 1, 1], adv, ref_logprobs=[0.0, -1.5, -1.0])
    logp = _leaf([0.0, -1.0, -2.0])
    out = DistillationLoss()(logp, batch, None)
    assert out.loss.item() == pytest.approx(-0.75)
    assert out.metrics["opd_reverse_kl"] == pytest.approx(-0.25)  # (0.5 - 1) / 2
    assert "kl" not in out.metrics  # the teacher is not a KL-loss reference
    out.loss.backward()
    torch.testing.assert_close(logp.grad, T([0.0, 0.0, -0.75]))
    with pytest.raises(ConfigError, match="ref_logprobs"):
        DistillationLoss()(logp, dataclasses.replace(batch, ref_logprobs=None), None)
    with pytest.raises(ConfigError, match="kl_coef"):
        DistillationLoss.Config(policy=PolicyLoss.Config(kl_coef=0.1))


def test_value_loss_clipping() -> None:
    # t0: V 1.0, V_old 0.8, R 1.5: (V-R)^2 = 0.25, clipped V 1.0 -> 0.25 (not clipped)
    # t1: V 2.0, V_old 1.0, R 2.5: 0.25 vs clipped V 1.2 -> 1.69 (clipped wins)
    # t2: V 0.5, V_old 0.5, R 0.0: 0.25 both
    # loss = 0.5 * (0.25 * 0.5 + 1.69 * 0.25 + 0.25 * 0.25) = 0.305, clipfrac = 0.25
    v = _leaf([1.0, 2.0, 0.5])
    old, ret, w = T([0.8, 1.0, 0.5]), T([1.5, 2.5, 0.0]), T([0.5, 0.25, 0.25])
    loss, clipfrac = value_loss(v, old, ret, w, clip=0.2)
    assert loss.item() == pytest.approx(0.305)
    assert float(clipfrac) == pytest.approx(0.25)
    loss.backward()
    # dL/dV = (V - R) w on unclipped tokens; 0 on t1 (clipped branch is constant in V)
    torch.testing.assert_close(v.grad, T([-0.25, 0.0, 0.125]))
    loss, clipfrac = value_loss(v, old, ret, w, clip=None)
    assert loss.item() == pytest.approx(0.5 * (0.125 + 0.0625 + 0.0625))
    assert float(clipfrac) == 0.0


def test_registry_and_protocol() -> None:
    assert {"policy", "sft"} <= set(LOSSES)
    for cls in LOSSES.values():
        assert isinstance(cls(cls.Config()), LossFn)
    assert PolicyLoss(PolicyLoss.Config(entropy_coef=0.1)).requires_entropy
    assert PolicyLoss().requires_entropy  # logged by default
    assert not PolicyLoss(PolicyLoss.Config(log_entropy=False)).requires_entropy
    assert not SFTLoss(SFTLoss.Config(log_entropy=False)).requires_entropy
    assert math.isclose(PolicyLoss.Config(eps_clip_low=0.1).eps_clip_low, 0.1)


def test_garbage_off_the_mask_does_not_leak() -> None:
    """Prompt positions may carry -inf/NaN log-probs; loss, metrics and gradient stay finite."""
    inf, nan = float("inf"), float("nan")
    batch = _batch(
        [0, 3],
        [0, 1, 1],
        [nan, 1.0, -1.0],
        old_logprobs=[-inf, -1.0, -1.0],
        ref_logprobs=[-inf, -1.1, -0.9],
        rollout_logprobs=[nan, -1.0, -1.2],
    )
    cfg = PolicyLoss.Config(
        variant="cispo", kl_coef=0.1, kl_type="k3", entropy_coef=0.1, correction="mis"
    )
    for loss_fn in (PolicyLoss(), PolicyLoss(cfg), SFTLoss()):
        logp = _leaf([-inf, -0.9, -1.1])
        out = loss_fn(logp, batch, T([nan, 1.0, 1.0]))
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert torch.isfinite(logp.grad).all() and float(logp.grad[0]) == 0.0
        assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics
