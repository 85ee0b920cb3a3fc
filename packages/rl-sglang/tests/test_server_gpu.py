"""SGLang on CUDA (``gpu`` marker; skipped without CUDA): the colocated memory calls and a
tensor-parallel server. Run on a GPU host with ``python -m pytest -m gpu packages/rl-sglang``.

They need SGLang for CUDA in its own venv (``scripts/setup_sglang_env.sh``, or
``RL_SGLANG_PYTHON`` pointing at an interpreter with sglang); without one they skip and say so.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rl_core.types import GenerationRequest, SamplingParams
from rl_sglang import SGLangGenerator, _cpu_support

P = (5, 17, 42, 99, 3, 120, 64, 7, 250, 31, 11, 2)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_sglang_python() -> str:
    """An interpreter with SGLang for CUDA; skips when there is none (no install attempted)."""
    py = os.environ.get("RL_SGLANG_PYTHON") or str(_cpu_support.default_python())
    if not Path(py).exists():
        pytest.skip(f"no SGLang interpreter at {py}; run scripts/setup_sglang_env.sh")
    return py


def _used_bytes() -> int:
    """Device memory in use on GPU 0 by every process (the servers run in other processes)."""
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def _greedy(gen: SGLangGenerator) -> list[tuple[int, ...]]:
    reqs = [
        GenerationRequest(
            request_id=f"g{i}",
            input_ids=P[: 4 + i],
            sampling=SamplingParams(max_new_tokens=8, temperature=0.0),
        )
        for i in range(3)
    ]
    return [r.output_ids for r in asyncio.run(gen.generate(reqs))]


@pytest.fixture(scope="module")
def cuda_gen(
    cuda_sglang_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangGenerator]:
    """One CUDA server with the memory saver on and a bounded static memory fraction."""
    gen = SGLangGenerator(
        SGLangGenerator.Config(
            model_path=str(tiny_model),
            python=cuda_sglang_python,
            device="cuda",
            mem_fraction_static=0.3,
            enable_memory_saver=True,
            log_dir=str(tmp_path_factory.mktemp("sglang-cuda-logs")),
            server_args={"log_level": "warning"},
            health_interval_s=0,
        )
    )
    yield gen
    asyncio.run(gen.close())


def test_release_frees_memory_and_resume_restores_weights(cuda_gen: SGLangGenerator) -> None:
    """release_memory drops the device memory in use (KV cache and weights), resume_memory
    takes it back and reloads the weights, and greedy outputs are the same as before."""
    assert cuda_gen.supports_memory_release
    before = _greedy(cuda_gen)
    used = _used_bytes()
    asyncio.run(cuda_gen.release_memory())
    released = _used_bytes()
    total = torch.cuda.mem_get_info(0)[1]
    print(f"GPU memory in use: {used / 2**30:.2f} GiB -> released {released / 2**30:.2f} GiB")
    assert used - released > 0.1 * total  # mem_fraction_static=0.3 was reserved, most of it freed
    asyncio.run(cuda_gen.resume_memory())
    assert _used_bytes() > released + 0.1 * total
    assert _greedy(cuda_gen) == before
    asyncio.run(cuda_gen.release_memory(["kv_cache"]))
    asyncio.run(cuda_gen.resume_memory(["kv_cache"]))
    assert _greedy(cuda_gen) == before


def test_tensor_parallel_server_matches_tp1(
    cuda_sglang_python: str,
    cuda_gen: SGLangGenerator,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A TP=2 server (needs 2 GPUs) gives the same greedy outputs as the TP=1 server."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    expected = _greedy(cuda_gen)
    gen = SGLangGenerator(
        SGLangGenerator.Config(
            model_path=str(tiny_model),
            python=cuda_sglang_python,
            device="cuda",
            tp_size=2,
            mem_fraction_static=0.3,
            log_dir=str(tmp_path_factory.mktemp("sglang-tp2-logs")),
            server_args={"log_level": "warning"},
            health_interval_s=0,
        )
    )
    try:
        assert gen._fleet.servers[0].tp_size == 2
        assert _greedy(gen) == expected
    finally:
        asyncio.run(gen.close())
