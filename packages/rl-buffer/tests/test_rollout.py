"""Turning prompts into groups (:mod:`rl_buffer.rollout`): stable per-sample seeds, a
``generate_fn`` that reuses ``ctx.sampling`` still samples differently per sample, a
``generate_fn`` that returns the wrong kind of value fails its prompt's rollouts (counted, or
raised without stats), a prompt's LoRA adapter on its requests, a result's routing kept on
its rollout, agent sessions counted once, and a whole round (generate, score, filter) as the
README shows it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl_buffer.failures import RolloutStats
from rl_buffer.rollout import agent_metrics, derive_seed, generate_groups, rollout_from_result
from rl_core.errors import RLError
from rl_core.interfaces import RolloutContext
from rl_core.testing.fake_generator import FakeGenerator
from rl_core.types import FinishReason, GenerationResult, Prompt, Rollout, SamplingParams


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


def _rollout(rid: str, versions=(0, 0, 0), **meta) -> Rollout:
    return Rollout(
        prompt_uid="p",
        rollout_id=rid,
        sample_id=f"{rid}/{len(meta)}",
        tokens=(1, 2, 3, 4),
        response_start=1,
        loss_mask=(1, 0, 1),
        rollout_logprobs=(-0.1, 0.0, -0.1),
        versions=versions,
        metadata=meta,
    )


def test_agent_metrics_count_each_session_once():
    counts = {"session_turns": 3, "tool_calls": 2, "ill_formed": 1, "template_mismatch": 0}
    rs = [
        _rollout("s1", **counts),
        _rollout("s1", **counts, tool_errors=1),  # a fork of s1: the same session's counts
        _rollout("s2", session_turns=1, tool_calls=0, ill_formed=0, template_mismatch=1),
        # a weight update between its turns (the masked tool token's version does not count)
        _rollout("s3", versions=(0, 1, 1), session_turns=2),
        _rollout("s4", versions=(0, 1, 0), session_turns=2),
    ]
    m = agent_metrics(rs)
    assert m["rollout/agent/sessions"] == 4
    assert m["rollout/agent/turns"] == 8 and m["rollout/agent/turns_mean"] == 2.0
    assert m["rollout/agent/tool_calls"] == 2 and m["rollout/agent/tool_calls_mean"] == 1.0
    assert m["rollout/agent/ill_formed"] == 1 and m["rollout/agent/template_mismatch"] == 1
    assert m["rollout/agent/trajectories_mean"] == 1.25
    assert m["rollout/agent/multi_version"] == 1
    assert "rollout/agent/tool_errors" not in m  # s1's first rollout stands for the session
    assert agent_metrics([_rollout("x")]) == {}  # not an agent run: nothing new is logged


def test_naive_rollout_function_samples_differently_per_sample():
    """Every call passes ctx.sampling (the prompt's seed): the four samples still differ, and
    the same run samples them again identically."""

    async def naive(prompt, ctx: RolloutContext):
        out = []
        for k in range(ctx.n_samples):
            res = await ctx.generate(prompt.token_ids, ctx.sampling, request_id=f"{prompt.uid}/{k}")
            out.append(rollout_from_result(prompt, res, f"{prompt.uid}/{k}"))
        return out

    def run() -> list[tuple[int, ...]]:
        (g,) = asyncio.run(
            generate_groups(
                [Prompt(uid="p0", input="x", token_ids=(1, 2, 3))],
                generator=FakeGenerator(FakeGenerator.Config(vocab_size=32, eos_token_id=-1)),
                tokenizer=None,
                sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
                n_samples=4,
                seed_parts=(0, "rl", 1, 0),
                policy_version=0,
                generate_fn=naive,
            )
        )
        return [r.tokens[r.response_start :] for r in g.rollouts]

    first = run()
    assert len(set(first)) == 4, first
    assert run() == first  # reproducible


def test_rollout_from_result_keeps_the_routing() -> None:
    prompt = Prompt(uid="p", input="x", token_ids=(5, 6, 7))
    routed = torch.arange(5 * 2 * 2, dtype=torch.uint8).view(5, 2, 2)
    res = GenerationResult(
        request_id="p/0",
        output_ids=(8, 9),
        output_logprobs=(-0.1, -0.2),
        finish_reason=FinishReason.STOP,
        weight_version=0,
        routed_experts=routed,
    )
    r = rollout_from_result(prompt, res, "p/0")
    assert r.routed_experts is not None and torch.equal(r.routed_experts, routed)


def test_a_tagged_prompt_names_its_adapter_on_default_and_custom_requests() -> None:
    """Both sampling paths put the prompt's adapter on the request: the default one and a
    ``generate_fn`` using ``ctx.generate``."""
    import asyncio

    from rl_buffer.rollout import generate_groups, rollout_from_result
    from rl_core.lora import SEQUENCE_ADAPTER_KEY
    from rl_core.types import FinishReason, GenerationResult, Prompt, SamplingParams

    class Recorder:
        seen: list = []

        async def generate(self, requests):
            self.seen += [q.adapter for q in requests]
            return [
                GenerationResult(
                    request_id=q.request_id,
                    output_ids=(1,),
                    output_logprobs=(0.0,),
                    finish_reason=FinishReason.STOP,
                    weight_version=0,
                )
                for q in requests
            ]

    async def custom(prompt, ctx):
        res = await ctx.generate(prompt.token_ids, request_id=f"{prompt.uid}/0")
        return [rollout_from_result(prompt, res, res.request_id)]

    prompts = [
        Prompt(uid=f"p{i}", input="x", token_ids=(3, 4), metadata={SEQUENCE_ADAPTER_KEY: a})
        for i, a in enumerate(["critic", "solver"])
    ]
    for fn in (None, custom):
        gen = Recorder()
        gen.seen = []
        asyncio.run(
            generate_groups(
                prompts,
                generator=gen,
                tokenizer=None,
                sampling=SamplingParams(max_new_tokens=1),
                n_samples=1,
                seed_parts=(0,),
                policy_version=0,
                generate_fn=fn,
            )
        )
        assert gen.seen == ["critic", "solver"]
