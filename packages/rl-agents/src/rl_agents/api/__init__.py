"""The HTTP API surfaces of :class:`~rl_agents.server.AgentServer`, one module each.

- :mod:`~rl_agents.api.chat_completions`: OpenAI ``POST /v1/chat/completions``.
- :mod:`~rl_agents.api.anthropic_messages`: Anthropic ``POST /v1/messages``.
- :mod:`~rl_agents.api.responses`: OpenAI ``POST /v1/responses``.

Each surface turns its request into a :class:`~rl_agents.api.common.ChatRequest` (OpenAI chat
messages, the server's canonical form), asks the server for one completion
(:meth:`AgentServer.complete`, which renders, generates and records the turn), and writes the
:class:`~rl_agents.api.common.Completion` back in its own wire format, streamed or not.
"""
