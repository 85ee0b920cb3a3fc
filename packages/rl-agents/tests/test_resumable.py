"""Multi-turn partial rollouts on the reference HFGenerator: a weight update mid-turn aborts
the in-flight turn, keeps its partial tokens (old version), resumes it on the new weights; the
finished turns keep their tokens and versions; the trajectory's per-token versions say which
policy sampled what."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest

from rl_agents.resumable import ResumableTurns
from rl_agents.trajectory import TrajectoryBuilder
from rl_core.errors import ConfigError
from rl_core.interfaces import Generator
from rl_core.types import GenerationRequest, GenerationResult, RolloutStatus, SamplingParams
from rl_hf import HFGenerator, build_tiny_model, build_tokenizer
from rl_hf.tiny import TinyModelSpec


class Versioned(Generator):
    """The real HF engine behind a weight version the test's ``Updates`` moves (loading real
    new weights is the transports' business, tested elsewhere)."""

    supports_abort = True

    def __init__(self, inner: HFGenerator) -> None:
        self.inner, self.version = inner, 0
        self.requests: list[GenerationRequest] = []

    @property
    def weight_version(self) -> int:
        return self.version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.requests.extend(requests)
        v = self.version
        out = await self.inner.generate(requests)
        return [dataclasses.replace(r, weight_version=v) for r in out]

    async def abort(self, request_ids=None) -> None:
        await self.inner.abort(request_ids)

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


class Updates:
    """Releases versions on demand; catch_up loads the newest into the generator."""

    def __init__(self, gen: Versioned) -> None:
        self.gen, self.released, self.changed = gen, 0, asyncio.Event()
        self.catch_ups = 0

    def release(self) -> None:
        self.released += 1
        self.changed.set()

    async def newer_than(self, version: int) -> None:
        while self.released <= version:
            self.changed.clear()
            await self.changed.wait()

    async def catch_up(self) -> int:
        self.catch_ups += 1
        await asyncio.sleep(0.01)  # a weight load takes time
        self.gen.version = self.released
        return self.released


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = build_tiny_model(
        tmp_path_factory.mktemp("resume_tiny"),
        TinyModelSpec(
            hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
        ),
    )
    # No EOS stop: the long turn must still be running when the update lands (a sampled EOS
    # ended it early under load and the test saw no interruption).
    # The plain transformers decode (not the lean one): 400 tokens must outlast the 0.1 s the
    # test waits before the update; the lean decode finished them first on a quiet machine.
    gen = HFGenerator(
        HFGenerator.Config(model_path=str(path), stop_on_eos=False, fast_decode=False)
    )
    yield gen
    asyncio.run(gen.close())


def test_update_mid_turn_resumes_that_turn_and_keeps_finished_ones(hf):
    tok = build_tokenizer()
    gen = Versioned(hf)
    updates = Updates(gen)
    turns = ResumableTurns(gen, updates)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=400, seed=3, stop_token_ids=())
    short = dataclasses.replace(sampling, max_new_tokens=4)

    async def rollout():
        traj = TrajectoryBuilder(tok.encode("go", add_special_tokens=False))
        pieces_per_turn = []
        for turn, sp in enumerate((short, sampling, short)):
            pieces = await turns.generate(traj.input_ids, sp, request_id=f"r/{turn}")
            pieces_per_turn.append(pieces)
            for p in pieces:
                traj.append_model(p)
            traj.append_text("\nok\n", tok)
        return traj, pieces_per_turn

    async def main():
        task = asyncio.ensure_future(rollout())
        while len(gen.requests) < 2:  # turn 1 (the long one) has started
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.1)  # let it sample some (of its 400) tokens
        updates.release()
        return await task

    traj, pieces = asyncio.run(main())
    first, middle, last = pieces
    assert len(first) == 1 and first[0].weight_version == 0  # finished before: untouched
    assert len(middle) == 2, [p.finish_reason for p in middle]
    cut, resumed = middle
    assert cut.finish_reason == "abort" and cut.weight_version == 0 and len(cut.output_ids) > 0
    assert resumed.weight_version == 1 and resumed.finish_reason != "abort"
    assert len(cut.output_ids) + len(resumed.output_ids) <= 400
    # The resumed request continued from the partial tokens, with the rest of the budget.
    req = gen.requests[2]
    assert req.input_ids == gen.requests[1].input_ids + cut.output_ids
    assert req.sampling.max_new_tokens == 400 - len(cut.output_ids)
    assert len(last) == 1 and last[0].weight_version == 1
    assert turns.stats.interruptions == 1 and updates.catch_ups == 1
    r = traj.to_rollout("p", "p/0")
    model_versions = [v for v, m in zip(r.versions, r.loss_mask, strict=True) if m]
    n0 = len(first[0].output_ids) + len(cut.output_ids)
    assert model_versions == [0] * n0 + [1] * (len(model_versions) - n0)
    assert r.status != RolloutStatus.ABORTED


