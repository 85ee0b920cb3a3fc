"""The generator in a process of its own (``runtime.generator_process``): the standard generator
suite on an ``hf`` generator in a spawned child, its results equal to the in-process
generator's, and a dead child reported as a GenerationError."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.config import ComponentSpec
from rl_core.errors import ConfigError, GenerationError
from rl_core.interfaces import Generator
from rl_core.testing.generator import (
    GeneratorConformance,
    causal_lm_logprobs,
    perturbed_weights,
)
from rl_core.types import GenerationRequest, SamplingParams
from rl_hf import TinyModelSpec, build_tiny_model
from rl_hf.generator import HFGenerator
from rl_trainer.generator_process import ProcessGenerator

SPEC = TinyModelSpec(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=3)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen2 with a sharpened output distribution (long responses, rare EOS)."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), SPEC)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 20.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _spec(path: Path) -> ComponentSpec:
    return ComponentSpec(type="hf", options={"model_path": str(path), "max_batch_size": 32})


@pytest.fixture(scope="module")
def reference(tiny_path: Path) -> HFGenerator:
    """An in-process generator on the same model: the source of original weights and EOS."""
    return HFGenerator(HFGenerator.Config(model_path=str(tiny_path), max_batch_size=32))


@pytest.fixture(scope="module")
def child(tiny_path: Path) -> Iterator[ProcessGenerator]:
    """One child for the module (spawning costs seconds); tests get it reset to version 0."""
    gen = ProcessGenerator(_spec(tiny_path), threads=1)
    yield gen
    asyncio.run(gen.close())


def _original(reference: HFGenerator) -> list[tuple[str, torch.Tensor]]:
    return [
        (n, t.detach().clone())
        for n, t in reference.model.state_dict().items()
        if n != "lm_head.weight"
    ]


def _req(rid: str, ids: Sequence[int], **sampling: object) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, input_ids=tuple(ids), sampling=SamplingParams(**sampling)
    )


class TestProcessGeneratorConformance(GeneratorConformance):
    """HFGenerator in a spawned child against the standard suite."""

    @pytest.fixture
    def generator(self, child: ProcessGenerator, reference: HFGenerator) -> Iterable[Generator]:
        asyncio.run(child.resume())
        child.load_weights(_original(reference), version=0)
        assert child.weight_version == 0
        yield child
        asyncio.run(child.abort())

    @pytest.fixture
    def vocab_size(self, reference: HFGenerator) -> int:
        return int(reference.vocab_size)

    @pytest.fixture
    def default_stop_ids(self, reference: HFGenerator) -> tuple[int, ...]:
        return tuple(reference.default_stop_ids)

    def new_weights(self, generator: Generator, seed: int) -> Iterable[tuple[str, torch.Tensor]]:
        assert isinstance(generator, ProcessGenerator)
        return perturbed_weights(generator._shared.items(), seed)

    def teacher_forced_logprobs(
        self,
        generator: Generator,
        input_ids: Sequence[int],
        output_ids: Sequence[int],
        temperature: float,
    ) -> torch.Tensor:
        assert isinstance(generator, ProcessGenerator)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(generator.spec.options["model_path"])
        model.load_state_dict(dict(generator._shared), strict=False)
        model.tie_weights()
        return causal_lm_logprobs(model.eval(), input_ids, output_ids, temperature)


def test_results_equal_the_in_process_generator(
    child: ProcessGenerator, reference: HFGenerator
) -> None:
    """Same model, same seeds: the child samples the same tokens and log-probs, also when
    the calls of one tick are batched together, and after the same weight update."""
    child.load_weights(_original(reference), version=0)
    reqs = [
        _req(f"r{i}", [3 + i, 7, 11 + i], max_new_tokens=6, temperature=0.9, seed=i)
        for i in range(5)
    ]

    async def both(gen: Generator) -> list:
        a, b = await asyncio.gather(gen.generate(reqs[:2]), gen.generate(reqs[2:]))
        return a + b

    def key(results: list) -> list:
        return [(r.request_id, r.output_ids, r.output_logprobs, r.finish_reason) for r in results]

    assert key(asyncio.run(both(child))) == key(asyncio.run(both(reference)))
    g = torch.Generator().manual_seed(5)
    new = [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in _original(reference)]
    fresh = HFGenerator(reference.config)
    fresh.load_weights(new, version=4)
    child.load_weights(new, version=4)
    assert child.weight_version == 4
    got = asyncio.run(both(child))
    assert key(got) == key(asyncio.run(both(fresh)))
    assert {r.weight_version for r in got} == {4}
    child.load_weights(_original(reference), version=0)


def test_a_dead_child_fails_calls_with_a_generation_error(tiny_path: Path) -> None:
    gen = ProcessGenerator(_spec(tiny_path), threads=1)
    assert asyncio.run(gen.health()) is True
    gen._proc.kill()
    gen._reader.join(30)
    assert asyncio.run(gen.health()) is False
    with pytest.raises(GenerationError, match="generator process exited"):
        asyncio.run(gen.generate([_req("x", [1, 2], max_new_tokens=2)]))
    asyncio.run(gen.close())


def test_unusable_backends_and_options_fail_before_spawning(tiny_path: Path) -> None:
    with pytest.raises(ConfigError, match="generator.max_batch_sizes"):
        ProcessGenerator(
            ComponentSpec(type="hf", options={"model_path": str(tiny_path), "max_batch_sizes": 3}),
            threads=1,
        )
    with pytest.raises(ConfigError, match="load_weights"):
        ProcessGenerator(ComponentSpec(type=f"{__file__}:NoWeights"), threads=1)


class NoWeights(Generator):
    """A backend that takes weights only through a transport (as a server engine does)."""

    @property
    def weight_version(self) -> int:
        return 0

    async def generate(self, requests):
        return []

    async def update_weights(self, update, transport):
        pass

    async def health(self):
        return True
