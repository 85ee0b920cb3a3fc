"""The trainer's micro-batch plan (``rl_trainer.step.packing.plan``): a policy that computes a shared
prompt once gets each GRPO group's samples in one micro-batch where the cap allows."""

from __future__ import annotations

from rl_core.testing.buffer import make_group
from rl_core.types import ModelShape
from rl_trainer.step import packing

SHAPE = ModelShape(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn_hidden_size=128,
    vocab_size=100,
)


class _Policy:
    model_shape = SHAPE

    def __init__(self, shares: bool) -> None:
        self.shares_prefixes = shares


def _spread(rollouts, order, bounds) -> dict[str, int]:
    """Micro-batches each group's samples landed in."""
    seen: dict[str, set[int]] = {}
    for m in range(len(bounds) - 1):
        for i in order[bounds[m] : bounds[m + 1]]:
            seen.setdefault(rollouts[i].prompt_uid, set()).add(m)
    return {uid: len(ms) for uid, ms in seen.items()}


def test_a_prefix_sharing_policy_gets_each_group_in_one_micro_batch():
    # 6 groups of 4 samples, 3-token prompts, 5..10 response tokens: 32..52 tokens a group.
    groups = [make_group(f"p{g}", n=4, response_length=5 + g) for g in range(6)]
    rollouts = [r for g in groups for r in g.rollouts]
    cap = 64
    order, bounds, _ = packing.plan(rollouts, _Policy(shares=True), cap)
    assert sorted(order) == list(range(len(rollouts)))
    assert set(_spread(rollouts, order, bounds).values()) == {1}
    for m in range(len(bounds) - 1):
        assert sum(len(rollouts[i].tokens) for i in order[bounds[m] : bounds[m + 1]]) <= cap
    # token balance alone spreads groups over micro-batches (and shares less)
    order, bounds, _ = packing.plan(rollouts, _Policy(shares=False), cap)
    assert max(_spread(rollouts, order, bounds).values()) > 1
