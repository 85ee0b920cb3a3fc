"""Packing rollouts into TrainBatch and splitting it into micro-batches."""

from __future__ import annotations

import pytest
import torch

from rl_core.batching import pack_rollouts, plan_micro_batches
from rl_core.types import Rollout, RolloutStatus


def _rollout(sid: str, prompt: list[int], resp: list[int], version: int = 0, mask=None) -> Rollout:
    r = len(resp)
    return Rollout(
        prompt_uid="p",
        rollout_id=sid,
        sample_id=sid,
        tokens=tuple(prompt + resp),
        response_start=len(prompt),
        loss_mask=tuple(mask or [1] * r),
        rollout_logprobs=tuple(-0.5 for _ in range(r)),
        versions=(version,) * r,
    )


def test_pack_layout():
    a = _rollout("a", [1, 2, 3], [4, 5])
    b = _rollout("b", [6], [7, 8, 9], version=2, mask=[1, 0, 1])
    batch = pack_rollouts([a, b], advantages=[[1.0, 1.0], [2.0, 2.0, 2.0]])
    assert batch.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert batch.cu_seqlens.tolist() == [0, 5, 9]
    assert batch.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 0, 1]
    assert batch.advantages.tolist() == [0, 0, 0, 1, 1, 0, 2, 0, 2]
    assert batch.versions.tolist() == [-1, -1, -1, 0, 0, -1, 2, 2, 2]
    assert batch.rollout_logprobs.tolist() == [0, 0, 0, -0.5, -0.5, 0, -0.5, -0.5, -0.5]
    # default weights: token mean over the mask
    assert torch.allclose(batch.loss_weights.sum(), torch.tensor(1.0))
    assert batch.loss_weights.tolist()[3] == pytest.approx(0.25)
    assert batch.position_ids().tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]


def test_first_token_never_trained_and_version_mask():
    a = _rollout("a", [], [4, 5, 6], version=1)  # empty prompt: first token has no log-prob
    b = _rollout("b", [1], [2, 3], version=3)
    batch = pack_rollouts([a, b], mask_versions_below=2)
    assert batch.loss_mask.tolist() == [0, 0, 0, 0, 1, 1]


def test_micro_batches_roundtrip():
    rs = [_rollout(str(i), [1] * (i + 1), [2] * 3) for i in range(5)]
    bounds = plan_micro_batches([len(r.tokens) for r in rs], max_tokens=9)
    assert bounds == (0, 2, 3, 4, 5)
    batch = pack_rollouts(rs, micro_batch_bounds=bounds)
    mbs = batch.micro_batches()
    assert [m.num_sequences for m in mbs] == [2, 1, 1, 1]
    assert torch.equal(torch.cat([m.tokens for m in mbs]), batch.tokens)
    assert torch.equal(torch.cat([m.loss_weights for m in mbs]), batch.loss_weights)
    assert all(int(m.cu_seqlens[0]) == 0 and int(m.cu_seqlens[-1]) == m.num_tokens for m in mbs)
    assert tuple(s for m in mbs for s in m.sample_ids) == batch.sample_ids


def test_over_cap_sequence_gets_its_own_micro_batch():
    assert plan_micro_batches([3, 20, 3], max_tokens=8) == (0, 1, 2, 3)


def test_rollout_validation():
    with pytest.raises(ValueError, match="loss_mask has 1 entries but the response has 2"):
        Rollout(
            prompt_uid="p",
            rollout_id="r",
            sample_id="s",
            tokens=(1, 2, 3),
            response_start=1,
            loss_mask=(1,),
            rollout_logprobs=(0.0, 0.0),
            versions=(0, 0),
        )
    assert RolloutStatus.TRUNCATED.is_trainable() and not RolloutStatus.ABORTED.is_trainable()


def test_data_parallel_shards_cover_the_batch_with_their_own_micro_batches():
    import dataclasses

    from rl_core.testing.policy import random_batch

    batch = random_batch(50, [3, 4, 2, 5, 6], seed=0, micro_batch_bounds=(0, 2, 3, 5))
    batch = dataclasses.replace(batch, dp_bounds=(0, 3, 5))
    assert batch.num_shards == 2
    first, second = batch.shard(0), batch.shard(1)
    assert first.micro_batch_bounds == (0, 2, 3) and second.micro_batch_bounds == (0, 2)
    assert first.num_sequences == 3 and second.num_sequences == 2
    assert torch.equal(torch.cat([first.tokens, second.tokens]), batch.tokens)
    # the step's loss weights are kept, so the shards' weights sum to the whole batch's
    total = first.loss_weights.sum() + second.loss_weights.sum()
    assert torch.isclose(total, batch.loss_weights.sum())
    assert [m.num_tokens for m in first.micro_batches()] == [7, 2]
    assert dataclasses.replace(batch, dp_bounds=()).shard(0) is not None
    with pytest.raises(ValueError, match="dp_bounds"):
        dataclasses.replace(batch, dp_bounds=(0, 4, 5))  # 4 is not a micro-batch bound
    with pytest.raises(IndexError):
        dataclasses.replace(batch, dp_bounds=()).shard(1)


def test_rollout_adapters_follow_their_sequences() -> None:
    """Multi-LoRA: a rollout's ``metadata["lora_adapter"]`` becomes its ``TrainBatch.adapters``
    entry and stays with it through micro-batches and data-parallel shards."""
    from rl_core.lora import SEQUENCE_ADAPTER_KEY

    rs = [_rollout(f"s{i}", [1, 2], [3, 4]) for i in range(4)]
    for r, a in zip(rs, ["a", None, "b", "a"], strict=True):
        if a is not None:
            r.metadata[SEQUENCE_ADAPTER_KEY] = a
    batch = pack_rollouts(rs, micro_batch_bounds=(0, 1, 2, 4))
    batch.dp_bounds = (0, 2, 4)
    assert batch.adapters == ("a", None, "b", "a")
    assert [mb.adapters for mb in batch.micro_batches()] == [("a",), (None,), ("b", "a")]
    assert batch.shard(1).adapters == ("b", "a")
    assert pack_rollouts(rs[1:2]).adapters == ()  # untagged: the default for every sequence


def test_scatter_response_matches_the_per_rollout_layout():
    """The vectorised scatter equals zeros at the prompt then the values, rollout by rollout,
    for sequences, tensors (any dtype) and a mix, bitwise; a wrong length names the rollout."""
    from rl_core.batching import scatter_response

    g = torch.Generator().manual_seed(0)
    rs = [
        _rollout(f"r{i}", [1] * int(p), [2] * int(n))
        for i, (p, n) in enumerate(torch.randint(0, 6, (12, 2), generator=g).tolist())
    ]
    vals = [torch.randn(r.response_length, generator=g, dtype=torch.float64) for r in rs]
    want = torch.cat(
        [torch.cat([torch.zeros(r.response_start), v.float()]) for r, v in zip(rs, vals)]
    )
    assert torch.equal(scatter_response(rs, vals), want)
    assert torch.equal(scatter_response(rs, [v.tolist() for v in vals]), want)
    mixed = [v if i % 2 else v.tolist() for i, v in enumerate(vals)]
    assert torch.equal(scatter_response(rs, mixed), want)
    assert scatter_response([], []).shape == (0,)
    bad = [*vals[:-1], [*vals[-1].tolist(), 1.0]]
    with pytest.raises(ValueError, match="r11"):
        scatter_response(rs, bad)
