"""rl-tinker: a Tinker-compatible training service.

The official ``tinker`` SDK (``tinker.ServiceClient(base_url=...)``) and ``tinker-cookbook``
recipes train LoRA adapters, one per training client, on a base model held by this process:

- :class:`~rl_tinker.server.TinkerService`: the REST API (futures, per-client ordering, limits,
  ``tinker://`` checkpoints, per-operation metrics).
- :class:`~rl_tinker.backend.BaseModel`: the HF backend (a frozen base model, peft adapters, an
  AdamW per tenant, sampling from pinned adapter snapshots).
- :func:`~rl_tinker.runner.start`: run one in a background thread; ``rl-tinker serve CONFIG``
  runs one in the foreground.

See ``docs/service.md``.
"""

from __future__ import annotations

from rl_tinker.version import __version__

__all__ = ["__version__"]
