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


def test_prompts_to_scored_groups_as_the_readme_shows():
    """The README's round with a real (bigram) generator: n_samples rollouts per prompt, each
    scored, the same tokens when the round is run again (derived seeds), and a reward that
    fails on some rollouts counted, not raised."""
    from rl_buffer import RewardStdFilter, Scorer, filter_groups
    from rl_core.testing.fake_generator import FakeGenerator
    from rl_core.types import Prompt

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    def reward(prompt, text, rollout):
        if rollout.sample_id.endswith("/0"):
            raise ValueError("judge offline")
        return float(len(text.split()) % 2)

    async def one_round(prompts):
        stats = RolloutStats()
        groups = await generate_groups(
            prompts,
            generator=FakeGenerator(),
            tokenizer=Tok(),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
            n_samples=4,
            seed_parts=(0, "rl", 1),
            policy_version=1,
            stats=stats,
        )
        await Scorer(reward, Tok(), timeout_s=5.0).score(groups, stats)
        stats.check("step 1")
        tokens = [[r.tokens for r in g.rollouts] for g in groups]
        return filter_groups(groups, [RewardStdFilter()], stats), stats, tokens

    prompts = [Prompt(uid=f"p{i}", input="x", token_ids=(1, 2, 3 + i)) for i in range(3)]
    kept, stats, tokens = asyncio.run(one_round(prompts))
    assert stats.rollouts == 12 and stats.failed == {"reward_error": 3}
    assert "judge offline" in stats.first["reward_error"].error
    assert all(len(g.rollouts) == 3 for g in kept)  # the failed sample of each group is out
    assert sum(stats.dropped.values()) + len(kept) == 3
    assert asyncio.run(one_round(prompts))[2] == tokens
