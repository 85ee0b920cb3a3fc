"""Tests of the reference HFGenerator, the FakeGenerator and the InMemoryTransport.

Both generators run the full :class:`GeneratorConformance` suite; the HF-specific tests compare
the KV-cache sampler with teacher-forced and no-cache forwards of the same model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
import torch

from rl_core.errors import ConfigError, GenerationError, WeightSyncError
from rl_core.interfaces import Generator, WeightTransport
from rl_core.testing.generator import (
    FakeGenerator,
    GeneratorConformance,
    InMemoryTransport,
    causal_lm_logprobs,
    perturbed_weights,
)
from rl_core.testing.weight_transport import WeightTransportConformance
from rl_core.types import FinishReason, GenerationRequest, SamplingParams
from rl_hf import TinyModelSpec, build_tiny_model
from rl_hf.generator import HFGenerator

SPEC = TinyModelSpec(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=3)
SHARPEN = 20.0
"""Scale of the final norm: peaked next-token distributions, so EOS is rare and responses long."""


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen2 (hidden 32, 2 layers, vocab 260) with a sharpened output distribution."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), SPEC)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * SHARPEN
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _gen(path: Path, **kw: object) -> HFGenerator:
    return HFGenerator(HFGenerator.Config(model_path=str(path), max_batch_size=32, **kw))


def _req(rid: str, ids: Sequence[int], **sampling: object) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, input_ids=tuple(ids), sampling=SamplingParams(**sampling)
    )


def _assert_logprobs_exact(gen: HFGenerator, prompt: Sequence[int], q, r) -> torch.Tensor:
    """Assert ``r``'s log-probs are the teacher-forced ones of request ``q`` (its sampling's
    temperature, top-p and top-k) within 1e-4; returns the reference ``[R, V]`` log-probs."""
    s = q.sampling
    ref_RV = causal_lm_logprobs(
        gen.model, prompt, r.output_ids, s.temperature, top_p=s.top_p, top_k=s.top_k
    )
    want_R = ref_RV.gather(1, torch.tensor(r.output_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(r.output_logprobs), want_R, atol=1e-4, rtol=0)
    return ref_RV


# ---------------------------------------------------------------------------------- suites


class TestHFGeneratorConformance(GeneratorConformance):
    """The reference generator against the standard suite."""

    @pytest.fixture
    def generator(self, tiny_path: Path) -> Iterable[Generator]:
        gen = _gen(tiny_path)
        yield gen
        asyncio.run(gen.close())

    def new_weights(self, generator: Generator, seed: int) -> Iterable[tuple[str, torch.Tensor]]:
        assert isinstance(generator, HFGenerator)
        state = generator.model.state_dict().items()
        # lm_head.weight is tied: sent once, as the embedding
        return perturbed_weights(((n, t) for n, t in state if n != "lm_head.weight"), seed)

    def teacher_forced_logprobs(
        self,
        generator: Generator,
        input_ids: Sequence[int],
        output_ids: Sequence[int],
        temperature: float,
    ) -> torch.Tensor:
        assert isinstance(generator, HFGenerator)
        return causal_lm_logprobs(generator.model, input_ids, output_ids, temperature)


class TestFakeGeneratorConformance(GeneratorConformance):
    """The fake against the standard suite (so other packages can trust it)."""

    @pytest.fixture
    def generator(self) -> Iterable[Generator]:
        gen = FakeGenerator(FakeGenerator.Config(vocab_size=64, step_delay_s=2e-4))
        yield gen
        asyncio.run(gen.close())

    def new_weights(self, generator: Generator, seed: int) -> Iterable[tuple[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        yield "table", torch.randn(64, 64, generator=g) * 2.0

    def teacher_forced_logprobs(
        self,
        generator: Generator,
        input_ids: Sequence[int],
        output_ids: Sequence[int],
        temperature: float,
    ) -> torch.Tensor:
        assert isinstance(generator, FakeGenerator)
        return generator.teacher_forced_logprobs(input_ids, output_ids, temperature)


class TestInMemoryTransportConformance(WeightTransportConformance):
    """The suites' in-memory transport is a conforming WeightTransport."""

    @pytest.fixture
    def transport(self) -> WeightTransport:
        return InMemoryTransport(keep=4)


# ---------------------------------------------------------------------------------- HF-specific


def _mixed_batch(n: int = 16) -> list[GenerationRequest]:
    """Prompts of lengths 1..31 (so heavy left padding), per-row temperatures and truncation."""
    temps = [0.0, 0.3, 0.7, 1.0, 1.6]
    reqs = []
    for i in range(n):
        length = 1 + (i * 7) % 31
        prompt = [(13 * i + 5 * j + 2) % 256 for j in range(length)]
        reqs.append(
            _req(
                f"m{i}",
                prompt,
                temperature=temps[i % len(temps)],
                top_p=0.85 if i % 3 == 1 else 1.0,
                top_k=7 if i % 4 == 2 else 0,
                max_new_tokens=4 + (i * 5) % 20,
                seed=i,
                # many stop ids: rows end at different steps (exercises compaction)
                stop_token_ids=tuple(range(0, 260, 11)) if i % 2 else (),
            )
        )
    return reqs


