"""HFGenerator.generate_stream: tokens arrive per decode step, in a continuous batch, and the
streamed tokens and log-probs are exactly those of the non-streamed result for the same seed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rl_core.interfaces import GenerationChunk
from rl_core.testing.generator import FakeGenerator
from rl_core.types import FinishReason, GenerationRequest, SamplingParams
from rl_hf import TinyModelSpec, build_tiny_model
from rl_hf.generator import HFGenerator

SPEC = TinyModelSpec(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=3)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), SPEC)


def _req(rid: str, ids: tuple[int, ...], seed: int, n: int = 24) -> GenerationRequest:
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=n, seed=seed)
    return GenerationRequest(request_id=rid, input_ids=ids, sampling=sp)


def test_stream_equals_generate_in_a_continuous_batch(tiny_path: Path) -> None:
    gen = HFGenerator(HFGenerator.Config(model_path=str(tiny_path), max_batch_size=8))
    assert gen.streams_tokens
    others = [_req(f"o{i}", (5 + i, 6, 7, 8), seed=100 + i, n=40) for i in range(4)]
    target = _req("t", (9, 10, 11), seed=7)

    async def run() -> tuple[list[GenerationChunk], list[bool], list]:
        chunks: list[GenerationChunk] = []
        other_done_at_chunk: list[bool] = []
        batch = asyncio.ensure_future(gen.generate(others))

        async def consume() -> None:
            async for c in gen.generate_stream(target):
                chunks.append(c)
                other_done_at_chunk.append(batch.done())

        await asyncio.gather(consume(), batch)
        return chunks, other_done_at_chunk, batch.result()

    chunks, _, other_results = asyncio.run(run())
    try:
        final = chunks[-1].result
        assert final is not None and all(c.result is None for c in chunks[:-1])
        # one chunk per decode step while it runs: streamed, not emulated
        assert len(chunks) >= 2 and all(len(c.output_ids) == 1 for c in chunks[:-1])
        ids = tuple(i for c in chunks for i in c.output_ids)
        lps = tuple(x for c in chunks for x in c.output_logprobs)
        assert ids == final.output_ids and lps == final.output_logprobs

        # the same batch, not streamed: identical tokens and log-probs (bitwise)
        async def plain() -> tuple[list, list]:
            batch = asyncio.ensure_future(gen.generate(others))
            mine = asyncio.ensure_future(gen.generate([target]))
            return await batch, await mine

        again, (whole,) = asyncio.run(plain())
        assert whole.output_ids == final.output_ids
        assert whole.output_logprobs == final.output_logprobs
        assert whole.finish_reason == final.finish_reason
        assert [r.output_ids for r in again] == [r.output_ids for r in other_results]
    finally:
        asyncio.run(gen.close())


def test_stream_abort_returns_partial_result(tiny_path: Path) -> None:
    gen = HFGenerator(HFGenerator.Config(model_path=str(tiny_path), max_batch_size=8))
    req = _req("a", (3, 4, 5), seed=1, n=200)

    async def run() -> list[GenerationChunk]:
        chunks = []
        async for c in gen.generate_stream(req):
            chunks.append(c)
            if len(chunks) == 3:
                await gen.abort(["a"])
        return chunks

    try:
        chunks = asyncio.run(run())
        final = chunks[-1].result
        assert final is not None
        ids = tuple(i for c in chunks for i in c.output_ids)
        assert ids == final.output_ids
        assert final.finish_reason == FinishReason.ABORT
        assert 3 <= len(final.output_ids) < 200
    finally:
        asyncio.run(gen.close())


def test_default_generate_stream_yields_the_whole_result_once() -> None:
    gen = FakeGenerator(FakeGenerator.Config(vocab_size=64))
    assert not gen.streams_tokens
    req = _req("f", (1, 2, 3), seed=0, n=5)

    async def run() -> list[GenerationChunk]:
        return [c async for c in gen.generate_stream(req)]

    (chunk,) = asyncio.run(run())
    (whole,) = asyncio.run(FakeGenerator(FakeGenerator.Config(vocab_size=64)).generate([req]))
    assert chunk.result is not None
    assert chunk.output_ids == chunk.result.output_ids == whole.output_ids
    assert chunk.output_logprobs == whole.output_logprobs
