"""Loss aggregation weights: hand-computed values and exact micro-batch / rank splits."""

from __future__ import annotations

import pytest
import torch

from rl_core.algorithms import compute_loss_weights, rollout_token_counts
from rl_core.errors import ConfigError, DataError

T = torch.tensor

# three sequences of 4, 3 and 5 tokens with 3, 2 and 3 masked tokens (8 in all)
MASK = T([0.0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1])
CU = T([0, 4, 7, 12])
IDS = ["a", "a", "b"]  # sequences 0 and 1 are fan-out siblings of rollout "a"


def _expect(per_seq: list[float]) -> torch.Tensor:
    lengths = (CU[1:] - CU[:-1]).tolist()
    return torch.repeat_interleave(T(per_seq), T(lengths)) * MASK


def test_token_mode() -> None:
    w = compute_loss_weights(MASK, CU, mode="token")
    torch.testing.assert_close(w, MASK / 8)
    assert w.dtype == torch.float32


def test_sequence_mode() -> None:
    # 1 / (M_i * N): 1/(3*3), 1/(2*3), 1/(3*3)
    w = compute_loss_weights(MASK, CU, mode="sequence")
    torch.testing.assert_close(w, _expect([1 / 9, 1 / 6, 1 / 9]))


def test_rollout_mode_counts_fan_out_siblings_once() -> None:
    # D_a = 3 + 2 = 5, D_b = 3, 2 rollouts: 1/(5*2) on both siblings of "a", 1/(3*2) on "b"
    w = compute_loss_weights(MASK, CU, mode="rollout", rollout_ids=IDS)
    torch.testing.assert_close(w, _expect([0.1, 0.1, 1 / 6]))
    # each rollout contributes total weight 1/num_rollouts
    assert float(w[:7].sum()) == pytest.approx(0.5)
    assert float(w[7:].sum()) == pytest.approx(0.5)
    # without fan-out, rollout mode equals sequence mode
    distinct = compute_loss_weights(MASK, CU, mode="rollout", rollout_ids=T([0, 1, 2]))
    torch.testing.assert_close(distinct, compute_loss_weights(MASK, CU, mode="sequence"))


def test_constant_mode() -> None:
    # Dr.GRPO: 1 / (constant * N) = 1 / (10 * 3)
    w = compute_loss_weights(MASK, CU, mode="constant", constant=10)
    torch.testing.assert_close(w, MASK / 30)


def test_sequence_without_masked_tokens_gets_zero_but_counts() -> None:
    mask, cu = T([0.0, 1, 1, 0, 0]), T([0, 3, 5])
    w = compute_loss_weights(mask, cu, mode="sequence")
    torch.testing.assert_close(w, T([0.0, 0.25, 0.25, 0.0, 0.0]))  # 1 / (2 * 2)
    assert torch.isfinite(compute_loss_weights(torch.zeros(3), T([0, 3]), mode="token")).all()


@pytest.mark.parametrize("mode", ["token", "sequence", "rollout", "constant"])
def test_rank_split_with_global_counts_equals_whole_batch(mode: str) -> None:
    """Weights computed per rank from step-wide counts sum to the same loss as the whole batch."""
    torch.manual_seed(0)
    x = torch.randn(12)
    kw = {"constant": 7.0} if mode == "constant" else {}
    whole = compute_loss_weights(MASK, CU, mode=mode, rollout_ids=IDS, **kw)
    counts = rollout_token_counts(MASK, CU, IDS)
    assert counts == {"a": 5.0, "b": 3.0}
    step = {
        "global_tokens": 8,
        "global_sequences": 3,
        "global_rollouts": 2,
        "rollout_tokens": counts,
        **kw,
    }
    # rank 0 gets sequence 0 (tokens 0..3); rank 1 gets sequences 1, 2 (tokens 4..11): the
    # siblings of rollout "a" sit on different ranks
    w0 = compute_loss_weights(MASK[:4], T([0, 4]), mode=mode, rollout_ids=IDS[:1], **step)
    w1 = compute_loss_weights(MASK[4:], T([0, 3, 8]), mode=mode, rollout_ids=IDS[1:], **step)
    torch.testing.assert_close(torch.cat([w0, w1]), whole)
    total = (x[:4] * w0).sum() + (x[4:] * w1).sum()
    torch.testing.assert_close(total, (x * whole).sum())
    # with only local counts, rank 0's token weights would be 1/3 instead of 1/8
    if mode == "token":
        local = compute_loss_weights(MASK[:4], T([0, 4]), mode=mode)
        assert not torch.allclose(local, w0)


def test_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"'mean'.*token, sequence, rollout, constant"):
        compute_loss_weights(MASK, CU, mode="mean")
    with pytest.raises(ConfigError, match="rollout_ids"):
        compute_loss_weights(MASK, CU, mode="rollout")
    with pytest.raises(ConfigError, match="constant"):
        compute_loss_weights(MASK, CU, mode="constant")
    with pytest.raises(DataError, match="rollout_ids"):
        compute_loss_weights(MASK, CU, mode="rollout", rollout_ids=["a"])
    with pytest.raises(DataError, match="cu_seqlens"):
        compute_loss_weights(MASK, T([0, 4, 11]), mode="token")
