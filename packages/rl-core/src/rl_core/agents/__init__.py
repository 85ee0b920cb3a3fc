"""Agent adapters: train unmodified agent programs through an OpenAI-compatible server.

- :class:`AgentServer`: ``/v1/chat/completions`` (streaming or not, tool calls) and
  ``/v1/models`` in front of any :class:`~rl_core.interfaces.Generator`; it records the exact
  token ids and log-probs served in each session.
- :class:`Session`, :class:`TurnRecord`, :func:`linearize`: the recorded turns and how they
  become training rollouts (turns merged when the next prompt extends the held tokens).
- :class:`AgentRollout`: a :class:`~rl_core.interfaces.GenerateFn` that runs an agent program (a
  Python callable or a subprocess) against the server; :class:`SessionReward` trains on the
  reward the program reports.
- :class:`ChatFormat`: chat template rendering and ``<tool_call>`` parsing.

The server needs ``aiohttp`` (``pip install rl-core[agents]``); it is imported only when a server
starts. See ``docs/agents.md``.
"""

from rl_core.agents.chat import ChatFormat, ParsedCompletion, ToolCall
from rl_core.agents.rollout import AgentRollout, AgentTask, SessionReward
from rl_core.agents.server import AgentServer
from rl_core.agents.session import Session, TurnRecord, linearize

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
    "linearize",
]
