"""Train/inference mismatch correction: importance weights between the trainer's old policy and
the sampling engine.

The engine samples with ``pi_roll`` (its own kernels, precision, maybe stale weights); the trainer
recomputes ``pi_old``. The policy-gradient loss of each token is multiplied by a detached weight
derived from ``log_w = logp_old - logp_rollout`` on masked tokens:

- level ``token``: ``w_t = exp(log_w_t)``;
- level ``sequence``: ``w_t = exp(sum_{s in i} m_s log_w_s)``, the product of the token ratios
  of sequence ``i`` (the unbiased sequence-level weight), broadcast to its tokens;
- level ``geometric``: ``w_t = exp(mean_{s in i} m_s log_w_s)``, the geometric mean of the token
  ratios (lower variance, biased), broadcast to its tokens.

Modes, with bounds ``[low, high]``:

- ``tis`` (truncated IS): ``w = clamp(w, low, high)``;
- ``mis`` (masked IS) and ``icepop`` (the IcePop name for the same rule): ``w`` inside the bounds,
  ``0`` outside (the token, or at sequence level the whole sequence, is dropped);
- ``none``: ``w = 1``.

A token counts as *clipped* when its raw weight lies outside ``[low, high]``. All outputs are 0
off the mask.

**Veto** (slime's MIS rejection sampling, ``mis_veto_threshold``): with ``veto`` set, a sequence in
which any masked token has a *token* ratio ``exp(log_w_t) < veto`` gets weight 0 on all its tokens,
whatever the mode and level (``none`` excepted): one catastrophic token drops the whole sequence.
Vetoed tokens count as clipped. The log-weight is clamped to ``+-LOG_RATIO_BOUND`` (20) before ``exp``, so ``raw``
is at most ``exp(20)`` and never overflows; inside the bound the clamp changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rl_core.algorithms._segments import check_cu_seqlens, segment_sum, seq_index
from rl_core.errors import ConfigError, DataError

__all__ = [
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "LOG_RATIO_BOUND",
    "CorrectionWeights",
    "clamp_log_ratio",
    "importance_weights",
    "logprob_mismatch",
]

CORRECTION_MODES: tuple[str, ...] = ("none", "tis", "mis", "icepop")
"""Names accepted as ``mode`` by :func:`importance_weights`."""
CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
"""Names accepted as ``level`` by :func:`importance_weights`."""

LOG_RATIO_BOUND = 20.0
"""Bound on every log-ratio before ``exp``: losses, corrections and KL estimators use
``exp(clamp(x, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))`` (see :func:`clamp_log_ratio`).

``exp(x)`` overflows float32 above ~88.7; unclamped, one token with a huge log-ratio makes a PPO
loss ``0 * inf = NaN`` on a zero advantage (every all-equal GRPO group) and its gradient NaN,
which poisons the whole step. ``exp(20) ~ 4.9e8`` is far outside any clip range (PPO's
``1 +- eps``, the correction bounds), so the clamp only touches tokens that are clipped, masked or
truncated anyway, and there the gradient through the clamp is 0. Inside the bound it changes no
bit of the result. verl clamps its low-variance KL at the same 20.
"""


def clamp_log_ratio(log_ratio_T: torch.Tensor) -> torch.Tensor:
    """``log_ratio_T`` clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]``: apply before ``exp``.

    The identity (bit for bit, gradient included) inside the bound; ``+-inf`` become the bound,
    with zero gradient.
    """
    return log_ratio_T.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@dataclass(frozen=True, slots=True, kw_only=True)
class CorrectionWeights:
    """What :func:`importance_weights` returns; every tensor is ``[T]``, detached, 0 off the mask."""

    weights_T: torch.Tensor
    """Weight multiplying each token's policy-gradient loss."""
    raw_T: torch.Tensor
    """The importance ratio before truncation or masking."""
    clipped_T: torch.Tensor
    """1.0 where the raw ratio was outside ``[low, high]`` (truncated or masked) or the sequence
    was vetoed, else 0."""
    vetoed_T: torch.Tensor | None = None
    """1.0 on the tokens of sequences dropped by the veto (``None`` without a veto)."""


