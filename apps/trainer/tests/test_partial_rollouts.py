"""Partial rollouts (``rl.partial_rollouts``): a weight update released while a round generates
aborts it, the partial rollouts wait in the buffer with their versions, and resume on the new
weights with the rest of their budget."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from rl_buffer import GroupBuffer
from rl_buffer.rollout import PartialStats, generate_groups_resumable
from rl_core.errors import ConfigError
from rl_core.interfaces import Generator
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    RolloutStatus,
    SamplingParams,
)
from rl_trainer.config import load_trainer_config
from rl_trainer.step.pipeline import RolloutPipeline


class _StepGenerator(Generator):
    """Emits one token per request per tick (token = 1000 * version + position in the
    response); ``abort`` ends every running request with what it has."""

    supports_abort = True

    def __init__(self, tick_s: float = 0.002) -> None:
        self.version = 0
        self.tick_s = tick_s
        self.tokens_out = 0
        self.seen: list[GenerationRequest] = []
        self._aborted = False

    @property
    def weight_version(self) -> int:
        return self.version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.seen.extend(requests)
        self._aborted = False
        outs: list[list[int]] = [[] for _ in requests]
        budgets = [q.sampling.max_new_tokens for q in requests]
        while not self._aborted and any(len(o) < b for o, b in zip(outs, budgets)):
            await asyncio.sleep(self.tick_s)
            for q, o, b in zip(requests, outs, budgets):
                if len(o) < b:
                    start = len(q.input_ids) - 3  # response tokens before this request
                    o.append(1000 * self.version + start + len(o))
                    self.tokens_out += 1
        return [
            GenerationResult(
                request_id=q.request_id,
                output_ids=tuple(o),
                output_logprobs=tuple(-0.5 - self.version for _ in o),
                finish_reason=FinishReason.LENGTH if len(o) == b else FinishReason.ABORT,
                weight_version=self.version,
            )
            for q, o, b in zip(requests, outs, budgets)
        ]

    async def update_weights(self, update, transport) -> None:  # pragma: no cover - unused
        raise NotImplementedError

    async def abort(self, request_ids=None) -> None:
        self._aborted = True


class _Updates:
    """Releases version 1 once the generator has produced ``after`` tokens."""

    def __init__(self, gen: _StepGenerator, after: int) -> None:
        self.gen, self.after = gen, after
        self.caught_up = 0

    async def newer_than(self, version: int) -> None:
        if version >= 1:
            await asyncio.Event().wait()  # nothing newer than version 1 in this test
        while self.gen.tokens_out < self.after:
            await asyncio.sleep(0.001)

    async def catch_up(self) -> int:
        self.caught_up += 1
        self.gen.version = 1
        return 1


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(uid=f"p{i}", input="x", token_ids=(7, 8, 9)) for i in range(n)]


def _generate(gen, updates, *, prompts: int, n: int, max_new: int):
    """Run resumable generation; returns (groups, buffer, stats)."""
    buf, stats = GroupBuffer(), PartialStats()
    groups = asyncio.run(
        generate_groups_resumable(
            _prompts(prompts),
            generator=gen,
            buffer=buf,
            sampling=SamplingParams(max_new_tokens=max_new),
            n_samples=n,
            seed_parts=(0, "rl", 1, 0),
            updates=updates,
            stats=stats,
        )
    )
    return groups, buf, stats


def test_interrupted_rollouts_resume_on_the_new_version_with_their_prefix():
    gen = _StepGenerator()
    updates = _Updates(gen, after=3 * 4)  # 4 requests x 3 tokens, then version 1 is released
    groups, buf, stats = _generate(gen, updates, prompts=2, n=2, max_new=8)
    assert updates.caught_up == 1 and stats.interruptions == 1
    rollouts = [r for g in groups for r in g.rollouts]
    assert [g.prompt.uid for g in groups] == ["p0", "p1"]
    assert [r.sample_id for r in rollouts] == ["p0/0", "p0/1", "p1/0", "p1/1"]
    assert stats.resumed == 4 and stats.resumed_tokens == sum(r.versions.count(0) for r in rollouts)
    for r in rollouts:
        k = r.versions.count(0)
        assert 1 <= k < 8, r.versions  # aborted mid-response
        # The prefix is kept, the rest continues on version 1 at the right positions.
        assert r.response_ids == tuple(range(k)) + tuple(1000 + i for i in range(k, 8))
        assert r.versions == (0,) * k + (1,) * (8 - k)
        assert r.rollout_logprobs == (-0.5,) * k + (-1.5,) * (8 - k)
        assert r.loss_mask == (1,) * 8 and r.tokens[:3] == (7, 8, 9)
        assert r.status == RolloutStatus.TRUNCATED  # budget used up: finished by length
    # The partial groups went through the buffer's partial store and came back out.
    assert buf.counters["partial_put"] == 2 and buf.counters["partial_taken"] == 2
    assert buf.num_partial == 0 and len(buf) == 0
    # Resumed requests: same ids, the remaining budget, a new seed.
    first, resumed = gen.seen[:4], gen.seen[4:]
    assert [q.request_id for q in resumed] == [q.request_id for q in first]
    for q0, q1, r in zip(first, resumed, rollouts):
        assert q1.sampling.max_new_tokens == 8 - r.versions.count(0)
        assert q1.sampling.seed != q0.sampling.seed
        assert q1.input_ids == r.tokens[: 3 + r.versions.count(0)]


def test_without_an_update_nothing_is_aborted():
    gen = _StepGenerator()
    updates = _Updates(gen, after=10**9)
    groups, buf, stats = _generate(gen, updates, prompts=1, n=3, max_new=4)
    assert stats == PartialStats() and updates.caught_up == 0 and len(gen.seen) == 3
    assert all(r.versions == (0,) * 4 for g in groups for r in g.rollouts)
    assert buf.counters["partial_put"] == 0


def test_pipeline_newer_than_and_catch_up_serve_the_newest_release():
    served = []

    async def serve(version, weights):
        served.append((version, weights))

    async def produce(step):  # pragma: no cover - the producer is not started
        return {}

    async def main():
        pipe = RolloutPipeline(
            produce=produce,
            serve=serve,
            max_staleness=2,
            first_version=0,
            last_step=10,
            next_step=1,
            released=0,
        )
        waiter = asyncio.ensure_future(pipe.newer_than(0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await pipe.release(1, "w1")
        await pipe.release(2, "w2")
        await asyncio.wait_for(waiter, 1)
        assert await pipe.catch_up() == 2
        await asyncio.wait_for(pipe.newer_than(1), 1)  # already newer: returns at once

    asyncio.run(main())
    assert served == [(2, "w2")]  # the newest copy; the older one is dropped


def test_hf_generator_abort_and_resume(tmp_path):
    """With the reference generator: an update released mid-generation cuts the running batch
    short; every rollout still gets its full budget, and the tokens sampled after the update
    carry the new version."""
    from rl_hf import HFGenerator
    from rl_hf.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny")
    gen = HFGenerator(
        HFGenerator.Config(model_path=str(model_dir), max_batch_size=2, stop_on_eos=False)
    )
    forwards = [0]  # model calls: one prefill, then one per decode step
    gen.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    class Updates:
        caught_up = 0

        async def newer_than(self, version: int) -> None:
            if version >= 1:
                await asyncio.Event().wait()
            while forwards[0] < 10:  # the first batch of two is decoding, six are queued
                await asyncio.sleep(0.001)

        async def catch_up(self) -> int:
            Updates.caught_up += 1
            weights = [(n, t.clone()) for n, t in gen.model.state_dict().items()]
            await asyncio.to_thread(gen.load_weights, weights, version=1)
            return 1

    stats = PartialStats()
    buf = GroupBuffer()

    async def main():
        try:
            return await generate_groups_resumable(
                [Prompt(uid=f"p{i}", input="x", token_ids=(3, 4, 5 + i)) for i in range(4)],
                generator=gen,
                buffer=buf,
                sampling=SamplingParams(max_new_tokens=100, temperature=1.0),
                n_samples=2,
                seed_parts=(0,),
                updates=Updates(),
                stats=stats,
            )
        finally:
            await gen.close()

    groups = asyncio.run(main())
    rollouts = [r for g in groups for r in g.rollouts]
    assert Updates.caught_up == 1 and stats.interruptions == 1 and stats.resumed >= 1
    assert all(r.response_length == 100 for r in rollouts)
    assert all(list(r.versions) == sorted(r.versions) for r in rollouts)
    assert any(0 in r.versions and 1 in r.versions for r in rollouts)  # cut mid-response
    assert any(set(r.versions) == {1} for r in rollouts)  # queued: all on the new version
    assert all(len(r.rollout_logprobs) == 100 for r in rollouts)


@pytest.mark.parametrize(
    ("rl", "rollout", "match"),
    [
        ({"partial_rollouts": True}, {}, "async_generation"),
        ({"partial_rollouts": True, "async_generation": True, "max_staleness": 0}, {}, "max_stal"),
        ({"async_mode": "continuous"}, {}, "rl.async_mode"),
        ({"async_mode": "continuous", "async_generation": True, "max_staleness": 0}, {}, "mode"),
        ({"async_mode": "eventually"}, {}, "async_mode"),
    ],
)
def test_partial_rollouts_config_errors(tmp_path, tiny_recipe_dict, rl, rollout, match):
    """Refused: partial rollouts or continuous mode without generation running ahead."""
    recipe = tiny_recipe_dict(tmp_path)
    recipe["rl"].update(rl)
    recipe["rollout"].update(rollout)
    with pytest.raises(ConfigError, match=match):
        load_trainer_config(recipe)
