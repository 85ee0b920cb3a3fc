"""Tools for multi-turn rollouts.

- :class:`~rl_agents.tools.sandbox.Sandbox`: run model-written Python or an agent's shell
  commands in subprocesses with wall-time, CPU, memory, process-count and file-size limits, a
  private temporary root and no network (bubblewrap, user namespaces or rlimits: whichever
  runs here; :attr:`SandboxResult.isolation` says which). :class:`Episode` keeps one root for a
  whole agent episode; ``python -m rl_agents.tools --root DIR -- CMD`` runs one command in it.

The calculator tool lives with its rollout in :mod:`rl_agents.examples.calculator`.
"""

from rl_agents.tools.sandbox import (
    Episode,
    Sandbox,
    SandboxResult,
    bwrap_available,
    isolation_modes,
    namespaces_available,
)

__all__ = [
    "Episode",
    "Sandbox",
    "SandboxResult",
    "bwrap_available",
    "isolation_modes",
    "namespaces_available",
]
