"""Train an unmodified agent program: a :class:`~rl_core.interfaces.GenerateFn` that runs it
against an :class:`~rl_agents.server.AgentServer` and returns the session's rollouts.

The program talks to the policy through the OpenAI API and knows nothing about training. It is
either a Python callable (``program: "my_agent:solve"``)::

    def solve(task: AgentTask) -> float | None:
        client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key)
        ...                                   # any number of chat completions, tool calls
        return reward                         # or None: the trainer's reward function scores it

(``async def`` works too; an Anthropic-client agent uses
``anthropic.Anthropic(base_url=task.anthropic_base_url, api_key=task.api_key)``), or a
subprocess (``command: ["python", "agent.py"]``: ``python`` means the trainer's own interpreter,
``sys.executable``, and a relative script path resolves against the recipe's directory; see
:func:`resolve_command`) whose environment holds what the official clients read
(:meth:`AgentTask.env`): ``OPENAI_BASE_URL`` (``<root>/v1``), ``OPENAI_API_KEY``,
``ANTHROPIC_BASE_URL`` (the root: the Anthropic client appends ``/v1/messages`` itself),
``ANTHROPIC_API_KEY`` (the keys are the session id), ``RL_SERVER_URL`` (the root), ``RL_MODEL``
(the served model name) and ``RL_TASK`` (JSON with the prompt's ``input``, ``label`` and
``metadata``; the same JSON comes on stdin). If the last line it prints is a JSON object with a
numeric ``"reward"``, that is the session's reward. A program may report counts with its
reward (:data:`REPORTED_COUNTS`: ``tool_errors``, the tool calls that failed), by returning
``{"reward": x, "tool_errors": n}`` or printing it as its last line; with the server's own
counts (turns, tool calls, ill-formed calls, template mismatches) they are in every rollout's
metadata and the trainer logs them per step (``rollout/agent/*``).

Concurrency is set by the config: at most ``max_sessions`` sessions run at once (across every
prompt of the step; the others wait their turn), at most ``max_subprocesses`` of them as
subprocesses. A plain (``def``) program runs on a pool of daemon threads of its own, one per
running session (never asyncio's default executor: its few workers are shared with the server's
request rendering, and agents blocked on the server in every one of them would deadlock the
run), so partial rollouts with sync agents and many sessions per step complete, and an
abandoned session (a timeout, a stop signal) never holds the process's exit. A session that is
cancelled (the trainer stopping) kills its subprocess.

Each of the ``ctx.n_samples`` runs of a prompt is one session; its rollouts (one per merged
trajectory) share the session id as ``rollout_id``. A run that raises, times out or exits
non-zero gives failed rollouts (the reason is in ``metadata["failure"]`` and counted by the
trainer). A returned reward is stored in ``metadata["session_reward"]``; score with
:class:`SessionReward` (``reward: {type: session_reward}``) to train on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar

from rl_agents.server import AgentServer
from rl_core.config import CodeRef, PositiveFloat, PositiveInt, from_dict
from rl_core.errors import ConfigError, RewardError
from rl_core.interfaces import Generator, RolloutContext
from rl_core.locations import Located, base_dir_of
from rl_core.types import Prompt, Rollout

logger = logging.getLogger(__name__)

__all__ = [
    "AgentRollout",
    "AgentTask",
    "SessionReward",
    "resolve_command",
    "run_in_daemon_thread",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentTask:
    """What an agent program gets for one session."""

    base_url: str
    """OpenAI ``base_url`` of the server (``http://127.0.0.1:<port>/v1``)."""
    api_key: str
    """The session id; pass it as the client's ``api_key`` (OpenAI and Anthropic alike)."""
    model: str
    """Model name to put in requests (the server answers another name with 404)."""
    prompt: Prompt
    """The prompt (``input`` is text or chat messages; ``label`` and ``metadata`` as loaded)."""
    root_url: str = ""
    """The server's root (``http://127.0.0.1:<port>``); ``""``: ``base_url`` without its
    ``/v1``."""

    def __post_init__(self) -> None:
        if not self.root_url:
            root = self.base_url.rstrip("/")
            object.__setattr__(self, "root_url", root.removesuffix("/v1"))

    @property
    def openai_base_url(self) -> str:
        """The OpenAI client's ``base_url`` (``<root>/v1``; the same as :attr:`base_url`)."""
        return self.base_url

    @property
    def anthropic_base_url(self) -> str:
        """The Anthropic client's ``base_url``: the root, since the client appends
        ``/v1/messages`` itself (``<root>/v1`` would be answered 404)."""
        return self.root_url

    def env(self) -> dict[str, str]:
        """The variables an unmodified agent's clients read: ``OPENAI_BASE_URL``,
        ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY`` (the keys are the
        session id), ``RL_SERVER_URL`` (the root) and ``RL_MODEL`` (the model name)."""
        return {
            "OPENAI_BASE_URL": self.openai_base_url,
            "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": self.anthropic_base_url,
            "ANTHROPIC_API_KEY": self.api_key,
            "RL_SERVER_URL": self.root_url,
            "RL_MODEL": self.model,
        }

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

        program: Annotated[str | None, CodeRef()] = None
        """``"module:attr"`` or ``"path/to/file.py:attr"`` of a callable
        ``fn(task: AgentTask) -> float | None`` (sync: run on a daemon thread of its own;
        async: awaited). A module that is a file beside the recipe (``my_agent:solve`` with
        ``my_agent.py`` next to it) loads without ``PYTHONPATH``."""
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
        max_sessions: PositiveInt = 64
        """Sessions running at once at most, over every prompt of the step (the others wait);
        a sync ``program`` runs on this many daemon threads at most."""
        max_subprocesses: PositiveInt | None = None
        """``command`` subprocesses running at once at most (``None``: ``max_sessions``)."""

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
            for name in ("max_sessions", "max_subprocesses"):
                value = getattr(self, name)
                if value is not None and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1
                ):
                    raise ConfigError(
                        f"generate_fn.{name}: a whole number >= 1, got {value!r}; it caps the "
                        "agent sessions (subprocesses) running at once."
                    )

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
        self._limits: (
            tuple[asyncio.AbstractEventLoop, asyncio.Semaphore, asyncio.Semaphore] | None
        ) = None
        self.running = 0
        """Sessions running now (at most ``Config.max_sessions``)."""
        self.peak_running = 0
        """The most sessions that ran at once."""

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

    def _semaphores(self) -> tuple[asyncio.Semaphore, asyncio.Semaphore]:
        """The session and subprocess limits of the running event loop."""
        loop = asyncio.get_running_loop()
        if self._limits is None or self._limits[0] is not loop:
            cfg = self.config
            procs = cfg.max_subprocesses or cfg.max_sessions
            self._limits = (loop, asyncio.Semaphore(cfg.max_sessions), asyncio.Semaphore(procs))
        return self._limits[1], self._limits[2]

    async def __call__(self, prompt: Prompt, ctx: RolloutContext) -> list[Rollout]:
        """Run ``ctx.n_samples`` sessions of the agent concurrently (within
        ``Config.max_sessions``); all their rollouts."""
        server = await self.ensure_server(ctx)
        sessions, _ = self._semaphores()

        async def limited(k: int) -> list[Rollout]:
            async with sessions:
                self.running += 1
                self.peak_running = max(self.peak_running, self.running)
                try:
                    return await self._session(server, prompt, ctx, k)
                finally:
                    self.running -= 1

        runs = await asyncio.gather(*(limited(k) for k in range(ctx.n_samples)))
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
            base_url=server.base_url,
            root_url=server.root_url,
            api_key=sid,
            model=server.config.model_name,
            prompt=prompt,
        )
        reward: float | None = None
        failure: str | None = None
        extra: dict[str, Any] = {}
        try:
            if self._fn is not None:
                reward = await asyncio.wait_for(self._call(task), self.config.timeout_s)
                if isinstance(reward, Mapping):
                    reward, extra = _report(reward, sid)
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
        out = await run_in_daemon_thread(self._fn, task)
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
        # ANTHROPIC_AUTH_TOKEN would make the Anthropic client send a bearer token besides
        # the key (the trainer's own, if it has one): only the session id goes out.
        env = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_AUTH_TOKEN"}
        env.update(task.env(), RL_TASK=payload)
        assert self.argv is not None
        from rl_agents.tools.private import private_argv  # its own PID namespace: no key leak

        _, procs = self._semaphores()
        async with procs:
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
            except BaseException:  # a timeout, or the session cancelled (the run stopping)
                if proc.returncode is None:
                    proc.kill()
                    await asyncio.shield(proc.wait())
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
                reward, counts = _report(last, self.argv[0])
                return reward, {**counts, "agent_stdout": stdout[-2000:]}
        return reward, {"agent_stdout": stdout[-2000:]}


