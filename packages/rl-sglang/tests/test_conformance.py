"""The standard Generator conformance suite against a real SGLang server on CPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_core.testing.generator import GeneratorConformance
from rl_sglang import SGLangGenerator


class TestSGLangConformance(GeneratorConformance):
    """SGLangGenerator attached to the session server; updates go through the tensor path
    (``/update_weights_from_tensor``) of the suite's in-memory transport."""

    seed_batch_invariant = False  # SGLang honours seeds only in deterministic mode (GPU only)
    logprob_atol = 1e-3
    # The tiny random model samples EOS or PAD with p ~ 1/130 per token, so on a quiet machine a
    # request often ends within 0.4 s; abort sooner (the generator repeats aborts for requests
    # still in transit) and keep 8 requests inside the server's 16k-token KV cache.
    abort_delay_s = 0.15
    abort_max_new_tokens = 1024

    @pytest.fixture
    def generator(
        self, attach: Callable[..., SGLangGenerator], tiny_model: Path, perturbed: Any
    ) -> SGLangGenerator:
        self._model_dir = tiny_model
        self._perturbed = perturbed
        return attach()

    def new_weights(self, generator: SGLangGenerator, seed: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return self._perturbed(load_file(str(self._model_dir / "model.safetensors")), seed)

    def teacher_forced_logprobs(
        self,
        generator: SGLangGenerator,
        input_ids: Sequence[int],
        output_ids: Sequence[int],
        temperature: float,
    ) -> torch.Tensor:
        """transformers forward of the base weights (the suite asks on version 0 only)."""
        assert generator.weight_version == 0
        model = _hf_model(str(self._model_dir))
        ids = torch.tensor([list(input_ids) + list(output_ids)])
        with torch.no_grad():
            logits_RV = model(ids).logits[0, len(input_ids) - 1 : -1]
        t = temperature if temperature > 0 else 1.0
        return torch.log_softmax(logits_RV.float() / t, -1)

    @pytest.mark.xfail(
        strict=False,
        reason="timing: the suite's requests stop on EOS/PAD, and on a quiet machine the tiny "
        "random model often ends all un-aborted requests before the second abort; the same "
        "behaviour is tested deterministically (EOS off) by "
        "test_generator.py::test_abort_by_id_returns_partial",
    )
    def test_abort_by_id(self, generator: SGLangGenerator, prompts: list) -> None:
        super().test_abort_by_id(generator, prompts)

    @pytest.mark.xfail(
        strict=True,
        reason="SGLang applies sampling_seed only with --enable-deterministic-inference, which "
        "needs a GPU attention backend (fa3/flashinfer/triton); on CPU sampling is not seeded",
    )
    def test_seeded_sampling_reproducible(self, generator: SGLangGenerator, prompts: list) -> None:
        super().test_seeded_sampling_reproducible(generator, prompts)


_MODELS: dict[str, torch.nn.Module] = {}


def _hf_model(path: str) -> torch.nn.Module:
    if path not in _MODELS:
        _MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _MODELS[path]
