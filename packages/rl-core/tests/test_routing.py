"""Routing payload: dtype, padding, mismatch, and its journey through Rollout, packing and serde."""

from __future__ import annotations

import io

import pytest
import torch

from rl_core.batching import pack_rollouts
from rl_core.routing import (
    RoutingShape,
    pad_routing,
    routing_bytes_per_token,
    routing_dtype,
    routing_mismatch,
)
from rl_core.serde import rollout_from_dict, rollout_to_dict
from rl_core.types import Rollout


def _rollout(sid: str, p: int, r: int, *, routing: bool = True, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    routed = torch.randint(0, 8, (p + r, 3, 2), generator=g).to(torch.uint8) if routing else None
    return Rollout(
        prompt_uid="u",
        rollout_id=sid,
        sample_id=sid,
        tokens=tuple(range(p + r)),
        response_start=p,
        loss_mask=(1,) * r,
        rollout_logprobs=(-0.5,) * r,
        versions=(0,) * r,
        routed_experts=routed,
    )


@pytest.mark.parametrize(
    ("experts", "dtype"),
    [
        (1, torch.uint8),
        (256, torch.uint8),
        (257, torch.int16),
        (32768, torch.int16),
        (40000, torch.int32),
    ],
)
def test_routing_dtype_is_the_smallest_that_holds_the_experts(experts, dtype):
    assert routing_dtype(experts) == dtype
    assert torch.iinfo(dtype).max >= experts - 1


def test_bytes_per_token():
    assert routing_bytes_per_token(RoutingShape(num_layers=48, top_k=8, num_experts=128)) == 384
    assert routing_bytes_per_token(RoutingShape(num_layers=2, top_k=2, num_experts=300)) == 8


def test_pad_repeats_the_last_row_and_cuts():
    x = torch.arange(12, dtype=torch.uint8).reshape(3, 2, 2)
    y = pad_routing(x, 5)
    assert y.shape == (5, 2, 2)
    assert torch.equal(y[3], x[2]) and torch.equal(y[4], x[2]) and torch.equal(y[:3], x)
    assert torch.equal(pad_routing(x, 2), x[:2])


def test_mismatch_ignores_topk_order_and_respects_mask():
    a = torch.tensor([[[0, 1]], [[2, 3]], [[4, 5]]])
    b = torch.tensor([[[1, 0]], [[2, 4]], [[4, 5]]])
    assert routing_mismatch(a, b) == pytest.approx(1 / 3)
    assert routing_mismatch(a, b, torch.tensor([1, 0, 1])) == 0.0
    assert routing_mismatch(a, b, torch.tensor([0, 1, 0])) == 1.0


def test_rollout_refuses_routing_of_the_wrong_length():
    good = _rollout("a", 3, 2)
    with pytest.raises(ValueError, match="covers 4 tokens but the sequence has 5"):
        Rollout(
            **{
                **{f: getattr(good, f) for f in good.__slots__},
                "routed_experts": good.routed_experts[:4],
            }
        )


def test_packing_concatenates_routing_and_micro_batches_cut_it():
    rs = [_rollout("a", 3, 2, seed=1), _rollout("b", 2, 4, seed=2)]
    batch = pack_rollouts(rs, micro_batch_bounds=(0, 1, 2))
    assert batch.routed_experts.shape == (11, 3, 2) and batch.routed_experts.dtype == torch.uint8
    mb = batch.micro_batches()
    assert torch.equal(mb[0].routed_experts, rs[0].routed_experts)
    assert torch.equal(mb[1].routed_experts, rs[1].routed_experts)


def test_packing_refuses_a_mix_with_and_without_routing():
    with pytest.raises(ValueError, match="has no routed_experts"):
        pack_rollouts([_rollout("a", 3, 2), _rollout("b", 2, 2, routing=False)])


def test_serde_keeps_the_compact_tensor_through_torch_save():
    r = _rollout("a", 3, 2)
    buf = io.BytesIO()
    torch.save(rollout_to_dict(r), buf)
    buf.seek(0)
    back = rollout_from_dict(torch.load(buf, weights_only=True))
    assert back.routed_experts.dtype == torch.uint8
    assert torch.equal(back.routed_experts, r.routed_experts)
