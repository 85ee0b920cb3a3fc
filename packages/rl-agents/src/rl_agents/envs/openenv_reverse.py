"""A small OpenEnv environment, written against OpenEnv's server API, for the OpenEnv
connector's recipe (``recipes/env_openenv.yaml``) and tests: the model must write the episode's
target string (the built-in ``reverse`` task's label); each attempt is scored by position match
and gets ``"<n> right"`` back, up to ``max_attempts`` (reset argument, default 1).

It is an ordinary OpenEnv environment (an ``openenv.core.Environment`` with pydantic action and
observation models, served by ``openenv.core.create_app``), so it runs in OpenEnv's own server
and is reached through its WebSocket client protocol; no container is needed. ``app`` is the
FastAPI app (``"rl_agents.envs.openenv_reverse:app"``), built on first use.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from openenv.core import Action, Environment, Observation, State, create_app

__all__ = ["ReverseAction", "ReverseEnvironment", "ReverseObservation", "app"]


class ReverseAction(Action):
    """The model's answer."""

    message: str


class ReverseObservation(Observation):
    """The judgement of an answer."""

    feedback: str = ""
    """``"<n> right"``: how many positions of the answer were right (empty after reset)."""
    score: float = 0.0
    """Share of positions right, over the longer of answer and target."""
    exact: float = 0.0
    """1 for an exact answer."""


class ReverseEnvironment(Environment):
    """Judges answers against the target given to ``reset(target=...)``."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._target = ""
        self._max_attempts = 1

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        target: str = "",
        max_attempts: int = 1,
        **kwargs: Any,
    ) -> ReverseObservation:
        """Start an episode judged against ``target``."""
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._target, self._max_attempts = str(target), int(max_attempts)
        return ReverseObservation(done=False, reward=0.0)

    def step(
        self, action: ReverseAction, timeout_s: float | None = None, **kwargs: Any
    ) -> ReverseObservation:
        """Score one answer."""
        self._state.step_count += 1
        answer, target = action.message.strip(), self._target
        right = sum(a == b for a, b in zip(answer, target))
        score = right / max(len(answer), len(target)) if (answer or target) else 1.0
        exact = float(answer == target)
        done = bool(exact) or self._state.step_count >= self._max_attempts
        return ReverseObservation(
            feedback=f"{right} right",
            score=score,
            exact=exact,
            done=done,
            reward=score,
        )

    @property
    def state(self) -> State:
        """Episode id and step count."""
        return self._state


def app() -> Any:
    """The FastAPI app serving :class:`ReverseEnvironment` (up to 1024 sessions at once)."""
    return create_app(
        ReverseEnvironment,
        ReverseAction,
        ReverseObservation,
        env_name="reverse",
        max_concurrent_envs=1024,
    )
