"""Advantage estimators against hand-computed examples (uneven groups, masks with holes)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    GAE,
    GRPO,
    RLOO,
    DrGRPO,
    ReinforcePP,
    ReinforcePPBaseline,
    compute_gae,
    grpo_advantages,
    masked_whiten,
)
from rl_core.algorithms._segments import discounted_cumsum
from rl_core.errors import ConfigError, DataError, RLError
from rl_core.interfaces import AdvantageFn
from rl_core.types import AdvantageInputs

T = torch.tensor


def _close(got: list[torch.Tensor], want: list[list[float]], atol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, T(w, dtype=torch.float32), atol=atol, rtol=0)


# Rewards [1, 0, 0 | 1, 0] in groups [0, 0, 0 | 1, 1] (uneven: 3 and 2); masks of different
# lengths with holes (tool tokens) so broadcasting and "0 off the mask" are both exercised.
MASKS = [T([0.0, 1, 1]), T([1.0, 1]), T([1.0, 0, 1]), T([1.0]), T([1.0, 1, 0])]
UNEVEN = AdvantageInputs(
    rewards=T([1.0, 0, 0, 1, 0]), group_index=T([0, 0, 0, 1, 1]), response_mask=MASKS
)


def _spread(per_rollout: list[float]) -> list[list[float]]:
    """Scalar advantage of each rollout placed on its mask."""
    return [(m * a).tolist() for m, a in zip(MASKS, per_rollout)]


def test_grpo_unbiased_std_on_uneven_groups() -> None:
    # group 0: mean 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std 0.577350
    #   A = (2/3)/0.577350 = 1.154701, -(1/3)/0.577350 = -0.577350
    # group 1: mean 0.5, unbiased var (0.25 + 0.25) / 1 = 0.5, std 0.707107 -> A = +-0.707107
    got = GRPO()(UNEVEN)
    _close(got, _spread([1.154701, -0.577350, -0.577350, 0.707107, -0.707107]))


def test_grpo_population_std() -> None:
    # group 0 population std sqrt(2/9) = 0.471405 -> 1.414214, -0.707107; group 1 std 0.5 -> +-1
    got = GRPO(GRPO.Config(std_unbiased=False))(UNEVEN)
    _close(got, _spread([1.414214, -0.707107, -0.707107, 1.0, -1.0]))


def test_grpo_equal_rewards_and_singleton_group_give_zero_not_nan() -> None:
    inputs = AdvantageInputs(
        rewards=T([1.0, 1.0, 3.0]),
        group_index=T([4, 4, 7]),  # ids need not be contiguous
        response_mask=[T([1.0, 1]), T([1.0]), T([1.0, 1, 1])],
    )
    for fn in (GRPO(), GRPO(GRPO.Config(std_unbiased=False)), DrGRPO(), RLOO()):
        got = fn(inputs)
        _close(got, [[0.0, 0.0], [0.0], [0.0, 0.0, 0.0]])


def test_dr_grpo_subtracts_group_mean_only() -> None:
    _close(DrGRPO()(UNEVEN), _spread([2 / 3, -1 / 3, -1 / 3, 0.5, -0.5]))


def test_rloo_leave_one_out_mean() -> None:
    # r0 = 1, others {0, 0} -> 1; r1 = 0, others {1, 0} -> -0.5; r2 likewise -0.5
    # group 1: 1 - 0 = 1; 0 - 1 = -1
    _close(RLOO()(UNEVEN), _spread([1.0, -0.5, -0.5, 1.0, -1.0]))


def test_group_order_does_not_matter() -> None:
    # the same rollouts interleaved across groups give the same per-rollout advantages
    perm = [3, 0, 4, 1, 2]
    shuffled = AdvantageInputs(
        rewards=UNEVEN.rewards[perm],
        group_index=UNEVEN.group_index[perm],
        response_mask=[MASKS[i] for i in perm],
    )
    base = grpo_advantages(UNEVEN)
    for j, i in enumerate(perm):
        torch.testing.assert_close(grpo_advantages(shuffled)[j], base[i])


def test_reinforce_pp_discounted_kl_return_skips_tool_tokens() -> None:
    # rollout 0: mask [1, 0, 1, 1] (index 1 is a tool token), KL [0.1, 5.0, 0.2, 0.3], r = 1
    # kl_coef 0.5, gamma 0.5. Token rewards on the masked steps: [-0.05, -0.10, -0.15 + 1 = 0.85]
    # returns: G2 = 0.85, G1 = -0.10 + 0.5 * 0.85 = 0.325, G0 = -0.05 + 0.5 * 0.325 = 0.1125
    # rollout 1: mask [1, 1], KL 0, r = 0 -> [0, 0]
    inputs = AdvantageInputs(
        rewards=T([1.0, 0.0]),
        group_index=T([0, 0]),
        response_mask=[T([1.0, 0, 1, 1]), T([1.0, 1])],
        kl=[T([0.1, 5.0, 0.2, 0.3]), T([0.0, 0.0])],
    )
    raw = ReinforcePP(ReinforcePP.Config(gamma=0.5, kl_coef=0.5, whiten=False))(inputs)
    _close(raw, [[0.1125, 0.0, 0.325, 0.85], [0.0, 0.0]])
    # whitened over the 5 masked tokens [0.1125, 0.325, 0.85, 0, 0]: mean 0.2575, var 0.10185
    white = ReinforcePP(ReinforcePP.Config(gamma=0.5, kl_coef=0.5))(inputs)
    _close(white, [[-0.45435, 0.0, 0.21151, 1.85655], [-0.80686, -0.80686]])


def test_reinforce_pp_baseline() -> None:
    # group 0 = rollouts 0, 1 (mean 0.5); group 1 = rollout 2 alone (mean 1); kl_coef 0.5
    # A0 = 0.5 - 0.5 [0.2, 0.4] = [0.4, 0.3]; A1 = -0.5 - 0.5 * 0.6 = -0.8, then masked 0; A2 = 0
    inputs = AdvantageInputs(
        rewards=T([1.0, 0.0, 1.0]),
        group_index=T([0, 0, 1]),
        response_mask=[T([1.0, 1]), T([1.0, 0]), T([1.0])],
        kl=[T([0.2, 0.4]), T([0.6, 9.0]), T([0.0])],
    )
    raw = ReinforcePPBaseline(ReinforcePPBaseline.Config(kl_coef=0.5, whiten=False))(inputs)
    _close(raw, [[0.4, 0.3], [-0.8, 0.0], [0.0]])
    # whitened over [0.4, 0.3, -0.8, 0]: mean -0.025, var 0.221875
    white = ReinforcePPBaseline(ReinforcePPBaseline.Config(kl_coef=0.5))(inputs)
    _close(white, [[0.90227, 0.68997], [-1.64531, 0.0], [0.05307]])


def test_kl_estimators_without_kl_input_raise_config_error() -> None:
    inputs = AdvantageInputs(rewards=T([1.0]), group_index=T([0]), response_mask=[T([1.0])])
    for fn in (
        ReinforcePP(ReinforcePP.Config(kl_coef=0.1)),
        ReinforcePPBaseline(ReinforcePPBaseline.Config(kl_coef=0.1)),
    ):
        with pytest.raises(ConfigError, match=r"kl_coef.*AdvantageInputs\.kl"):
            fn(inputs)


def test_gae_hand_computed() -> None:
    # mask [1, 0, 1, 1], V [0.5, 9 (tool token, ignored), 0.4, 0.2], r = 1, gamma 0.9, lam 0.8
    # masked steps: rewards [0, 0, 1], V [0.5, 0.4, 0.2], V_next [0.4, 0.2, 0]
    # delta = [0.9*0.4 - 0.5, 0.9*0.2 - 0.4, 1 - 0.2] = [-0.14, -0.22, 0.8]
    # A2 = 0.8; A1 = -0.22 + 0.72 * 0.8 = 0.356; A0 = -0.14 + 0.72 * 0.356 = 0.11632
    # returns = A + V = [0.61632, 0.756, 1.0]
    inputs = AdvantageInputs(
        rewards=T([1.0]),
        group_index=T([0]),
        response_mask=[T([1.0, 0, 1, 1])],
        values=[T([0.5, 9.0, 0.4, 0.2])],
    )
    adv, ret = compute_gae(inputs, gamma=0.9, lam=0.8)
    _close(adv, [[0.11632, 0.0, 0.356, 0.8]])
    _close(ret, [[0.61632, 0.0, 0.756, 1.0]])
    # gamma = lam = 1: A_t = (reward to go) - V_t = 1 - V_t
    adv1 = GAE(GAE.Config(gamma=1.0, lam=1.0))(inputs)
    _close(adv1, [[0.5, 0.0, 0.6, 0.8]])


def test_gae_with_kl_reward() -> None:
    # two masked tokens, V = 0, KL [1, 2], kl_coef 0.1, r = 1, gamma = lam = 1
    # token rewards [-0.1, -0.2 + 1] -> A = [0.7, 0.8]
    inputs = AdvantageInputs(
        rewards=T([1.0]),
        group_index=T([0]),
        response_mask=[T([1.0, 1])],
        values=[T([0.0, 0.0])],
        kl=[T([1.0, 2.0])],
    )
    _close(GAE(GAE.Config(kl_coef=0.1))(inputs), [[0.7, 0.8]])


def test_gae_requires_values() -> None:
    inputs = AdvantageInputs(rewards=T([1.0]), group_index=T([0]), response_mask=[T([1.0])])
    with pytest.raises(ConfigError, match="values"):
        GAE()(inputs)


def test_discounted_cumsum_matches_loop_across_chunks() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 300, dtype=torch.float64)
    got = discounted_cumsum(x, 0.97, chunk=128)
    want = torch.zeros_like(x)
    acc = torch.zeros(3, dtype=torch.float64)
    for t in range(299, -1, -1):
        acc = x[:, t] + 0.97 * acc
        want[:, t] = acc
    torch.testing.assert_close(got, want)


def test_masked_whiten() -> None:
    x, m = T([1.0, 2.0, 3.0, 100.0]), T([1.0, 1, 1, 0])
    # mean 2, population var 2/3, std 0.816497
    torch.testing.assert_close(masked_whiten(x, m), T([-1.224745, 0.0, 1.224745, 0.0]))
    torch.testing.assert_close(
        masked_whiten(x, m, shift_mean=False), T([1.224745, 2.449490, 3.674235, 0.0])
    )
    torch.testing.assert_close(masked_whiten(x, torch.zeros(4)), torch.zeros(4))


def test_bad_inputs_raise_data_errors() -> None:
    with pytest.raises(DataError, match=r"rewards\[1\]"):
        GRPO()(AdvantageInputs(rewards=T([1.0, math.nan]), group_index=T([0, 0]),
                               response_mask=[T([1.0]), T([1.0])]))  # fmt: skip
    with pytest.raises(DataError, match="response_mask"):
        GRPO()(AdvantageInputs(rewards=T([1.0, 0.0]), group_index=T([0, 0]),
                               response_mask=[T([1.0])]))  # fmt: skip
    with pytest.raises(RLError, match="group_index"):
        GRPO()(AdvantageInputs(rewards=T([1.0]), group_index=T([0, 1]), response_mask=[T([1.0])]))


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match=r"ReinforcePP\.Config\.gamma"):
        ReinforcePP.Config(gamma=1.5)
    with pytest.raises(ConfigError, match=r"GAE\.Config\.lam"):
        GAE.Config(lam=-0.1)


def test_registry_classes_satisfy_the_protocol() -> None:
    assert set(ADVANTAGE_ESTIMATORS) >= {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
    }
    for cls in ADVANTAGE_ESTIMATORS.values():
        fn = cls(cls.Config())
        assert isinstance(fn, AdvantageFn)
        assert not hasattr(cls.Config(), "__dict__")  # slots=True
