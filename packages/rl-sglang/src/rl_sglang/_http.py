"""The client side of the SGLang servers: one :class:`Server` entry per server and the HTTP calls
made to them (:class:`ServerClient`), over the generator's private IO loop."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rl_core.errors import GenerationError, WeightSyncError
from rl_sglang._io import IOLoop
from rl_sglang.server import ManagedProcess

log = logging.getLogger("rl_sglang.generator")  # the generator's logger, as before the split


@dataclass(slots=True, eq=False)
class Server:
    """One SGLang server and its client-side state (lives on the IO loop)."""

    index: int
    """Position among the generator's servers (also picks its GPUs and log name)."""
    url: str
    """``http://host:port``."""
    port: int
    """The port it listens on (a restarted server keeps it)."""
    proc: ManagedProcess | None
    """Its launcher process; ``None`` for an attached server (not owned)."""
    sem: asyncio.Semaphore
    """Bounds the requests in flight on it (``max_concurrency``)."""
    up: bool = False
    """In rotation: requests and weight updates go to it."""
    down: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when it leaves rotation (requests in flight on it are retried elsewhere)."""
    failures: int = 0
    """Consecutive failed health probes."""
    restarts: int = 0
    """Times it was restarted."""
    recovering: asyncio.Task[None] | None = None
    """The task bringing it back into rotation, if any."""
    tp_size: int = 1
    """Its tensor-parallel size (a tensor update sends one payload per rank)."""


class ServerClient:
    """GET/POST to the servers on the IO loop; control calls that must succeed."""

    def __init__(self, io: IOLoop) -> None:
        """Use ``io``'s pooled HTTP session (every call runs on ``io``'s loop)."""
        self._io = io

    async def get_json(self, s: Server, path: str, *, timeout: float) -> Any:
        """GET ``path`` of ``s`` and return its JSON body (not 200: GenerationError)."""
        assert self._io.session is not None
        async with self._io.session.get(
            s.url + path, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                raise GenerationError(f"GET {s.url}{path}: HTTP {resp.status} {await resp.text()}")
            return await resp.json(content_type=None)

    async def post(
        self, url: str, path: str, body: dict[str, Any], *, timeout: float = 300.0
    ) -> tuple[int, Any]:
        """POST ``body`` as JSON to ``url + path``: the status and the parsed (or raw) reply."""
        assert self._io.session is not None
        async with self._io.session.post(
            url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            text = await resp.text()
            try:
                data = json.loads(text) if text else None
            except ValueError:
                data = text
            return resp.status, data

    async def control(self, s: Server, path: str, body: dict[str, Any]) -> Any:
        """POST a control call that must succeed (``success: false`` raises WeightSyncError).

        A write into a pooled connection the server had just closed (``ClientOSError``, e.g.
        broken pipe: the request never reached the server) is retried on a fresh connection.
        """
        for attempt in range(3):
            try:
                status, data = await self.post(s.url, path, body)
                break
            except aiohttp.ClientOSError:
                if attempt == 2 or (s.proc is not None and not s.proc.alive()):
                    raise
                await asyncio.sleep(0.2)
        ok = status == 200 and not (isinstance(data, dict) and data.get("success") is False)
        if not ok:
            msg = data.get("message", data) if isinstance(data, dict) else data
            raise WeightSyncError(f"{s.url}{path} failed (HTTP {status}): {msg}")
        return data

    async def set_version(self, s: Server, version: int) -> None:
        """Stamp ``version`` as the weight version ``s`` serves."""
        await self.control(
            s, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
        )
