"""Train an unmodified agent program: a :class:`~rl_core.interfaces.GenerateFn` that runs it
against an :class:`~rl_agents.server.AgentServer` and returns the session's rollouts.

The program talks to the policy through the OpenAI API and knows nothing about training. It is
either a Python callable (``program: "my_agent:solve"``)::

    def solve(task: AgentTask) -> float | None:
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key)
        ...                                   # any number of chat completions, tool calls
        return reward                         # or None: the trainer's reward function scores it

(``async def`` works too), or a subprocess (``command: ["python", "agent.py"]``: ``python``
means the trainer's own interpreter, ``sys.executable``, and a relative script path resolves
against the recipe's directory; see :func:`resolve_command`) that gets
``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (the session id) and ``RL_TASK`` (JSON with the prompt's
``input``, ``label`` and ``metadata``) in its environment and the same JSON on stdin. If the last
line it prints is a JSON object with a numeric ``"reward"``, that is the session's reward.

Each of the ``ctx.n_samples`` runs of a prompt is one session; its rollouts (one per merged
trajectory) share the session id as ``rollout_id``. A run that raises, times out or exits
non-zero gives failed rollouts (the reason is in ``metadata["failure"]`` and counted by the
trainer). A returned reward is stored in ``metadata["session_reward"]``; score with
:class:`SessionReward` (``reward: {type: session_reward}``) to train on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import os
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_agents.server import AgentServer
from rl_core.config import PositiveFloat, from_dict
from rl_core.errors import ConfigError, RewardError
from rl_core.interfaces import Generator, RolloutContext
from rl_core.locations import Located, base_dir_of
from rl_core.types import Prompt, Rollout

logger = logging.getLogger(__name__)

__all__ = ["AgentRollout", "AgentTask", "SessionReward", "resolve_command"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentTask:
    """What an agent program gets for one session."""

    base_url: str
    """OpenAI ``base_url`` of the server (``http://127.0.0.1:<port>/v1``)."""
    api_key: str
    """The session id; pass it as the client's ``api_key``."""
    model: str
    """Model name to put in requests (the server answers another name with 404)."""
    prompt: Prompt
    """The prompt (``input`` is text or chat messages; ``label`` and ``metadata`` as loaded)."""

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The prompt as chat messages (text becomes one user message)."""
        if isinstance(self.prompt.input, str):
            return [{"role": "user", "content": self.prompt.input}]
        return [dict(m) for m in self.prompt.input]


class AgentRollout:
    """GenerateFn running an agent program once per sample; see the module docstring."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`AgentRollout` (set exactly one of ``program`` and ``command``)."""

        program: str | None = None
        """``"module:attr"`` of a callable ``fn(task: AgentTask) -> float | None`` (sync: run in
        a worker thread; async: awaited)."""
        command: list[Located | str] | None = None
        """A subprocess to run per session (see the module docstring). ``python`` /
        ``python3`` as the program is the trainer's interpreter; a relative path (the program
        or an argument) naming a file beside the recipe resolves there
        (:func:`resolve_command`; strings from a recipe remember its directory:
        :class:`~rl_core.locations.Located`)."""
        timeout_s: PositiveFloat = 600.0
        """Seconds one session may take; then it fails (a subprocess is killed)."""
        server: dict[str, Any] | None = None
        """Options of :class:`~rl_agents.server.AgentServer.Config` (host, port, max_turns,
        chat, ...)."""

        def __post_init__(self) -> None:
            if (self.program is None) == (self.command is None):
                raise ConfigError(
                    "generate_fn: set exactly one of program ('module:attr') and command "
                    "(a subprocess argv)."
                )
            if self.command is not None and (
                not self.command or not all(isinstance(a, str) for a in self.command)
            ):
                raise ConfigError(
                    f"generate_fn.command: a non-empty list of strings, got {self.command!r}."
                )
            if not self.timeout_s > 0:
                raise ConfigError(f"generate_fn.timeout_s: must be > 0, got {self.timeout_s}.")

    def __init__(self, config: Config) -> None:
        self.config = config
        self.server_config = from_dict(
            AgentServer.Config, dict(config.server or {}), path="generate_fn.server"
        )
        self.argv: list[str] | None = (
            resolve_command(config.command) if config.command is not None else None
        )
        """The command as it is started (:func:`resolve_command`), or ``None``."""
        self._fn: Any = None
        if config.program is not None:
            from rl_core.registry import check_callable, load_object

            self._fn = check_callable(
                load_object(config.program), AgentTask, field="generate_fn.program", n_args=1
            )
        self.server: AgentServer | None = None
        """The server, started on the first call on that call's event loop."""
        self._server_for: Generator | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def ensure_server(self, ctx: RolloutContext) -> AgentServer:
        """The server for ``ctx.generator`` on the running event loop (started, or restarted
        when the generator or loop changed)."""
        loop = asyncio.get_running_loop()
        if self.server is not None and (
            self._server_for is not ctx.generator or self._loop is not loop
        ):
            if self._loop is loop:
                await self.server.close()
            self.server = None
        if self.server is None:
            server = AgentServer(
                self.server_config, generator=ctx.generator, tokenizer=ctx.tokenizer
            )
            await server.start()
            self.server, self._server_for, self._loop = server, ctx.generator, loop
        return self.server

    async def aclose(self) -> None:
        """Stop the server."""
        if self.server is not None:
            await self.server.close()
            self.server = None

    async def __call__(self, prompt: Prompt, ctx: RolloutContext) -> list[Rollout]:
        """Run ``ctx.n_samples`` sessions of the agent concurrently; all their rollouts."""
        server = await self.ensure_server(ctx)
        runs = await asyncio.gather(
            *(self._session(server, prompt, ctx, k) for k in range(ctx.n_samples))
        )
        return [r for rs in runs for r in rs]

    async def _session(
        self, server: AgentServer, prompt: Prompt, ctx: RolloutContext, k: int
    ) -> list[Rollout]:
        sid = f"{prompt.uid}/{k}/{uuid.uuid4().hex[:8]}"
        sampling = ctx.sampling
        if sampling.seed is not None:
            seed = (sampling.seed * 1_009 + k) & 0x7FFFFFFF
            sampling = dataclasses.replace(sampling, seed=seed)
        server.open_session(
            sid, sampling=sampling, metadata={"sample": k}, return_routing=ctx.return_routing
        )
        task = AgentTask(
            base_url=server.base_url, api_key=sid, model=server.config.model_name, prompt=prompt
        )
        reward: float | None = None
        failure: str | None = None
        extra: dict[str, Any] = {}
        try:
            if self._fn is not None:
                reward = await asyncio.wait_for(self._call(task), self.config.timeout_s)
            else:
                reward, extra = await self._run_command(task)
            if reward is not None:
                reward = _as_reward(reward, sid)
        except TimeoutError:
            failure = f"agent_timeout: session ran over {self.config.timeout_s}s"
        except Exception as e:  # an agent's bug must not crash the training step
            # Recorded twice: on the rollout (its status, counted by the trainer) and, with the
            # traceback the rollout cannot hold, in the log.
            failure = f"agent_error: {e!r}"
            logger.warning("agent session %s failed: %r", sid, e, exc_info=True)
        return server.finish_session(
            sid,
            prompt_uid=prompt.uid,
            prompt_ids=prompt.token_ids,
            reward=reward if failure is None else None,
            failure=failure,
            metadata=extra,
        )

    async def _call(self, task: AgentTask) -> Any:
        if inspect.iscoroutinefunction(self._fn) or inspect.iscoroutinefunction(
            type(self._fn).__call__
        ):
            return await self._fn(task)
        out = await asyncio.to_thread(self._fn, task)
        if inspect.isawaitable(out):
            out = await out
        return out

    async def _run_command(self, task: AgentTask) -> tuple[float | None, dict[str, Any]]:
        payload = json.dumps(
            {
                "input": task.prompt.input,
                "label": task.prompt.label,
                "metadata": task.prompt.metadata,
            },
            default=str,
        )
        env = {
            **os.environ,
            "OPENAI_BASE_URL": task.base_url,
            "OPENAI_API_KEY": task.api_key,
            "RL_TASK": payload,
        }
        assert self.argv is not None
        from rl_agents.tools.private import private_argv  # its own PID namespace: no key leak

        proc = await asyncio.create_subprocess_exec(
            *private_argv(self.argv),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(payload.encode()), self.config.timeout_s
            )
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        stdout = out.decode(errors="replace")
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-500:]
            raise RuntimeError(f"{self.argv[0]} exited with {proc.returncode}: {tail}")
        reward = None
        lines = [ln for ln in stdout.splitlines() if ln.strip()]
        if lines:
            try:
                last = json.loads(lines[-1])
            except json.JSONDecodeError:
                last = None
            if isinstance(last, dict) and "reward" in last:
                reward = last["reward"]
        return reward, {"agent_stdout": stdout[-2000:]}


