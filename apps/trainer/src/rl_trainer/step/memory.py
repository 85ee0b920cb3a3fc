"""Memory of this process: its resident set size and the device bytes its models hold (the
``memory/*`` metrics of the colocated hand-over, :mod:`rl_trainer.step.offload`, also measured in
the ``ray`` runtime's policy ranks)."""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["memory_sample", "process_rss_bytes"]


def process_rss_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_sample(models: list[Any]) -> dict[str, int]:
    """``bytes`` (CUDA allocated when the models are on CUDA, else their resident tensor
    bytes) and ``rss_bytes`` of this process; ``models`` offer ``resident_storages()``."""
    on_cuda = any(getattr(m, "device", torch.device("cpu")).type == "cuda" for m in models)
    if on_cuda or (not models and torch.cuda.is_available()):
        allocated = int(torch.cuda.memory_allocated())
    else:
        allocated = sum(s.nbytes for m in models for s in m.resident_storages())
    return {"bytes": allocated, "rss_bytes": process_rss_bytes()}
