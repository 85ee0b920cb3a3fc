"""TrajectoryBuilder keeps the engine's expert routing over multi-turn trajectories."""

from __future__ import annotations

import pytest
import torch

from rl_agents.trajectory import TrajectoryBuilder
from rl_core.errors import DataError
from rl_core.types import FinishReason, GenerationResult


def _result(rid: str, out: tuple[int, ...], routed: torch.Tensor | None) -> GenerationResult:
    return GenerationResult(
        request_id=rid,
        output_ids=out,
        output_logprobs=(-0.1,) * len(out),
        finish_reason=FinishReason.STOP,
        weight_version=0,
        routed_experts=routed,
    )


def _rows(n: int, fill: int) -> torch.Tensor:
    """``n`` routing rows ``[n, 2 layers, top-2]``; row ``i`` holds ``fill * 10 + i`` (mod 256)."""
    base = (torch.arange(n) + fill * 10) % 256
    return base.to(torch.uint8)[:, None, None].expand(n, 2, 2).contiguous()


def test_each_token_keeps_the_rows_of_the_first_pass_that_ran_it() -> None:
    traj = TrajectoryBuilder((1, 2, 3))
    # Turn 1: input 3 prompt tokens, output 2; the last output token was never run.
    turn1 = _rows(5, 1)
    traj.append_model(_result("t1", (4, 5), turn1))
    traj.append_tokens((6, 7))  # tool tokens
    # Turn 2: the engine re-runs the whole trajectory (7 tokens) and samples 2 more.
    turn2 = _rows(9, 2)
    traj.append_model(_result("t2", (8, 9), turn2))
    traj.append_tokens((10,))  # tool tokens after the last turn: never run
    r = traj.to_rollout("p", "p/0")
    routed = r.routed_experts
    assert routed is not None and routed.shape == (10, 2, 2)
    # Rows 0..3 from turn 1 (the tokens it ran), 4..8 from turn 2 (token 4 was turn 1's last
    # sampled token, first run by turn 2), row 9 (the trailing tool token) repeats row 8.
    assert torch.equal(routed[:4], turn1[:4])
    assert torch.equal(routed[4:9], turn2[4:9])
    assert torch.equal(routed[9], routed[8])


def test_routing_must_cover_the_request_and_every_turn() -> None:
    traj = TrajectoryBuilder((1, 2, 3))
    with pytest.raises(DataError, match="expected 5 rows"):
        traj.append_model(_result("t1", (4, 5), _rows(4, 1)))
    traj.append_model(_result("t1", (4, 5), _rows(5, 1)))
    with pytest.raises(DataError, match="did not"):
        traj.append_model(_result("t2", (6,), None))
    plain = TrajectoryBuilder((1, 2, 3))
    plain.append_model(_result("t1", (4,), None))
    with pytest.raises(DataError, match="earlier one did not"):
        plain.append_model(_result("t2", (5,), _rows(5, 2)))
    assert plain.to_rollout("p", "p/0").routed_experts is None