@pytest.mark.parametrize(
    ("compact_fraction", "attn"), [(1.0, "sdpa"), (0.01, "sdpa"), (0.01, "eager")]
)
def test_logprobs_equal_teacher_forcing_in_mixed_batch(
    tiny_path: Path, compact_fraction: float, attn: str
) -> None:
    """Sampled log-probs equal log_softmax(logits / T) of an unpadded teacher-forced forward within
    1e-4, for every row of a left-padded batch with per-row temperatures, with and without cache
    compaction, with our own SDPA masks and with transformers' masks (eager)."""
    gen = _gen(tiny_path, compact_fraction=compact_fraction, attn_implementation=attn)
    assert gen._own_masks == (attn == "sdpa")
    reqs = _mixed_batch()
    res = asyncio.run(gen.generate(reqs))
    for q, r in zip(reqs, res):
        ref_RV = _assert_logprobs_exact(gen, q.input_ids, q, r)
        if q.sampling.temperature == 0:
            assert list(r.output_ids) == ref_RV.argmax(-1).tolist()
    assert {r.finish_reason for r in res} == {FinishReason.STOP, FinishReason.LENGTH}
    asyncio.run(gen.close())


def test_llama_arch_mixed_batch(tmp_path: Path) -> None:
    """The same exactness on a llama-architecture model (no q/k/v biases, untied head)."""
    spec = TinyModelSpec(
        arch="llama",
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        tie_word_embeddings=False,
        seed=4,
    )
    gen = _gen(build_tiny_model(tmp_path / "llama", spec), compact_fraction=0.01)
    reqs = _mixed_batch(8)
    for q, r in zip(reqs, asyncio.run(gen.generate(reqs))):
        _assert_logprobs_exact(gen, q.input_ids, q, r)
    asyncio.run(gen.close())


def test_compaction_does_not_change_samples(tiny_path: Path) -> None:
    """Compacting finished rows out of the batch and its KV cache gives the same tokens."""
    reqs = _mixed_batch()
    outs = []
    for frac in (1.0, 0.01):
        gen = _gen(tiny_path, compact_fraction=frac)
        outs.append([r.output_ids for r in asyncio.run(gen.generate(reqs))])
        asyncio.run(gen.close())
    assert outs[0] == outs[1]


