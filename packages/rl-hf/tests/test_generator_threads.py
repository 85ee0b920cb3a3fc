"""``HFGenerator.Config.threads``: the worker thread that generates runs with that many torch
threads (0 keeps the process's count), and the calling thread's own count is left alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.types import GenerationRequest, SamplingParams
from rl_hf import TinyModelSpec, build_tiny_model
from rl_hf.generator import HFGenerator


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(arch="qwen2"))


def _worker_threads(model_dir: Path, threads: int, monkeypatch: pytest.MonkeyPatch) -> int:
    seen: list[int] = []
    orig = HFGenerator._run_batch

    def run_batch(self: HFGenerator, *a: Any, **k: Any) -> Any:
        seen.append(torch.get_num_threads())
        return orig(self, *a, **k)

    monkeypatch.setattr(HFGenerator, "_run_batch", run_batch)
    gen = HFGenerator(HFGenerator.Config(model_path=str(model_dir), threads=threads))
    req = GenerationRequest(
        request_id="r0", input_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=2)
    )

    async def go() -> None:
        await gen.generate([req])
        await gen.close()

    asyncio.run(go())
    return seen[0]


def test_worker_runs_with_the_configured_thread_count(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _worker_threads(model_dir, 0, monkeypatch) == 2  # 0: the process's count
        assert _worker_threads(model_dir, 1, monkeypatch) == 1
        assert torch.get_num_threads() == 2  # the caller's count is its own
    finally:
        torch.set_num_threads(before)
