"""Environments: a small ``reset``/``step`` protocol run by a built-in multi-turn loop, and
connectors to environment libraries.

- :class:`Environment`, :class:`Action`, :class:`StepResult` (:mod:`rl_agents.envs.base`): what
  a task implements.
- :class:`EnvRollout` (``generate_fn: {type: env, env: ...}``) runs it, token-in/token-out, and
  :class:`EnvReward` (``reward: {type: env_reward}``) trains on its rewards
  (:mod:`rl_agents.envs.loop`).
- :mod:`rl_agents.envs.reasoning_gym`: reasoning-gym's procedural tasks and scorers as a task
  (data + reward) and as an environment (``pip install 'rlpost-agents[reasoning-gym]'``).
- :mod:`rl_agents.envs.openenv_env`: an OpenEnv environment through OpenEnv's client protocol,
  its server running elsewhere or started in-process (``pip install 'rlpost-agents[openenv]'``);
  :mod:`rl_agents.envs.openenv_reverse` is a small OpenEnv environment for its recipe.
- :mod:`rl_agents.envs.verifiers_env`: a verifiers environment runs its own rollout through
  the agent server and its rubric gives the reward (``pip install 'rlpost-agents[verifiers]'``);
  :mod:`rl_agents.envs.verifiers_reverse` is a small verifiers environment for its recipe.

Connectors import their library only when used, so this package imports without them.
"""

from rl_agents.envs.base import Action, Environment, StepResult
from rl_agents.envs.loop import EnvReward, EnvRollout, EnvStats

__all__ = ["Action", "EnvReward", "EnvRollout", "EnvStats", "Environment", "StepResult"]
