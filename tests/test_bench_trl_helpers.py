"""The pure helpers of the TRL side of the benchmarks (benchmarks/_e2e_worker.py): the reward
wrapper counts samples and response tokens as our trainer does, and every loss averaging our
trainer offers that TRL has is mapped to the TRL loss with the same averaging."""

from __future__ import annotations

import typing
from pathlib import Path

from rl_core.testing.modules import load_module
from rl_trainer.config import AlgorithmConfig

worker = load_module(
    "_e2e_worker", Path(__file__).resolve().parents[1] / "benchmarks" / "_e2e_worker.py"
)


def test_counting_reward_counts_tokens_to_the_stop_token_and_logs_the_mean() -> None:
    counts: dict = {}
    fn = worker.counting_reward(lambda c, lab: float(c == lab), 2, counts)
    out = fn(["p", "p"], ["a", "b"], [[5, 6, 2, 0], [5, 6, 7]], label=["a", "a"])
    assert out == [1.0, 0.0]
    assert counts["samples"] == 2 and counts["response_tokens"] == 3 + 3
    fn(["p"], ["a"], [[2]], label=["a"])
    assert counts["samples"] == 3 and counts["response_tokens"] == 7
    assert counts["reward_per_call"] == [0.5, 1.0]


def test_loss_type_map_covers_our_aggregations_but_rollout() -> None:
    hints = typing.get_type_hints(AlgorithmConfig)
    ours = set(typing.get_args(hints["aggregation"]))
    assert set(worker.TRL_LOSS_TYPES) == ours - {"rollout"}
