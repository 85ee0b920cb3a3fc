"""Turning prompts into groups (:mod:`rl_buffer.rollout`): stable per-sample seeds; a
``generate_fn`` that returns the wrong kind of value fails its prompt's rollouts, counted with the
cause (or raised without stats)."""

from __future__ import annotations

import asyncio

import pytest

from rl_buffer.failures import RolloutStats
from rl_buffer.rollout import derive_seed, generate_groups
from rl_core.errors import RLError
from rl_core.types import SamplingParams


def test_seeds_are_stable_and_distinct():
    assert derive_seed(1, "rl", 3, 0, 1) == derive_seed(1, "rl", 3, 0, 1)
    seeds = {derive_seed(1, "rl", 3, i, j) for i in range(20) for j in range(8)}
    assert len(seeds) == 160 and all(0 <= s < 2**31 for s in seeds)


def test_generate_fn_returning_the_wrong_type(text_group, char_tokenizer):
    prompts = [text_group(f"p{i}", ["a"]).prompt for i in range(2)]

    async def rollout_fn(prompt, ctx):
        return {"tokens": [1, 2]}

    def run(stats):
        return asyncio.run(
            generate_groups(
                prompts,
                generator=None,
                tokenizer=char_tokenizer,
                sampling=SamplingParams(),
                n_samples=3,
                seed_parts=(0,),
                policy_version=0,
                generate_fn=rollout_fn,
                stats=stats,
            )
        )

    stats = RolloutStats()
    groups = run(stats)
    assert [len(g.rollouts) for g in groups] == [0, 0]
    assert (stats.rollouts, stats.failed) == (6, {"rollout_fn_invalid": 6})
    assert "a GenerateFn returns a list of Rollout" in stats.first["rollout_fn_invalid"].error
    with pytest.raises(RLError, match=r"^rollout.generate_fn: returned dict"):
        run(None)  # no stats to count in: the cause is raised
