"""Host memory of a long run: the C allocator's freed memory returned to the system (glibc
``malloc_trim``), and the objects a run builds kept out of the garbage collector's full passes.

A train step on CPU allocates and frees gigabytes of temporaries (activations, logits, gradients).
glibc keeps what is freed in its arenas for reuse, and raises its mmap threshold after the first
large free, so later large tensors also come from the arenas: the process's RSS stays near the
step's peak between steps (on SmolLM2-135M 1.4-1.8 GB more than the live state, issue #36).
``malloc_trim(0)`` releases the free pages of every arena; the live tensors are not touched, so
values are unchanged::

    from rl_core.memory import trim_host_memory

    trim_host_memory()  # True on glibc; a no-op returning False elsewhere

A trim is not free: the next step touches those pages again and the kernel faults each one in
and zeroes it (~1 us per 4 KiB page). On the demo's tiny model, where a step's temporaries are
tens of MB, trimming after every step made the train step ~25% slower (thread CPU 72-77 ms
without, 99-103 ms with). :class:`HostMemoryTrim` therefore trims once, then only when the
process's resident memory grew by at least :data:`TRIM_MIN_GROWTH_BYTES` (256 MiB) since the last
trim: SmolLM2-135M's 1.4-1.8 GB of retained temporaries are still returned after every step,
a tiny model's are kept for the next step. ``rl_hf.HFPolicy`` uses one after each train step
and the trainer one per RL step (after training and the weight sync: it covers any policy
backend and an in-process generator)::

    from rl_core.memory import HostMemoryTrim

    trim = HostMemoryTrim()
    for step in steps:
        ...           # a train step
        trim()        # True when it trimmed

Python's cyclic garbage collector walks every tracked object in a full (oldest-generation)
collection, holding the GIL throughout. After the imports of torch and transformers a trainer
process tracks ~370k objects: a full collection took ~0.26 s (20 of them in a 200-step demo run,
~5 s, on 2 loaded cores) and stalled every thread, the training one included. What a run builds
before its loop (modules, models, configs) lives until the run ends, so
:class:`FrozenObjects` moves it to the collector's permanent generation (``gc.freeze``) and back
at the end (``gc.unfreeze``): the full collections then walk only what the loop allocated.
Each freeze collects first, so no garbage is frozen; what dies while frozen is freed as usual
by its reference count, and only reference cycles among frozen objects wait for the next
freeze or the thaw::

    from rl_core.memory import FrozenObjects

    frozen = FrozenObjects()
    ...  # build the models
    frozen.freeze()
    ...  # the loop
    frozen.thaw()
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import sys
from typing import Any

__all__ = [
    "TRIM_MIN_GROWTH_BYTES",
    "FrozenObjects",
    "HostMemoryTrim",
    "resident_bytes",
    "trim_host_memory",
]

TRIM_MIN_GROWTH_BYTES = 256 * 2**20
""":class:`HostMemoryTrim`'s default: the growth of the resident memory since the last trim from
which the next trim pays for its page faults (re-faulting 256 MiB costs ~65k faults, well under
the cost of a step whose temporaries are that large)."""


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` or ``None`` (not Linux, or a C library without it, e.g. musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


def trim_host_memory() -> bool:
    """Give the memory the C allocator holds freed back to the system (``malloc_trim(0)``).

    Returns:
        Whether it ran (``False`` where there is no glibc: a no-op there).
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def resident_bytes() -> int | None:
    """This process's resident memory (``/proc/self/statm``), or ``None`` where that file is
    missing (not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


class HostMemoryTrim:
    """Calls :func:`trim_host_memory` the first time and then only when this process's resident
    memory grew by at least ``min_growth_bytes`` since just after the last trim (module
    docstring). Where the resident memory cannot be read, every call trims."""

    def __init__(self, min_growth_bytes: int = TRIM_MIN_GROWTH_BYTES) -> None:
        """``min_growth_bytes=0`` trims on every call."""
        self.min_growth_bytes = min_growth_bytes
        """The growth since the last trim from which the next call trims."""
        self.trims = 0
        """How many calls trimmed."""
        self._after_trim: int | None = None

    def __call__(self) -> bool:
        """Trim when due; returns whether it trimmed (``False`` also without glibc)."""
        if _malloc_trim() is None:
            return False
        rss = resident_bytes()
        if self._after_trim is not None and rss is not None:
            self._after_trim = min(self._after_trim, rss)  # memory given back meanwhile
            if rss - self._after_trim < self.min_growth_bytes:
                return False
        trim_host_memory()
        self._after_trim = resident_bytes()
        self.trims += 1
        return True


class FrozenObjects:
    """Keeps the objects a run built out of the cyclic garbage collector's passes until the run
    ends (module docstring): :meth:`freeze` after each build, :meth:`thaw` at the end.

    A process that froze objects itself before (``gc.get_freeze_count() > 0`` when this is
    made) is left as it is: both methods are then no-ops, so its own freeze is never undone.
    """

    def __init__(self, enabled: bool = True) -> None:
        """``enabled=False`` makes both methods no-ops (the run's ``runtime.freeze_gc``)."""
        self.enabled = enabled and gc.get_freeze_count() == 0
        """Whether this object freezes: asked for, and nothing in the process was frozen."""
        self.frozen = False
        """Whether objects are frozen now by :meth:`freeze`."""

    def freeze(self) -> None:
        """Collect the garbage, then move every object the collector tracks to its permanent
        generation. Call it again after a later build: what an earlier freeze held is given
        back first, so what the later build replaced (a warm-up's policy) is collected, not
        kept frozen. One full collection per call (~0.1-0.3 s in a trainer process)."""
        if self.enabled:
            if self.frozen:
                gc.unfreeze()
            gc.collect()
            gc.freeze()
            self.frozen = True

    def thaw(self) -> None:
        """Give the frozen objects back to the collector (its oldest generation); cycles among
        them are collected by its next full pass."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
