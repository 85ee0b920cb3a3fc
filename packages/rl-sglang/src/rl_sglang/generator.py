"""SGLangGenerator: a :class:`~rl_core.interfaces.Generator` backed by real SGLang servers.

It launches ``num_servers`` SGLang servers (each its own process group, from the interpreter of
SGLang's own venv) or attaches to running ones, optionally behind the SGLang router, and serves
requests token-in/token-out::

    gen = SGLangGenerator(SGLangGenerator.Config(model_path="runs/tiny", num_servers=2))
    results = await gen.generate(requests)             # token ids, log-probs, finish, version
    await gen.update_weights(update, transport)        # disk_full / disk_delta / any transport
    await gen.close()                                  # stops servers and router

Protocol (SGLang 0.5.23, verified on CPU): ``/generate`` with ``input_ids`` and
``return_logprob``; the server runs with ``--skip-tokenizer-init``, so no text is ever decoded or
re-encoded. Weight updates go to every server directly (the router does not route control
endpoints): ``/update_weights_from_disk`` for a verified checkpoint directory (the
:class:`~rl_weightsync.disk_full.DiskWeightTarget` protocol: ``disk_full`` versions, and the local
checkpoint ``disk_delta`` patches), ``/begin_weight_update`` + ``/update_weights_from_tensor`` +
``/end_weight_update`` for tensors of any other transport (a plain pickle payload: the default
ForkingPickler payload crashes a CPU server), and ``/update_weights_from_distributed`` over a
collective group for :class:`~rl_sglang.collective.SGLangCollectiveTransport`. Every update stamps
the server's weight version; every response's version is checked against the generator's.

Failure handling: requests that fail on a connection error, a 5xx, a server that is marked down
or a server on the wrong weight version are retried (with exponential backoff) on the other
servers; after ``max_retries`` retries the request returns ``ERROR`` with no tokens (its rollout
is failed: counted by the trainer, never trained on) and is counted in
``stats["failed_requests"]``. A health monitor probes
``/health_generate`` every ``health_interval_s`` (not while paused or updating); a server whose
process died, or that failed ``health_failures`` probes in a row, is taken out of rotation,
restarted on the same port (owned servers), re-synced to the current weights and version, and
put back.

Seeds: SGLang honours ``sampling_seed`` only with ``--enable-deterministic-inference``, which
needs a GPU attention backend; on CPU, seeded requests are sent with their seed but sampling is
not reproducible.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import pickle
import random
import tempfile
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import torch

from rl_core.config import NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, Seed
from rl_core.errors import ConfigError, GenerationError, WeightSyncError
from rl_core.interfaces import Generator, WeightTransport
from rl_core.types import FinishReason, GenerationRequest, GenerationResult, WeightUpdate
from rl_sglang._io import IOLoop
from rl_sglang.server import (
    ManagedProcess,
    ServerArgs,
    free_port,
    launch_router,
    launch_server,
    wait_healthy,
)

__all__ = ["PAUSE_MODES", "SGLangGenerator"]

log = logging.getLogger(__name__)

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


class SGLangGenerator(Generator):
    """Rollout on SGLang servers (launched or attached), optionally behind the SGLang router."""

    supports_abort: ClassVar[bool] = True
    """:meth:`abort` ends requests with their partial tokens and log-probs."""
    supports_pause: ClassVar[bool] = True
    """:meth:`pause` holds new requests server-side (in-flight ones per ``pause_mode``)."""
    supports_memory_release: ClassVar[bool] = False
    """Off: memory release needs a GPU and crashes a CPU server. On GPU, instances set it."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`SGLangGenerator`."""

        model_path: str = ""
        """Hugging Face checkpoint the launched servers serve (also read for EOS and vocab)."""
        server_urls: tuple[str, ...] = ()
        """Attach to these running servers instead of launching (not owned: never stopped)."""
        num_servers: PositiveInt = 1
        """Servers to launch when ``server_urls`` is empty."""
        python: str | None = None
        """Interpreter with SGLang; ``None``: the venv of ``scripts/setup_sglang_env.sh``."""
        device: str = "cpu"
        """``cpu`` (stub driver, torch-native attention) or ``cuda``."""
        server_args: dict[str, Any] = field(default_factory=dict)
        """More SGLang ``ServerArgs`` fields (``max_total_tokens``, ``mem_fraction_static``, ...),
        validated against SGLang's own parser."""
        host: str = "127.0.0.1"
        """Address launched servers and the router bind to."""
        log_dir: str | None = None
        """Server and router logs (and their working directory); ``None``: a temporary dir."""
        startup_timeout_s: PositiveFloat = 600.0
        """Longest wait for a launched server to answer ``/health_generate``."""
        use_router: bool = False
        """Launch the SGLang router in front of the servers for ``/generate`` traffic."""
        router_url: str | None = None
        """Send ``/generate`` through this running router instead (not owned)."""
        router_policy: str = "round_robin"
        """Policy of a launched router."""
        max_concurrency: PositiveInt = 64
        """Requests in flight per server."""
        request_timeout_s: PositiveFloat = 600.0
        """Longest a single ``/generate`` call may take before it is retried."""
        max_retries: NonNegInt = 3
        """Retries of a failing request before it returns ABORT with no tokens."""
        retry_backoff_s: NonNegFloat = 0.5
        """First retry delay; doubles each retry."""
        health_interval_s: NonNegFloat = 5.0
        """Seconds between health probes; 0 disables the monitor."""
        health_timeout_s: PositiveFloat = 60.0
        """A probe slower than this counts as a failure (hung server)."""
        health_failures: PositiveInt = 3
        """Consecutive failed probes that take a server out of rotation."""
        restart_dead_servers: bool = True
        """Restart launched servers that died or hung (attached ones are waited for)."""
        pause_mode: str = "retract"
        """Default mode of :meth:`pause`: ``abort``, ``retract`` or ``in_place``."""
        stop_on_eos: bool = True
        """Stop on the model's EOS and PAD ids (sent as ``stop_token_ids`` with every request).
        ``False`` sends SGLang's ``ignore_eos``, which makes SGLang ignore *every* stop id, so
        responses end only at ``max_new_tokens``; requests (or ``extra_stop_token_ids``) with
        stop ids are then refused rather than silently run past their stops."""
        extra_stop_token_ids: tuple[NonNegInt, ...] = ()
        """More stop ids for every request."""
        seed: Seed = 0
        """Seeds the seeds of requests that carry none."""
        initial_version: NonNegInt = 0
        """Weight version of the starting weights (stamped on the servers)."""

        def __post_init__(self) -> None:
            if not self.server_urls and not self.model_path:
                raise ConfigError(
                    "SGLangGenerator.Config: set model_path (to launch servers) or server_urls "
                    "(to attach to running ones)."
                )
            if self.num_servers < 1 or self.max_concurrency < 1:
                raise ConfigError(
                    "SGLangGenerator.Config.num_servers and max_concurrency: must be >= 1 (got "
                    f"{self.num_servers}, {self.max_concurrency})."
                )
            if self.pause_mode not in PAUSE_MODES:
                raise ConfigError(
                    f"SGLangGenerator.Config.pause_mode: {self.pause_mode!r} is not one of "
                    f"{PAUSE_MODES}."
                )
            if self.device not in ("cpu", "cuda"):
                raise ConfigError(
                    f"SGLangGenerator.Config.device: {self.device!r}; use 'cpu' or 'cuda'."
                )
            if self.max_retries < 0 or self.health_failures < 1:
                raise ConfigError(
                    "SGLangGenerator.Config.max_retries must be >= 0 and health_failures >= 1."
                )
            if self.use_router and self.router_url:
                raise ConfigError(
                    "SGLangGenerator.Config: use_router launches a router; router_url attaches "
                    "to one. Set only one."
                )
            self.server_urls = tuple(u.rstrip("/") for u in self.server_urls)
            self.extra_stop_token_ids = tuple(int(x) for x in self.extra_stop_token_ids)
            self.server_args = dict(self.server_args)

    def __init__(self, config: SGLangGenerator.Config) -> None:
        """Launch (or attach to) the servers and wait until all are healthy."""
        from rl_sglang import _cpu_support

        self.config = c = config
        self.owned = not c.server_urls
        """True when this generator launched its servers (and stops them on close)."""
        self.python = str(c.python or _cpu_support.default_python())
        """Interpreter the servers and the router run in."""
        if (self.owned or c.use_router) and not Path(self.python).exists():
            raise ConfigError(
                f"SGLangGenerator.Config.python: {self.python} does not exist; run "
                "packages/rl-sglang/scripts/setup_sglang_env.sh (installs SGLang into its own "
                "venv) or point `python` at an interpreter with sglang."
            )
        self.supports_memory_release = c.device != "cpu"  # type: ignore[misc]
        self._tmp = None
        if c.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rl-sglang-")
            self.log_dir = Path(self._tmp.name)
            """Directory of the server and router logs."""
        else:
            self.log_dir = Path(c.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.server_args = (
            ServerArgs.validate(c.server_args, python=self.python) if self.owned else {}
        )
        """The validated SGLang server arguments (launched servers only)."""
        self.stats: dict[str, int] = {
            "requests": 0,
            "retries": 0,
            "failed_requests": 0,
            "restarts": 0,
            "version_mismatches": 0,
        }
        """Counters: requests served, retries, requests given up, server restarts, responses
        on a wrong weight version."""
        self._version = c.initial_version
        self._updating = False
        self._paused: str | None = None
        self._closed = False
        self._seed_rng = random.Random(c.seed)
        self._live: dict[str, list[_Live]] = {}
        self._abort_epoch = 0  # bumped by abort-all; generate() calls from before it are aborted
        self._source: tuple[str, Any] | None = None  # how to re-sync a restarted server
        self._router: ManagedProcess | None = None
        self._router_sem: asyncio.Semaphore | None = None
        self._background: set[asyncio.Future[Any]] = set()
        self.router_url: str | None = c.router_url.rstrip("/") if c.router_url else None
        """URL ``/generate`` traffic goes to when a router is used."""
        self._io = IOLoop("SGLangGenerator-io", max_connections=0)
        self._procs: list[ManagedProcess] = []
        self._finalizer = weakref.finalize(self, _cleanup, self._procs, self._io)
        self._servers: list[_Server] = []
        try:
            self._start()
        except BaseException:
            self._finalizer()
            raise
        model_dir = self._model_dir()
        self.vocab_size: int | None = _vocab_size(model_dir)
        """Rows of the served model's LM head (``None`` if the checkpoint is not readable)."""
        eos = _eos_ids(model_dir) if c.stop_on_eos else ()
        self.default_stop_ids: tuple[int, ...] = tuple(sorted({*eos, *c.extra_stop_token_ids}))
        """Stop ids sent with every request (EOS and PAD, plus ``extra_stop_token_ids``)."""
        self._monitor: Any = None
        if c.health_interval_s > 0:
            self._monitor = self._io.submit(self._health_loop())

    # ------------------------------------------------------------------ start-up

    def _launch(self, port: int, index: int) -> ManagedProcess:
        proc = launch_server(
            model_path=self.config.model_path,
            python=self.python,
            port=port,
            server_args=self.server_args,
            device=self.config.device,
            log_dir=self.log_dir,
            host=self.config.host,
            name=f"sglang-{index}",
            weight_version=self.config.initial_version,
        )
        self._procs.append(proc)
        return proc

    async def _launch_on_loop(self, port: int, index: int) -> ManagedProcess:
        return self._launch(port, index)

    def _start(self) -> None:
        c = self.config
        sem_total = c.max_concurrency
        if self.owned:
            ports = [free_port(c.host) for _ in range(c.num_servers)]
            # Launched from the IO thread, which lives as long as the generator: the servers'
            # parent-death signal is tied to the launching thread.
            procs = [self._io.call(self._launch_on_loop(p, i)) for i, p in enumerate(ports)]
            urls = [f"http://{c.host}:{p}" for p in ports]
            for proc, url in zip(procs, urls):
                wait_healthy(proc, url, timeout_s=c.startup_timeout_s)
        else:
            procs = [None] * len(c.server_urls)
            urls = list(c.server_urls)
            ports = [int(u.rsplit(":", 1)[1].split("/")[0]) for u in urls]

        async def make() -> None:
            for i, (url, port, proc) in enumerate(zip(urls, ports, procs)):
                s = _Server(i, url, port, proc, asyncio.Semaphore(sem_total))
                info = await self._get_json(s, "/get_server_info", timeout=30)
                s.tp_size = int(info.get("tp_size") or 1)
                s.up = True
                self._servers.append(s)
                self._server_info = info
            if not self.owned:
                # Stamp the version the caller says these weights are.
                await asyncio.gather(*(self._set_version(s, self._version) for s in self._servers))

        self._io.call(make())
        if c.use_router:
            port = free_port(c.host)

            async def start_router() -> ManagedProcess:
                return launch_router(
                    worker_urls=urls,
                    python=self.python,
                    port=port,
                    log_dir=self.log_dir,
                    host=c.host,
                    policy=c.router_policy,
                )

            self._router = self._io.call(start_router())
            self._procs.append(self._router)
            self.router_url = f"http://{c.host}:{port}"
            wait_healthy(self._router, self.router_url, timeout_s=120, path="/health")
        if self.router_url is not None:

            async def router_sem() -> None:
                self._router_sem = asyncio.Semaphore(sem_total * len(self._servers))

            self._io.call(router_sem())

    def _model_dir(self) -> Path | None:
        path = self.config.model_path or getattr(self, "_server_info", {}).get("model_path")
        return Path(path) if path and Path(path).is_dir() else None

    # ------------------------------------------------------------------ properties

    @property
    def weight_version(self) -> int:
        """Version of the weights the servers serve."""
        return self._version

    @property
    def server_urls(self) -> list[str]:
        """URLs of the servers (launched or attached), in index order."""
        return [s.url for s in self._servers]

    @property
    def server_processes(self) -> list[ManagedProcess | None]:
        """The launcher process of each server (``None`` for attached ones)."""
        return [s.proc for s in self._servers]

    def servers_up(self) -> list[bool]:
        """Whether each server is in rotation."""
        return [s.up for s in self._servers]

    # ------------------------------------------------------------------ HTTP helpers

    async def _get_json(self, s: _Server, path: str, *, timeout: float) -> Any:
        assert self._io.session is not None
        async with self._io.session.get(
            s.url + path, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                raise GenerationError(f"GET {s.url}{path}: HTTP {resp.status} {await resp.text()}")
            return await resp.json(content_type=None)

    async def _post(
        self, url: str, path: str, body: dict[str, Any], *, timeout: float = 300.0
    ) -> tuple[int, Any]:
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

    async def _control(self, s: _Server, path: str, body: dict[str, Any]) -> Any:
        """POST a control call that must succeed (``success: false`` raises WeightSyncError).

        A write into a pooled connection the server had just closed (``ClientOSError``, e.g.
        broken pipe: the request never reached the server) is retried on a fresh connection.
        """
        for attempt in range(3):
            try:
                status, data = await self._post(s.url, path, body)
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

    async def _set_version(self, s: _Server, version: int) -> None:
        await self._control(
            s, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
        )

    # ------------------------------------------------------------------ generation

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Serve ``requests`` (concurrently, bounded per server); results in request order."""
        if self._closed:
            raise GenerationError("SGLangGenerator.generate: the generator is closed.")
        if not requests:
            return []
        seeds = []
        for r in requests:
            if not r.input_ids:
                raise GenerationError(
                    f"SGLangGenerator.generate: request {r.request_id!r} has no input ids."
                )
            v = self.vocab_size
            if v is not None and (min(r.input_ids) < 0 or max(r.input_ids) >= v):
                raise GenerationError(
                    f"SGLangGenerator.generate: request {r.request_id!r} has token ids outside "
                    f"[0, {v}); encode prompts with the served model's tokenizer."
                )
            if not self.config.stop_on_eos and (
                r.sampling.stop_token_ids or self.config.extra_stop_token_ids
            ):
                raise GenerationError(
                    f"SGLangGenerator.generate: request {r.request_id!r} has stop ids, but "
                    "generator.stop_on_eos=false sends SGLang's ignore_eos, which ignores every "
                    "stop id; set stop_on_eos=true or drop the stop ids."
                )
            seeds.append(
                r.sampling.seed if r.sampling.seed is not None else self._seed_rng.getrandbits(62)
            )
        # An abort-all issued after this call started covers its requests even if they are not
        # registered on the I/O loop yet (a loaded machine can delay that past the abort).
        epoch = self._abort_epoch
        return await self._io.run(self._generate_all(list(requests), seeds, epoch))

    async def _generate_all(
        self, requests: list[GenerationRequest], seeds: list[int], epoch: int
    ) -> list[GenerationResult]:
        lives = []
        for r in requests:
            live = _Live(r.request_id)
            live.aborted = epoch != self._abort_epoch
            self._live.setdefault(r.request_id, []).append(live)
            lives.append(live)
        try:
            return list(
                await asyncio.gather(
                    *(self._one(r, s, lv) for r, s, lv in zip(requests, seeds, lives))
                )
            )
        finally:
            for lv in lives:
                group = self._live.get(lv.request_id)
                if group is not None:
                    with contextlib.suppress(ValueError):
                        group.remove(lv)
                    if not group:
                        del self._live[lv.request_id]

    def _payload(self, req: GenerationRequest, seed: int, rid: str) -> dict[str, Any]:
        s = req.sampling
        stops = sorted(set(s.stop_token_ids) | set(self.default_stop_ids))
        params: dict[str, Any] = {
            "temperature": float(s.temperature),
            "top_p": float(s.top_p),
            "top_k": int(s.top_k) if s.top_k > 0 else -1,
            "max_new_tokens": int(s.max_new_tokens),
            "stop_token_ids": stops,
            "sampling_seed": int(seed),
            "no_stop_trim": True,
            "ignore_eos": not self.config.stop_on_eos,
            "skip_special_tokens": False,
        }
        return {
            "rid": rid,
            "input_ids": list(req.input_ids),
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
        }

    def _aborted_result(self, req: GenerationRequest) -> GenerationResult:
        return GenerationResult(
            request_id=req.request_id,
            output_ids=(),
            output_logprobs=(),
            finish_reason=FinishReason.ABORT,
            weight_version=self._version,
        )

    async def _pick(self) -> _Server:
        """The up server with the most free slots; waits while none is up."""
        deadline = time.monotonic() + self.config.request_timeout_s
        while True:
            up = [s for s in self._servers if s.up]
            if up:
                return max(up, key=lambda s: (s.sem._value, -s.index))
            if time.monotonic() > deadline:
                raise _Retry("no SGLang server in rotation")
            await asyncio.sleep(0.2)

    async def _one(self, req: GenerationRequest, seed: int, live: _Live) -> GenerationResult:
        attempt = 0
        while True:
            if live.aborted:
                return self._aborted_result(req)
            try:
                return await self._attempt(req, seed, live, attempt)
            except _Retry as e:
                attempt += 1
                if live.aborted:
                    return self._aborted_result(req)
                if attempt > self.config.max_retries:
                    self.stats["failed_requests"] += 1
                    log.warning(
                        "SGLangGenerator: request %s failed %d times (%s); returning it as "
                        "an error (a failed rollout).",
                        req.request_id,
                        attempt,
                        e,
                    )
                    return dataclasses.replace(
                        self._aborted_result(req), finish_reason=FinishReason.ERROR
                    )
                self.stats["retries"] += 1
                await asyncio.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))

    async def _attempt(
        self, req: GenerationRequest, seed: int, live: _Live, attempt: int
    ) -> GenerationResult:
        via_router = self.router_url is not None
        server = None if via_router else await self._pick()
        sem = self._router_sem if via_router else server.sem  # type: ignore[union-attr]
        assert sem is not None
        async with sem:
            if live.aborted:
                return self._aborted_result(req)
            if server is not None and not server.up:
                raise _Retry(f"{server.url} left rotation")
            rid = f"{req.request_id}#{attempt}-{random.getrandbits(32):08x}"
            live.rid, live.server = rid, server
            url = self.router_url if via_router else server.url  # type: ignore[union-attr]
            assert url is not None
            post = asyncio.ensure_future(
                self._post(
                    url,
                    "/generate",
                    self._payload(req, seed, rid),
                    timeout=self.config.request_timeout_s,
                )
            )
            waiters: set[asyncio.Future[Any]] = {post}
            down = None
            if server is not None:
                down = asyncio.ensure_future(server.down.wait())
                waiters.add(down)
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if down is not None:
                    down.cancel()
            if not post.done():
                post.cancel()
                with contextlib.suppress(BaseException):
                    await post
                raise _Retry(f"{server.url if server else url} was taken out of rotation")
            try:
                status, data = post.result()
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                if server is not None:
                    self._suspect(server)
                raise _Retry(f"{url}: {type(e).__name__}: {e}") from e
            finally:
                live.server = None
        if status != 200:
            msg = data.get("error", data) if isinstance(data, dict) else data
            if 400 <= status < 500 and status not in (408, 429):
                raise GenerationError(
                    f"SGLangGenerator: request {req.request_id!r} refused by {url} (HTTP "
                    f"{status}): {msg}"
                )
            raise _Retry(f"{url}: HTTP {status}: {str(msg)[:200]}")
        return self._parse(req, data, server)

    def _parse(self, req: GenerationRequest, data: Any, server: _Server | None) -> GenerationResult:
        if isinstance(data, list):
            (data,) = data
        meta = data["meta_info"]
        ids = tuple(int(t) for t in data.get("output_ids") or ())
        lps_raw = meta.get("output_token_logprobs") or []
        lps = tuple(float(x[0]) for x in lps_raw)
        if len(lps) != len(ids) or any(int(x[1]) != t for x, t in zip(lps_raw, ids)):
            raise _Retry(
                f"{req.request_id}: {len(ids)} output ids but {len(lps)} log-probs in the response"
            )
        version = self._response_version(meta, req, server)
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        reason = _FINISH.get(str(kind))
        if reason is None:
            raise _Retry(f"{req.request_id}: unknown finish reason {finish!r}")
        self.stats["requests"] += 1
        return GenerationResult(
            request_id=req.request_id,
            output_ids=ids,
            output_logprobs=lps,
            finish_reason=reason,
            weight_version=version,
        )

    def _response_version(
        self, meta: dict[str, Any], req: GenerationRequest, server: _Server | None
    ) -> int:
        raw = [meta.get("weight_version")]
        spans = meta.get("weight_versions") or []
        raw += [sp.get("version") for sp in spans if isinstance(sp, dict)]
        try:
            versions = [int(str(v)) for v in raw if v is not None]
        except ValueError as e:
            raise _Retry(f"{req.request_id}: weight version {raw} is not an integer") from e
        if not versions:
            raise _Retry(f"{req.request_id}: the response carries no weight version")
        version = min(versions)
        if not self._updating and any(v != self._version for v in versions):
            # A server out of sync (restarted elsewhere, or changed behind our back).
            self.stats["version_mismatches"] += 1
            if server is not None:
                self._mark_down(
                    server, f"serves weight version {versions}, expected {self._version}"
                )
            raise _Retry(
                f"{req.request_id}: served by weight version {versions}, expected {self._version}"
            )
        return version

    # ------------------------------------------------------------------ abort / pause

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the given (or all) requests; they return ABORT with their partial tokens.

        Requests still waiting for a slot return ABORT with no tokens. Unknown ids are ignored.
        Aborting all also covers requests of :meth:`generate` calls already made but not yet
        dispatched.
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

    # ------------------------------------------------------------------ weight updates

    async def update_weights(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """Load ``update`` through ``transport`` on every server; on failure keep the old ones.

        A collective transport (:class:`~rl_sglang.collective.SGLangCollectiveTransport`)
        broadcasts into the servers; disk transports hand the verified checkpoint directory to
        ``/update_weights_from_disk``; any other transport's tensors are pushed with
        ``/update_weights_from_tensor``.
        """
        from rl_sglang.collective import SGLangCollectiveTransport

        if self._closed:
            raise GenerationError("SGLangGenerator.update_weights: the generator is closed.")
        if isinstance(transport, SGLangCollectiveTransport):
            await self._io.run(self._distributed_update(update, transport))
            return
        await asyncio.to_thread(transport.apply, update, self)

    def load_weights_from_disk(self, path: str, *, version: int) -> None:
        """Point every server at the Hugging Face checkpoint ``path`` and set ``version``.

        Called by disk transports after they verified the checkpoint (``DiskWeightTarget``).
        """
        self._io.call(self._update_all("disk", str(path), int(version)))

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Push Hugging Face-named tensors to every server and set ``version``."""
        tensors = [(n, t.detach().to("cpu").contiguous().clone()) for n, t in named_tensors]
        self._io.call(self._update_all("tensors", tensors, int(version)))

    async def _update_all(self, kind: str, payload: Any, version: int) -> None:
        async with self._weights_lock():
            self._updating = True
            try:
                up = [s for s in self._servers if s.up]
                one = self._disk_one if kind == "disk" else self._tensors_one
                results = await asyncio.gather(
                    *(one(s, payload, version) for s in up), return_exceptions=True
                )
                errors = []
                for s, r in zip(up, results):
                    if isinstance(r, aiohttp.ClientError | asyncio.TimeoutError | OSError):
                        self._mark_down(s, f"weight update failed: {r!r}")  # resyncs later
                    elif isinstance(r, BaseException):
                        errors.append((s, r))
                if errors:
                    if len(errors) < len(up):
                        for s, _ in errors:
                            self._mark_down(s, "weight update failed")
                    raise WeightSyncError(
                        f"SGLangGenerator: weight version {version} ({kind}) failed on "
                        f"{[s.url for s, _ in errors]}: {errors[0][1]}; the generator stays on "
                        f"version {self._version}."
                    ) from errors[0][1]
                self._version = version
                self._source = (kind, payload)
            finally:
                self._updating = False

    async def _disk_one(self, s: _Server, path: str, version: int) -> None:
        await self._control(
            s,
            "/update_weights_from_disk",
            {
                "model_path": path,
                "weight_version": str(version),
                "flush_cache": True,
                "abort_all_requests": False,
                "keep_pause": self._paused is not None,
            },
        )

    async def _tensors_one(
        self, s: _Server, tensors: list[tuple[str, torch.Tensor]], version: int
    ) -> None:
        # Plain pickle, base64: SGLang's SafeUnpickler rebuilds the inlined storages. (The
        # default ForkingPickler payload shares CPU storages by fd and crashes a CPU server.)
        blob = await asyncio.to_thread(
            lambda: base64.b64encode(pickle.dumps(tensors, protocol=4)).decode()
        )
        await self._control(s, "/begin_weight_update", {})
        try:
            await self._control(
                s,
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [blob] * s.tp_size,
                    "weight_version": str(version),
                    "flush_cache": True,
                },
            )
        finally:
            await self._control(s, "/end_weight_update", {})

    async def _distributed_update(self, update: WeightUpdate, transport: Any) -> None:
        async with self._weights_lock():
            if update.version <= self._version:
                raise WeightSyncError(
                    f"SGLangGenerator: weight version {update.version} refused: already on "
                    f"{self._version} (replayed or out-of-order update)."
                )
            up = [s for s in self._servers if s.up]
            if not up:
                raise WeightSyncError("SGLangGenerator: no server in rotation to update.")
            self._updating = True
            try:
                await transport.push(update, up, self)
                self._version = update.version
                self._source = ("tensors", transport.staged(update.version))
            finally:
                self._updating = False

    # ------------------------------------------------------------------ memory (GPU only)

    async def release_memory(self) -> None:
        """Free weights and KV cache on every server (GPU only; refused on CPU)."""
        await self._memory("/release_memory_occupation")

    async def resume_memory(self) -> None:
        """Undo :meth:`release_memory` (GPU only; refused on CPU)."""
        await self._memory("/resume_memory_occupation")

    async def _memory(self, path: str) -> None:
        if self.config.device == "cpu":
            raise GenerationError(
                f"SGLangGenerator{path}: not available on CPU (it crashes the server); "
                "supports_memory_release is False there."
            )

        async def go() -> None:
            await asyncio.gather(*(self._control(s, path, {}) for s in self._servers if s.up))

        await self._io.run(go())

    # ------------------------------------------------------------------ shutdown

    async def close(self) -> None:
        """Stop the monitor, the router and launched servers; attached servers are left running
        (resumed if this generator paused them)."""
        if self._closed:
            return
        if self._paused and not self.owned:
            with contextlib.suppress(Exception):
                await self.resume()
        self._closed = True
        await asyncio.to_thread(self._finalizer)

    def __repr__(self) -> str:
        return f"SGLangGenerator(servers={self.server_urls}, version={self._version})"


def _cleanup(procs: list[ManagedProcess], io: IOLoop) -> None:
    io.cancel_tasks()  # no monitor may restart what is being stopped
    for p in list(procs):
        p.stop()
    io.close()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _eos_ids(model_dir: Path | None) -> tuple[int, ...]:
    if model_dir is None:
        return ()
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        cfg = _read_json(model_dir / name)
        for key in ("eos_token_id", "pad_token_id"):
            v = cfg.get(key)
            out.update(int(x) for x in (v if isinstance(v, list) else [v]) if x is not None)
    return tuple(sorted(out))


def _vocab_size(model_dir: Path | None) -> int | None:
    if model_dir is None:
        return None
    v = _read_json(model_dir / "config.json").get("vocab_size")
    return int(v) if v is not None else None
