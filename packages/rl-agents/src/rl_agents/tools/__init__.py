"""Tools for multi-turn rollouts.

- :class:`~rl_agents.tools.sandbox.Sandbox`: run model-written Python in a subprocess with
  wall-time, CPU, memory and file-size limits, its own directory and no network.

The calculator tool lives with its rollout in :mod:`rl_agents.examples.calculator`.
"""

from rl_agents.tools.sandbox import Sandbox, SandboxResult, namespaces_available

__all__ = ["Sandbox", "SandboxResult", "namespaces_available"]
