"""GroupBuffer's routing budget (``max_routing_bytes``) and routing kept through its state."""

from __future__ import annotations

import pytest
import torch

from rl_buffer import GroupBuffer
from rl_core.errors import ConfigError
from rl_core.types import Group, Prompt, Rollout, RolloutStatus


def _group(uid: str, n_tokens: int = 10, *, routed: bool = True, aborted: bool = False) -> Group:
    p = Prompt(uid=uid, input="x", token_ids=(1, 2))
    r = n_tokens - 2
    rollout = Rollout(
        prompt_uid=uid,
        rollout_id=f"{uid}/0",
        sample_id=f"{uid}/0",
        tokens=tuple(range(n_tokens)),
        response_start=2,
        loss_mask=(1,) * r,
        rollout_logprobs=(-0.5,) * r,
        versions=(0,) * r,
        status=RolloutStatus.ABORTED if aborted else RolloutStatus.COMPLETED,
        # 2 layers x top-2, uint8: 4 bytes per token
        routed_experts=torch.ones(n_tokens, 2, 2, dtype=torch.uint8) if routed else None,
    )
    return Group(prompt=p, rollouts=[rollout])


def test_over_budget_put_is_refused_and_nothing_is_stored() -> None:
    buf = GroupBuffer(GroupBuffer.Config(max_routing_bytes=100))
    buf.put([_group("a")])  # 40 bytes
    buf.put_partial([_group("b", aborted=True)])  # 80 bytes held
    assert buf.routing_bytes() == 80
    with pytest.raises(ConfigError, match=r"buffer.max_routing_bytes.*120 bytes.*budget of 100"):
        buf.put([_group("c")])
    assert len(buf) == 1 and buf.routing_bytes() == 80
    with pytest.raises(ConfigError, match="rollout.routing_replay: off"):
        buf.put_partial([_group("d", aborted=True)])
    assert buf.num_partial == 1
    # Taking frees the budget; rollouts without routing never count.
    buf.take(1)
    buf.put([_group("c"), _group("e", 1000, routed=False)])
    assert buf.routing_bytes() == 80
    assert buf.stats()["buffer/routing_bytes"] == 80.0


def test_no_budget_holds_anything() -> None:
    buf = GroupBuffer()
    buf.put([_group(str(i), 100) for i in range(10)])
    assert buf.routing_bytes() == 10 * 400


def test_budget_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="buffer.max_routing_bytes"):
        GroupBuffer.Config(max_routing_bytes=0)


def test_state_dict_keeps_the_routing_tensors() -> None:
    buf = GroupBuffer(GroupBuffer.Config(max_routing_bytes=1000))
    buf.put([_group("a")])
    buf.put_partial([_group("b", aborted=True)])
    other = GroupBuffer(GroupBuffer.Config(max_routing_bytes=1000))
    other.load_state_dict(buf.state_dict())
    (g,) = other.take(1)
    got = g.rollouts[0].routed_experts
    assert got is not None and got.dtype == torch.uint8 and got.shape == (10, 2, 2)
    assert other.routing_bytes() == 40