def test_kv_cache_greedy_equals_no_cache_decode(tiny_path: Path) -> None:
    """Greedy decoding through the batched KV cache equals a plain argmax loop that re-runs the
    whole unpadded sequence at every step."""
    gen = _gen(tiny_path, stop_on_eos=False)
    prompts = [[1 + (3 * i + j) % 200 for j in range(2 + 5 * i)] for i in range(5)]
    reqs = [_req(f"g{i}", p, temperature=0.0, max_new_tokens=20) for i, p in enumerate(prompts)]
    res = asyncio.run(gen.generate(reqs))
    for p, r in zip(prompts, res):
        seq = list(p)
        with torch.no_grad():
            for _ in range(20):
                seq.append(int(gen.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert list(r.output_ids) == seq[len(p) :]
        assert r.finish_reason == FinishReason.LENGTH
    asyncio.run(gen.close())


def test_per_row_temperature_changes_distribution(tiny_path: Path) -> None:
    """Rows of one batch with the same prompt and seed but different temperatures report
    log-probs under their own temperature (hot rows spread out: lower mean log-prob)."""
    gen = _gen(tiny_path, stop_on_eos=False)
    prompt = [5, 6, 7, 8]
    temps = [0.25, 1.0, 4.0]
    reqs = [
        _req(f"t{i}", prompt, temperature=t, max_new_tokens=24, seed=9) for i, t in enumerate(temps)
    ]
    res = asyncio.run(gen.generate(reqs))
    means = [sum(r.output_logprobs) / len(r.output_logprobs) for r in res]
    assert means[0] > means[1] > means[2], means
    for q, r in zip(reqs, res):
        _assert_logprobs_exact(gen, prompt, q, r)
    asyncio.run(gen.close())


def test_event_loop_stays_responsive(tiny_path: Path) -> None:
    """The event loop keeps running other tasks while a batch decodes in the worker thread."""
    gen = _gen(tiny_path, stop_on_eos=False)
    reqs = [_req(f"r{i}", [1, 2, 3], max_new_tokens=300, seed=i) for i in range(8)]

    async def go() -> tuple[int, float]:
        ticks = 0
        task = asyncio.ensure_future(gen.generate(reqs))
        t0 = time.perf_counter()
        while not task.done():
            await asyncio.sleep(0.002)
            ticks += 1
        await task
        return ticks, time.perf_counter() - t0

    ticks, elapsed = asyncio.run(go())
    assert elapsed > 0.02 and ticks >= 5, (ticks, elapsed)
    asyncio.run(gen.close())


def test_load_weights_checks_before_touching(tiny_path: Path) -> None:
    """Unknown names and wrong shapes raise WeightSyncError and change neither weights nor
    version; a tied lm_head.weight is accepted and lands in the embedding."""
    gen = _gen(tiny_path)
    before = {k: v.clone() for k, v in gen.model.state_dict().items()}
    emb = before["model.embed_tokens.weight"]
    bad = [
        [("model.embed_tokens.weight", emb + 1), ("model.nope.weight", torch.zeros(2))],
        [("model.norm.weight", torch.ones(3))],
    ]
    for tensors in bad:
        with pytest.raises(WeightSyncError, match=r"model\."):
            gen.load_weights(tensors, version=5)
        assert gen.weight_version == 0
        for k, v in gen.model.state_dict().items():
            assert torch.equal(v, before[k]), k
    gen.load_weights([("lm_head.weight", emb * 2)], version=3)
    assert gen.weight_version == 3
    assert torch.equal(gen.model.get_input_embeddings().weight, emb * 2)
    asyncio.run(gen.close())


def test_update_waits_for_running_batch(tiny_path: Path) -> None:
    """A weight update issued mid-batch lands between batches: the running batch reports the old
    version for all its rows, the next one the new version."""
    gen = _gen(tiny_path, stop_on_eos=False)
    transport = InMemoryTransport()
    new = [(k, v + 0.05) for k, v in gen.model.state_dict().items() if k != "lm_head.weight"]
    update = transport.publish(1, new)

    async def go() -> tuple[list, list]:
        reqs = [_req(f"r{i}", [1, 2, 3], max_new_tokens=200, seed=i) for i in range(4)]
        task = asyncio.ensure_future(gen.generate(reqs))
        while not gen._running_ids:  # until the worker runs the batch
            await asyncio.sleep(0.001)
        await gen.update_weights(update, transport)
        first = await task
        second = await gen.generate([_req("n", [1, 2], max_new_tokens=2)])
        return first, second

    first, second = asyncio.run(go())
    assert {r.weight_version for r in first} == {0}
    assert all(len(r.output_ids) == 200 for r in first)
    assert second[0].weight_version == 1
    asyncio.run(gen.close())


def test_bad_config_and_requests(tiny_path: Path, tmp_path: Path) -> None:
    """Bad config fields and out-of-vocabulary prompts raise errors naming the field or request."""
    with pytest.raises(ConfigError, match="dtype"):
        HFGenerator.Config(model_path=str(tiny_path), dtype="float8")
    with pytest.raises(ConfigError, match="max_batch_size"):
        HFGenerator.Config(model_path=str(tiny_path), max_batch_size=0)
    with pytest.raises(ConfigError, match="model_path"):
        HFGenerator(HFGenerator.Config(model_path=str(tmp_path)))
    gen = _gen(tiny_path)
    assert gen.tokenizer is not None and gen.tokenizer.eos_token_id in gen.default_stop_ids
    with pytest.raises(GenerationError, match="bad"):
        asyncio.run(gen.generate([_req("bad", [1, 100_000])]))
    with pytest.raises(GenerationError, match="max_position_embeddings"):
        asyncio.run(gen.generate([_req("long", [1] * 4000, max_new_tokens=200)]))
    with pytest.raises(GenerationError, match="empty"):
        asyncio.run(gen.generate([_req("empty", [])]))
    asyncio.run(gen.close())
    assert asyncio.run(gen.health()) is False
    with pytest.raises(GenerationError, match="closed"):
        asyncio.run(gen.generate([_req("late", [1])]))


def test_seeded_results_independent_of_max_batch_size(tiny_path: Path) -> None:
    """The same seeded requests give the same tokens when split into batches of 3 or run as one."""
    reqs = _mixed_batch(10)
    outs = []
    for mbs in (3, 32):
        gen = HFGenerator(HFGenerator.Config(model_path=str(tiny_path), max_batch_size=mbs))
        outs.append([r.output_ids for r in asyncio.run(gen.generate(reqs))])
        asyncio.run(gen.close())
    assert outs[0] == outs[1]


def test_group_batch_shares_prefill(tiny_path: Path) -> None:
    """A GRPO-shaped batch (3 prompts x 4 seeds) prefills each prompt once and still samples
    each row as if alone, with teacher-forced log-probs."""
    gen = _gen(tiny_path, stop_on_eos=False)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [42]]
    reqs = [
        _req(f"p{i}-s{j}", p, temperature=0.8 + 0.2 * j, max_new_tokens=12, seed=10 * i + j)
        for i, p in enumerate(prompts)
        for j in range(4)
    ]
    res = asyncio.run(gen.generate(reqs))
    for q, r in zip(reqs, res):
        _assert_logprobs_exact(gen, q.input_ids, q, r)
    assert len({r.output_ids for r in res[:4]}) > 1, "samples of one prompt are all equal"
    (alone,) = asyncio.run(gen.generate([reqs[5]]))
    assert alone.output_ids == res[5].output_ids
    asyncio.run(gen.close())
