"""verifiers connector: a `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_
environment (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ...) runs its own rollout
against the agent server, and its rubric's reward trains the policy
(``pip install 'rlpost-agents[verifiers]'``, verifiers 0.3.x).

A verifiers environment samples through an OpenAI-compatible client. :class:`VerifiersRollout`
is an :class:`~rl_agents.rollout.AgentRollout` whose agent program is the environment: each
session builds the environment's ``RolloutInput`` from the prompt (its chat messages, its label
as ``answer``, its metadata as ``info``), calls the environment's ``run_rollout`` with a
verifiers OpenAI chat client pointed at the session's base URL, and returns the reward the
environment's rubric gave. The agent server records the exact tokens and log-probs of every
completion of the session (merged into one rollout per trajectory), as for any agent program.

In a recipe::

    rollout:
      generate_fn:
        type: "rl_agents.envs.verifiers_env:VerifiersRollout"
        environment: "my_pkg.envs:load_environment"   # a factory returning a vf.Environment
        max_sessions: 64
    reward: {type: session_reward}

The environment is built once, at start-up; its ``dataset`` is not used (the recipe's data
source supplies the prompts), only its rollout logic, parser and rubric. Environments that run
tools in remote sandboxes (``SandboxEnv``, ``PythonEnv``) need network access and credentials;
``SingleTurnEnv``, ``MultiTurnEnv`` and ``ToolEnv`` with local Python tools need neither.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Annotated, Any

from rl_agents.rollout import AgentRollout, AgentTask
from rl_core.config import CodeRef, PositiveFloat, PositiveInt
from rl_core.errors import ConfigError
from rl_core.interfaces import RolloutContext
from rl_core.registry import load_object
from rl_core.types import Prompt, Rollout

__all__ = ["VerifiersRollout", "run_session"]

_ENVS: dict[str, Any] = {}
"""Built environments by key (the agent program finds its environment here)."""
_KEY = "verifiers_env"
_COUNTER = itertools.count()


class VerifiersRollout:
    """GenerateFn: ``ctx.n_samples`` sessions of a verifiers environment per prompt (see the
    module docstring); the sessions' rewards are in ``metadata["session_reward"]``
    (``reward: {type: session_reward}``)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Options of :class:`VerifiersRollout`."""

        environment: Annotated[str, CodeRef()]
        """``"module:factory"`` (or ``"path/file.py:factory"``) of a zero-argument function or
        class that returns a ``verifiers`` environment (e.g. a ``load_environment``)."""
        environment_args: dict[str, Any] = field(default_factory=dict)
        """Keyword arguments of the factory."""
        sampling_args: dict[str, Any] = field(default_factory=dict)
        """Extra sampling arguments the environment sends with each completion (on top of the
        recipe's sampling, which the server applies)."""
        max_sessions: PositiveInt = 64
        """Sessions running at once at most (``AgentRollout.Config.max_sessions``)."""
        timeout_s: PositiveFloat = 600.0
        """Seconds one session may take."""
        server: dict[str, Any] | None = None
        """Options of the agent server (``AgentServer.Config``)."""

    def __init__(self, config: Config) -> None:
        try:
            import verifiers  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                "verifiers is not installed; pip install 'rlpost-agents[verifiers]' "
                f"(verifiers>=0.3.1,<0.4) to use the verifiers connector ({e})."
            ) from None
        self.config = config
        factory = load_object(config.environment)
        env = factory(**config.environment_args)
        if not callable(getattr(env, "run_rollout", None)):
            raise ConfigError(
                f"generate_fn.environment: {config.environment!r} returned a "
                f"{type(env).__name__}, not a verifiers environment (no run_rollout)."
            )
        self.environment = env
        """The verifiers environment."""
        self._key = f"{config.environment}#{next(_COUNTER)}"
        _ENVS[self._key] = (env, dict(config.sampling_args))
        self._agent = AgentRollout(
            AgentRollout.Config(
                program="rl_agents.envs.verifiers_env:run_session",
                max_sessions=config.max_sessions,
                timeout_s=config.timeout_s,
                server=config.server,
            )
        )

    async def __call__(self, prompt: Prompt, ctx: RolloutContext) -> list[Rollout]:
        """Run ``ctx.n_samples`` sessions of the environment on ``prompt``."""
        tagged = Prompt(
            uid=prompt.uid,
            input=prompt.input,
            token_ids=prompt.token_ids,
            label=prompt.label,
            metadata={**prompt.metadata, _KEY: self._key},
        )
        return await self._agent(tagged, ctx)


async def run_session(task: AgentTask) -> float:
    """The agent program of :class:`VerifiersRollout`: one ``run_rollout`` of the environment
    against this session's server; returns the rubric's reward."""
    import openai
    import verifiers as vf

    meta = dict(task.prompt.metadata)
    env, sampling_args = _ENVS[meta.pop(_KEY)]
    client = vf.OpenAIChatCompletionsClient(
        openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    )
    label = task.prompt.label
    rollout_input = {
        "prompt": task.messages,
        "example_id": 0,
        "answer": "" if label is None else str(label),
        "info": meta,
    }
    out = await env.run_rollout(rollout_input, client, task.model, sampling_args)
    reward = out.get("reward") if isinstance(out, dict) else getattr(out, "reward", None)
    if reward is None:
        raise RuntimeError(
            f"verifiers environment {type(env).__name__}: its rollout has no reward "
            "(score_rollouts off?); give it a rubric."
        )
    return float(reward)
