"""The servers of :class:`~rl_sglang.generator.SGLangGenerator`: launch or attach, the router,
pause and resume, health probes, and taking a server out of rotation, restarting and re-admitting
it (:class:`ServerFleet`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from rl_core.errors import ConfigError
from rl_sglang._http import Server, ServerClient
from rl_sglang._io import IOLoop
from rl_sglang._launch import ServerLauncher
from rl_sglang.server import ManagedProcess, free_port, wait_healthy

log = logging.getLogger("rl_sglang.generator")  # the generator's logger, as before the split

PAUSE_MODES = ("abort", "retract", "in_place")
"""SGLang's pause modes: abort in-flight requests, retract them to the queue, or freeze them."""


class ServerFleet:
    """The generator's SGLang servers (launched or attached) and optional router: which are in
    rotation, pausing them, probing their health, restarting dead ones.

    A server that comes back is re-synced by the ``rejoin`` hook (the generator's weights and
    adapters) before it is put back; probes are skipped while ``busy()`` (a weight update).
    """

    def __init__(
        self,
        *,
        io: IOLoop,
        client: ServerClient,
        launcher: ServerLauncher,
        procs: list[ManagedProcess],
        stats: dict[str, int],
        max_concurrency: int,
        startup_timeout_s: float,
        health_interval_s: float,
        health_timeout_s: float,
        health_failures: int,
        restart_dead_servers: bool,
        router_url: str | None,
    ) -> None:
        """Nothing starts until :meth:`start`. ``procs`` collects every process launched (the
        generator's finalizer stops them); ``stats["restarts"]`` counts restarts."""
        self._io = io
        self._client = client
        self._launcher = launcher
        self._procs = procs
        self._stats = stats
        self._max_concurrency = max_concurrency
        self._startup_timeout_s = startup_timeout_s
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._health_failures = health_failures
        self._restart_dead_servers = restart_dead_servers
        self.servers: list[Server] = []
        """Every server, in index order (in rotation or not)."""
        self.server_info: dict[str, Any] = {}
        """``/get_server_info`` of the last server (how the servers were launched)."""
        self.router_url: str | None = router_url.rstrip("/") if router_url else None
        """URL ``/generate`` traffic goes to when a router is used."""
        self.router_sem: asyncio.Semaphore | None = None
        """Bounds the requests in flight through the router."""
        self._router: ManagedProcess | None = None
        self.paused: str | None = None
        """The pause mode in effect, or ``None``."""
        self.closed = False
        """Set when the generator closes: no recovery is attempted after."""
        self._rejoin: Callable[[Server], Awaitable[None]] | None = None
        self._busy: Callable[[], bool] = lambda: False

    def set_hooks(
        self, *, rejoin: Callable[[Server], Awaitable[None]], busy: Callable[[], bool]
    ) -> None:
        """``rejoin(s)``: brings a recovered server to the current weights and puts it back
        (:meth:`readmit`); ``busy()``: true while a weight update runs (no probes then)."""
        self._rejoin = rejoin
        self._busy = busy

    # ------------------------------------------------------------------ start-up

    def _launch(self, port: int, index: int) -> ManagedProcess:
        proc = self._launcher.server(port, index)
        self._procs.append(proc)
        return proc

    async def _launch_on_loop(self, port: int, index: int) -> ManagedProcess:
        return self._launch(port, index)

    def start(
        self,
        *,
        launch: int,
        external_urls: Sequence[str],
        attach_urls: Sequence[str],
        use_router: bool,
        version: int,
    ) -> None:
        """Launch ``launch`` servers (plus the running ``external_urls`` next to them), or attach
        to ``attach_urls`` when ``launch`` is 0; wait until all are healthy, stamp ``version`` on
        the attached ones; launch the router when ``use_router``."""
        host = self._launcher.options.host
        sem_total = self._max_concurrency
        procs: list[ManagedProcess | None]
        if launch:
            ports = [free_port(host) for _ in range(launch)]
            # Launched from the IO thread, which lives as long as the generator: the servers'
            # parent-death signal is tied to the launching thread.
            procs = [self._io.call(self._launch_on_loop(p, i)) for i, p in enumerate(ports)]
            urls = [f"http://{host}:{p}" for p in ports]
            for proc, url in zip(procs, urls):
                assert proc is not None
                wait_healthy(proc, url, timeout_s=self._startup_timeout_s)
            # External engines registered next to the launched servers (never owned).
            procs += [None] * len(external_urls)
            urls += list(external_urls)
            ports += [_port(u) for u in external_urls]
        else:
            procs = [None] * len(attach_urls)
            urls = list(attach_urls)
            ports = [_port(u) for u in urls]

        async def make() -> None:
            for i, (url, port, proc) in enumerate(zip(urls, ports, procs)):
                s = Server(i, url, port, proc, asyncio.Semaphore(sem_total))
                info = await self._client.get_json(s, "/get_server_info", timeout=30)
                s.tp_size = int(info.get("tp_size") or 1)
                s.up = True
                self.servers.append(s)
                self.server_info = info
            # Stamp the version the caller says the attached servers' weights are.
            attached = [s for s in self.servers if s.proc is None]
            await asyncio.gather(*(self._client.set_version(s, version) for s in attached))

        self._io.call(make())
        if use_router:
            port = free_port(host)

            async def start_router() -> ManagedProcess:
                return self._launcher.router(urls, port)

            self._router = self._io.call(start_router())
            self._procs.append(self._router)
            self.router_url = f"http://{host}:{port}"
            wait_healthy(self._router, self.router_url, timeout_s=120, path="/health")
        if self.router_url is not None:

            async def router_sem() -> None:
                self.router_sem = asyncio.Semaphore(sem_total * len(self.servers))

            self._io.call(router_sem())

    def up(self) -> list[Server]:
        """The servers in rotation."""
        return [s for s in self.servers if s.up]

    # ------------------------------------------------------------------ pause

    async def pause(self, mode: str) -> None:
        """Hold new requests on every server in rotation (``mode``: one of :data:`PAUSE_MODES`)."""
        if mode not in PAUSE_MODES:
            raise ConfigError(f"SGLangGenerator.pause: mode {mode!r} is not one of {PAUSE_MODES}.")

        async def go() -> None:
            self.paused = mode
            await asyncio.gather(
                *(
                    self._client.control(s, "/pause_generation", {"mode": mode})
                    for s in self.servers
                    if s.up
                )
            )

        await self._io.run(go())

    async def resume(self) -> None:
        """Continue generation on every server in rotation."""

        async def go() -> None:
            self.paused = None
            await asyncio.gather(
                *(
                    self._client.control(s, "/continue_generation", {"torch_empty_cache": False})
                    for s in self.servers
                    if s.up
                )
            )

        await self._io.run(go())

    # ------------------------------------------------------------------ health and restart

    async def health(self) -> bool:
        """True when at least one server is in rotation and answers ``/health_generate``."""

        async def go() -> bool:
            for s in self.servers:
                if s.up and await self._probe(s):
                    return True
            return False

        return await self._io.run(go())

    async def _probe(self, s: Server) -> bool:
        if s.proc is not None and not s.proc.alive():
            return False
        assert self._io.session is not None
        try:
            async with self._io.session.get(
                s.url + "/health_generate",
                timeout=aiohttp.ClientTimeout(total=self._health_timeout_s),
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def health_loop(self) -> None:
        """Probe the servers every ``health_interval_s`` (not while paused or updating); take
        a dead or hung one out of rotation."""
        while True:
            await asyncio.sleep(self._health_interval_s)
            if self.paused or self._busy():
                continue
            for s in list(self.servers):
                if not s.up:
                    continue
                if await self._probe(s):
                    s.failures = 0
                    continue
                if self.paused or self._busy():
                    break  # a probe during pause/update proves nothing
                s.failures += 1
                dead = s.proc is not None and not s.proc.alive()
                if dead or s.failures >= self._health_failures:
                    self.mark_down(s, "process exited" if dead else f"{s.failures} failed probes")

    def suspect(self, s: Server) -> None:
        """A request to ``s`` failed at the connection level: act now if the process is gone."""
        if s.proc is not None and not s.proc.alive():
            self.mark_down(s, "process exited")

    def mark_down(self, s: Server, why: str) -> None:
        """Take ``s`` out of rotation and start bringing it back (on the IO loop)."""
        if not s.up:
            return
        log.warning("SGLangGenerator: server %s out of rotation: %s", s.url, why)
        s.up = False
        s.down.set()
        if s.recovering is None or s.recovering.done():
            s.recovering = asyncio.ensure_future(self._recover(s))

    async def readmit(self, s: Server) -> None:
        """Put the re-synced ``s`` back in rotation (paused again if the fleet is paused)."""
        if self.paused:
            await self._client.control(s, "/pause_generation", {"mode": self.paused})
        s.failures = 0
        s.down = asyncio.Event()
        s.up = True

    async def _recover(self, s: Server) -> None:
        """Restart (owned) or wait for (attached) ``s``, re-sync it, put it back."""
        while not self.closed:
            try:
                if s.proc is not None and self._restart_dead_servers:
                    old = s.proc
                    await asyncio.to_thread(old.stop)
                    with contextlib.suppress(ValueError):
                        self._procs.remove(old)
                    s.proc = self._launch(s.port, s.index)
                    await asyncio.to_thread(
                        wait_healthy, s.proc, s.url, timeout_s=self._startup_timeout_s
                    )
                    self._stats["restarts"] += 1
                    s.restarts += 1
                else:
                    while not await self._probe(s):
                        await asyncio.sleep(max(self._health_interval_s, 1.0))
                assert self._rejoin is not None, "ServerFleet.set_hooks was not called"
                await self._rejoin(s)
                log.warning("SGLangGenerator: server %s back in rotation", s.url)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.error("SGLangGenerator: recovering %s failed: %s; retrying", s.url, e)
                await asyncio.sleep(5.0)


def _port(url: str) -> int:
    """The port of a server URL (``http://host:port``)."""
    return int(url.rsplit(":", 1)[1].split("/")[0])
