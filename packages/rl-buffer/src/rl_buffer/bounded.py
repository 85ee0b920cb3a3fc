"""Calling user code with a time limit that holds even when the code never returns.

A reward is user code: it can hang (a deadlocked verifier, a network call without a timeout, an
infinite loop). :class:`BoundedCaller` runs each call under a deadline and, past it, *abandons*
the call instead of waiting for it:

- a synchronous function runs in a daemon worker thread, one call at a time and in the order
  the calls were made (as if it ran inline); a call past its deadline is left running in its
  thread, which is marked abandoned (it exits once the call returns, if ever, and never blocks
  the process's exit), and a fresh thread takes the next calls;
- an ``async`` function runs as a task on the event loop and is cancelled past its deadline;
- a function whose ``main_thread`` attribute is true (:class:`~rl_core.rewards.math_answer.MathEquiv`,
  whose own timeout is ``SIGALRM``, which only the main thread gets) is called inline, bounded
  by that timeout alone;
- a function whose ``inline`` attribute is true is called inline with no limit: for functions
  bounded by their input and quick (the trainer's built-in tasks, :mod:`rl_trainer.tasks`:
  string arithmetic on one response), where the worker thread's hand-off would cost more than
  the call and hold the GIL the training thread needs (256 hand-offs per step on the demo).

A call is also abandoned once it has run :data:`STOP_GRACE_S` after a stop was requested
(:func:`stop_requested`: a check registered with :func:`add_stop_check`, e.g. the trainer's
SIGTERM/SIGINT handler, :class:`rl_trainer.lifecycle.stopping.StopSignals`), so SIGTERM stops a
run whose reward hangs (calls still queued behind it run, each with the same grace). Limitation: an ``async`` function that blocks the
event loop itself (``time.sleep`` inside ``async def``) cannot be interrupted by any of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "STOP_GRACE_S",
    "BoundedCaller",
    "CallAbandoned",
    "add_stop_check",
    "is_async",
    "remove_stop_check",
    "stop_requested",
]

STOP_GRACE_S = 2.0
"""After a stop signal, how long a running call may still take before it is abandoned."""

_POLL_S = 0.05
_STOP_POLL_S = 0.25


_STOP_CHECKS: list[Callable[[], bool]] = []


def add_stop_check(check: Callable[[], bool]) -> None:
    """Register ``check`` (true once the process is stopping: a stop signal came) for
    :func:`stop_requested`; :func:`remove_stop_check` takes it back."""
    _STOP_CHECKS.append(check)


def remove_stop_check(check: Callable[[], bool]) -> None:
    """Unregister a check added with :func:`add_stop_check` (no error when it is absent)."""
    if check in _STOP_CHECKS:
        _STOP_CHECKS.remove(check)


def stop_requested() -> bool:
    """Whether a registered stop check says the process is stopping: code that waits on user
    functions (:class:`BoundedCaller`, :func:`rl_buffer.rollout.until_stopped`) polls it to give
    up on calls that would hold the stop back."""
    return any(check() for check in _STOP_CHECKS)


class CallAbandoned(Exception):
    """A user call was given up on: it passed its deadline or the run is stopping."""


@dataclass(eq=False)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    started_future: asyncio.Future
    started: float | None = None
    done: bool = False
    cancelled: bool = False
    thread: threading.Thread | None = field(default=None, repr=False)


class _SyncRunner:
    """Runs synchronous calls one at a time, in submission order, in a daemon thread that is
    replaced when a call is abandoned."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._abandoned: set[threading.Thread] = set()
        self.abandoned_threads = 0
        """How many worker threads were left behind with a call that had not returned."""

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> _Job:
        loop = asyncio.get_running_loop()
        job = _Job(
            fn=fn,
            args=args,
            loop=loop,
            future=loop.create_future(),
            started_future=loop.create_future(),
        )
        with self._lock:
            self._ensure_thread()
        self._queue.put(job)
        return job

    def abandon(self, job: _Job) -> None:
        """Give up on ``job``: drop it if not started, else leave its thread behind."""
        with self._lock:
            job.cancelled = True
            if job.done or job.thread is None:
                return
            self._abandoned.add(job.thread)
            self.abandoned_threads += 1
            if self._thread is job.thread:
                self._thread = None
            self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            t = threading.Thread(target=self._work, name="rl-user-call", daemon=True)
            self._thread = t
            t.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._queue.get()
            with self._lock:
                if job.cancelled:
                    continue
                job.thread, job.started = me, time.monotonic()
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                job.loop.call_soon_threadsafe(_settle, job.started_future, True, None)
            try:
                result, error = job.fn(*job.args), None
            except BaseException as e:  # handed to the caller
                result, error = None, e
            with self._lock:
                job.done = True
                gone = me in self._abandoned
                if gone:
                    self._abandoned.discard(me)
            if not job.cancelled:
                with contextlib.suppress(RuntimeError):  # the event loop is closed
                    job.loop.call_soon_threadsafe(_settle, job.future, result, error)
            if gone:
                return


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` returns a coroutine (an ``async def`` function or callable)."""
    call = None if inspect.isroutine(fn) else inspect.getattr_static(type(fn), "__call__", None)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


class BoundedCaller:
    """Calls user functions with a per-call time limit (``timeout_s``) and an optional
    deadline shared by a batch of calls (a round), abandoning what runs past either (see the
    module docstring)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        """Time limit of one call in seconds (from when it starts running); ``None``: none."""
        self._runner = _SyncRunner()

    @property
    def abandoned_threads(self) -> int:
        """Worker threads left behind with a call that had not returned."""
        return self._runner.abandoned_threads

    async def call(self, fn: Callable[..., Any], *args: Any, deadline: float | None = None) -> Any:
        """``fn(*args)``, awaited if it returns an awaitable; :class:`CallAbandoned` when it
        runs past ``timeout_s``, past ``deadline`` (a :func:`time.monotonic` time) or on in a
        stopping run."""
        if getattr(fn, "inline", False) or getattr(fn, "main_thread", False):
            # quick and bounded by its input, or bounded by its own (signal-based) timeout
            value = fn(*args)
            return await self._await(value, deadline) if inspect.isawaitable(value) else value
        if is_async(fn):
            return await self._await(fn(*args), deadline)
        job = self._runner.submit(fn, args)
        value = await self._wait(
            job.future,
            lambda: job.started,
            deadline,
            lambda: self._runner.abandon(job),
            job.started_future,
        )
        if inspect.isawaitable(value):  # a plain function that returned an awaitable
            return await self._await(value, deadline)
        return value

    async def _await(self, awaitable: Any, deadline: float | None) -> Any:
        task = asyncio.ensure_future(awaitable)
        start = time.monotonic()
        try:
            return await self._wait(task, lambda: start, deadline, task.cancel)
        finally:
            if not task.done():
                task.cancel()

    async def _wait(
        self,
        fut: asyncio.Future,
        started: Callable[[], float | None],
        deadline: float | None,
        give_up: Callable[[], Any],
        started_future: asyncio.Future | None = None,
    ) -> Any:
        """Wait for ``fut``, waking only when a limit may have passed: a queued call (not
        ``started`` yet) at its start or the deadline; a running one at its time limit, the
        deadline, or every :data:`_STOP_POLL_S` for a stop signal (every :data:`_POLL_S` once
        one came)."""
        stop_seen: float | None = None
        while not fut.done():
            now = time.monotonic()
            t0 = started()
            if t0 is None and started_future is not None and not started_future.done():
                left = None if deadline is None else max(deadline - now, 0.0)
                await asyncio.wait(
                    {fut, started_future}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                if not (fut.done() or started_future.done()):
                    give_up()
                    raise CallAbandoned(
                        "was still queued behind other calls at the round's deadline "
                        "(rollout.reward_round_timeout_s); the call was abandoned"
                    )
                continue
            waits = [_POLL_S if stop_seen is not None else _STOP_POLL_S]
            if self.timeout_s is not None and t0 is not None:
                waits.append(t0 + self.timeout_s - now)
            if deadline is not None:
                waits.append(deadline - now)
            await asyncio.wait({fut}, timeout=max(min(waits), 0.0) + 1e-3)
            if fut.done():
                break
            now = time.monotonic()
            why = None
            if self.timeout_s is not None and t0 is not None and now - t0 > self.timeout_s:
                why = f"did not return within {self.timeout_s:g} s (rollout.reward_timeout_s)"
            elif deadline is not None and now > deadline:
                why = "was still running at the round's deadline (rollout.reward_round_timeout_s)"
            elif stop_requested() and t0 is not None:
                stop_seen = now if stop_seen is None else stop_seen
                if now - max(stop_seen, t0) > STOP_GRACE_S:
                    why = "was still running when the run stopped (a stop signal)"
            if why is not None:
                give_up()
                raise CallAbandoned(f"{why}; the call was abandoned")
        return fut.result()
