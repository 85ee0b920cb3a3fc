"""rl-agents: multi-turn and agent rollouts; train unmodified agent programs through an
OpenAI- and Anthropic-compatible server.

- :class:`AgentServer`: OpenAI ``/v1/chat/completions`` and ``/v1/responses``, Anthropic
  ``/v1/messages`` (streaming or not, tool calls) and ``/v1/models`` in front of any
  :class:`~rl_core.interfaces.Generator` (one module per API under :mod:`rl_agents.api`); it
  records the exact token ids and log-probs served in each session.
- :class:`Session`, :class:`TurnRecord`, :func:`linearize`: the recorded turns and how they
  become training rollouts (turns merged when the next prompt extends the held tokens).
- :class:`AgentRollout`: a :class:`~rl_core.interfaces.GenerateFn` that runs an agent program (a
  Python callable or a subprocess) against the server; :class:`SessionReward` trains on the
  reward the program reports.
- :class:`ChatFormat`: chat template rendering and ``<tool_call>`` parsing.
- :mod:`rl_agents.trajectory`: :class:`~rl_agents.trajectory.TrajectoryBuilder`, the token-exact
  record of a multi-turn rollout that any custom ``generate_fn`` can build.
- :mod:`rl_agents.tools`: the code :class:`~rl_agents.tools.Sandbox`.
- :mod:`rl_agents.examples`: the calculator tool rollout (``generate_fn: {type: calculator}``).

The server needs ``aiohttp`` (a dependency of rl-agents); it is imported only when a server
starts, so ``import rl_agents`` stays light. See ``docs/agents.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rl_agents.version import __version__

if TYPE_CHECKING:
    from rl_agents.chat import ChatFormat, ParsedCompletion, ToolCall
    from rl_agents.rollout import AgentRollout, AgentTask, SessionReward
    from rl_agents.server import AgentServer
    from rl_agents.session import Session, TurnRecord, linearize

# Imported on first use (PEP 562), so that `python -m rl_agents.tools` (a sandbox command an
# agent's shell tool runs per call) and the agent programs start without importing torch.
_LAZY = {
    "AgentRollout": "rl_agents.rollout",
    "AgentServer": "rl_agents.server",
    "AgentTask": "rl_agents.rollout",
    "ChatFormat": "rl_agents.chat",
    "ParsedCompletion": "rl_agents.chat",
    "Session": "rl_agents.session",
    "SessionReward": "rl_agents.rollout",
    "ToolCall": "rl_agents.chat",
    "TurnRecord": "rl_agents.session",
    "linearize": "rl_agents.session",
}


def __getattr__(name: str) -> Any:
    """The public names, imported on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rl_agents' has no attribute {name!r}")


__all__ = [
    "AgentRollout",
    "AgentServer",
    "AgentTask",
    "ChatFormat",
    "ParsedCompletion",
    "Session",
    "SessionReward",
    "ToolCall",
    "TurnRecord",
    "__version__",
    "linearize",
]
