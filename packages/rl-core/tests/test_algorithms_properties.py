"""Invariants of advantages and aggregation on random uneven inputs (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.algorithms import (
    compute_loss_weights,
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
)
from rl_core.types import AdvantageInputs

FAST = settings(max_examples=25, deadline=None)


@st.composite
def grouped_rewards(draw: st.DrawFn) -> AdvantageInputs:
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=5))
    rewards = draw(
        st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=sum(sizes), max_size=sum(sizes))
    )
    group = [g for g, n in enumerate(sizes) for _ in range(n)]
    order = draw(st.permutations(range(len(group))))
    return AdvantageInputs(
        rewards=torch.tensor([rewards[i] for i in order]),
        group_index=torch.tensor([group[i] for i in order]),
        response_mask=[torch.ones(1 + i % 3) for i in range(len(group))],
    )


@FAST
@given(grouped_rewards())
def test_grpo_is_zero_mean_unit_std_per_group(inputs: AdvantageInputs) -> None:
    adv_N = torch.stack([a[0] for a in grpo_advantages(inputs, eps=0.0)]).double()
    for g in inputs.group_index.unique():
        sel = inputs.group_index == g
        r, a = inputs.rewards[sel].double(), adv_N[sel]
        assert float(a.sum()) == pytest.approx(0.0, abs=1e-5)
        if sel.sum() > 1 and float(r.std()) > 0:
            assert float(a.std()) == pytest.approx(1.0, abs=1e-5)
        else:
            assert torch.all(a == 0)


@FAST
@given(grouped_rewards())
def test_rloo_is_scaled_dr_grpo(inputs: AdvantageInputs) -> None:
    counts = torch.bincount(inputs.group_index)[inputs.group_index].double()
    scale = torch.where(counts > 1, counts / (counts - 1).clamp_min(1), 0.0)
    dr = torch.stack([a[0] for a in dr_grpo_advantages(inputs)]).double()
    rloo = torch.stack([a[0] for a in rloo_advantages(inputs)]).double()
    torch.testing.assert_close(rloo, scale * dr, atol=1e-5, rtol=0)


@FAST
@given(
    st.lists(st.lists(st.booleans(), min_size=1, max_size=6), min_size=1, max_size=6),
    st.data(),
)
def test_weights_sum_to_the_share_of_trainable_units(masks: list[list[bool]], data) -> None:
    mask_T = torch.tensor([float(b) for m in masks for b in m])
    cu = torch.tensor([0] + [len(m) for m in masks]).cumsum(0)
    ids = data.draw(st.lists(st.integers(0, 3), min_size=len(masks), max_size=len(masks)))
    has = [any(m) for m in masks]
    token = compute_loss_weights(mask_T, cu, mode="token")
    assert float(token.sum()) == pytest.approx(1.0 if any(has) else 0.0, abs=1e-6)
    seq = compute_loss_weights(mask_T, cu, mode="sequence")
    assert float(seq.sum()) == pytest.approx(sum(has) / len(masks), abs=1e-6)
    roll = compute_loss_weights(mask_T, cu, mode="rollout", rollout_ids=ids)
    trainable = {i for i, h in zip(ids, has) if h}
    assert float(roll.sum()) == pytest.approx(len(trainable) / len(set(ids)), abs=1e-6)
    assert torch.all(roll[mask_T == 0] == 0)