async def run_in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a new daemon thread, awaited: a thread of its own per call (the
    caller bounds how many run at once), never asyncio's shared default executor, and never
    joined at exit, so a call left blocked (a cancelled or timed-out session) cannot keep the
    process alive."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():  # cancelled meanwhile: nobody waits for the result
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def work() -> None:
        try:
            result, ok = fn(*args), True
        except BaseException as e:  # handed to the awaiting session
            result, ok = e, False
        # The loop may be closed (the run ended while the call was blocked): nobody waits.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, ok, result)

    name = f"agent-{getattr(fn, '__name__', type(fn).__name__)}"
    threading.Thread(target=work, name=name, daemon=True).start()
    return await fut


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

    scores_sessions: ClassVar[bool] = True
    """It scores a session, not a response text: ``rl-train check`` scores the dry session of
    the recipe's ``generate_fn`` with it instead of dummy responses."""

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout) -> float:
        """The session's reward."""
        if "session_reward" not in rollout.metadata:
            raise RewardError(
                f"rollout {rollout.sample_id}: its agent session reported no reward; return a "
                'float from the agent program (or print {"reward": x} last), or use a reward '
                "function that scores the response."
            )
        return float(rollout.metadata["session_reward"])


REPORTED_COUNTS = ("tool_errors",)
"""Counts an agent may report with its reward (a returned mapping, or the keys of its last
JSON line): stored in the rollouts' metadata and aggregated into the trainer's
``rollout/agent/*`` metrics."""


def _report(report: Mapping[str, Any], who: str) -> tuple[Any, dict[str, int]]:
    """``(reward, counts)`` of an agent's report ``{"reward": x, "tool_errors": n}``."""
    counts = {}
    for key in REPORTED_COUNTS:
        if key in report:
            value = report[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RewardError(
                    f"agent {who}: reported {key}={value!r}; expected a whole number >= 0."
                )
            counts[key] = value
    return report.get("reward"), counts


def _as_reward(value: Any, sid: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(f"session {sid}: the agent returned {value!r}; expected a float or None.")
    return float(value)
