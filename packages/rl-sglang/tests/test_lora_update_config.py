"""Adapter-only updates refused before anything moves when the servers cannot serve them (no
server: the generator's state is set by hand): a ``ConfigError`` naming the generator options."""

from __future__ import annotations

import asyncio

import pytest

from rl_core.errors import ConfigError, WeightSyncError
from rl_core.lora import LoRAConfig, with_adapter
from rl_core.types import WeightUpdate
from rl_sglang import SGLangGenerator
from rl_sglang.collective import SGLangCollectiveTransport

LORA = LoRAConfig(rank=16, target_modules=("q_proj", "down_proj"), name="policy")


class _NoTransport:
    """A transport that must not be reached."""

    def apply(self, update: WeightUpdate, target: object) -> None:
        raise AssertionError("the transport was used before the servers were checked")


def _gen(*, lora: bool, server_info: dict | None = None) -> SGLangGenerator:
    """A generator attached to nothing, with the state a launch would have set."""
    gen = SGLangGenerator.__new__(SGLangGenerator)
    gen.config = SGLangGenerator.Config(server_urls=("http://127.0.0.1:1",))
    gen.supports_lora = lora
    gen._server_info = server_info or {}  # type: ignore[attr-defined]
    gen._closed = False
    gen._version = 0
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
