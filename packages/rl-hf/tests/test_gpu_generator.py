"""GPU tier: the reference HFGenerator on CUDA passes the Generator conformance suite (sampling,
log-probs against a teacher-forced forward, weight updates, aborts)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.interfaces import Generator
from rl_core.testing.generator import (
    GeneratorConformance,
    causal_lm_logprobs,
    perturbed_weights,
)
from rl_hf import TinyModelSpec, build_tiny_model
from rl_hf.generator import HFGenerator

SPEC = TinyModelSpec(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=3)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen2 with a sharpened output distribution (long responses, as in
    test_reference_generator.py)."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), SPEC)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 20.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.gpu
class TestHFGeneratorCUDAConformance(GeneratorConformance):
    """HFGenerator with ``device: cuda`` against the standard suite."""

    @pytest.fixture
    def generator(self, tiny_path: Path) -> Iterable[Generator]:
        gen = HFGenerator(
            HFGenerator.Config(model_path=str(tiny_path), max_batch_size=32, device="cuda")
        )
        assert gen.model.device.type == "cuda"
        yield gen
        asyncio.run(gen.close())

    def new_weights(self, generator: Generator, seed: int) -> Iterable[tuple[str, torch.Tensor]]:
        assert isinstance(generator, HFGenerator)
        state = generator.model.state_dict().items()
        # lm_head.weight is tied: sent once, as the embedding
        cpu = ((n, t.detach().cpu()) for n, t in state if n != "lm_head.weight")
        return perturbed_weights(cpu, seed)

    def teacher_forced_logprobs(
        self,
        generator: Generator,
        input_ids: Sequence[int],
        output_ids: Sequence[int],
        temperature: float,
    ) -> torch.Tensor:
        assert isinstance(generator, HFGenerator)
        return causal_lm_logprobs(generator.model, input_ids, output_ids, temperature)
