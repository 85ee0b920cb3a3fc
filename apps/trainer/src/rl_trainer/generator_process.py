"""The generator in a process of its own on the local runtime (``runtime.generator_process``).

On the ``local`` runtime the generator runs in the trainer's process: with
``rl.async_generation`` its Python (the decode loop, sampling, bookkeeping) and the trainer's
(the model's forward, the loss, the step) take turns on one GIL, and on a small model both are
mostly Python. :class:`ProcessGenerator` runs the generator (any backend with ``load_weights``:
``hf``) in a spawned child process instead, as the ``ray`` runtime does, without Ray:

- requests and results travel over a pipe; the calls made in one event-loop tick go as one
  message, so the child batches them as the in-process generator would;
- weights go through shared memory: the first update allocates one shared tensor per weight,
  every update copies into them and the child loads from them (``load_weights``), so an update
  costs one copy on each side and no pickling;
- a child that dies fails its pending calls with a :class:`GenerationError` and ``health()``
  turns false.

The child builds the generator from the same ``ComponentSpec`` through the registry, so the
backend must be importable there (an installed entry point or a ``module:attr`` path; a class
registered at run time with :func:`rl_core.registry.register` is not).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rl_core import registry
from rl_core.config import ComponentSpec, from_dict
from rl_core.errors import ConfigError, GenerationError, RLError
from rl_core.interfaces import Generator, WeightTransport
from rl_core.lora import adapter_of
from rl_core.memory import FrozenObjects
from rl_core.types import GenerationRequest, GenerationResult, WeightUpdate

__all__ = ["ProcessGenerator", "check_process_generator"]

logger = logging.getLogger(__name__)

_CAPABILITIES = (
    "supports_abort",
    "supports_pause",
    "supports_memory_release",
    "supports_routing",
    "truncated_logprobs",
)


def check_process_generator(spec: ComponentSpec) -> type:
    """The generator class of ``spec``, when it can run in a child process (it takes weights
    through ``load_weights``) and ``spec.options`` are valid; else :class:`ConfigError`."""
    cls = registry.resolve(registry.GROUPS["generator"], spec.type, field="generator.type")
    config_cls = getattr(cls, "Config", None)
    if config_cls is not None:  # the options' errors name their field here, not in the child
        from_dict(config_cls, spec.options, path="generator")
    if not callable(getattr(cls, "load_weights", None)):
        raise ConfigError(
            f"runtime.generator_process: generator {spec.type!r} takes no weights through "
            "load_weights (a server-backed engine such as sglang is a process of its own "
            "already); set runtime.generator_process: false."
        )
    return cls


class ProcessGenerator(Generator):
    """A :class:`~rl_core.interfaces.Generator` served by a spawned child process.

    The capabilities (``supports_abort``, ...) are those of the wrapped backend, except LoRA
    adapter updates: the trainer publishes merged weights to it.
    """

    supports_lora_adapters = False

    def __new__(cls, spec: ComponentSpec, **kwargs: Any) -> ProcessGenerator:
        """An instance of the subclass carrying the backend's capabilities as class
        attributes (where callers look for them)."""
        return super().__new__(_subclass_for(check_process_generator(spec)))

    def __init__(
        self,
        spec: ComponentSpec,
        *,
        threads: int,
        start_timeout_s: float = 300.0,
        wait: bool = True,
        freeze_gc: bool = True,
    ):
        """Spawn the child, build the generator from ``spec`` there with ``threads`` torch
        threads, and (``wait``) wait until it is ready. With ``wait=False`` the child is
        spawned and boots while the caller goes on; :meth:`wait_ready` waits for it (every
        other method needs it ready). ``freeze_gc``: the child freezes what it built out of
        the garbage collector's passes (``runtime.freeze_gc``, :class:`rl_core.memory.FrozenObjects`).

        Raises:
            ConfigError: the backend cannot run in a child (:func:`check_process_generator`).
            GenerationError: the child failed to build the generator (its error is included).
        """
        self.spec = spec
        """What the child builds."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve,
            args=(child_conn, spec, threads, freeze_gc),
            name="rl-generator",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        self._ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()  # _pending and sends from several threads
        self._dead: str | None = None
        self._staged: list[tuple[int, list[GenerationRequest]]] = []
        self._shared: dict[str, torch.Tensor] = {}
        self._closed = False
        self._start_timeout_s = start_timeout_s
        self._version = -1
        self._reader: threading.Thread | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the child has built its generator (at once when it has).

        Raises:
            GenerationError: the child did not start in ``start_timeout_s`` or failed to build
                the generator (its error is included); the child is ended.
        """
        if self._reader is not None:
            return
        if not self._conn.poll(self._start_timeout_s):
            self._proc.kill()
            raise GenerationError(
                f"runtime.generator_process: the generator process did not start in "
                f"{self._start_timeout_s:.0f} s."
            )
        ok, payload = self._recv_start()
        if not ok:
            self._proc.join(5)
            raise GenerationError(
                f"runtime.generator_process: building the generator failed: {payload}"
            )
        self._version = int(payload)
        self._reader = threading.Thread(target=self._read, name="rl-generator-reader", daemon=True)
        self._reader.start()

    def _recv_start(self) -> tuple[bool, Any]:
        try:
            _, ok, payload = self._conn.recv()
        except EOFError:
            return False, f"the process exited (code {self._proc.exitcode})"
        return ok, payload

    # ------------------------------------------------------------------ plumbing

    def _read(self) -> None:
        """Resolve the futures of the child's replies until the pipe closes."""
        while True:
            try:
                cid, ok, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                fut = self._pending.pop(cid, None)
            if fut is None:
                continue
            if ok:
                fut.set_result(payload)
            else:
                fut.set_exception(_rebuild_error(payload))
        self._proc.join(1)
        why = f"the generator process exited (code {self._proc.exitcode})"
        with self._lock:
            self._dead = why
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(GenerationError(f"{why}; see its log above."))

    def _register(self) -> tuple[int, concurrent.futures.Future]:
        """A new call id and the future of its reply (``_lock`` held by the caller)."""
        if self._dead is not None:
            raise GenerationError(f"{self._dead}; build a new generator.")
        cid = next(self._ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending[cid] = fut
        return cid, fut

    def _send(self, kind: str, payload: Any = None) -> concurrent.futures.Future:
        """Send one command; the future of its reply."""
        with self._lock:
            cid, fut = self._register()
            self._conn.send((kind, cid, payload))
        return fut

    async def _call(self, kind: str, payload: Any = None) -> Any:
        return await asyncio.wrap_future(self._send(kind, payload))

    # ------------------------------------------------------------------ Generator API

    @property
    def weight_version(self) -> int:
        """Version of the weights the child serves (as of its last acknowledged update)."""
        return self._version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Serve ``requests`` in the child; calls of one event-loop tick go as one batch."""
        if self._closed:
            raise GenerationError("ProcessGenerator.generate: the generator is closed.")
        if not requests:
            return []
        loop = asyncio.get_running_loop()
        with self._lock:
            cid, fut = self._register()
            first = not self._staged
            self._staged.append((cid, list(requests)))
        if first:
            loop.call_soon(self._flush)
        return await asyncio.wrap_future(fut)

    def _flush(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, []
            if staged and self._dead is None:
                self._conn.send(("generate", -1, staged))

    async def update_weights(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """``transport.apply(update, ...)`` in a worker thread: the tensors are copied into the
        shared buffers and the child loads them (waiting for its running batch)."""
        if adapter_of(update) is not None:
            raise GenerationError(
                "ProcessGenerator.update_weights: an adapter-only update; this generator "
                "takes merged weights (supports_lora_adapters is false)."
            )
        await asyncio.to_thread(transport.apply, update, self)

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Copy ``named_tensors`` into the shared buffers (allocated at the first update) and
        have the child load them; blocks until it has."""
        tensors = list(named_tensors)  # a stream that fails midway touches no buffer
        names, rebind = [], {}
        with torch.no_grad():
            for name, t in tensors:
                buf = self._shared.get(name)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype).share_memory_()
                    self._shared[name] = rebind[name] = buf
                buf.copy_(t)
                names.append(name)
        self._version = int(self._send("load", (int(version), names, rebind)).result())

    async def health(self) -> bool:
        """False once the child has exited; else the backend's own ``health()``."""
        if self._dead is not None or self._closed:
            return False
        return bool(await self._call("health"))

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """The backend's ``abort`` in the child."""
        await self._call("abort", None if request_ids is None else list(request_ids))

    async def pause(self) -> None:
        """The backend's ``pause`` in the child."""
        await self._call("pause")

    async def resume(self) -> None:
        """The backend's ``resume`` in the child."""
        await self._call("resume")

    async def release_memory(self) -> None:
        """The backend's ``release_memory`` in the child."""
        await self._call("release_memory")

    async def resume_memory(self) -> None:
        """The backend's ``resume_memory`` in the child."""
        await self._call("resume_memory")

    async def close(self) -> None:
        """Close the backend, end the child and free the shared buffers."""
        if self._closed:
            return
        self._closed = True
        if self._reader is None:  # never became ready (wait_ready failed or was not called)
            self._proc.kill()
        elif self._dead is None:
            try:
                await asyncio.wait_for(self._call("close"), timeout=30)
            except (GenerationError, TimeoutError) as e:
                logger.warning("generator process: close failed (%s); killing it", e)
        await asyncio.to_thread(self._proc.join, 10)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5)
        self._conn.close()
        self._shared.clear()


