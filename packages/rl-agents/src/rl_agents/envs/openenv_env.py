"""OpenEnv connector: an `OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ environment,
reached through OpenEnv's own client protocol, as an :class:`~rl_agents.envs.base.Environment`
(``pip install 'rlpost-agents[openenv]'``, openenv-core 0.2.x).

An OpenEnv environment runs behind an HTTP/WebSocket server (``openenv.core.create_app``) and
is driven by a client (``openenv.core.EnvClient``): ``reset(**kwargs)`` and ``step(action)``,
each answering ``StepResult(observation, reward, done)``. :class:`OpenEnvEnv` opens one client
session per episode with OpenEnv's :class:`~openenv.core.GenericEnvClient` (plain dicts, so no
code of the environment's package runs in the trainer), sends the model's turn as the action
(its text in ``action_field``, or a tool call's JSON arguments as the action's fields) and
appends the observation, rendered by ``observation_template``, as observation tokens.

The server is either already running (``base_url``) or started in this process (``app``: the
``"module:attr"`` of the environment's FastAPI app; uvicorn serves it on a free local port on a
daemon thread, once per process). Environments that OpenEnv ships as Docker images need a
container runtime; an environment whose server is plain Python (like
:mod:`rl_agents.envs.openenv_reverse`, used by ``recipes/env_openenv.yaml``) needs none.

In a recipe::

    rollout:
      generate_fn:
        type: env
        env: "rl_agents.envs.openenv_env:OpenEnvEnv"
        env_options:
          app: "rl_agents.envs.openenv_reverse:app"    # or base_url: http://host:8000
          action_field: message
          label_reset_key: target                      # reset(target=<the prompt's label>)
          observation_template: "{feedback}\\n"
    reward: {type: env_reward}
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rl_agents.envs.base import Action, StepResult
from rl_core.config import PositiveFloat
from rl_core.errors import ConfigError, DataError
from rl_core.registry import load_object
from rl_core.types import Prompt

__all__ = ["OpenEnvEnv", "serve_app"]

_SERVED: dict[str, str] = {}
_SERVE_LOCK = threading.Lock()


def serve_app(ref: str, *, timeout_s: float = 30.0) -> str:
    """Serve the FastAPI app named ``ref`` (``"module:attr"``, or a zero-argument factory that
    returns one) with uvicorn on ``127.0.0.1`` and a free port, on a daemon thread; returns its
    base URL. Each ``ref`` is served once per process."""
    with _SERVE_LOCK:
        if ref in _SERVED:
            return _SERVED[ref]
        try:
            import uvicorn
        except ImportError as e:
            raise ConfigError(
                f"generate_fn.env_options.app: serving {ref!r} needs uvicorn; pip install "
                f"'rlpost-agents[openenv]' ({e})."
            ) from None
        app = load_object(ref)
        if callable(app) and not hasattr(app, "router"):  # a factory, not the app itself
            app = app()
        server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=0, log_level="warning", ws="websockets-sansio"
            )
        )
        thread = threading.Thread(target=server.run, name=f"openenv:{ref}", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(
                    f"generate_fn.env_options.app: the OpenEnv server {ref!r} did not start "
                    f"within {timeout_s} s (see the log above)."
                )
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        _SERVED[ref] = url = f"http://127.0.0.1:{port}"
        return url


class OpenEnvEnv:
    """An OpenEnv environment session per episode (see the module docstring). ``info`` holds
    the observation's scalar fields."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Options of :class:`OpenEnvEnv`."""

        base_url: str | None = None
        """URL of a running OpenEnv server (``http://host:port``)."""
        app: str | None = None
        """``"module:attr"`` of an OpenEnv FastAPI app to serve in this process instead."""
        action_field: str = "message"
        """Field of the environment's action that receives the model's text."""
        tool_call_actions: bool = True
        """A turn with a tool call sends the call's JSON arguments as the action's fields."""
        observation_template: str | None = None
        """How an observation becomes text: ``str.format`` over its fields (e.g.
        ``"{feedback}\\n"``); ``None``: its fields as JSON and a newline."""
        reset_kwargs: dict[str, Any] = field(default_factory=dict)
        """Keyword arguments of every ``reset`` (e.g. ``{seed: 0}``)."""
        label_reset_key: str | None = None
        """Pass the prompt's label to ``reset`` under this name (e.g. ``target``)."""
        metadata_reset_key: str | None = "openenv_reset"
        """A dict under this key of the prompt's metadata is merged into the reset arguments."""
        show_reset_observation: bool = False
        """Append the reset's observation after the prompt (else the prompt states the task)."""
        connect_timeout_s: PositiveFloat = 10.0
        """Time to open a session."""
        message_timeout_s: PositiveFloat = 60.0
        """Time to wait for one reset/step answer."""

        def __post_init__(self) -> None:
            if (self.base_url is None) == (self.app is None):
                raise ConfigError(
                    "generate_fn.env_options: set exactly one of base_url (a running OpenEnv "
                    "server) and app ('module:attr' of its FastAPI app, served here)."
                )
            if not self.action_field:
                raise ConfigError("generate_fn.env_options.action_field: empty.")

    def __init__(self, config: Config) -> None:
        try:
            from openenv.core import GenericEnvClient
        except ImportError as e:
            raise ConfigError(
                "openenv-core is not installed; pip install 'rlpost-agents[openenv]' "
                f"(openenv-core>=0.2.1,<0.3) to use the OpenEnv connector ({e})."
            ) from None
        self.config = config
        self._client_cls = GenericEnvClient
        self._client: Any = None

    def _url(self) -> str:
        c = self.config
        return c.base_url if c.base_url is not None else serve_app(str(c.app))

    def _render(self, observation: Any) -> str:
        obs = dict(observation) if isinstance(observation, dict) else {"observation": observation}
        t = self.config.observation_template
        if t is None:
            return json.dumps(obs, sort_keys=True, default=str) + "\n"
        try:
            return t.format(**obs)
        except (KeyError, IndexError) as e:
            raise DataError(
                f"generate_fn.env_options.observation_template: {t!r} names {e}, which the "
                f"observation does not have; its fields: {sorted(obs)}."
            ) from None

    def reset(self, prompt: Prompt) -> str | None:
        """Open a session and reset it (with the configured arguments)."""
        c = self.config
        kwargs = dict(c.reset_kwargs)
        if c.label_reset_key is not None:
            kwargs[c.label_reset_key] = prompt.label
        extra = prompt.metadata.get(c.metadata_reset_key) if c.metadata_reset_key else None
        if isinstance(extra, dict):
            kwargs.update(extra)
        self._client = self._client_cls(
            base_url=self._url(),
            connect_timeout_s=c.connect_timeout_s,
            message_timeout_s=c.message_timeout_s,
        )
        result = self._client.reset(**kwargs)
        return self._render(result.observation) if c.show_reset_observation else None

    def step(self, action: Action) -> StepResult:
        """Send the turn as the environment's action; its answer as observation and reward."""
        if self._client is None:
            raise DataError("OpenEnvEnv.step before reset; the loop calls reset first.")
        c = self.config
        payload: dict[str, Any] = {c.action_field: action.text}
        if c.tool_call_actions and action.tool_calls:
            args = json.loads(action.tool_calls[0].arguments)
            payload = args if isinstance(args, dict) else payload
        result = self._client.step(payload)
        obs = result.observation
        info = {
            k: v
            for k, v in (obs.items() if isinstance(obs, dict) else ())
            if isinstance(v, int | float | str | bool) and k not in ("done", "reward")
        }
        reward = 0.0 if result.reward is None else float(result.reward)
        return StepResult(
            observation="" if result.done else self._render(obs),
            reward=reward,
            done=bool(result.done),
            info=info,
        )

    def close(self) -> None:
        """End the session."""
        if self._client is not None:
            self._client.close()
            self._client = None
