"""KL estimators against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from rl_core.algorithms import KL_KINDS, kl_estimate
from rl_core.errors import ConfigError

T = torch.tensor

# x = logp - ref = [0.5, -1, 0]
LOGP = T([-1.0, -2.0, -0.5])
REF = T([-1.5, -1.0, -0.5])


@pytest.mark.parametrize(
    ("kind", "want"),
    [
        ("k1", [0.5, -1.0, 0.0]),
        ("k2", [0.125, 0.5, 0.0]),
        # exp(-0.5) - 1 + 0.5 = 0.106531; exp(1) - 1 - 1 = 0.718282
        ("k3", [0.106531, 0.718282, 0.0]),
        ("low_var_kl", [0.106531, 0.718282, 0.0]),
    ],
)
def test_kl_estimators(kind: str, want: list[float]) -> None:
    torch.testing.assert_close(kl_estimate(LOGP, REF, kind), T(want), atol=1e-6, rtol=0)


def test_low_var_kl_is_clamped_but_k3_is_not() -> None:
    # x = -20: k3 = exp(20) - 21 = 4.85e8; low_var_kl clamps it to 10
    logp, ref = T([-21.0]), T([-1.0])
    assert float(kl_estimate(logp, ref, "k3")) > 1e8
    assert float(kl_estimate(logp, ref, "low_var_kl")) == 10.0


def test_k3_gradient() -> None:
    # d/dlogp (exp(-x) - 1 + x) = 1 - exp(-x); at x = 0.5: 0.393469
    logp = T([-1.0], requires_grad=True)
    kl_estimate(logp, T([-1.5]), "k3").sum().backward()
    torch.testing.assert_close(logp.grad, T([0.393469]), atol=1e-6, rtol=0)


def test_unknown_kind_names_field_and_choices() -> None:
    with pytest.raises(ConfigError) as err:
        kl_estimate(LOGP, REF, "k4", field="loss.kl_type")
    msg = str(err.value)
    assert "loss.kl_type" in msg and "'k4'" in msg
    assert all(k in msg for k in KL_KINDS)
