"""Cancelling a ``generate`` call is never swallowed by the request retry loop.

No SGLang server: the generator's request path runs against one server entry whose
``/generate`` POST hangs (and, like a closing connection, takes a moment to wind down when
cancelled), so the test controls exactly when the server leaves rotation and when the caller
cancels.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rl_core.types import GenerationRequest
from rl_sglang import SGLangGenerator
from rl_sglang._state import _Live, _Server


def _generator_without_servers() -> tuple[SGLangGenerator, _Server, asyncio.Event]:
    """A generator object with one in-rotation server entry and a hanging POST (no launch)."""
    gen = object.__new__(SGLangGenerator)
    gen.config = SGLangGenerator.Config(server_urls=("http://127.0.0.1:9",), max_retries=3)
    gen.router_url = None
    gen._router_sem = None
    gen.default_stop_ids = ()
    gen.stats = dict.fromkeys(("requests", "retries", "failed_requests", "restarts"), 0)
    gen._version = 0
    gen._updating = False
    server = _Server(0, "http://127.0.0.1:9", 9, None, asyncio.Semaphore(4), up=True)
    gen._servers = [server]
    started = asyncio.Event()

    async def hanging_post(url: str, path: str, body: dict[str, Any], **kw: Any) -> Any:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # the connection takes a moment to close
            raise

    gen._post = hanging_post  # type: ignore[method-assign]
    return gen, server, started


def test_cancel_while_an_abandoned_attempt_winds_down_propagates() -> None:
    async def scenario() -> dict[str, int]:
        gen, server, started = _generator_without_servers()
        req = GenerationRequest(request_id="r", input_ids=(1, 2, 3))
        task = asyncio.ensure_future(gen._one(req, 0, None, _Live("r")))
        await started.wait()
        server.down.set()  # the server leaves rotation: the attempt cancels its POST ...
        await asyncio.sleep(0.1)  # ... and waits for it to wind down, when the caller cancels
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=5)  # before the fix: retried, never cancelled
        return gen.stats

    stats = asyncio.run(scenario())
    assert stats["retries"] == 0  # the cancelled call was not turned into a retry