_SUBCLASSES: dict[type, type] = {}


def _subclass_for(backend: type) -> type:
    """``ProcessGenerator`` with ``backend``'s capabilities (one class per backend)."""
    sub = _SUBCLASSES.get(backend)
    if sub is None:
        caps = {name: bool(getattr(backend, name, False)) for name in _CAPABILITIES}
        sub = type(f"ProcessGenerator[{backend.__name__}]", (ProcessGenerator,), caps)
        _SUBCLASSES[backend] = sub
    return sub


# ---------------------------------------------------------------------------- the child


def _error_payload(e: BaseException) -> tuple[str, str, bytes | None]:
    import pickle

    try:
        blob = pickle.dumps(e)
        pickle.loads(blob)
    except Exception:
        blob = None
    return type(e).__name__, f"{e}\n{''.join(traceback.format_exception(e))}", blob


def _rebuild_error(payload: tuple[str, str, bytes | None]) -> BaseException:
    import pickle

    name, text, blob = payload
    if blob is not None:
        err = pickle.loads(blob)
        if isinstance(err, RLError):
            return err
    return GenerationError(f"generator process: {name}: {text}")


def _serve(conn: Any, spec: ComponentSpec, threads: int, freeze_gc: bool = True) -> None:
    """The child: build the generator, then serve commands until ``close`` or a closed pipe.

    It ignores SIGINT and SIGTERM: Ctrl-C (or a scheduler) signals the whole process group, and
    the trainer, stopping cleanly after its current step, still needs the generator; the trainer
    closes it, and a trainer that dies closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(max(1, threads))
    try:
        generator = registry.build("generator", spec, field="generator")
    except BaseException as e:  # reported to the parent, which raises
        conn.send((-1, False, f"{type(e).__name__}: {e}"))
        return
    FrozenObjects(enabled=freeze_gc).freeze()  # lives until os._exit: never thawed
    conn.send((-1, True, generator.weight_version))
    asyncio.run(_Child(conn, generator).run())
    # Closed (or orphaned): nothing is left to do, and the parent's ``close`` waits for this
    # process to end. Skip the interpreter's teardown of torch and the model (~1 s of the
    # trainer's exit on 2 cores); only the streams need flushing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Child:
    """The child's event loop: a reader thread hands commands to it; replies go from it."""

    def __init__(self, conn: Any, generator: Any):
        self.conn = conn
        self.generator = generator
        self.shared: dict[str, torch.Tensor] = {}
        self.done: asyncio.Event | None = None
        self.tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.done = asyncio.Event()

        def read() -> None:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    loop.call_soon_threadsafe(self.done.set)
                    return
                loop.call_soon_threadsafe(self.dispatch, msg)
                if msg[0] == "close":
                    return

        threading.Thread(target=read, name="rl-generator-commands", daemon=True).start()
        await self.done.wait()

    def reply(self, cid: int, ok: bool, payload: Any) -> None:
        try:
            self.conn.send((cid, ok, payload))
        except (BrokenPipeError, OSError):
            assert self.done is not None
            self.done.set()

    def spawn(self, cid: int, coro: Any) -> None:
        async def run() -> None:
            try:
                result = await coro
            except Exception as e:
                self.reply(cid, False, _error_payload(e))
            else:
                self.reply(cid, True, result)

        task = asyncio.get_running_loop().create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def dispatch(self, msg: tuple[str, int, Any]) -> None:
        kind, cid, payload = msg
        gen = self.generator
        if kind == "generate":  # every call of one parent tick, created in one tick here
            for call_id, requests in payload:
                self.spawn(call_id, gen.generate(requests))
        elif kind == "load":
            self.spawn(cid, self.load(*payload))
        elif kind == "close":
            self.spawn(cid, self.close())
        elif kind in ("health", "pause", "resume", "release_memory", "resume_memory"):
            self.spawn(cid, getattr(gen, kind)())
        elif kind == "abort":
            self.spawn(cid, gen.abort(payload))
        else:
            self.reply(cid, False, _error_payload(GenerationError(f"unknown command {kind!r}")))

    async def load(self, version: int, names: list[str], rebind: dict[str, torch.Tensor]) -> int:
        self.shared.update(rebind)
        tensors = [(name, self.shared[name]) for name in names]
        await asyncio.to_thread(self.generator.load_weights, tensors, version=version)
        return int(self.generator.weight_version)

    async def close(self) -> None:
        await self.generator.close()
        assert self.done is not None
        asyncio.get_running_loop().call_soon(self.done.set)
