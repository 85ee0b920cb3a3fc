"""Client-side state of :class:`~rl_sglang.generator.SGLangGenerator`: servers, requests in flight.

Shared by the generator's parts (``_http``, ``_requests``, ``_control``, ``_weights``), which are
mixins of one class; :class:`_GeneratorState` declares the attributes they read and write.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rl_core.types import FinishReason
from rl_sglang._io import IOLoop
from rl_sglang._routing import RoutingLayout
from rl_sglang.server import ManagedProcess

if TYPE_CHECKING:
    from rl_sglang.generator import SGLangGenerator

PAUSE_MODES = ("abort", "retract", "in_place")
"""SGLang's pause modes: abort in-flight requests, retract them to the queue, or freeze them."""

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class _Retry(Exception):
    """A transient failure: retry the request elsewhere."""


@dataclass(slots=True, eq=False)
class _Server:
    """One SGLang server and its client-side state (lives on the IO loop)."""

    index: int
    url: str
    port: int
    proc: ManagedProcess | None
    sem: asyncio.Semaphore
    up: bool = False
    down: asyncio.Event = field(default_factory=asyncio.Event)
    failures: int = 0
    restarts: int = 0
    recovering: asyncio.Task[None] | None = None
    tp_size: int = 1


@dataclass(slots=True, eq=False)
class _Live:
    """One request in flight (or waiting for a slot)."""

    request_id: str
    rid: str = ""
    server: _Server | None = None
    aborted: bool = False


class _GeneratorState:
    """Attributes shared by the mixins of :class:`~rl_sglang.generator.SGLangGenerator`
    (set in its ``__init__``)."""

    config: SGLangGenerator.Config
    owned: bool
    python: str
    stats: dict[str, int]
    router_url: str | None
    vocab_size: int | None
    default_stop_ids: tuple[int, ...]
    routing_layout: RoutingLayout | None
    supports_routing: bool
    supports_lora: bool
    _lora: dict[str, str]
    _lora_alias: dict[str, str]
    _default_lora: str | None
    _version: int
    _updating: bool
    _paused: str | None
    _closed: bool
    _seed_rng: random.Random
    _live: dict[str, list[_Live]]
    _abort_epoch: int
    _source: tuple[str, Any] | None
    _router_sem: asyncio.Semaphore | None
    _background: set[asyncio.Future[Any]]
    _io: IOLoop
    _procs: list[ManagedProcess]
    _servers: list[_Server]
