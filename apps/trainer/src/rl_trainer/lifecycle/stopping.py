"""Preemption-safe stops: SIGTERM and SIGINT ask the training loop to stop at a step boundary.

A scheduler (Slurm, Kubernetes, ``docker stop``) sends SIGTERM and waits a grace period before
SIGKILL; Ctrl-C sends SIGINT. :class:`StopSignals` turns the first of either into a flag the loop
polls after every step (:attr:`StopSignals.signum`); the loop then writes a checkpoint and
returns, and ``rl-train run ... --resume`` continues exactly where it stopped. A second signal
means "now": the process exits at once with status ``128 + signal`` (the shell's convention for
a death by that signal), no checkpoint written; checkpoints are atomic, so the newest complete
one stays valid::

    with StopSignals() as stop:
        for step in steps:
            train(step)
            if stop.signum is not None:
                save_checkpoint()
                break
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

from rl_buffer.bounded import add_stop_check, remove_stop_check

__all__ = ["StopSignals", "stop_requested"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run cleanly."""

_ACTIVE: list[StopSignals] = []


def stop_requested() -> bool:
    """Whether a stop signal reached an active :class:`StopSignals` (the run is stopping):
    code that waits on user functions (the reward :class:`~rl_buffer.scoring.Scorer`) polls
    it, through :func:`rl_buffer.bounded.stop_requested` (each active :class:`StopSignals`
    registers there), to give up on calls that would hold the stop back."""
    return any(s.signum is not None for s in _ACTIVE)


class StopSignals:
    """Context manager that routes SIGTERM and SIGINT to a stop flag while it is active.

    Handlers can only be installed from the main thread; elsewhere (a run started from a worker
    thread) the signals keep their handlers and :attr:`signum` stays ``None``. The previous
    handlers come back on exit.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        """The first stop signal received (``None`` until one arrives)."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        _ACTIVE.append(self)
        add_stop_check(self._stopping)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        remove_stop_check(self._stopping)

    def _stopping(self) -> bool:
        """Whether a stop signal came (the check registered with rl-buffer's bounded calls)."""
        return self.signum is not None

    @property
    def name(self) -> str | None:
        """The name of :attr:`signum` (``"SIGTERM"``), or ``None``."""
        return signal.Signals(self.signum).name if self.signum is not None else None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            _say(
                f"\n{name} again: exiting now without a checkpoint; --resume continues from the "
                "newest complete checkpoint.\n"
            )
            os._exit(128 + signum)
        self.signum = signum
        _say(
            f"\n{name}: finishing the current step, then writing a checkpoint and stopping "
            f"(send {name} again to exit at once).\n"
        )


def _say(text: str) -> None:
    """Write ``text`` to stderr from a signal handler: unbuffered, since the interrupted code
    may be inside a ``print`` itself. On a terminal, first show the cursor again (the progress
    bar hides it, and an immediate exit skips its cleanup)."""
    data = text.encode()
    if os.isatty(2):
        data = b"\x1b[?25h" + data
    os.write(2, data)
