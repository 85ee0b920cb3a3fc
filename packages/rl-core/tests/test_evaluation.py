"""pass@k and eval summaries (rl_core.evaluation)."""

from __future__ import annotations

import itertools

import pytest

from rl_core.errors import ConfigError
from rl_core.evaluation import pass_at_k, summarize_eval


def _brute_force(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (c correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_force(n, c, k), abs=1e-12)


def test_pass_at_1_is_accuracy_and_monotone_in_k():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    values = [pass_at_k(10, 3, k) for k in range(1, 11)]
    assert values == sorted(values) and values[-1] == 1.0
    assert pass_at_k(10, 0, 10) == 0.0


def test_pass_at_k_rejects_bad_k():
    with pytest.raises(ConfigError, match="k must be in 1..n_samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ConfigError, match="outside"):
        pass_at_k(4, 5, 1)


def test_summarize_eval_counts_failed_as_wrong():
    # prompt 1: 1 of 4 correct (one failed); prompt 2: all wrong but partial credit.
    out = summarize_eval([[1.0, 0.0, None, 0.2], [0.5, 0.5, 0.5, 0.5]], ks=(1, 2, 4))
    assert out["reward_mean"] == pytest.approx((1.2 + 2.0) / 8)
    assert out["accuracy"] == pytest.approx(1 / 8)
    assert out["pass@1"] == pytest.approx((0.25 + 0.0) / 2)
    assert out["pass@2"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["pass@4"] == pytest.approx(0.5)
    # a lower threshold turns partial credit into correct answers
    assert summarize_eval([[0.5, 0.4]], ks=(1,), threshold=0.5)["pass@1"] == 0.5
    assert summarize_eval([]) == {}
