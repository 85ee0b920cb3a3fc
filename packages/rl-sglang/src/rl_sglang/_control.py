"""Abort, pause and health of :class:`~rl_sglang.generator.SGLangGenerator` (restart of dead servers)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import aiohttp

from rl_core.errors import ConfigError
from rl_sglang._state import PAUSE_MODES, _GeneratorState, _Server
from rl_sglang.server import wait_healthy

log = logging.getLogger("rl_sglang.generator")  # the generator's logger, as before the split


class _ControlMixin(_GeneratorState):
    """Abort and pause requests; probe servers, take dead ones out of rotation, restart and re-sync them."""

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the given (or all) requests; they return ABORT with their partial tokens.

        Requests still waiting for a slot return ABORT with no tokens. Unknown ids are ignored.
        Aborting all also covers requests of :meth:`~rl_sglang.SGLangGenerator.generate` calls
        already made but not yet dispatched.
        """
        if request_ids is None:
            self._abort_epoch += 1
        await self._io.run(self._abort(None if request_ids is None else list(request_ids)))

    async def _abort(self, request_ids: list[str] | None) -> None:
        if request_ids is None:
            lives = [lv for group in self._live.values() for lv in group]
        else:
            lives = [lv for rid in request_ids for lv in self._live.get(rid, [])]
        for lv in lives:
            lv.aborted = True
        up = [s for s in self._servers if s.up]
        if request_ids is None:
            bodies = [{"abort_all": True}]
        else:
            bodies = [{"rid": lv.rid} for lv in lives if lv.rid]
        if not bodies:
            return

        async def send() -> None:
            calls = []
            for body in bodies:
                targets = up
                if "rid" in body:
                    owner = next((lv.server for lv in lives if lv.rid == body["rid"]), None)
                    targets = [owner] if owner is not None else up
                calls += [self._post(s.url, "/abort_request", body, timeout=30) for s in targets]
            await asyncio.gather(*calls, return_exceptions=True)

        await send()
        # A request still in transit to the server when the abort arrived is unknown there;
        # repeat the abort shortly for the ones still running.
        pending = [lv for lv in lives if lv.rid]

        async def again() -> None:
            for delay in (0.1, 0.4):
                await asyncio.sleep(delay)
                still = [lv for lv in pending if lv.request_id in self._live]
                if not still:
                    return
                await asyncio.gather(
                    *(
                        self._post(s.url, "/abort_request", {"rid": lv.rid}, timeout=30)
                        for lv in still
                        for s in ([lv.server] if lv.server else up)
                    ),
                    return_exceptions=True,
                )

        if pending:
            task = asyncio.ensure_future(again())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def pause(self, mode: str | None = None) -> None:
        """Hold new requests on every server until :meth:`resume`.

        ``mode`` (default ``Config.pause_mode``): ``abort`` ends in-flight requests (ABORT with
        partial tokens), ``retract`` puts them back in the queue, ``in_place`` freezes them with
        their KV cache. New requests wait server-side either way.
        """
        mode = mode or self.config.pause_mode
        if mode not in PAUSE_MODES:
            raise ConfigError(f"SGLangGenerator.pause: mode {mode!r} is not one of {PAUSE_MODES}.")

        async def go() -> None:
            self._paused = mode
            await asyncio.gather(
                *(
                    self._control(s, "/pause_generation", {"mode": mode})
                    for s in self._servers
                    if s.up
                )
            )

        await self._io.run(go())

    async def resume(self) -> None:
        """Continue generation on every server."""

        async def go() -> None:
            self._paused = None
            await asyncio.gather(
                *(
                    self._control(s, "/continue_generation", {"torch_empty_cache": False})
                    for s in self._servers
                    if s.up
                )
            )

        await self._io.run(go())

    @property
    def paused(self) -> str | None:
        """The pause mode in effect, or ``None``."""
        return self._paused

    # ------------------------------------------------------------------ health and restart

    async def health(self) -> bool:
        """True when at least one server is in rotation and answers ``/health_generate``."""

        async def go() -> bool:
            for s in self._servers:
                if s.up and await self._probe(s):
                    return True
            return False

        return await self._io.run(go())

    async def _probe(self, s: _Server) -> bool:
        if s.proc is not None and not s.proc.alive():
            return False
        assert self._io.session is not None
        try:
            async with self._io.session.get(
                s.url + "/health_generate",
                timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s),
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            if self._paused or self._updating:
                continue
            for s in list(self._servers):
                if not s.up:
                    continue
                if await self._probe(s):
                    s.failures = 0
                    continue
                if self._paused or self._updating:
                    break  # a probe during pause/update proves nothing
                s.failures += 1
                dead = s.proc is not None and not s.proc.alive()
                if dead or s.failures >= self.config.health_failures:
                    self._mark_down(s, "process exited" if dead else f"{s.failures} failed probes")

    def _suspect(self, s: _Server) -> None:
        """A request to ``s`` failed at the connection level: act now if the process is gone."""
        if s.proc is not None and not s.proc.alive():
            self._mark_down(s, "process exited")

    def _mark_down(self, s: _Server, why: str) -> None:
        if not s.up:
            return
        log.warning("SGLangGenerator: server %s out of rotation: %s", s.url, why)
        s.up = False
        s.down.set()
        if s.recovering is None or s.recovering.done():
            s.recovering = asyncio.ensure_future(self._recover(s))

    async def _recover(self, s: _Server) -> None:
        """Restart (owned) or wait for (attached) ``s``, re-sync its weights, put it back."""
        c = self.config
        while not self._closed:
            try:
                if s.proc is not None and c.restart_dead_servers:
                    old = s.proc
                    await asyncio.to_thread(old.stop)
                    with contextlib.suppress(ValueError):
                        self._procs.remove(old)
                    s.proc = self._launch(s.port, s.index)
                    await asyncio.to_thread(
                        wait_healthy, s.proc, s.url, timeout_s=c.startup_timeout_s
                    )
                    self.stats["restarts"] += 1
                    s.restarts += 1
                else:
                    while not await self._probe(s):
                        await asyncio.sleep(max(c.health_interval_s, 1.0))
                async with self._weights_lock():
                    await self._resync(s)
                    await self._reload_adapters(s)  # type: ignore[attr-defined]
                    if self._paused:
                        await self._control(s, "/pause_generation", {"mode": self._paused})
                    s.failures = 0
                    s.down = asyncio.Event()
                    s.up = True
                log.warning("SGLangGenerator: server %s back in rotation", s.url)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.error("SGLangGenerator: recovering %s failed: %s; retrying", s.url, e)
                await asyncio.sleep(5.0)

    def _weights_lock(self) -> asyncio.Lock:
        lock = getattr(self, "_wlock", None)
        if lock is None:
            lock = self._wlock = asyncio.Lock()
        return lock

    async def _resync(self, s: _Server) -> None:
        """Bring ``s`` to the current weights and version from the last update's source."""
        kind, payload = self._source or ("base", None)
        if kind == "disk":
            await self._disk_one(s, payload, self._version)
        elif kind == "tensors":
            await self._tensors_one(s, payload, self._version)
        else:
            await self._set_version(s, self._version)
