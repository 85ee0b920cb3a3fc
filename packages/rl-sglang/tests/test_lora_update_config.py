"""Adapter-only updates refused before anything moves when the servers cannot serve them (no
server: the generator's parts are built by hand): a ``ConfigError`` naming the generator options."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from rl_core.errors import ConfigError, GenerationError, WeightSyncError
from rl_core.lora import LoRAConfig, with_adapter
from rl_core.types import GenerationRequest, WeightUpdate
from rl_sglang import SGLangGenerator
from rl_sglang._fleet import ServerFleet
from rl_sglang._lora import LoRARegistry
from rl_sglang._weights import WeightUpdater
from rl_sglang.collective import SGLangCollectiveTransport

LORA = LoRAConfig(rank=16, target_modules=("q_proj", "down_proj"), name="policy")


class _NoTransport:
    """A transport that must not be reached."""

    def apply(self, update: WeightUpdate, target: object) -> None:
        raise AssertionError("the transport was used before the servers were checked")


def _gen(*, lora: bool, server_info: dict | None = None) -> SGLangGenerator:
    """A generator attached to nothing, with the parts a launch would have made (no servers, no
    IO loop: nothing may go out)."""
    info = server_info or {}
    gen = SGLangGenerator.__new__(SGLangGenerator)
    gen.config = SGLangGenerator.Config(server_urls=("http://127.0.0.1:1",))
    gen.supports_lora = lora
    fleet = ServerFleet(
        io=None,  # type: ignore[arg-type]
        client=None,  # type: ignore[arg-type]
        launcher=None,  # type: ignore[arg-type]
        procs=[],
        stats={},
        max_concurrency=1,
        startup_timeout_s=1.0,
        health_interval_s=0.0,
        health_timeout_s=1.0,
        health_failures=1,
        restart_dead_servers=False,
        router_url=None,
    )
    weights = WeightUpdater(io=None, client=None, fleet=fleet, version=0, base_model="")  # type: ignore[arg-type]
    gen._fleet = fleet
    gen._weights = weights
    gen._lora = LoRARegistry(
        io=None,  # type: ignore[arg-type]
        client=None,  # type: ignore[arg-type]
        fleet=fleet,
        weights=weights,
        adapters_dir=Path("/nonexistent"),
        enabled=lora,
        max_rank=info.get("max_lora_rank") or gen.config.max_lora_rank,
        target_modules=info.get("lora_target_modules") or gen.config.lora_target_modules,
    )
    return gen


def _update() -> WeightUpdate:
    return with_adapter(WeightUpdate(version=1, base_version=None, transport="disk_full"), LORA)


def test_adapter_update_without_lora_serving_names_the_options() -> None:
    with pytest.raises(ConfigError, match="enable_lora=true, max_lora_rank>=16") as err:
        asyncio.run(_gen(lora=False).update_weights(_update(), _NoTransport()))  # type: ignore[arg-type]
    assert "lora_target_modules=['down_proj', 'q_proj']" in str(err.value)
    assert "launched without LoRA" in str(err.value)


@pytest.mark.parametrize(
    ("info", "match"),
    [
        ({"max_lora_rank": 8, "lora_target_modules": ["all"]}, "ranks up to 8"),
        ({"max_lora_rank": 64, "lora_target_modules": ["q_proj"]}, r"missing \['down_proj'\]"),
    ],
)
def test_adapter_the_servers_cannot_take_is_refused(info: dict, match: str) -> None:
    gen = _gen(lora=True, server_info=info)
    with pytest.raises(ConfigError, match=match):
        asyncio.run(gen.update_weights(_update(), _NoTransport()))  # type: ignore[arg-type]


def test_adapter_update_not_through_the_collective() -> None:
    transport = SGLangCollectiveTransport.__new__(SGLangCollectiveTransport)
    with pytest.raises(WeightSyncError, match="sglang_collective"):
        asyncio.run(_gen(lora=True).update_weights(_update(), transport))


def test_adapters_refused_by_a_server_without_lora() -> None:
    """Without LoRA serving, a request naming an adapter and the adapter calls are refused with a
    GenerationError naming enable_lora, before anything reaches a server."""
    gen = _gen(lora=False)
    req = GenerationRequest(request_id="r", input_ids=(1, 2))
    with pytest.raises(GenerationError, match="enable_lora=true"):
        asyncio.run(gen.generate([req], lora_adapter="x"))
    with pytest.raises(GenerationError, match="enable_lora=true"):
        asyncio.run(gen.generate([dataclasses.replace(req, adapter="x")]))
    with pytest.raises(GenerationError, match="enable_lora=true"):
        asyncio.run(gen.load_lora_adapter("x", "/nonexistent"))
    with pytest.raises(GenerationError, match="enable_lora=true"):
        gen.default_lora_adapter = "x"
