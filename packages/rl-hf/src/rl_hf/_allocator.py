"""The C allocator's settings for HFPolicy's memory: the trim (now public in
:mod:`rl_core.memory`; kept so ``rl_hf._allocator.trim_host_memory`` still resolves) and glibc's
mmap threshold (``HFPolicy.Config.host_mmap_threshold``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

from rl_core.memory import trim_host_memory

__all__ = ["MMAP_THRESHOLD_MAX", "set_mmap_threshold", "trim_host_memory"]

MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's largest ``M_MMAP_THRESHOLD`` on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``)."""

_M_MMAP_THRESHOLD = -3  # <malloc.h>


@functools.cache
def _mallopt() -> Any:
    """glibc's ``mallopt`` or ``None`` (not Linux, or a C library without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    fn = getattr(libc, "mallopt", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def set_mmap_threshold(nbytes: int) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)``: blocks of at least ``nbytes`` are mapped on their
    own and returned to the system when freed (as ``MALLOC_MMAP_THRESHOLD_=nbytes`` in the
    environment), instead of glibc raising the threshold after the first large free and keeping
    later large blocks in its heap. Process-wide and permanent; values are unchanged.

    Returns:
        Whether it was set (``False`` without glibc: a no-op there).
    """
    fn = _mallopt()
    return fn is not None and fn(_M_MMAP_THRESHOLD, int(nbytes)) == 1
