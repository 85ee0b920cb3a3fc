"""Advantage estimators: rewards (and optionally KL, values) to per-token advantages.

Every estimator takes an :class:`~rl_core.types.AdvantageInputs` over the ``N`` rollouts of one
step and returns ``N`` tensors ``[R_i]`` (0 off each rollout's response mask). Groups may be
uneven (fan-out, filters): statistics are taken per actual group through ``group_index``, never
by reshaping rewards into ``[G, n]``.

Notation: ``r_i`` scalar reward of rollout ``i``, ``g(i)`` its group, ``n_g`` the size of group
``g``, ``m_t`` the response mask, ``KL_t`` the per-token KL to the reference.

- **GRPO** (``grpo``, also used by GSPO and CISPO):
  ``A_i = (r_i - mean_g r) / (std_g r + eps)``. ``std`` is the *unbiased* (Bessel, ``n_g - 1``)
  standard deviation by default, as ``torch.std`` computes it in slime, verl and TRL; set
  ``std_unbiased=False`` for the population std. A group of one has advantage 0 (never NaN).
- **Dr.GRPO** (``dr_grpo``): ``A_i = r_i - mean_g r`` (no std division).
- **RLOO** (``rloo``): ``A_i = r_i - mean_{j in g, j != i} r_j = n_g/(n_g-1) * (r_i - mean_g r)``;
  a group of one has advantage 0.
- **REINFORCE++** (``reinforce_pp``): token rewards ``r_t = -kl_coef * KL_t`` on masked tokens plus
  ``r_i`` on the last masked token; return ``G_t = sum_l gamma**l r_{t+l}``; then
  :func:`masked_whiten` over all masked tokens of the step.
- **REINFORCE++-baseline** (``reinforce_pp_baseline``):
  ``A_t = (r_i - mean_g r) - kl_coef * KL_t``, then :func:`masked_whiten`.
- **GAE** (``gae``, PPO with a critic): with the same token rewards as REINFORCE++,
  ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V`` after the last token is 0),
  ``A_t = sum_l (gamma lam)**l delta_{t+l}``, returns ``R_t = A_t + V_t``.

Time steps of the discounted estimators (REINFORCE++, GAE) are the *masked* tokens of a rollout:
tool/observation tokens (mask 0) are skipped, so ``t+1`` is the next model token (verl's multi-turn
GAE does the same). With ``gamma = lam = 1`` (the usual setting) this equals a per-position scan.

Whitening is over all masked tokens of the step (the :class:`AdvantageInputs` is step-wide), with
the population variance: ``(A - mean) / sqrt(var + eps)``.

Example::

    inputs = AdvantageInputs(rewards=torch.tensor([1., 0., 0., 1., 1.]),
                             group_index=torch.tensor([0, 0, 0, 1, 1]),
                             response_mask=[torch.ones(2)] * 5)
    GRPO()(inputs)   # group 0: mean 1/3, std sqrt(1/3) -> A = [1.1547, -0.5774, -0.5774]
                     # group 1: two equal rewards        -> A = [0, 0]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_core.algorithms._segments import (
    compact,
    discounted_cumsum,
    ragged_lengths,
    uncompact,
)
from rl_core.config import NonNegFloat, Probability
from rl_core.errors import ConfigError, DataError
from rl_core.types import AdvantageInputs

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GAE",
    "GRPO",
    "RLOO",
    "DrGRPO",
    "ReinforcePP",
    "ReinforcePPBaseline",
    "compute_gae",
    "dr_grpo_advantages",
    "grpo_advantages",
    "masked_whiten",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8, shift_mean: bool = True
) -> torch.Tensor:
    """Whiten ``values`` over the entries where ``mask > 0``; 0 elsewhere.

    ``mean = sum(v m) / sum(m)``, ``var = sum((v - mean)^2 m) / sum(m)`` (population variance),
    result ``(v - mean) / sqrt(var + eps)`` (or ``v / sqrt(var + eps)`` with ``shift_mean=False``).
    An empty mask returns zeros.
    """
    if values.shape != mask.shape:
        raise DataError(
            f"masked_whiten: values {tuple(values.shape)} and mask {tuple(mask.shape)} differ."
        )
    m = (mask > 0).to(values.dtype)
    count = m.sum()
    if float(count) == 0:
        return torch.zeros_like(values)
    mean = (values * m).sum() / count
    var = ((values - mean) ** 2 * m).sum() / count
    centred = values - mean if shift_mean else values
    return centred * torch.rsqrt(var + eps) * m


def _check_inputs(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Validate shapes and values; return float64 rewards, int64 group index and N."""
    rewards_N = inputs.rewards
    n = int(rewards_N.shape[0]) if rewards_N.dim() == 1 else -1
    if n < 0:
        raise DataError(f"AdvantageInputs.rewards: expected [N], got {tuple(rewards_N.shape)}.")
    if tuple(inputs.group_index.shape) != (n,):
        raise DataError(
            f"AdvantageInputs.group_index: shape {tuple(inputs.group_index.shape)}, expected ({n},)."
        )
    if len(inputs.response_mask) != n:
        raise DataError(
            f"AdvantageInputs.response_mask: {len(inputs.response_mask)} masks for {n} rewards; "
            "give one [R_i] mask per rollout."
        )
    if not bool(torch.isfinite(rewards_N).all()):
        bad = int(torch.nonzero(~torch.isfinite(rewards_N))[0])
        raise DataError(
            f"AdvantageInputs.rewards[{bad}] = {float(rewards_N[bad])} is not finite; "
            "drop or re-score that rollout before computing advantages."
        )
    group_N = inputs.group_index.long()
    if n and int(group_N.min()) < 0:
        raise DataError("AdvantageInputs.group_index: group ids must be >= 0.")
    for name in ("kl", "values"):
        extra = getattr(inputs, name)
        if extra is None:
            continue
        if len(extra) != n or any(e.shape != m.shape for e, m in zip(extra, inputs.response_mask)):
            raise DataError(
                f"AdvantageInputs.{name}: expected {n} tensors shaped like response_mask."
            )
    return rewards_N.double(), group_N, n


