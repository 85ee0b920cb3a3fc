"""rl-core: backend-agnostic interfaces, value types, algorithms, config and registry.

Importing ``rl_core`` imports torch and numpy only; the Hugging Face reference backends live in
:mod:`rl_core.reference` (extra ``rl-core[hf]``) and are imported on demand.
"""

from rl_core.errors import RLError
from rl_core.version import __version__

__all__ = ["RLError", "__version__"]
