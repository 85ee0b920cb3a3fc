"""Colocation: generator engines that share bundles (and GPUs) with policy ranks release their
memory while the policy trains, and take it back before they generate.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Colocation"]


class Colocation:
    """Releases generator memory while colocated policy ranks train (synchronous loop only)."""

    def __init__(self, enabled: bool) -> None:
        """``enabled``: the layout is colocated and the loop synchronous."""
        self.enabled = enabled
        self.engines: list[Any] = []
        self.released = False

    def before_train(self) -> None:
        """Release the engines' memory before the policy trains (once until they generate)."""
        if self.enabled and self.engines and not self.released:
            import ray

            ray.get([e.release_memory.remote() for e in self.engines])
            self.released = True

    async def release(self) -> None:
        """Release the engines' memory now (the colocated hand-over of
        :mod:`rl_trainer.step.offload`); a no-op when disabled or already released."""
        if self.enabled and self.engines and not self.released:
            await asyncio.gather(*(e.release_memory.remote() for e in self.engines))
            self.released = True

    async def before_generate(self) -> None:
        """Take the released memory back before the engines generate."""
        if self.released:
            await asyncio.gather(*(e.resume_memory.remote() for e in self.engines))
            self.released = False
