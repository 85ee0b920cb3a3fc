"""DAPO's soft overlong penalty: hand-computed values at and around the band."""

from __future__ import annotations

import pytest

from rl_core.errors import ConfigError
from rl_core.rewards import OverlongPenalty, overlong_penalty
from rl_core.types import Rollout


@pytest.mark.parametrize(
    ("length", "want"),
    # L_max = 20, L_cache = 4: free up to 16, then (16 - |y|) / 4, then -1
    [(0, 0.0), (15, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0), (21, -1.0)],
)
def test_overlong_penalty_values(length: int, want: float) -> None:
    assert overlong_penalty(length, max_length=20, band=4) == pytest.approx(want)


def _rollout(response_len: int, reward: float | None) -> Rollout:
    return Rollout(
        prompt_uid="p",
        rollout_id=f"r{response_len}",
        sample_id=f"s{response_len}",
        tokens=(1, 2) + (3,) * response_len,
        response_start=2,
        loss_mask=(1,) * response_len,
        rollout_logprobs=(0.0,) * response_len,
        versions=(0,) * response_len,
        reward=reward,
        reward_info={} if reward is None else {"reward": reward},
    )


def test_apply_shapes_scored_rollouts_only() -> None:
    # max_length from the sampling limit (12), band 4, coef 0.5: lengths 8, 10, 12 -> 0, -0.25, -0.5
    shaping = OverlongPenalty(OverlongPenalty.Config(band=4, coef=0.5), max_length=12)
    rs = [_rollout(8, 1.0), _rollout(10, 1.0), _rollout(12, 0.0), _rollout(12, None)]
    shaping.apply(rs)
    assert [r.reward for r in rs] == [1.0, 0.75, -0.5, None]
    assert [r.reward_info.get("overlong_penalty") for r in rs] == [0.0, -0.25, -0.5, None]
    assert rs[1].reward_info["reward"] == 1.0  # the unshaped component stays


def test_overlong_penalty_errors() -> None:
    with pytest.raises(ConfigError, match="band: 8 exceeds max_length 4"):
        OverlongPenalty.Config(max_length=4, band=8)
    with pytest.raises(ConfigError, match="max_length: not set"):
        OverlongPenalty(OverlongPenalty.Config(band=2))
    with pytest.raises(ConfigError, match="exceeds the maximum length 3"):
        OverlongPenalty(OverlongPenalty.Config(band=4), max_length=3)
    with pytest.raises(ConfigError, match="0 < band <= max_length"):
        overlong_penalty(3, max_length=2, band=4)
