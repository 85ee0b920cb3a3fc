"""Crash recovery on the session server (runs after the other server tests): kill the server
process mid-rollout; every request still completes, the restarted server serves the current
weights and version. This is the one test that starts a second SGLang server. The weights are
pushed as tensors (the ``inprocess`` transport's path): the restarted server re-syncs from the
staged safetensors file of that push (``tensor_push`` ``file``)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import torch

from rl_core.testing.generator import InMemoryTransport
from rl_core.types import GenerationRequest, SamplingParams
from rl_sglang import SGLangGenerator

SESSION_SERVER_LAST = True
"""Runs after the other modules on the session server (it kills and restarts that server)."""


def test_killed_server_restarts_resyncs_and_requests_complete(
    owner: SGLangGenerator,
    tiny_model: Path,
    base_weights: dict[str, torch.Tensor],
    perturbed: Any,
    fp: Any,
) -> None:
    transport = InMemoryTransport()
    version = owner.weight_version + 1
    update = transport.publish(version, perturbed(base_weights, 99).items())
    asyncio.run(owner.update_weights(update, transport))
    proc = owner.server_processes[0]
    assert proc is not None and proc.alive()
    reqs = [
        GenerationRequest(
            request_id=f"c{i}",
            input_ids=(5, 17, 42, 99)[: 2 + i % 3],
            sampling=SamplingParams(max_new_tokens=1024, temperature=1.0),
        )
        for i in range(12)
    ]
    before = owner.stats["restarts"]

    async def go():
        task = asyncio.ensure_future(owner.generate(reqs))
        await asyncio.sleep(0.3)
        os.killpg(proc.pid, signal.SIGKILL)  # the whole server: launcher, scheduler, detokenizer
        return await asyncio.wait_for(task, 900)

    results = asyncio.run(go())
    assert owner.stats["restarts"] == before + 1
    assert owner.stats["failed_requests"] == 0
    new = owner.server_processes[0]
    assert new is not None and new is not proc and new.alive() and not proc.group_pids()
    assert all(len(r.output_ids) >= 1 for r in results)
    assert {r.weight_version for r in results} == {version}
    # The restarted server serves exactly the published weights, at the published version.
    got, served_version = fp.served(owner.server_urls[0])
    assert served_version == str(version)
    torch.testing.assert_close(
        got, fp.hf(perturbed(base_weights, 99), tiny_model), atol=1e-3, rtol=0
    )
