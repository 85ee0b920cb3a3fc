"""The environment protocol: what a multi-turn task implements so that
:class:`~rl_agents.envs.loop.EnvRollout` can run it.

An environment is an object with two methods, each plain or ``async``:

- ``reset(prompt)`` starts an episode for one :class:`~rl_core.types.Prompt` (its ``input``,
  ``label`` and ``metadata`` describe the task) and returns the text of a first observation to
  append after the prompt's tokens before the model's first turn, or ``None`` / ``""`` for
  none (the prompt already states the task).
- ``step(action)`` gets the model's turn as an :class:`Action` (its text, its exact token ids,
  the engine's finish reason and the tool calls parsed from it) and returns a
  :class:`StepResult`: the observation to append (tool results, feedback), the reward of the
  step, whether the episode is done, and ``info`` (numbers in it are reported with the reward).

An optional ``close()`` (plain or ``async``) is called when the episode ends, however it ends.
A fresh environment is built for every episode, so an environment may keep per-episode state
on ``self``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rl_agents.chat import ToolCall
from rl_core.types import FinishReason, Prompt

__all__ = ["Action", "Environment", "StepResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """One model turn, as the environment sees it."""

    text: str
    """The turn's text (the sampled ids decoded; the ids themselves are what is trained)."""
    token_ids: tuple[int, ...]
    """The ids the engine sampled, exactly."""
    finish_reason: FinishReason
    """Why the engine stopped (``stop``: a stop token or EOS; ``length``: the budget ran out)."""
    turn: int
    """0-based model turn of the episode."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Tool calls parsed from the text (Hermes/Qwen ``<tool_call>`` JSON blocks), when the
    loop's ``parse_tool_calls`` is on."""
    ill_formed_tool_call: bool = False
    """A ``<tool_call>`` block was present but could not be parsed (no call is made)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What an environment returns for one model turn."""

    observation: str = ""
    """Text appended after the model's turn as observation tokens (loss mask 0): tool results,
    feedback, the chat-template glue of the next user turn. Ignored when ``done``."""
    reward: float = 0.0
    """Reward of this step; the episode's reward is the sum over its steps."""
    done: bool = False
    """True ends the episode."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """Free-form details; the numeric entries of the last step's ``info`` are reported as
    reward components (e.g. ``exact``) by :class:`~rl_agents.envs.loop.EnvReward`."""


@runtime_checkable
class Environment(Protocol):
    """A multi-turn task: ``reset`` then ``step`` per model turn (see the module docstring).
    Either method may be ``async``."""

    def reset(self, prompt: Prompt) -> str | Awaitable[str | None] | None:
        """Start an episode; return a first observation to append, or ``None``."""
        ...

    def step(self, action: Action) -> StepResult | Awaitable[StepResult]:
        """React to one model turn."""
        ...