def test_generator_without_abort_is_refused(hf):
    class NoAbort(Versioned):
        supports_abort = False

    with pytest.raises(ConfigError, match="cannot abort"):
        ResumableTurns(NoAbort(hf), Updates(NoAbort(hf)))


def resumable_agent(task):
    """An unmodified agent: a short first call, then a long one (cut by the test's release)."""
    import openai

    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    msgs = task.messages
    r = client.chat.completions.create(model=task.model, messages=msgs, max_tokens=4)
    msgs += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "go on"},
    ]
    client.chat.completions.create(model=task.model, messages=msgs)
    return 1.0


def test_agent_session_through_a_resumable_generator_keeps_per_token_versions(hf):
    """An agent program behind the OpenAI server, on :class:`ResumableGenerator` (what the
    trainer hands a ``generate_fn`` as ``ctx.generator`` with partial rollouts): the release
    mid-call cuts only that call, which resumes on the new weights; the session's rollout
    records the first call on version 0 and the cut call on 0 then 1."""
    pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    from rl_agents import AgentRollout
    from rl_agents.resumable import ResumableGenerator
    from rl_core.interfaces import RolloutContext
    from rl_core.types import Prompt

    tok = build_tokenizer()
    gen = Versioned(hf)
    updates = Updates(gen)
    wrapped = ResumableGenerator(gen, updates)
    fn = AgentRollout(AgentRollout.Config(program=f"{__name__}:resumable_agent"))
    msgs = [{"role": "user", "content": "Count."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    prompt = Prompt(uid="u", input=msgs, token_ids=tuple(ids))
    ctx = RolloutContext(
        generator=wrapped,
        tokenizer=tok,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=200, seed=1, stop_token_ids=()),
        n_samples=1,
        policy_version=0,
    )

    async def main():
        task = asyncio.ensure_future(fn(prompt, ctx))
        while len(gen.requests) < 2:  # the long second call has started
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        updates.release()
        try:
            return await task
        finally:
            await fn.aclose()

    (rollout,) = asyncio.run(main())
    assert rollout.status != RolloutStatus.FAILED and rollout.metadata["session_turns"] == 2
    assert wrapped.stats.releases == 1 and wrapped.stats.interruptions == 1
    _, cut, resumed = gen.requests
    assert resumed.input_ids[: len(cut.input_ids)] == cut.input_ids  # continued, not redone
    model = [v for v, m in zip(rollout.versions, rollout.loss_mask, strict=True) if m]
    n0 = model.count(0)
    assert model == [0] * n0 + [1] * (len(model) - n0) and 4 < n0 < len(model)


def test_resumed_result_merges_pieces_and_trajectory_keeps_their_versions():
    from rl_agents.resumable import ResumedResult, token_versions
    from rl_core.types import FinishReason

    def piece(version, ids, reason):
        return GenerationResult(
            request_id="r",
            output_ids=ids,
            output_logprobs=(-0.1,) * len(ids),
            finish_reason=reason,
            weight_version=version,
        )

    one = piece(0, (5, 6), FinishReason.STOP)
    assert ResumedResult.merge([one]) is one and token_versions(one) == (0, 0)
    merged = ResumedResult.merge(
        [piece(0, (5, 6), FinishReason.ABORT), piece(1, (7,), FinishReason.STOP)]
    )
    assert merged.output_ids == (5, 6, 7) and merged.finish_reason == FinishReason.STOP
    assert merged.weight_version == 0  # the oldest: readers of one version over-state staleness
    assert token_versions(merged) == (0, 0, 1)
    traj = TrajectoryBuilder((1, 2))
    traj.append_model(merged)
    traj.append_tokens((9,))
    assert traj.versions == (0, 0, 1, 1) and traj.turns[0].version == 1