_PYTHON_NAMES = frozenset({"python", "python3", f"python3.{sys.version_info.minor}"})


def resolve_command(command: Sequence[str]) -> list[str]:
    """The argv an agent ``command`` starts: ``python`` (``python3``, ``python3.X`` of this
    version) as the program becomes :data:`sys.executable`, the interpreter the trainer runs
    in, not the first ``python`` on ``PATH``; a relative path (the program, or an argument
    that is not an option) naming an existing file in the recipe's directory (where the
    string was written: :func:`rl_core.locations.base_dir_of`) becomes that absolute path.
    Anything else is kept as written."""
    argv = [str(a) for a in command]
    if argv and argv[0] in _PYTHON_NAMES:
        argv[0] = sys.executable
    elif argv and "/" in argv[0]:
        argv[0] = _beside_recipe(command[0])
    for i in range(1, len(argv)):
        if not argv[i].startswith("-"):
            argv[i] = _beside_recipe(command[i])
    return argv


def _beside_recipe(arg: str) -> str:
    """``arg`` made absolute against its recipe's directory when it names a file there."""
    p = Path(str(arg))
    if p.is_absolute() or not str(arg):
        return str(arg)
    candidate = base_dir_of(arg) / p
    return str(candidate) if candidate.is_file() else str(arg)


class SessionReward:
    """RewardFn: the reward the agent program reported for the rollout's session
    (``metadata["session_reward"]``). A rollout without one is an error (counted as failed)."""

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout) -> float:
        """The session's reward."""
        if "session_reward" not in rollout.metadata:
            raise RewardError(
                f"rollout {rollout.sample_id}: its agent session reported no reward; return a "
                'float from the agent program (or print {"reward": x} last), or use a reward '
                "function that scores the response."
            )
        return float(rollout.metadata["session_reward"])


def _as_reward(value: Any, sid: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(f"session {sid}: the agent returned {value!r}; expected a float or None.")
    return float(value)
