"""Run a :class:`~rl_tinker.server.TinkerService` on its own event loop in a background thread
(tests, notebooks, benchmarks) or in the foreground (the CLI)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from rl_tinker.config import ServiceConfig
from rl_tinker.server import TinkerService

__all__ = ["RunningService", "serve_forever", "start"]


class RunningService:
    """A service listening on ``url`` from a background thread; :meth:`stop` ends it."""

    def __init__(
        self,
        service: TinkerService,
        loop: asyncio.AbstractEventLoop,
        runner: Any,
        thread: threading.Thread,
        port: int,
    ) -> None:
        self.service = service
        """The service object (its ``metrics``)."""
        self.url = f"http://{service.config.host}:{port}"
        """Base URL for ``tinker.ServiceClient(base_url=...)``."""
        self._loop, self._runner, self._thread = loop, runner, thread
        self._stopped = False

    def stop(self) -> None:
        """Stop listening, finish the running operation and end the thread (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=60)
        self.service.close()

    def __enter__(self) -> RunningService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _listen(service: TinkerService) -> tuple[Any, int]:
    from aiohttp import web

    service._loop = asyncio.get_running_loop()
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, service.config.host, service.config.port)
    await site.start()
    port = runner.addresses[0][1]
    return runner, port


def _preload(service: TinkerService) -> None:
    """With ``sampler: sglang`` load every base model (and launch its SGLang servers, a minute
    or more) before listening: inside a client's first request the launch would outlast the
    SDK's request timeout."""
    if service.config.sampler == "sglang":
        try:
            for name in service.config.models:
                service.base(name)
        except BaseException:
            service.close()
            raise


def start(config: ServiceConfig) -> RunningService:
    """Start a service in a daemon thread and return once it listens."""
    service = TinkerService(config)
    _preload(service)
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    started = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            ready["v"] = loop.run_until_complete(_listen(service))
        except BaseException as e:  # reported to the caller
            ready["e"] = e
            started.set()
            return
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=main, name="rl-tinker-http", daemon=True)
    thread.start()
    started.wait()
    if "e" in ready:
        raise ready["e"]
    runner, port = ready["v"]
    return RunningService(service, loop, runner, thread, port)


def serve_forever(config: ServiceConfig) -> None:
    """Run a service in the foreground until interrupted."""
    service = TinkerService(config)
    _preload(service)

    async def main() -> None:
        runner, port = await _listen(service)
        print(
            f"rl-tinker: serving {sorted(config.models)} on http://{config.host}:{port}", flush=True
        )
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        service.close()