def check_correction(
    mode: str, level: str, low: float, high: float, *, owner: str, veto: float | None = None
) -> None:
    """Raise :class:`ConfigError` (naming ``owner``'s fields) for bad correction settings."""
    if mode not in CORRECTION_MODES:
        raise ConfigError(
            f"{owner}.correction: unknown {mode!r}; choose one of {', '.join(CORRECTION_MODES)}."
        )
    if level not in CORRECTION_LEVELS:
        raise ConfigError(
            f"{owner}.correction_level: unknown {level!r}; choose one of "
            f"{', '.join(CORRECTION_LEVELS)}."
        )
    if not 0.0 <= low <= high:
        raise ConfigError(
            f"{owner}.correction_clip_low/high: need 0 <= low <= high, got low={low}, high={high}."
        )
    if veto is not None and not 0.0 < veto < 1.0:
        raise ConfigError(
            f"{owner}.correction_veto: must be in (0, 1) (e.g. 1e-4) or None, got {veto}."
        )


def logprob_mismatch(
    old_logprobs_T: torch.Tensor, rollout_logprobs_T: torch.Tensor, loss_mask_T: torch.Tensor
) -> torch.Tensor:
    """``[T]`` ``|logp_old - logp_rollout|`` on masked tokens, 0 elsewhere (detached)."""
    diff_T = (old_logprobs_T - rollout_logprobs_T).detach().abs()
    return torch.where(loss_mask_T > 0, diff_T, 0.0)


def importance_weights(
    old_logprobs_T: torch.Tensor,
    rollout_logprobs_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    cu_seqlens_N1: torch.Tensor | None = None,
    *,
    mode: str,
    level: str = "token",
    clip_low: float = 0.0,
    clip_high: float = 2.0,
    veto: float | None = None,
) -> CorrectionWeights:
    """Mismatch importance weights ``w = f(exp(logp_old - logp_rollout))`` (module docstring).

    ``cu_seqlens_N1`` is required for the ``sequence`` and ``geometric`` levels and for ``veto``.
    """
    check_correction(mode, level, clip_low, clip_high, owner="correction", veto=veto)
    t = int(loss_mask_T.shape[0])
    if old_logprobs_T.shape != (t,) or rollout_logprobs_T.shape != (t,):
        raise DataError(
            f"importance_weights: old {tuple(old_logprobs_T.shape)} and rollout "
            f"{tuple(rollout_logprobs_T.shape)} log-probs must both be [{t}] like the loss mask."
        )
    m_T = (loss_mask_T > 0).to(old_logprobs_T.dtype)
    if mode == "none":
        return CorrectionWeights(
            weights_T=m_T.clone(), raw_T=m_T.clone(), clipped_T=torch.zeros_like(m_T)
        )
    log_w_T = torch.where(m_T > 0, (old_logprobs_T - rollout_logprobs_T).detach(), 0.0)
    token_log_w_T = log_w_T
    seq_T, n = torch.zeros(t, dtype=torch.int64, device=loss_mask_T.device), 0
    if level != "token" or veto is not None:
        if cu_seqlens_N1 is None:
            raise ConfigError(
                f"correction_level {level!r} / veto {veto!r} need cu_seqlens (sequence bounds); "
                "pass them or use level 'token' without a veto."
            )
        check_cu_seqlens(cu_seqlens_N1, t)
        n = int(cu_seqlens_N1.shape[0]) - 1
        seq_T = seq_index(cu_seqlens_N1)
    if level != "token":
        log_w_N = segment_sum(log_w_T, seq_T, n)
        if level == "geometric":
            log_w_N = log_w_N / segment_sum(m_T, seq_T, n).clamp_min(1.0)
        log_w_T = log_w_N[seq_T]
    raw_T = torch.exp(clamp_log_ratio(log_w_T)) * m_T
    outside_T = ((raw_T < clip_low) | (raw_T > clip_high)).to(m_T.dtype) * m_T
    if mode == "tis":
        weights_T = raw_T.clamp(clip_low, clip_high) * m_T
    else:  # mis / icepop
        weights_T = raw_T * (1.0 - outside_T)
    vetoed_T = None
    if veto is not None:
        # log space: exp(log_w) < veto  <=>  log_w < log(veto); a -inf log-weight is vetoed too
        bad_T = ((token_log_w_T < math.log(veto)) & (m_T > 0)).to(m_T.dtype)
        vetoed_T = (segment_sum(bad_T, seq_T, n) > 0).to(m_T.dtype)[seq_T] * m_T
        weights_T = weights_T * (1.0 - vetoed_T)
        outside_T = torch.maximum(outside_T, vetoed_T)
    return CorrectionWeights(
        weights_T=weights_T, raw_T=raw_T, clipped_T=outside_T, vetoed_T=vetoed_T
    )
