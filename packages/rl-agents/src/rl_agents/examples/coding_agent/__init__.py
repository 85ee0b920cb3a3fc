"""A black-box coding agent: an unmodified program written against the official ``openai``
client (:mod:`~rl_agents.examples.coding_agent.agent`) solves small Python tasks
(:mod:`~rl_agents.examples.coding_agent.tasks`) with a file-write and a shell tool; its shell
commands run in the sandbox, and the reward comes from hidden unit tests run in a fresh sandbox
(:class:`~rl_agents.examples.coding_agent.rollout.CodingAgentRollout`).

Recipe: ``rl-train run coding_agent`` (``apps/trainer/src/rl_trainer/recipes/coding_agent.yaml``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_agents.examples.coding_agent.rollout import CodingAgentRollout
    from rl_agents.examples.coding_agent.tasks import CodingTasks

__all__ = ["CodingAgentRollout", "CodingTasks"]

# Lazy (PEP 562): the agent program (`python -m rl_agents.examples.coding_agent.agent`) must
# start without importing the trainer's stack.
_LAZY = {
    "CodingAgentRollout": "rl_agents.examples.coding_agent.rollout",
    "CodingTasks": "rl_agents.examples.coding_agent.tasks",
}


def __getattr__(name: str) -> Any:
    """The public names, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
