"""Generation interruptible by weight updates (:func:`rl_buffer.rollout.generate_groups_resumable`,
the trainer's ``rl.partial_rollouts``): a newer release aborts the round, the partial rollouts wait
in the buffer with their versions, and resume on the new weights with the rest of their budget."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rl_buffer import GroupBuffer
from rl_buffer.rollout import PartialStats, generate_groups_resumable
from rl_core.interfaces import Generator
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    RolloutStatus,
    SamplingParams,
)


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
