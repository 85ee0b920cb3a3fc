"""The C allocator's trim, now public in :mod:`rl_core.memory` (the trainer calls it once per RL
step too); kept so ``rl_hf._allocator.trim_host_memory`` still resolves."""

from __future__ import annotations

from rl_core.memory import trim_host_memory

__all__ = ["trim_host_memory"]
