"""SGLangGenerator against the session's real SGLang server: log-prob fidelity, abort and pause,
every weight-update path, the router, and attaching to an external server."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from rl_core.batching import gather_response, pack_rollouts
from rl_core.errors import WeightSyncError
from rl_core.testing.generator import InMemoryTransport
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Rollout,
    RolloutStatus,
    SamplingParams,
)
from rl_hf import HFPolicy
from rl_sglang import SGLangCollectiveTransport, SGLangGenerator
from rl_weightsync.disk_delta import DiskDeltaTransport
from rl_weightsync.disk_full import DiskFullTransport

P = (5, 17, 42, 99, 3, 120, 64, 7, 250, 31, 11, 2)
"""Prompt token ids."""


def _req(rid: str, ids: tuple[int, ...], **sampling: Any) -> GenerationRequest:
    return GenerationRequest(request_id=rid, input_ids=ids, sampling=SamplingParams(**sampling))


def _save_checkpoint(weights: dict[str, torch.Tensor], model_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix in (".json", ".jinja") and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


def test_logprobs_match_reference_policy(
    attach: Callable[..., SGLangGenerator],
    tiny_model: Path,
    base_weights: dict[str, torch.Tensor],
    perturbed: Callable[..., dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    """Sampled tokens' log-probs equal HFPolicy.compute_logprobs on the same (updated) weights
    within 1e-3, and the training targets are exactly the sampled ids (no re-tokenization)."""
    gen = attach()
    new = perturbed(base_weights, seed=11, scale=0.3)
    ckpt = _save_checkpoint(new, tiny_model, tmp_path / "v1")
    gen.load_weights_from_disk(str(ckpt), version=1)
    prompts = [P[: 3 + i] for i in range(6)]
    reqs = [_req(f"f{i}", p, max_new_tokens=12, temperature=1.0) for i, p in enumerate(prompts)]
    results = asyncio.run(gen.generate(reqs))
    assert {r.weight_version for r in results} == {1}
    rollouts = [
        Rollout(
            prompt_uid=q.request_id,
            rollout_id=q.request_id,
            sample_id=q.request_id,
            tokens=q.input_ids + r.output_ids,
            response_start=len(q.input_ids),
            loss_mask=(1,) * len(r.output_ids),
            rollout_logprobs=r.output_logprobs,
            versions=(r.weight_version,) * len(r.output_ids),
            status=r.finish_reason.to_status(),
        )
        for q, r in zip(reqs, results)
    ]
    policy = HFPolicy(HFPolicy.Config(model_path=str(ckpt)))
    ref_T = policy.compute_logprobs(pack_rollouts(rollouts)).logprobs
    for r, ref_R in zip(results, gather_response(rollouts, ref_T)):
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref_R, atol=1e-3, rtol=0)


def _long(i: int) -> GenerationRequest:
    return _req(f"l{i}", P[: 2 + i], max_new_tokens=3000, temperature=1.0)


def test_pause_modes_and_partial_rollouts(attach: Callable[..., SGLangGenerator]) -> None:
    """pause(abort) ends in-flight requests with partial tokens and log-probs; retract and
    in_place hold them and they finish normally after resume; new work waits while paused."""
    gen = attach(stop_on_eos=False)

    async def run(mode: str) -> tuple[list[GenerationResult], bool]:
        task = asyncio.ensure_future(gen.generate([_long(i) for i in range(4)]))
        await asyncio.sleep(0.5)
        await gen.pause(mode)
        late = asyncio.ensure_future(gen.generate([_req("late", P[:4], max_new_tokens=2)]))
        await asyncio.sleep(0.5)
        held = not late.done()
        if mode != "abort":
            assert not task.done(), f"{mode}: requests ended while paused"
        await gen.resume()
        if mode != "abort":
            await gen.abort()  # cut the 3000-token requests short after resume
        res = await asyncio.wait_for(task, 120)
        await asyncio.wait_for(late, 60)
        return res, held

    res, held = asyncio.run(run("abort"))
    assert held
    assert all(r.finish_reason == FinishReason.ABORT for r in res)
    assert all(0 < len(r.output_ids) == len(r.output_logprobs) < 3000 for r in res)
    assert all(r.finish_reason.to_status() == RolloutStatus.ABORTED for r in res)
    for mode in ("retract", "in_place"):
        res, held = asyncio.run(run(mode))
        assert held, mode
        assert all(len(r.output_ids) == len(r.output_logprobs) > 0 for r in res), mode


def test_abort_by_id_returns_partial(attach: Callable[..., SGLangGenerator]) -> None:
    """abort(ids) stops only those requests, each with its partial tokens and log-probs."""
    gen = attach(stop_on_eos=False)

    async def go() -> list[GenerationResult]:
        task = asyncio.ensure_future(gen.generate([_long(i) for i in range(4)]))
        await asyncio.sleep(0.5)
        await gen.abort(["l0", "l2"])
        # Long enough that l1/l3 get further than l0/l2 even on a loaded machine (at 0.5 s a
        # busy 2-core machine once left all four at the same 70 tokens); 3000 tokens each is
        # far more than a quiet machine generates in that time.
        await asyncio.sleep(2.0)
        await gen.abort()
        return await asyncio.wait_for(task, 60)

    res = asyncio.run(go())
    assert [r.finish_reason for r in res] == [FinishReason.ABORT] * 4
    assert all(len(r.output_ids) == len(r.output_logprobs) > 0 for r in res)
    assert min(len(res[1].output_ids), len(res[3].output_ids)) > max(
        len(res[0].output_ids), len(res[2].output_ids)
    )


def test_ignore_eos_mode_refuses_stop_ids(attach: Callable[..., SGLangGenerator]) -> None:
    """With stop_on_eos=False SGLang's ignore_eos would also ignore the request's stop ids: the
    request is refused with the fix, never run past its stops."""
    from rl_core.errors import GenerationError

    gen = attach(stop_on_eos=False)
    with pytest.raises(GenerationError, match="ignores every stop id"):
        asyncio.run(gen.generate([_req("s", P[:3], max_new_tokens=4, stop_token_ids=(5,))]))
    (ok,) = asyncio.run(gen.generate([_req("n", P[:3], max_new_tokens=4)]))
    assert ok.finish_reason == FinishReason.LENGTH and len(ok.output_ids) == 4


@pytest.mark.parametrize(
    "path", ["disk_full", "disk_delta", "tensor", "tensor_inline", "collective"]
)
def test_weight_update_paths_serve_exact_version(
    path: str,
    attach: Callable[..., SGLangGenerator],
    tiny_model: Path,
    base_weights: dict[str, torch.Tensor],
    perturbed: Callable[..., dict[str, torch.Tensor]],
    fp: Any,
    tmp_path: Path,
) -> None:
    """Two successive updates through each path: after each, the server's teacher-forced
    log-probs equal transformers' on exactly the published weights, the server reports the
    version, and generations carry it. A replayed update is refused and changes nothing.
    ``tensor`` pushes by file (the server is on 127.0.0.1), ``tensor_inline`` in the HTTP body."""
    gen = attach(tensor_push="inline") if path == "tensor_inline" else attach()
    assert gen._weights.pushes_by_file() == (path != "tensor_inline")
    if path == "disk_full":
        transport: Any = DiskFullTransport(
            DiskFullTransport.Config(directory=tmp_path / "sync", assets_dir=tiny_model)
        )
    elif path == "disk_delta":
        transport = DiskDeltaTransport(
            DiskDeltaTransport.Config(
                directory=tmp_path / "sync",
                local_dir=tmp_path / "local",
                base_checkpoint=tiny_model,
            )
        )
    elif path in ("tensor", "tensor_inline"):
        transport = InMemoryTransport()
    else:
        transport = SGLangCollectiveTransport(SGLangCollectiveTransport.Config(backend="gloo"))
    url = gen.server_urls[0]
    base_fp, _ = fp.served(url)
    torch.testing.assert_close(base_fp, fp.hf(base_weights, tiny_model), atol=1e-3, rtol=0)
    for version, seed in ((1, 21), (2, 22)):
        weights = perturbed(base_weights, seed)
        update = transport.publish(version, weights.items())
        asyncio.run(gen.update_weights(update, transport))
        assert gen.weight_version == version
        got, served_version = fp.served(url)
        assert served_version == str(version)
        torch.testing.assert_close(got, fp.hf(weights, tiny_model), atol=1e-3, rtol=0)
        assert (got - base_fp).abs().max() > 0.05, "weights did not change"
        (res,) = asyncio.run(gen.generate([_req("v", P[:5], max_new_tokens=3)]))
        assert res.weight_version == version
    with pytest.raises(WeightSyncError):
        asyncio.run(gen.update_weights(update, transport))
    assert gen.weight_version == 2
    torch.testing.assert_close(fp.served(url)[0], got, atol=0, rtol=0)
    transport.close()


def test_router_front(
    attach: Callable[..., SGLangGenerator],
    tiny_model: Path,
    base_weights: dict[str, torch.Tensor],
    perturbed: Callable[..., dict[str, torch.Tensor]],
) -> None:
    """With the SGLang router in front, /generate goes through the router and weight updates go
    to the servers directly; closing the generator stops the router it launched."""
    gen = attach(use_router=True)
    assert gen.router_url is not None and gen.router_url not in gen.server_urls
    reqs = [_req(f"r{i}", P[: 3 + i % 4], max_new_tokens=6) for i in range(8)]
    res = asyncio.run(gen.generate(reqs))
    assert [r.request_id for r in res] == [q.request_id for q in reqs]
    assert all(len(r.output_ids) == len(r.output_logprobs) >= 1 for r in res)
    transport = InMemoryTransport()
    update = transport.publish(1, perturbed(base_weights, 5).items())
    asyncio.run(gen.update_weights(update, transport))
    res = asyncio.run(gen.generate(reqs[:2]))
    assert {r.weight_version for r in res} == {1}
    router = next(p for p in gen._procs if p.name == "router")
    with urllib.request.urlopen(gen.router_url + "/workers", timeout=30) as resp:
        workers = json.dumps(json.loads(resp.read()))
    assert gen.server_urls[0] in workers, workers
    asyncio.run(gen.close())
    assert not router.alive() and not router.group_pids()


def test_external_attach_does_not_own(
    owner: SGLangGenerator, attach: Callable[..., SGLangGenerator]
) -> None:
    """An attached generator learns the server's setup, stamps its version, serves, and leaves
    the server running on close."""
    gen = attach(initial_version=0)
    assert not gen.owned and gen.server_processes == [None]
    assert gen.vocab_size == 260 and gen.default_stop_ids == (258, 259)
    (res,) = asyncio.run(gen.generate([_req("a", P[:4], max_new_tokens=4)]))
    assert res.weight_version == 0 and 1 <= len(res.output_ids) <= 4
    asyncio.run(gen.close())
    assert all(p is not None and p.alive() for p in owner.server_processes)
    assert asyncio.run(owner.health())


def test_routing_refused_on_dense_model(
    attach: Callable[..., SGLangGenerator], sglang_python: str, tiny_model: Path
) -> None:
    """A dense model has no routing: ``return_routing`` is refused with a GenerationError naming
    rollout.routing_replay, and ``capture_routing`` on a dense checkpoint is a ConfigError."""
    from rl_core.errors import ConfigError, GenerationError

    gen = attach()
    assert not gen.supports_routing
    req = GenerationRequest(request_id="r", input_ids=P, return_routing=True)
    with pytest.raises(GenerationError, match="routing_replay"):
        asyncio.run(gen.generate([req]))
    with pytest.raises(ConfigError, match="capture_routing"):
        SGLangGenerator(
            SGLangGenerator.Config(
                model_path=str(tiny_model), python=sglang_python, capture_routing=True
            )
        )


def test_memory_release_refused_on_cpu_server(
    attach: Callable[..., SGLangGenerator], fp: Any
) -> None:
    """A CPU server (no memory saver) reports supports_memory_release false; release/resume
    calls are refused with a GenerationError without reaching the server (SGLang 0.5.23's
    /release_memory_occupation would kill it: its handler calls torch.cuda.synchronize), which
    keeps serving; an adapter that is not loaded is refused too. (A server without LoRA refusing
    adapters: ``test_lora_update_config.py``; the session server serves LoRA.)"""
    from rl_core.errors import GenerationError

    gen = attach()
    assert not gen.supports_memory_release and gen.supports_lora
    with pytest.raises(GenerationError, match="tags"):
        asyncio.run(gen.release_memory(["weights", "activations"]))
    with pytest.raises(GenerationError, match="enable_memory_saver"):
        asyncio.run(gen.release_memory(["kv_cache"]))
    with pytest.raises(GenerationError, match="enable_memory_saver"):
        asyncio.run(gen.resume_memory())
    with pytest.raises(GenerationError, match="no LoRA adapter named 'x'"):
        asyncio.run(gen.generate([_req("l", P)], lora_adapter="x"))
    _, version = fp.served(gen.server_urls[0])
    assert version == "0"
