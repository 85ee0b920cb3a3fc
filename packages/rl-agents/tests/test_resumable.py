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
    gen = HFGenerator(HFGenerator.Config(model_path=str(path), stop_on_eos=False))
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
