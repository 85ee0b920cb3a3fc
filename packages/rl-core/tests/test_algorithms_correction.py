"""Mismatch correction weights (TIS / MIS / icepop at token, sequence, geometric level)."""

from __future__ import annotations

import pytest
import torch

from rl_core.algorithms import importance_weights, logprob_mismatch
from rl_core.errors import ConfigError

T = torch.tensor

# two sequences: tokens 0..3 and 4..6; first token of each has mask 0
MASK = T([0.0, 1, 1, 1, 0, 1, 1])
CU = T([0, 4, 7])
OLD = T([0.0, -1.0, -0.5, -2.0, 0.0, -0.3, -0.2])
ROLL = T([0.0, -1.2, -0.5, -0.9, 0.0, -1.0, -0.1])
# log w = old - rollout = [., 0.2, 0, -1.1, ., 0.7, -0.1]
# raw w = [0, 1.221403, 1, 0.332871, 0, 2.013753, 0.904837]
RAW = [0.0, 1.221403, 1.0, 0.332871, 0.0, 2.013753, 0.904837]


def _run(mode: str, level: str = "token", low: float = 0.0, high: float = 2.0):
    return importance_weights(
        OLD, ROLL, MASK, CU, mode=mode, level=level, clip_low=low, clip_high=high
    )


def _close(x: torch.Tensor, want: list[float]) -> None:
    torch.testing.assert_close(x, T(want, dtype=torch.float32), atol=1e-5, rtol=0)


def test_tis_token_truncates() -> None:
    out = _run("tis", high=2.0)
    _close(out.raw_T, RAW)
    _close(out.weights_T, [0.0, 1.221403, 1.0, 0.332871, 0.0, 2.0, 0.904837])
    _close(out.clipped_T, [0, 0, 0, 0, 0, 1, 0])  # only 2.0138 > 2
    out = _run("tis", low=0.5, high=1.5)
    _close(out.weights_T, [0.0, 1.221403, 1.0, 0.5, 0.0, 1.5, 0.904837])
    assert float(out.clipped_T.sum()) == 2  # 0.3329 < 0.5 and 2.0138 > 1.5


@pytest.mark.parametrize("mode", ["mis", "icepop"])
def test_mis_and_icepop_token_mask_out_of_range(mode: str) -> None:
    out = _run(mode, low=0.5, high=1.5)
    _close(out.weights_T, [0.0, 1.221403, 1.0, 0.0, 0.0, 0.0, 0.904837])
    _close(out.clipped_T, [0, 0, 0, 1, 0, 1, 0])


def test_sequence_level_uses_product_of_ratios() -> None:
    # seq 0: exp(0.2 + 0 - 1.1) = exp(-0.9) = 0.406570; seq 1: exp(0.7 - 0.1) = exp(0.6) = 1.822119
    out = _run("tis", level="sequence", low=0.5, high=1.5)
    _close(out.raw_T, [0.0, 0.406570, 0.406570, 0.406570, 0.0, 1.822119, 1.822119])
    _close(out.weights_T, [0.0, 0.5, 0.5, 0.5, 0.0, 1.5, 1.5])
    assert float(out.clipped_T.sum()) == 5  # every masked token of both sequences
    out = _run("mis", level="sequence", low=0.3, high=1.5)
    _close(out.weights_T, [0.0, 0.406570, 0.406570, 0.406570, 0.0, 0.0, 0.0])


def test_geometric_level_uses_mean_log_ratio() -> None:
    # seq 0: exp(-0.9 / 3) = 0.740818; seq 1: exp(0.6 / 2) = 1.349859
    out = _run("mis", level="geometric", low=0.7, high=1.2)
    _close(out.weights_T, [0.0, 0.740818, 0.740818, 0.740818, 0.0, 0.0, 0.0])
    _close(out.clipped_T, [0, 0, 0, 0, 0, 1, 1])


def test_none_is_identity_on_the_mask() -> None:
    out = _run("none")
    _close(out.weights_T, MASK.tolist())
    assert float(out.clipped_T.sum()) == 0


def test_huge_sequence_ratio_does_not_produce_nan() -> None:
    old, roll = T([0.0, 0.0, 0.0]), T([0.0, -60.0, -60.0])  # sum log w = 120
    for mode in ("tis", "mis"):
        out = importance_weights(old, roll, T([0.0, 1, 1]), T([0, 3]), mode=mode, level="sequence")
        assert torch.isfinite(out.weights_T).all()
        assert float(out.clipped_T.sum()) == 2


def test_weights_are_detached() -> None:
    old = OLD.clone().requires_grad_(True)
    out = importance_weights(old, ROLL, MASK, CU, mode="tis")
    assert not out.weights_T.requires_grad


def test_mismatch() -> None:
    _close(logprob_mismatch(OLD, ROLL, MASK), [0.0, 0.2, 0.0, 1.1, 0.0, 0.7, 0.1])


def test_bad_settings() -> None:
    with pytest.raises(ConfigError, match=r"'is'.*none, tis, mis, icepop"):
        _run("is")
    with pytest.raises(ConfigError, match="token, sequence, geometric"):
        _run("tis", level="batch")
    with pytest.raises(ConfigError, match="low <= high"):
        _run("tis", low=2.0, high=1.0)
    with pytest.raises(ConfigError, match="cu_seqlens"):
        importance_weights(OLD, ROLL, MASK, None, mode="tis", level="sequence")
