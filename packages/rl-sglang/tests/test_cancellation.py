"""Cancelling a ``generate`` call is never swallowed by the request retry loop.

No SGLang server: the generator's request part (``RequestDispatcher``) runs against one server
entry whose ``/generate`` POST hangs (and, like a closing connection, takes a moment to wind down when
cancelled), so the test controls exactly when the server leaves rotation and when the caller
cancels.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rl_core.types import GenerationRequest
from rl_sglang._fleet import ServerFleet
from rl_sglang._http import Server, ServerClient
from rl_sglang._requests import RequestDispatcher, _Live
from rl_sglang._weights import WeightUpdater


class _HangingClient(ServerClient):
    """A client whose ``/generate`` POST hangs until cancelled, then winds down slowly."""

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # no IO loop: nothing goes out
        self.started = asyncio.Event()

    async def post(self, url: str, path: str, body: dict[str, Any], **kw: Any) -> Any:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # the connection takes a moment to close
            raise


def _dispatcher_without_servers() -> tuple[RequestDispatcher, Server, asyncio.Event]:
    """The generator's request part over one in-rotation server entry whose POST hangs (no
    launch, no IO loop: the test awaits the attempt directly)."""
    client = _HangingClient()
    stats = dict.fromkeys(("requests", "retries", "failed_requests", "restarts"), 0)
    fleet = ServerFleet(
        io=None,  # type: ignore[arg-type]
        client=client,
        launcher=None,  # type: ignore[arg-type]
        procs=[],
        stats=stats,
        max_concurrency=4,
        startup_timeout_s=1.0,
        health_interval_s=0.0,
        health_timeout_s=1.0,
        health_failures=3,
        restart_dead_servers=False,
        router_url=None,
    )
    server = Server(0, "http://127.0.0.1:9", 9, None, asyncio.Semaphore(4), up=True)
    fleet.servers = [server]
    weights = WeightUpdater(
        io=None,  # type: ignore[arg-type]
        client=client,
        fleet=fleet,
        version=0,
        base_model="",
    )
    dispatcher = RequestDispatcher(
        io=None,  # type: ignore[arg-type]
        client=client,
        fleet=fleet,
        weights=weights,
        stats=stats,
        seed=0,
        max_retries=3,
        retry_backoff_s=0.5,
        request_timeout_s=600.0,
        stop_on_eos=True,
        extra_stop_token_ids=(),
        default_stop_ids=(),
        vocab_size=None,
        routing_layout=None,
        supports_routing=False,
    )
    return dispatcher, server, client.started


def test_cancel_while_an_abandoned_attempt_winds_down_propagates() -> None:
    async def scenario() -> dict[str, int]:
        dispatcher, server, started = _dispatcher_without_servers()
        req = GenerationRequest(request_id="r", input_ids=(1, 2, 3))
        task = asyncio.ensure_future(dispatcher._one(req, 0, None, _Live("r")))
        await started.wait()
        server.down.set()  # the server leaves rotation: the attempt cancels its POST ...
        await asyncio.sleep(0.1)  # ... and waits for it to wind down, when the caller cancels
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=5)  # before the fix: retried, never cancelled
        return dispatcher._stats

    stats = asyncio.run(scenario())
    assert stats["retries"] == 0  # the cancelled call was not turned into a retry
