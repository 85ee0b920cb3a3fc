"""Per-token KL estimators between the trained policy and a reference.

With ``x = logp - ref_logp`` (log-prob of the sampled token under the policy minus under the
reference), the estimators of ``KL(pi || pi_ref)`` on samples from ``pi`` are (Schulman, "Approximating
KL divergence"):

- ``k1 = x``: unbiased, high variance, can be negative per token;
- ``k2 = x**2 / 2``: biased, low variance, non-negative;
- ``k3 = exp(-x) - 1 + x``: unbiased, non-negative;
- ``low_var_kl``: ``k3`` clamped to ``[-10, 10]`` (verl / slime), for numerical safety.

In ``k3`` (and ``low_var_kl``) the ``exp`` argument is clamped to ``+-LOG_RATIO_BOUND`` (20, see
:mod:`rl_core.algorithms.correction`): without it ``x = -100`` gives an ``inf`` loss and a NaN
gradient (``low_var_kl``'s output clamp passes 0, and ``0 * inf`` is NaN). Inside the bound
nothing changes.

The same estimators serve the KL loss and a KL penalty in the reward (REINFORCE++, GAE).
"""

from __future__ import annotations

import torch

from rl_core.algorithms.correction import clamp_log_ratio
from rl_core.errors import ConfigError

__all__ = ["KL_KINDS", "kl_estimate"]

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
"""Names accepted by :func:`kl_estimate`."""


def kl_estimate(
    logp_T: torch.Tensor, ref_logp_T: torch.Tensor, kind: str, *, field: str = "kl_type"
) -> torch.Tensor:
    """Per-token KL estimate of the given ``kind`` (see the module docstring); same shape as
    the inputs and differentiable in both. ``field`` names the config field in error messages."""
    if kind not in KL_KINDS:
        raise ConfigError(
            f"{field}: unknown KL estimator {kind!r}; choose one of {', '.join(KL_KINDS)}."
        )
    x_T = logp_T - ref_logp_T
    if kind == "k1":
        return x_T
    if kind == "k2":
        return 0.5 * x_T**2
    k3_T = torch.expm1(clamp_log_ratio(-x_T)) + x_T
    if kind == "low_var_kl":
        return k3_T.clamp(-10.0, 10.0)
    return k3_T
