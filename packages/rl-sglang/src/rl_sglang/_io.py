"""A private event loop in a daemon thread, where all of the generator's HTTP traffic runs.

The generator's public coroutines may be awaited from any event loop (tests run one
``asyncio.run`` after another), and weight-transport callbacks arrive in worker threads; both
hand their coroutines to this loop, which owns the one ``aiohttp`` session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")

__all__ = ["IOLoop"]


class IOLoop:
    """An asyncio loop running forever in a daemon thread, with one pooled HTTP session."""

    def __init__(self, name: str, *, max_connections: int) -> None:
        """Start the thread; the session is created on the loop."""
        self.loop = asyncio.new_event_loop()
        """The private loop."""
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()
        self._max_connections = max_connections
        self.session: aiohttp.ClientSession | None = None
        """The HTTP session (created on the loop)."""
        self._thread.start()
        self._started.wait()
        self.call(self._make_session())

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    async def _make_session(self) -> None:
        # Idle connections are dropped after 2 s, before the server's keep-alive (uvicorn: 5 s)
        # closes them: a request written into a connection the server just closed fails with
        # "broken pipe", which must not look like a dead server.
        conn = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=2.0)
        # No session-wide timeout: each call sets its own; trust_env off (no proxies on loopback).
        self.session = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=None), trust_env=False
        )

    def in_loop(self) -> bool:
        """True when called from the private loop's thread."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the private loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the private loop from another event loop (cancellation propagates)."""
        return await asyncio.wrap_future(self.submit(coro))

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the private loop and block this (non-loop) thread for the result."""
        if self.in_loop():
            coro.close()
            raise RuntimeError("IOLoop.call from the loop's own thread would deadlock")
        return self.submit(coro).result(timeout)

    def cancel_tasks(self) -> None:
        """Cancel every task on the loop (monitors, recoveries, requests) and wait for them."""
        if not self._thread.is_alive():
            return

        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.call(cancel(), timeout=10)

    def close(self) -> None:
        """Cancel tasks, close the session, stop the loop and join the thread. Idempotent."""
        if not self._thread.is_alive():
            return
        self.cancel_tasks()

        async def shutdown() -> None:
            if self.session is not None:
                await self.session.close()

        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.call(shutdown(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