def _group_stats(
    rewards_N: torch.Tensor, group_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per rollout: its group's mean, size, and sum of squared deviations."""
    num_groups = int(group_N.max()) + 1 if group_N.numel() else 0
    dev = rewards_N.device
    count_G = torch.zeros(num_groups, dtype=rewards_N.dtype, device=dev).index_add(
        0, group_N, torch.ones_like(rewards_N)
    )
    sum_G = torch.zeros(num_groups, dtype=rewards_N.dtype, device=dev).index_add(
        0, group_N, rewards_N
    )
    mean_G = sum_G / count_G.clamp_min(1)
    dev_N = rewards_N - mean_G[group_N]
    sq_G = torch.zeros(num_groups, dtype=rewards_N.dtype, device=dev).index_add(
        0, group_N, dev_N**2
    )
    return mean_G[group_N], count_G[group_N], sq_G[group_N]


def _broadcast(adv_N: torch.Tensor, masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each rollout's scalar advantage on its masked response tokens, 0 elsewhere."""
    lengths = ragged_lengths(masks)
    if not masks:
        return []
    mask_T = torch.cat(masks).float()
    reps_N = torch.tensor(lengths, dtype=torch.long, device=mask_T.device)
    adv_T = torch.repeat_interleave(adv_N.float().to(mask_T.device), reps_N) * mask_T
    return list(torch.split(adv_T, lengths))


def _flat(masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Concatenated float mask ``[T]``, sequence index ``[T]`` and lengths of ragged masks."""
    lengths = ragged_lengths(masks)
    dev = masks[0].device if masks else None
    mask_T = torch.cat(masks).float() if masks else torch.zeros(0)
    seq_T = torch.repeat_interleave(
        torch.arange(len(masks), device=dev), torch.tensor(lengths, dtype=torch.long, device=dev)
    )
    return mask_T, seq_T, lengths


def _require_kl(inputs: AdvantageInputs, kl_coef: float, owner: str) -> list[torch.Tensor] | None:
    if kl_coef == 0:
        return None
    if inputs.kl is None:
        raise ConfigError(
            f"{owner}.kl_coef = {kl_coef} needs AdvantageInputs.kl (per-token KL to the reference, "
            "see rl_core.algorithms.kl_estimate); pass it or set kl_coef = 0."
        )
    return inputs.kl


def _token_rewards(
    rewards_N: torch.Tensor, inputs: AdvantageInputs, kl_coef: float, owner: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    """Compacted token rewards ``-kl_coef KL_t`` plus ``r`` on each rollout's last masked token.

    Returns ``(rew_NL, valid_NL, rows_K, cols_K, lengths, mask_T)``.
    """
    masks = list(inputs.response_mask)
    mask_T, seq_T, lengths = _flat(masks)
    n = len(masks)
    kl = _require_kl(inputs, kl_coef, owner)
    kl_T = torch.cat(kl).float() if kl is not None and n else torch.zeros_like(mask_T)
    rew_NL, valid_NL, rows_K, cols_K = compact(-kl_coef * kl_T, mask_T, seq_T, n)
    last_N = valid_NL.sum(1) - 1
    has_N = last_N >= 0
    rows = torch.arange(n, device=mask_T.device)[has_N]
    rew_NL[rows, last_N[has_N]] += rewards_N[has_N].float().to(rew_NL.device)
    return rew_NL, valid_NL, rows_K, cols_K, lengths, mask_T


# --------------------------------------------------------------------------------------------
# Functions
# --------------------------------------------------------------------------------------------


def grpo_advantages(
    inputs: AdvantageInputs, *, eps: NonNegFloat = 1e-6, std_unbiased: bool = True
) -> list[torch.Tensor]:
    """GRPO: ``(r - group mean) / (group std + eps)`` on each masked response token.

    ``std_unbiased`` picks Bessel's ``n_g - 1`` (default, as ``torch.std``) or ``n_g``. A group of
    one rollout gets advantage 0.
    """
    rewards_N, group_N, _ = _check_inputs(inputs)
    mean_N, count_N, sq_N = _group_stats(rewards_N, group_N)
    dof_N = (count_N - 1 if std_unbiased else count_N).clamp_min(1)
    std_N = torch.sqrt(sq_N / dof_N)
    # a group with zero spread (all equal, or a single rollout) has zero deviations: advantage 0,
    # also when eps is 0
    adv_N = torch.where(std_N > 0, (rewards_N - mean_N) / (std_N + eps), 0.0)
    return _broadcast(adv_N, list(inputs.response_mask))


def dr_grpo_advantages(inputs: AdvantageInputs) -> list[torch.Tensor]:
    """Dr.GRPO: ``r - group mean`` on each masked response token (no std division)."""
    rewards_N, group_N, _ = _check_inputs(inputs)
    mean_N, _, _ = _group_stats(rewards_N, group_N)
    return _broadcast(rewards_N - mean_N, list(inputs.response_mask))


def rloo_advantages(inputs: AdvantageInputs) -> list[torch.Tensor]:
    """RLOO: ``r_i`` minus the mean reward of the *other* rollouts of its group.

    Equals ``n/(n-1) * (r_i - mean)``; a group of one rollout gets advantage 0.
    """
    rewards_N, group_N, _ = _check_inputs(inputs)
    mean_N, count_N, _ = _group_stats(rewards_N, group_N)
    scale_N = torch.where(count_N > 1, count_N / (count_N - 1).clamp_min(1), 0.0)
    return _broadcast(scale_N * (rewards_N - mean_N), list(inputs.response_mask))


def reinforce_pp_advantages(
    inputs: AdvantageInputs,
    *,
    gamma: Probability = 1.0,
    kl_coef: NonNegFloat = 0.0,
    whiten: bool = True,
) -> list[torch.Tensor]:
    """REINFORCE++: discounted return of ``-kl_coef KL_t`` (+ ``r`` at the last masked token),
    then masked whitening across the step (``whiten=False`` returns the raw returns)."""
    rewards_N, _, _ = _check_inputs(inputs)
    rew_NL, _, rows_K, cols_K, lengths, mask_T = _token_rewards(
        rewards_N, inputs, kl_coef, "ReinforcePP.Config"
    )
    ret_T = uncompact(discounted_cumsum(rew_NL, gamma), mask_T, rows_K, cols_K)
    if whiten:
        ret_T = masked_whiten(ret_T, mask_T)
    return list(torch.split(ret_T, lengths))


def reinforce_pp_baseline_advantages(
    inputs: AdvantageInputs, *, kl_coef: NonNegFloat = 0.0, whiten: bool = True
) -> list[torch.Tensor]:
    """REINFORCE++-baseline: ``(r - group mean) - kl_coef KL_t`` on masked tokens, then masked
    whitening across the step."""
    rewards_N, group_N, _ = _check_inputs(inputs)
    mean_N, _, _ = _group_stats(rewards_N, group_N)
    masks = list(inputs.response_mask)
    mask_T, _, lengths = _flat(masks)
    adv_T = torch.cat(_broadcast(rewards_N - mean_N, masks)) if masks else mask_T
    kl = _require_kl(inputs, kl_coef, "ReinforcePPBaseline.Config")
    if kl is not None and masks:
        kl_T = torch.where(mask_T > 0, torch.cat(kl).float(), 0.0)
        adv_T = adv_T - kl_coef * kl_T
    if whiten:
        adv_T = masked_whiten(adv_T, mask_T)
    return list(torch.split(adv_T, lengths))


def compute_gae(
    inputs: AdvantageInputs,
    *,
    gamma: Probability = 1.0,
    lam: Probability = 1.0,
    kl_coef: NonNegFloat = 0.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE over the masked tokens of each rollout; returns ``(advantages, returns)``, each N
    tensors ``[R_i]`` (0 off the mask). Needs ``inputs.values`` (critic values ``V_t``).

    ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V`` past the last masked token is 0),
    ``A_t = sum_l (gamma lam)**l delta_{t+l}``, ``R_t = A_t + V_t``. Token rewards are those of
    REINFORCE++ (``-kl_coef KL_t``, plus the scalar reward on the last masked token). No whitening.
    """
    rewards_N, _, _ = _check_inputs(inputs)
    if inputs.values is None:
        raise ConfigError(
            "GAE needs AdvantageInputs.values (critic values per response token); compute them "
            "with the critic or pick an estimator without a critic (grpo, rloo, reinforce_pp)."
        )
    rew_NL, valid_NL, rows_K, cols_K, lengths, mask_T = _token_rewards(
        rewards_N, inputs, kl_coef, "GAE.Config"
    )
    n = len(lengths)
    values_T = torch.cat(inputs.values).float() if n else mask_T
    _, seq_T, _ = _flat(list(inputs.response_mask))
    v_NL, _, _, _ = compact(values_T, mask_T, seq_T, n)
    next_v_NL = torch.zeros_like(v_NL)
    next_v_NL[:, :-1] = v_NL[:, 1:] * valid_NL[:, 1:]
    delta_NL = (rew_NL + gamma * next_v_NL - v_NL) * valid_NL
    adv_NL = discounted_cumsum(delta_NL, gamma * lam)
    adv_T = uncompact(adv_NL, mask_T, rows_K, cols_K)
    ret_T = uncompact(adv_NL + v_NL, mask_T, rows_K, cols_K)
    return list(torch.split(adv_T, lengths)), list(torch.split(ret_T, lengths))


# --------------------------------------------------------------------------------------------
# AdvantageFn classes
# --------------------------------------------------------------------------------------------


def _check_gamma(value: float, name: str) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name}: must be in [0, 1], got {value}.")


class GRPO:
    """GRPO advantages (group-normalised reward, broadcast to the response); also for GSPO/CISPO."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`GRPO`."""

        eps: NonNegFloat = 1e-6
        """Added to the group std before dividing."""
        std_unbiased: bool = True
        """Bessel-corrected std (``n - 1``, as ``torch.std``); ``False`` divides by ``n``."""

        def __post_init__(self) -> None:
            if self.eps < 0:
                raise ConfigError(f"GRPO.Config.eps: must be >= 0, got {self.eps}.")

    def __init__(self, config: GRPO.Config | None = None) -> None:
        self.config = config or GRPO.Config()

    def __call__(self, inputs: AdvantageInputs) -> list[torch.Tensor]:
        """N tensors ``[R_i]`` of advantages."""
        return grpo_advantages(inputs, eps=self.config.eps, std_unbiased=self.config.std_unbiased)


class DrGRPO:
    """Dr.GRPO advantages: reward minus group mean, no std normalisation."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`DrGRPO` (none)."""

    def __init__(self, config: DrGRPO.Config | None = None) -> None:
        self.config = config or DrGRPO.Config()

    def __call__(self, inputs: AdvantageInputs) -> list[torch.Tensor]:
        """N tensors ``[R_i]`` of advantages."""
        return dr_grpo_advantages(inputs)


class RLOO:
    """RLOO advantages: reward minus the leave-one-out group mean."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`RLOO` (none)."""

    def __init__(self, config: RLOO.Config | None = None) -> None:
        self.config = config or RLOO.Config()

    def __call__(self, inputs: AdvantageInputs) -> list[torch.Tensor]:
        """N tensors ``[R_i]`` of advantages."""
        return rloo_advantages(inputs)


class ReinforcePP:
    """REINFORCE++: KL-shaped token rewards, discounted return, step-wide whitening."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`ReinforcePP`."""

        gamma: Probability = 1.0
        """Discount per masked token, in [0, 1]."""
        kl_coef: NonNegFloat = 0.0
        """Weight of the per-token KL penalty in the reward; > 0 needs ``AdvantageInputs.kl``."""
        whiten: bool = True
        """Whiten the returns over the step's masked tokens (REINFORCE++ requires it)."""

        def __post_init__(self) -> None:
            _check_gamma(self.gamma, "ReinforcePP.Config.gamma")

    def __init__(self, config: ReinforcePP.Config | None = None) -> None:
        self.config = config or ReinforcePP.Config()

    def __call__(self, inputs: AdvantageInputs) -> list[torch.Tensor]:
        """N tensors ``[R_i]`` of advantages."""
        c = self.config
        return reinforce_pp_advantages(inputs, gamma=c.gamma, kl_coef=c.kl_coef, whiten=c.whiten)


class ReinforcePPBaseline:
    """REINFORCE++-baseline: group-mean baseline minus per-token KL, step-wide whitening."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`ReinforcePPBaseline`."""

        kl_coef: NonNegFloat = 0.0
        """Weight of the per-token KL penalty; > 0 needs ``AdvantageInputs.kl``."""
        whiten: bool = True
        """Whiten over the step's masked tokens."""

    def __init__(self, config: ReinforcePPBaseline.Config | None = None) -> None:
        self.config = config or ReinforcePPBaseline.Config()

    def __call__(self, inputs: AdvantageInputs) -> list[torch.Tensor]:
        """N tensors ``[R_i]`` of advantages."""
        c = self.config
        return reinforce_pp_baseline_advantages(inputs, kl_coef=c.kl_coef, whiten=c.whiten)


class GAE:
    """GAE advantages for PPO with a critic; :meth:`advantages_and_returns` also gives returns."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`GAE`."""

        gamma: Probability = 1.0
        """Discount per masked token, in [0, 1]."""
        lam: Probability = 1.0
        """GAE lambda, in [0, 1]."""
        kl_coef: NonNegFloat = 0.0
        """Weight of the per-token KL penalty in the reward; > 0 needs ``AdvantageInputs.kl``."""
        whiten: bool = False
        """Whiten the advantages over the step's masked tokens (returns are left as they are)."""

        def __post_init__(self) -> None:
            _check_gamma(self.gamma, "GAE.Config.gamma")
            _check_gamma(self.lam, "GAE.Config.lam")

    def __init__(self, config: GAE.Config | None = None) -> None:
        self.config = config or GAE.Config()

    def advantages_and_returns(
        self, inputs: AdvantageInputs
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(advantages, returns)``: N tensors ``[R_i]`` each; returns are the critic targets."""
        c = self.config
        adv, ret = compute_gae(inputs, gamma=c.gamma, lam=c.lam, kl_coef=c.kl_coef)
        if c.whiten and adv:
            lengths = ragged_lengths(adv)
            mask_T = torch.cat(list(inputs.response_mask)).float()
            adv = list(torch.split(masked_whiten(torch.cat(adv), mask_T), lengths))
        return adv, ret

    def __call__(self, inputs: AdvantageInputs) -> list[torch.Tensor]:
        """N tensors ``[R_i]`` of advantages."""
        return self.advantages_and_returns(inputs)[0]


ADVANTAGE_ESTIMATORS: dict[str, type] = {
    "grpo": GRPO,
    "dr_grpo": DrGRPO,
    "rloo": RLOO,
    "reinforce_pp": ReinforcePP,
    "reinforce_pp_baseline": ReinforcePPBaseline,
    "gae": GAE,
}
"""Registry name -> estimator class (each has a nested ``Config``). GSPO and CISPO use ``grpo``."""
