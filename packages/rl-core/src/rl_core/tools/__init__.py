"""Tools for multi-turn rollouts.

- :class:`~rl_core.tools.sandbox.Sandbox`: run model-written Python in a subprocess with
  wall-time, CPU, memory and file-size limits, its own directory and no network.

The calculator tool lives with its rollout in :mod:`rl_core.examples.calculator`.
"""

from rl_core.tools.sandbox import Sandbox, SandboxResult, namespaces_available

__all__ = ["Sandbox", "SandboxResult", "namespaces_available"]
