"""Partial rollouts keep their expert routing across resumes."""

from __future__ import annotations

import pytest
import torch

from rl_buffer.partial import continue_rollout
from rl_core.types import FinishReason, GenerationResult, Rollout


def _rollout(sid: str, p: int, r: int) -> Rollout:
    routed = torch.randint(0, 8, (p + r, 3, 2), generator=torch.Generator().manual_seed(0)).to(
        torch.uint8
    )
    return Rollout(
        prompt_uid="u",
        rollout_id=sid,
        sample_id=sid,
        tokens=tuple(range(p + r)),
        response_start=p,
        loss_mask=(1,) * r,
        rollout_logprobs=(-0.5,) * r,
        versions=(0,) * r,
        status="aborted",
        routed_experts=routed,
    )


def test_a_resume_aborted_before_it_ran_keeps_the_old_routing():
    r = _rollout("a", 3, 2)
    empty = GenerationResult(
        request_id="a",
        output_ids=(),
        output_logprobs=(),
        finish_reason=FinishReason.ABORT,
        weight_version=1,
    )
    out = continue_rollout(r, empty)
    assert torch.equal(out.routed_experts, r.routed_experts)
    with pytest.raises(ValueError, match="returned none"):
        continue_rollout(
            r,
            GenerationResult(
                request_id="a",
                output_ids=(7,),
                output_logprobs=(-1.0,),
                finish_reason=FinishReason.STOP,
                weight_version=1,
            ),
        )
