"""rl-core: backend-agnostic interfaces, value types, algorithms, config, registry, rewards and
conformance suites.

Importing ``rl_core`` imports torch and numpy only. Backends are adapter packages: the
transformers backend is ``rl-hf`` (:mod:`rl_hf`), the agent server, trajectory builder and sandbox
are ``rl-agents`` (:mod:`rl_agents`); see ``docs/architecture.md`` for what belongs where.
"""

from rl_core.errors import RLError
from rl_core.version import __version__

__all__ = ["RLError", "__version__"]
