"""Loss functions: :class:`~rl_core.interfaces.LossFn` implementations and the value loss.

Every loss is ``sum_t x_t * w_t`` with ``w_t = TrainBatch.loss_weights`` (see
:mod:`rl_core.algorithms.aggregation`), so summing micro-batch losses over a step and its
data-parallel ranks gives the step loss. Metrics are weighted the same way: summing them over
micro-batches and ranks gives step means.

Notation: ``logp`` current log-probs (with gradient), ``old`` ``TrainBatch.old_logprobs`` (or
``sg(logp)`` when ``None``: on-policy, ratio 1 with the policy-gradient gradient), ``A_t`` the
advantages, ``rho_t = exp(logp_t - old_t)``, ``eps_l``/``eps_h`` the clip range.

Every log-ratio is clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` (20, defined in
:mod:`rl_core.algorithms.correction`) before ``exp``: a log-ratio above ~88 would overflow float32
to ``inf`` and turn the loss (``0 * inf`` on a zero advantage) or its gradient into NaN. The
bound is far outside any clip range, so it only touches tokens that are clipped anyway; there the
gradient is 0, and inside the bound the result is bitwise unchanged.

**PolicyLoss** variants:

- ``ppo``: ``L_t = max(-rho_t A_t, -clip(rho_t, 1-eps_l, 1+eps_h) A_t)`` (clip-higher when
  ``eps_h > eps_l``). Dual clip ``c > 1``: for ``A_t < 0``, ``L_t = min(-c A_t, L_t)``.
- ``gspo``: the same clip on the sequence ratio ``s_i = exp(mean_{t in i} m_t (logp_t - old_t))``,
  broadcast to the tokens of sequence ``i``.
- ``cispo``: ``L_t = -sg(clip(rho_t, 1-eps_l, 1+eps_h)) A_t logp_t``; the gradient
  ``-clip(rho) A grad(logp)`` flows through every token, clipped or not.

Then, in order: off-policy sequence masking (OPSM, below) zeroes ``L_t`` of masked sequences; the
mismatch weight of :mod:`rl_core.algorithms.correction` multiplies ``L_t`` (``old`` vs
``TrainBatch.rollout_logprobs``; with ``correction_veto`` a sequence holding one token ratio below
the veto is dropped whole); ``loss = sum L_t w_t``; the entropy bonus ``- entropy_coef * sum H_t
w_t``; the KL loss ``+ kl_coef * sum KL_t(logp, ref) w_t`` (with ``kl_unbiased`` each ``KL_t`` is
multiplied by ``rho_t``, DeepSeek-V3.2's unbiased estimator under off-policy samples).

**OPSM** (off-policy sequence masking, DeepSeek-V3.2, slime's ``--use-opsm``): with
``opsm_delta = delta`` and ``b_t`` the behaviour log-probs (``old``, or the engine's
``rollout_logprobs`` with ``opsm_reference: rollout``), sequence ``i`` has
``D_i = sum_{t in i} m_t (b_t - sg(logp_t)) / max(1, sum_{t in i} m_t)`` (the sampled KL from the
behaviour policy to the current one) and token ``t`` of sequence ``i`` is dropped when
``A_t < 0`` and ``D_i > delta``: negative-advantage samples the policy has drifted away from
teach little and destabilise training. Metric ``opsm_clipfrac`` (weighted fraction of dropped
tokens).

**SFTLoss**: ``-sum logp_t w_t``.

**DistillationLoss** (on-policy distillation, reverse KL to a teacher whose log-probs are given as
``TrainBatch.ref_logprobs``): the advantages are shaped to
``A_t - coef (old_t - teacher_t)`` (:func:`distillation_advantages`), then a :class:`PolicyLoss`
runs on them.

**value_loss**: ``0.5 * sum max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) w`` (the
``0.5`` is the usual PPO convention of verl, OpenRLHF and TRL).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Literal

import torch

from rl_core.algorithms._segments import segment_sum, seq_index
from rl_core.algorithms.correction import (
    check_correction,
    clamp_log_ratio,
    importance_weights,
    logprob_mismatch,
)
from rl_core.algorithms.kl import KL_KINDS, kl_estimate
from rl_core.config import NonNegFloat, PositiveFloat, Range
from rl_core.errors import ConfigError, DataError

if TYPE_CHECKING:
    from rl_core.interfaces import ValueLossFn
from rl_core.types import LossOutput, TrainBatch

__all__ = [
    "LOSSES",
    "POLICY_LOSS_VARIANTS",
    "DistillationLoss",
    "PolicyLoss",
    "SFTLoss",
    "distillation_advantages",
    "value_loss",
]

POLICY_LOSS_VARIANTS: tuple[str, ...] = ("ppo", "gspo", "cispo")
"""Names accepted by ``PolicyLoss.Config.variant``."""


def _masked(x_T: torch.Tensor, on_T: torch.Tensor) -> torch.Tensor:
    """``x_T`` on the mask, exactly 0 elsewhere (no NaN from inf * 0, no gradient off the mask)."""
    return torch.where(on_T, x_T, 0.0)


def _wsum(x_T: torch.Tensor, w_T: torch.Tensor) -> float:
    """Detached ``sum x w`` as a Python float (a metric)."""
    return float((x_T.detach() * w_T).sum())


def _check_logprobs(logprobs_T: torch.Tensor, batch: TrainBatch, owner: str) -> None:
    if logprobs_T.shape != (batch.num_tokens,):
        raise DataError(
            f"{owner}: logprobs has shape {tuple(logprobs_T.shape)} but the batch has "
            f"{batch.num_tokens} tokens; pass one log-prob per packed token."
        )


class PolicyLoss:
    """Clipped policy-gradient loss (PPO / GSPO / CISPO) with entropy, KL and mismatch correction.

    Example::

        loss_fn = PolicyLoss(PolicyLoss.Config(eps_clip_low=0.2, eps_clip_high=0.28,
                                               correction="tis", kl_coef=0.01))
        out = loss_fn(logprobs_T, batch, entropy_T)   # LossOutput(loss, metrics)
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`PolicyLoss`."""

        variant: str = "ppo"
        """``ppo`` (token ratio), ``gspo`` (sequence ratio) or ``cispo`` (clipped IS weight on
        ``logp``)."""
        eps_clip_low: NonNegFloat = 0.2
        """Lower clip: the ratio is clipped at ``1 - eps_clip_low``."""
        eps_clip_high: NonNegFloat | None = None
        """Upper clip: ``1 + eps_clip_high``; ``None`` uses ``eps_clip_low`` (DAPO's clip-higher
        sets it larger, e.g. 0.28)."""
        dual_clip_c: Annotated[float, Range(gt=1)] | None = None
        """Dual-clip constant ``c > 1``: for negative advantages the loss is at most ``-c A``."""
        entropy_coef: float = 0.0
        """Entropy bonus weight (the loss subtracts ``entropy_coef * H``); > 0 needs entropy."""
        log_entropy: bool = True
        """Ask the policy for the entropy even without a bonus, to log it (metric ``entropy``)."""
        kl_coef: NonNegFloat = 0.0
        """KL-loss weight against ``TrainBatch.ref_logprobs``; > 0 needs ref log-probs."""
        kl_type: str = "low_var_kl"
        """KL estimator: ``k1``, ``k2``, ``k3`` or ``low_var_kl``."""
        correction: str = "none"
        """Train/inference mismatch correction: ``none``, ``tis``, ``mis`` or ``icepop``."""
        correction_level: str = "token"
        """``token``, ``sequence`` (product of ratios) or ``geometric`` (geometric mean)."""
        correction_clip_low: NonNegFloat = 0.0
        """Lower bound of the mismatch weight."""
        correction_clip_high: NonNegFloat = 2.0
        """Upper bound of the mismatch weight."""
        correction_veto: Annotated[float, Range(gt=0, lt=1)] | None = None
        """With a ``correction``: drop every sequence in which one token's ratio
        ``exp(old - rollout)`` is below this (slime's ``mis_veto_threshold``, e.g. 1e-4);
        ``None``: no veto."""
        opsm_delta: NonNegFloat | None = None
        """Off-policy sequence masking threshold ``delta`` (slime ``--opsm-delta``, e.g. 1e-4):
        drop negative-advantage tokens of sequences whose mean ``behaviour - current``
        log-prob gap exceeds it; ``None``: off. Under the default one update per step with no
        separate old log-prob pass, ``old`` equals the current policy, so OPSM bites only with
        ``opsm_reference: rollout``, stale data, or several updates per step
        (``rl.ppo_epochs`` / ``rl.mini_batches_per_step``)."""
        opsm_reference: Literal["old", "rollout"] = "old"
        """Behaviour log-probs OPSM measures against: ``old`` (``TrainBatch.old_logprobs``, as
        slime does) or ``rollout`` (the engine's log-probs: staleness and train/inference
        mismatch together, as the DeepSeek-V3.2 report defines it)."""
        kl_unbiased: bool = False
        """Multiply the per-token KL-loss estimate by the ratio ``rho_t`` (slime
        ``--use-unbiased-kl``, DeepSeek-V3.2): unbiased when the samples come from the old
        policy rather than the current one."""

        def __post_init__(self) -> None:
            owner = "PolicyLoss.Config"
            if self.variant not in POLICY_LOSS_VARIANTS:
                raise ConfigError(
                    f"{owner}.variant: unknown {self.variant!r}; choose one of "
                    f"{', '.join(POLICY_LOSS_VARIANTS)}."
                )
            if self.eps_clip_low < 0 or (self.eps_clip_high is not None and self.eps_clip_high < 0):
                raise ConfigError(
                    f"{owner}.eps_clip_low/eps_clip_high: must be >= 0, got "
                    f"{self.eps_clip_low}/{self.eps_clip_high}."
                )
            if self.dual_clip_c is not None and self.dual_clip_c <= 1:
                raise ConfigError(
                    f"{owner}.dual_clip_c: must be > 1 (e.g. 3.0) or None, got {self.dual_clip_c}."
                )
            if self.kl_type not in KL_KINDS:
                raise ConfigError(
                    f"{owner}.kl_type: unknown {self.kl_type!r}; choose one of {', '.join(KL_KINDS)}."
                )
            if self.kl_coef < 0:
                raise ConfigError(f"{owner}.kl_coef: must be >= 0, got {self.kl_coef}.")
            check_correction(
                self.correction,
                self.correction_level,
                self.correction_clip_low,
                self.correction_clip_high,
                owner=owner,
                veto=self.correction_veto,
            )
            if self.correction_veto is not None and self.correction == "none":
                raise ConfigError(
                    f"{owner}.correction_veto: needs a correction (tis, mis or icepop); set "
                    "correction or remove correction_veto."
                )
            if self.opsm_delta is not None and self.opsm_delta < 0:
                raise ConfigError(
                    f"{owner}.opsm_delta: must be >= 0 (e.g. 1e-4) or None, got {self.opsm_delta}."
                )
            if self.opsm_reference not in ("old", "rollout"):
                raise ConfigError(
                    f"{owner}.opsm_reference: unknown {self.opsm_reference!r}; choose old or "
                    "rollout."
                )

    def __init__(self, config: PolicyLoss.Config | None = None) -> None:
        self.config = config or PolicyLoss.Config()

    @property
    def requires_entropy(self) -> bool:
        """True when the policy should pass the entropy tensor (``entropy_coef != 0``, or
        ``log_entropy``)."""
        return self.config.entropy_coef != 0 or self.config.log_entropy

    @property
    def requires_ref_logprobs(self) -> bool:
        """True when the loss needs ``TrainBatch.ref_logprobs`` (``kl_coef > 0``)."""
        return self.config.kl_coef > 0

    def __call__(
        self, logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None = None
    ) -> LossOutput:
        """The weighted loss of one micro-batch and its weighted metrics."""
        _check_logprobs(logprobs, batch, "PolicyLoss")
        logp_T = logprobs
        dtype = logp_T.dtype
        on_T = batch.loss_mask > 0
        m_T = on_T.to(dtype)
        w_T = batch.loss_weights.to(dtype) * m_T
        adv_T = _masked(batch.advantages.to(dtype), on_T)
        old_T = logp_T.detach() if batch.old_logprobs is None else batch.old_logprobs.to(dtype)
        metrics: dict[str, float] = {}

        ratio_T = self._ratio(logp_T, old_T, on_T, m_T, batch)
        pg_T, clipfrac_T = self._clipped_pg(ratio_T, adv_T, logp_T, on_T, w_T, metrics)
        pg_T = self._opsm(pg_T, logp_T, old_T, adv_T, on_T, w_T, batch, metrics)
        pg_T = self._corrected(pg_T, old_T, m_T, w_T, batch, metrics)

        pg_loss = (pg_T * w_T).sum()
        loss = pg_loss
        metrics["pg_loss"] = float(pg_loss.detach())
        metrics["pg_clipfrac"] = _wsum(clipfrac_T, w_T)
        metrics["ppo_kl"] = _wsum(_masked(old_T - logp_T, on_T), w_T)
        loss = self._entropy_term(loss, entropy, on_T, w_T, metrics)
        loss = self._kl_term(loss, logp_T, old_T, on_T, w_T, batch, metrics)
        return LossOutput(loss=loss, metrics=metrics)

    def _ratio(
        self,
        logp_T: torch.Tensor,
        old_T: torch.Tensor,
        on_T: torch.Tensor,
        m_T: torch.Tensor,
        batch: TrainBatch,
    ) -> torch.Tensor:
        """Importance ratio ``pi / pi_old`` per token (per sequence for GSPO)."""
        # log-ratio, 0 off the mask so garbage log-probs there cannot overflow exp()
        log_ratio_T = _masked(logp_T - old_T, on_T)
        if self.config.variant == "gspo":
            n = batch.num_sequences
            seq_T = seq_index(batch.cu_seqlens)
            count_N = segment_sum(m_T, seq_T, n).clamp_min(1.0)
            log_ratio_T = (segment_sum(log_ratio_T, seq_T, n) / count_N)[seq_T] * m_T
        # clamped: exp(>88) is inf in float32, and 0 * inf a NaN loss/gradient (LOG_RATIO_BOUND)
        return torch.exp(clamp_log_ratio(log_ratio_T))

    def _clipped_pg(
        self,
        ratio_T: torch.Tensor,
        adv_T: torch.Tensor,
        logp_T: torch.Tensor,
        on_T: torch.Tensor,
        w_T: torch.Tensor,
        metrics: dict[str, float],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token clipped policy-gradient loss and clip indicator (PPO/GSPO or CISPO)."""
        cfg = self.config
        dtype = logp_T.dtype
        eps_low = cfg.eps_clip_low
        eps_high = cfg.eps_clip_low if cfg.eps_clip_high is None else cfg.eps_clip_high
        lo, hi = 1.0 - eps_low, 1.0 + eps_high
        if cfg.variant == "cispo":
            clipped_ratio_T = ratio_T.clamp(lo, hi).detach()
            pg_T = -clipped_ratio_T * adv_T * _masked(logp_T, on_T)
            clipfrac_T = ((ratio_T < lo) | (ratio_T > hi)).to(dtype)
            return pg_T, clipfrac_T
        loss1_T = -adv_T * ratio_T
        loss2_T = -adv_T * ratio_T.clamp(lo, hi)
        pg_T = torch.maximum(loss1_T, loss2_T)
        clipfrac_T = (loss2_T > loss1_T).to(dtype)
        if cfg.dual_clip_c is not None:
            loss3_T = -adv_T * cfg.dual_clip_c
            dual_T = (adv_T < 0) & (loss3_T < pg_T)
            pg_T = torch.where(dual_T, loss3_T, pg_T)
            metrics["pg_clipfrac_lower"] = _wsum(dual_T.to(dtype), w_T)
        return pg_T, clipfrac_T

    def _opsm(
        self,
        pg_T: torch.Tensor,
        logp_T: torch.Tensor,
        old_T: torch.Tensor,
        adv_T: torch.Tensor,
        on_T: torch.Tensor,
        w_T: torch.Tensor,
        batch: TrainBatch,
        metrics: dict[str, float],
    ) -> torch.Tensor:
        """Off-policy sequence masking (module docstring): ``pg_T`` with the negative-advantage
        tokens of drifted sequences set to 0 (no gradient)."""
        cfg = self.config
        if cfg.opsm_delta is None:
            return pg_T
        dtype = logp_T.dtype
        if cfg.opsm_reference == "rollout":
            if batch.rollout_logprobs is None:
                raise ConfigError(
                    "PolicyLoss.Config.opsm_reference = 'rollout' needs "
                    "TrainBatch.rollout_logprobs (the engine's log-probs); have the generator "
                    "return log-probs or set opsm_reference = 'old'."
                )
            behaviour_T = batch.rollout_logprobs.to(dtype)
        else:
            behaviour_T = old_T
        n = batch.num_sequences
        seq_T = seq_index(batch.cu_seqlens)
        gap_T = _masked(behaviour_T.detach() - logp_T.detach(), on_T)
        count_N = segment_sum(on_T.to(dtype), seq_T, n).clamp_min(1.0)
        kl_N = segment_sum(gap_T, seq_T, n) / count_N
        drop_T = on_T & (adv_T < 0) & (kl_N > cfg.opsm_delta)[seq_T]
        metrics["opsm_clipfrac"] = _wsum(drop_T.to(dtype), w_T)
        return torch.where(drop_T, 0.0, pg_T)

    def _corrected(
        self,
        pg_T: torch.Tensor,
        old_T: torch.Tensor,
        m_T: torch.Tensor,
        w_T: torch.Tensor,
        batch: TrainBatch,
        metrics: dict[str, float],
    ) -> torch.Tensor:
        """Report the trainer/engine mismatch and apply the off-policy correction, if any."""
        cfg = self.config
        dtype = m_T.dtype
        if batch.rollout_logprobs is not None:
            roll_T = batch.rollout_logprobs.to(dtype)
            metrics["mismatch"] = _wsum(logprob_mismatch(old_T, roll_T, m_T), w_T)
        if cfg.correction == "none":
            return pg_T
        if batch.rollout_logprobs is None:
            raise ConfigError(
                f"PolicyLoss.Config.correction = {cfg.correction!r} needs "
                "TrainBatch.rollout_logprobs (the engine's log-probs); have the generator "
                "return log-probs or set correction = 'none'."
            )
        corr = importance_weights(
            old_T.detach(),
            batch.rollout_logprobs.to(dtype),
            m_T,
            batch.cu_seqlens,
            mode=cfg.correction,
            level=cfg.correction_level,
            clip_low=cfg.correction_clip_low,
            clip_high=cfg.correction_clip_high,
            veto=cfg.correction_veto,
        )
        pg_T = pg_T * corr.weights_T
        metrics["tis_weight_mean"] = _wsum(corr.weights_T, w_T)
        metrics["tis_clipfrac"] = _wsum(corr.clipped_T, w_T)
        if corr.vetoed_T is not None:
            metrics["tis_veto_frac"] = _wsum(corr.vetoed_T, w_T)
        return pg_T

    def _entropy_term(
        self,
        loss: torch.Tensor,
        entropy: torch.Tensor | None,
        on_T: torch.Tensor,
        w_T: torch.Tensor,
        metrics: dict[str, float],
    ) -> torch.Tensor:
        """Report the entropy and subtract ``entropy_coef`` times it from ``loss``."""
        cfg = self.config
        if entropy is not None:
            ent_T = _masked(entropy.to(w_T.dtype), on_T)
            metrics["entropy"] = _wsum(ent_T, w_T)
            if cfg.entropy_coef != 0:
                loss = loss - cfg.entropy_coef * (ent_T * w_T).sum()
        elif cfg.entropy_coef != 0:
            raise ConfigError(
                f"PolicyLoss.Config.entropy_coef = {cfg.entropy_coef} needs the entropy tensor; "
                "have the policy compute it (requires_entropy is True) or set entropy_coef = 0."
            )
        return loss

    def _kl_term(
        self,
        loss: torch.Tensor,
        logp_T: torch.Tensor,
        old_T: torch.Tensor,
        on_T: torch.Tensor,
        w_T: torch.Tensor,
        batch: TrainBatch,
        metrics: dict[str, float],
    ) -> torch.Tensor:
        """Report the KL to the reference model and add ``kl_coef`` times it to ``loss``."""
        cfg = self.config
        if batch.ref_logprobs is not None:
            # mask the inputs, not the output: a NaN/inf off the mask must not reach backward
            ref_T = _masked(batch.ref_logprobs.to(logp_T.dtype), on_T)
            kl_T = kl_estimate(_masked(logp_T, on_T), ref_T, cfg.kl_type)
            if cfg.kl_unbiased:
                kl_T = kl_T * torch.exp(clamp_log_ratio(_masked(logp_T - old_T, on_T)))
            metrics["kl"] = _wsum(kl_T, w_T)
            if cfg.kl_coef > 0:
                loss = loss + cfg.kl_coef * (kl_T * w_T).sum()
        elif cfg.kl_coef > 0:
            raise ConfigError(
                f"PolicyLoss.Config.kl_coef = {cfg.kl_coef} needs TrainBatch.ref_logprobs; "
                "configure a reference model or set kl_coef = 0."
            )
        return loss


class SFTLoss:
    """Supervised fine-tuning: ``-sum logp_t w_t`` (negative log-likelihood, weighted)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`SFTLoss`."""

        log_entropy: bool = True
        """Ask the policy for the entropy, to log it (metric ``entropy``)."""

    def __init__(self, config: SFTLoss.Config | None = None) -> None:
        self.config = config or SFTLoss.Config()

    @property
    def requires_entropy(self) -> bool:
        """True when the policy should pass the entropy tensor (``log_entropy``)."""
        return self.config.log_entropy

    def __call__(
        self, logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None = None
    ) -> LossOutput:
        """The weighted negative log-likelihood; metric ``sft_loss`` (and ``entropy``)."""
        _check_logprobs(logprobs, batch, "SFTLoss")
        on_T = batch.loss_mask > 0
        w_T = batch.loss_weights.to(logprobs.dtype) * on_T
        loss = -(_masked(logprobs, on_T) * w_T).sum()
        metrics = {"sft_loss": float(loss.detach())}
        if entropy is not None:
            metrics["entropy"] = _wsum(_masked(entropy.to(logprobs.dtype), on_T), w_T)
        return LossOutput(loss=loss, metrics=metrics)


def distillation_advantages(
    advantages_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    teacher_logprobs_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    *,
    coef: float = 1.0,
) -> torch.Tensor:
    """On-policy distillation shaping: ``A_t - coef (old_t - teacher_t)`` on masked tokens, 0
    elsewhere (detached). ``old_t - teacher_t`` is the sampled reverse KL to the teacher."""
    rkl_T = (old_logprobs_T - teacher_logprobs_T).detach()
    return _masked(advantages_T - coef * rkl_T, loss_mask_T > 0).detach()


class DistillationLoss:
    """On-policy distillation: reverse KL to a teacher (``TrainBatch.ref_logprobs``) folded into
    the advantages, then a :class:`PolicyLoss`.

    With zero task advantages this is pure distillation; with task advantages it adds the
    teacher's signal on top (slime's OPD). Metric ``opd_reverse_kl``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`DistillationLoss`."""

        coef: float = 1.0
        """Weight ``lambda`` of the reverse-KL term in the advantage."""
        policy: PolicyLoss.Config = field(default_factory=PolicyLoss.Config)
        """The policy loss run on the shaped advantages; its ``kl_coef`` must be 0 (the
        ``ref_logprobs`` slot holds the teacher)."""

        def __post_init__(self) -> None:
            if self.policy.kl_coef != 0:
                raise ConfigError(
                    "DistillationLoss.Config.policy.kl_coef: must be 0, because "
                    "TrainBatch.ref_logprobs holds the teacher's log-probs; set kl_coef = 0."
                )

    def __init__(self, config: DistillationLoss.Config | None = None) -> None:
        self.config = config or DistillationLoss.Config()
        self._policy_loss = PolicyLoss(self.config.policy)

    @property
    def requires_entropy(self) -> bool:
        """True when the inner policy loss needs entropy."""
        return self._policy_loss.requires_entropy

    @property
    def requires_ref_logprobs(self) -> bool:
        """Always True: ``TrainBatch.ref_logprobs`` carries the teacher's log-probs."""
        return True

    def __call__(
        self, logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None = None
    ) -> LossOutput:
        """Shape the advantages with the teacher's log-probs and run the policy loss."""
        _check_logprobs(logprobs, batch, "DistillationLoss")
        if batch.ref_logprobs is None:
            raise ConfigError(
                "DistillationLoss needs the teacher's log-probs in TrainBatch.ref_logprobs; "
                "configure a teacher (reference) model."
            )
        dtype = logprobs.dtype
        old_T = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs.to(dtype)
        teacher_T = batch.ref_logprobs.to(dtype)
        m_T = (batch.loss_mask > 0).to(dtype)
        shaped_T = distillation_advantages(
            batch.advantages.to(dtype), old_T, teacher_T, m_T, coef=self.config.coef
        )
        inner = dataclasses.replace(batch, advantages=shaped_T, ref_logprobs=None)
        out = self._policy_loss(logprobs, inner, entropy)
        out.metrics["opd_reverse_kl"] = _wsum(
            _masked(old_T - teacher_T, m_T > 0), batch.loss_weights.to(dtype) * m_T
        )
        return out


def value_loss(
    values_T: torch.Tensor,
    old_values_T: torch.Tensor,
    returns_T: torch.Tensor,
    weights_T: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped critic loss and the weighted fraction of tokens where the clipped term won.

    ``0.5 * sum_t max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2) w_t``; with
    ``clip=None`` only ``(V - R)^2`` (clipfrac 0). Returns ``(loss, clipfrac)``, both scalars;
    ``clipfrac`` is detached.
    """
    if clip is not None and clip <= 0:
        raise ConfigError(f"value_loss clip: must be > 0 or None, got {clip}.")
    unclipped_T = (values_T - returns_T) ** 2
    if clip is None:
        return 0.5 * (unclipped_T * weights_T).sum(), torch.zeros(
            (), dtype=values_T.dtype, device=values_T.device
        )
    v_clip_T = old_values_T + (values_T - old_values_T).clamp(-clip, clip)
    clipped_T = (v_clip_T - returns_T) ** 2
    loss = 0.5 * (torch.maximum(unclipped_T, clipped_T) * weights_T).sum()
    clipfrac = ((clipped_T > unclipped_T).to(values_T.dtype) * weights_T).sum().detach()
    return loss, clipfrac


class ValueLoss:
    """The critic's loss (a :class:`~rl_core.interfaces.ValueLossFn`): clipped squared error
    to ``TrainBatch.returns`` around ``TrainBatch.old_values``, weighted by
    ``TrainBatch.loss_weights`` (see :func:`value_loss`)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`ValueLoss`."""

        clip: PositiveFloat | None = 0.2
        """Value clipping range around the old values; ``None`` turns clipping off."""

        def __post_init__(self) -> None:
            if self.clip is not None and not self.clip > 0:
                raise ConfigError(
                    f"ValueLoss.Config.clip: must be > 0 or null (off), got {self.clip}."
                )

    def __init__(self, config: ValueLoss.Config | None = None) -> None:
        self.config = config or ValueLoss.Config()

    def __call__(self, values: torch.Tensor, batch: TrainBatch) -> LossOutput:
        """Metrics ``value_loss``, ``value_clipfrac``, ``value_mean``, ``value_error`` (weighted
        mean absolute error to the returns)."""
        if batch.returns is None or batch.old_values is None:
            raise ConfigError(
                "ValueLoss: TrainBatch.returns and TrainBatch.old_values must be set (GAE "
                "returns and the critic's values before the step)."
            )
        if values.shape != batch.loss_mask.shape:
            raise ValueError(
                f"ValueLoss: values {tuple(values.shape)} vs batch {tuple(batch.loss_mask.shape)}."
            )
        on_T = batch.loss_mask > 0
        w_T = batch.loss_weights.to(values.dtype) * on_T
        values_T = _masked(values, on_T)
        returns_T = batch.returns.to(values.dtype)
        old_T = batch.old_values.to(values.dtype)
        loss, clipfrac = value_loss(values_T, old_T, returns_T, w_T, self.config.clip)
        metrics = {
            "value_loss": float(loss.detach()),
            "value_clipfrac": float(clipfrac),
            "value_mean": _wsum(values_T.detach(), w_T),
            "value_error": _wsum((values_T.detach() - returns_T).abs(), w_T),
        }
        return LossOutput(loss=loss, metrics=metrics)


class ValueObjective:
    """Adapts a :class:`~rl_core.interfaces.ValueLossFn` to the :class:`~rl_core.interfaces.LossFn`
    signature, so a critic can reuse a policy's training loop: the per-token output the loop
    computes (the values) goes to ``loss_fn(values, batch)``; no entropy is asked for."""

    requires_entropy = False

    def __init__(self, loss_fn: ValueLossFn) -> None:
        self.loss_fn = loss_fn

    def __call__(
        self, values: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None = None
    ) -> LossOutput:
        """``loss_fn(values, batch)``."""
        return self.loss_fn(values, batch)


LOSSES: dict[str, type] = {
    "policy": PolicyLoss,
    "sft": SFTLoss,
    "distill": DistillationLoss,
    "value": ValueLoss,
}
"""Registry name -> loss class (each has a nested ``Config``)."""
