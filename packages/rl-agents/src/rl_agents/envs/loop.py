"""The built-in multi-turn loop: :class:`EnvRollout` runs an
:class:`~rl_agents.envs.base.Environment` as a :class:`~rl_core.interfaces.GenerateFn`, and
:class:`EnvReward` trains on the rewards the environment gave.

One episode, token-in/token-out, on one :class:`~rl_agents.trajectory.TrajectoryBuilder`::

    prompt ids                          Prompt.token_ids                  (the prompt)
    + reset(prompt) text                observation tokens, loss mask 0   (if any)
    + model turn 0                      the engine's ids and log-probs, loss mask 1
    + step(action 0).observation        observation tokens, loss mask 0
    + model turn 1 ...                  until done / max_turns / max_length

Model tokens are never decoded and re-encoded (the environment reads the decoded text, the
trajectory keeps the sampled ids); observation text is encoded once, when it is appended. The
episode ends when a step says ``done``, after ``max_turns`` model turns, when a turn stops for
another reason than a stop token (``length``, ``abort``, ``error``: the environment still sees
that turn), or when the ``max_length`` token budget is full. Every model turn goes through
``ctx.generate``, so with ``rl.partial_rollouts`` (the trainer then hands a
:class:`~rl_agents.resumable.ResumableGenerator` as ``ctx.generator``) a turn cut by a weight
update resumes on the new weights and keeps each token's version.

In a recipe::

    rollout:
      generate_fn:
        type: env
        env: "my_pkg.envs:GuessNumber"        # or a name of the rl.envs entry-point group
        env_options: {low: 1, high: 100}      # the environment's Config, if it has one
        max_turns: 4
        max_length: 512
        max_concurrent_episodes: 64
    reward: {type: env_reward}

A plain (``def``) environment method runs on a daemon thread of its own (one per call), so a
blocking environment never stalls the event loop that also drives the generator, and never
competes for asyncio's small default executor; ``sync_env: inline`` calls it on the loop
instead (for environments whose steps are instant). An exception in ``reset`` or ``step``
fails that rollout (``metadata["failure"]`` says where; the trainer counts it) and the run
goes on; a ``step`` that returns something other than a
:class:`~rl_agents.envs.base.StepResult` is a programming error and raises
:class:`~rl_core.errors.DataError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from rl_agents.chat import ChatFormat
from rl_agents.envs.base import Action, StepResult
from rl_agents.parsers import FAMILIES, ParsedCompletion
from rl_agents.trajectory import TrajectoryBuilder
from rl_core import registry
from rl_core.config import CodeRef, PositiveInt, Range, from_dict
from rl_core.errors import ConfigError, DataError, RewardError
from rl_core.interfaces import RolloutContext
from rl_core.types import FinishReason, GenerationResult, Prompt, Rollout, RolloutStatus

logger = logging.getLogger(__name__)

__all__ = ["ENV_GROUP", "EnvReward", "EnvRollout", "EnvStats"]

ENV_GROUP = "rl.envs"
"""Entry-point group of named environments (``env: <name>``)."""


@dataclass(slots=True)
class EnvStats:
    """What an :class:`EnvRollout` did so far (for tests and logs)."""

    episodes: int = 0
    """Episodes finished (failed ones included)."""
    failed: int = 0
    """Episodes whose environment raised."""
    running: int = 0
    """Episodes running now."""
    peak_running: int = 0
    """Most episodes that ran at once."""


class EnvRollout:
    """GenerateFn: ``ctx.n_samples`` episodes of an environment per prompt, each one rollout
    (see the module docstring). Rollout metadata: ``env_reward`` (sum of step rewards),
    ``env_done``, ``env_end`` (``done``, ``max_turns``, ``length``, ``finish:<reason>`` or
    ``failed``), ``env_steps``, ``env_info`` (the last step's scalar ``info`` entries),
    ``tool_calls``, ``ill_formed_tool_calls`` and the builder's ``turns`` / ``model_turns``."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`EnvRollout`."""

        env: Annotated[str, CodeRef()]
        """The environment: ``"package.module:Class"``, ``"path/to/file.py:Class"`` (relative
        to the recipe's directory) or a name of the ``rl.envs`` entry-point group. A class with a nested ``Config`` is built with
        ``env_options`` validated against it; a class without one (or a zero-argument factory
        function) is called with no arguments. One instance per episode."""
        env_options: dict[str, Any] = field(default_factory=dict)
        """Options of the environment's ``Config``."""
        max_turns: PositiveInt = 4
        """Model turns per episode at most."""
        max_length: Annotated[int, Range(ge=2)] | None = 2048
        """Token budget of an episode (prompt included); ``None`` for none."""
        max_concurrent_episodes: PositiveInt | None = None
        """Episodes that may run at once across every prompt of the run (the others wait their
        turn); ``None``: no cap."""
        parse_tool_calls: bool = True
        """Parse each turn's tool calls (in the ``tool_format`` family's format) into
        ``Action.tool_calls``."""
        tool_format: str = "hermes"
        """The model family whose tool-call format turns are parsed in
        (:data:`rl_agents.parsers.FAMILIES`: ``hermes`` (Qwen ``<tool_call>`` JSON blocks),
        ``qwen3_coder``, ``llama3``, ``mistral``, ``deepseek``, ``glm``, ``kimi_k2``); the
        policy's own family when it was trained to call tools in its format. Families whose
        calls are marked by special tokens are parsed from the text decoded with them."""
        tools: list[dict[str, Any]] | None = None
        """OpenAI tool definitions (``{type: function, function: {name, parameters}}``) of the
        tools the environment offers: families that write arguments as text (``glm``,
        ``qwen3_coder``) cast them to these schemas' types; ``None``: arguments written as
        text stay strings."""
        sync_env: Literal["thread", "inline"] = "thread"
        """How plain (``def``) ``reset``/``step`` run: on a daemon thread per call, or on the
        event loop (instant steps only: a slow one stalls generation)."""
        sandbox: dict[str, Any] | None = None
        """Options of :class:`rl_agents.tools.Sandbox.Config` (e.g. ``{timeout_s: 5,
        max_concurrent: 8}``): one sandbox, shared by every episode (its ``max_concurrent``
        caps the commands running at once), is set as the ``sandbox`` attribute of each
        environment before ``reset``; the environment runs model-written code with
        ``await self.sandbox.arun(code)``. The environment class must declare ``sandbox``."""

        def __post_init__(self) -> None:
            if not self.env or not isinstance(self.env, str):
                raise ConfigError(
                    "generate_fn.env: name the environment class, e.g. "
                    "env: 'my_pkg.envs:MyEnv' (or a name of the rl.envs entry-point group)."
                )
            if self.tool_format not in FAMILIES:
                raise ConfigError(
                    f"generate_fn.tool_format: unknown model family {self.tool_format!r}; "
                    f"expected one of: {', '.join(sorted(FAMILIES))} (hermes: Qwen-style "
                    "<tool_call> JSON blocks)."
                )
            if self.sync_env not in ("thread", "inline"):
                raise ConfigError(
                    f"generate_fn.sync_env: {self.sync_env!r}; choose 'thread' or 'inline'."
                )

    def __init__(self, config: Config) -> None:
        self.config = config
        self.stats = EnvStats()
        """Episode counters (running, peak, failed)."""
        self._factory = _env_factory(config.env, config.env_options)
        probe = self._factory()
        _check_env(probe, config.env)  # a wrong class fails at start-up, not mid-run
        self.sandbox: Any = None
        """The shared :class:`~rl_agents.tools.Sandbox` (``Config.sandbox``), or ``None``."""
        if config.sandbox is not None:
            if not hasattr(probe, "sandbox"):
                raise ConfigError(
                    f"generate_fn.sandbox: set, but {config.env!r} has no 'sandbox' attribute "
                    "to receive it; declare `sandbox = None` on the class (and run code with "
                    "`await self.sandbox.arun(code)`), or remove generate_fn.sandbox."
                )
            from rl_agents.tools import Sandbox

            box_config = from_dict(Sandbox.Config, dict(config.sandbox), path="generate_fn.sandbox")
            self.sandbox = Sandbox(box_config)
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None

    def _semaphore(self) -> asyncio.Semaphore | None:
        cap = self.config.max_concurrent_episodes
        if cap is None:
            return None
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:  # one per event loop
            self._sem, self._sem_loop = asyncio.Semaphore(cap), loop
        return self._sem

    async def __call__(self, prompt: Prompt, ctx: RolloutContext) -> list[Rollout]:
        """Run ``ctx.n_samples`` episodes of ``prompt`` concurrently (within the cap)."""
        return list(
            await asyncio.gather(*(self._capped(prompt, ctx, k) for k in range(ctx.n_samples)))
        )

    async def _capped(self, prompt: Prompt, ctx: RolloutContext, k: int) -> Rollout:
        sem = self._semaphore()
        if sem is None:
            return await self._episode(prompt, ctx, k)
        async with sem:
            return await self._episode(prompt, ctx, k)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        if self.config.sync_env == "inline":
            out = fn(*args)
        else:
            out = await _in_daemon_thread(fn, *args)
        return await out if inspect.isawaitable(out) else out

    def _parse(
        self, result: GenerationResult, text: str, tokenizer: Any = None
    ) -> ParsedCompletion:
        """Tool calls of one turn in ``Config.tool_format``: Hermes from ``text`` (decoded
        without special tokens, as before families were configurable); other families from
        the text decoded with its special tokens (their call markers may be special tokens),
        a final stop token left out."""
        c = self.config
        if c.tool_format == "hermes":
            return ChatFormat.parse(text, tools_enabled=c.parse_tool_calls)
        ids = list(result.output_ids)
        if result.finish_reason == FinishReason.STOP and ids:
            ids = ids[:-1]
        raw = tokenizer.decode(ids, skip_special_tokens=False)
        return FAMILIES[c.tool_format].parse(raw, tools_enabled=c.parse_tool_calls, tools=c.tools)

    async def _episode(self, prompt: Prompt, ctx: RolloutContext, k: int) -> Rollout:
        c = self.config
        sid = f"{prompt.uid}/{k}"
        self.stats.running += 1
        self.stats.peak_running = max(self.stats.peak_running, self.stats.running)
        env = self._factory()
        if self.sandbox is not None:
            env.sandbox = self.sandbox
        traj = TrajectoryBuilder(
            prompt.token_ids,
            TrajectoryBuilder.Config(max_length=c.max_length),
            version=ctx.policy_version,
        )
        total, steps, calls, ill_formed = 0.0, 0, 0, 0
        done, end, info = False, "max_turns", {}
        where = "reset"
        try:
            first = await self._call(env.reset, prompt)
            if first:
                traj.append_text(_text(first, c.env, "reset"), ctx.tokenizer)
            for turn in range(c.max_turns):
                if traj.is_full:
                    end = "length"
                    break
                result = await ctx.generate(
                    traj.input_ids, traj.clamp(ctx.sampling), request_id=f"{sid}/{turn}"
                )
                traj.append_model(result)
                text = ctx.tokenizer.decode(list(result.output_ids), skip_special_tokens=True)
                parsed = self._parse(result, text, ctx.tokenizer)
                calls += len(parsed.tool_calls)
                ill_formed += int(parsed.ill_formed)
                action = Action(
                    text=text,
                    token_ids=tuple(result.output_ids),
                    finish_reason=result.finish_reason,
                    turn=turn,
                    tool_calls=parsed.tool_calls,
                    ill_formed_tool_call=parsed.ill_formed,
                )
                where = f"step (turn {turn})"
                step = await self._call(env.step, action)
                if not isinstance(step, StepResult):
                    raise DataError(
                        f"environment {c.env}: step returned {type(step).__name__}; return a "
                        "rl_agents.envs.StepResult(observation=..., reward=..., done=...)."
                    )
                steps += 1
                total += _reward(step.reward, c.env, turn)
                info = dict(step.info)
                if step.done:
                    done, end = True, "done"
                    break
                if result.finish_reason != FinishReason.STOP:
                    end = f"finish:{result.finish_reason.value}"
                    break
                if step.observation and turn < c.max_turns - 1:
                    traj.append_text(_text(step.observation, c.env, "step"), ctx.tokenizer)
        except (asyncio.CancelledError, DataError, ConfigError):
            raise
        except Exception as e:  # the environment failed: this rollout fails, the run goes on
            logger.warning("environment %s failed in %s of %s: %r", c.env, where, sid, e)
            self.stats.failed += 1
            return traj.to_rollout(
                prompt.uid,
                sid,
                status=RolloutStatus.FAILED,
                metadata={"failure": f"env {where}: {type(e).__name__}: {e}", "env_end": "failed"},
            )
        finally:
            self.stats.running -= 1
            self.stats.episodes += 1
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    await self._call(close)
                except Exception as e:  # a failing close never loses the episode
                    logger.warning("environment %s: close() failed: %r", c.env, e)
        if end == "max_turns" and traj.is_full:
            end = "length"
        return traj.to_rollout(
            prompt.uid,
            sid,
            metadata={
                "env_reward": total,
                "env_done": done,
                "env_end": end,
                "env_steps": steps,
                "env_info": _scalars(info),
                "tool_calls": calls,
                "ill_formed_tool_calls": ill_formed,
            },
        )


class EnvReward:
    """RewardFn: the episode's reward, ``metadata["env_reward"]`` (the sum of its steps'
    rewards), as ``reward``, with the numeric entries of the last step's ``info`` as further
    components (``exact``, ``format``, ...). A rollout without one (not produced by
    :class:`EnvRollout`) is an error, counted as failed."""

    scores_sessions: ClassVar[bool] = True
    """It scores what the environment reported, not a response text: ``rl-train check`` scores
    a dry episode instead of its dummy responses (as for ``session_reward``)."""

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout) -> dict[str, float]:
        """The components of ``rollout``'s episode reward."""
        if "env_reward" not in rollout.metadata:
            raise RewardError(
                f"rollout {rollout.sample_id}: no env_reward in its metadata; env_reward scores "
                "rollouts of generate_fn type 'env' only (set rollout.generate_fn.type: env)."
            )
        out = {"reward": float(rollout.metadata["env_reward"])}
        for key, value in rollout.metadata.get("env_info", {}).items():
            if key != "reward" and isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = float(value)
        return out


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def _env_factory(ref: str, options: Mapping[str, Any]) -> Callable[[], Any]:
    """A zero-argument callable that builds one environment (options validated now)."""
    obj = registry.resolve(ENV_GROUP, ref, field="generate_fn.env")
    config_cls = getattr(obj, "Config", None) if inspect.isclass(obj) else None
    if config_cls is not None:
        config = from_dict(config_cls, dict(options), path="generate_fn.env_options")
        return lambda: obj(config)
    if options:
        raise ConfigError(
            f"generate_fn.env_options: {ref!r} has no Config, so it takes no options; remove "
            f"{sorted(options)} or give the class a nested Config dataclass."
        )
    if not callable(obj):
        raise ConfigError(f"generate_fn.env: {ref!r} is not a class or a factory function.")
    return obj


def _check_env(env: Any, ref: str) -> None:
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(
            f"generate_fn.env: {ref!r} built a {type(env).__name__} without "
            f"{' and '.join(missing)}(); an environment needs reset(prompt) and step(action) "
            "(see rl_agents.envs.Environment)."
        )


async def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a new daemon thread; its result (or exception) on the event loop. The
    thread never holds the process's exit and shares no pool with other work."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if fut.cancelled():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def work() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting coroutine
            value, error = None, e
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, name="rl-env", daemon=True).start()
    return await fut


def _text(value: Any, ref: str, method: str) -> str:
    if not isinstance(value, str):
        raise DataError(
            f"environment {ref}: {method} returned an observation of type "
            f"{type(value).__name__}; observations are text (str), appended as tokens."
        )
    return value


def _reward(value: Any, ref: str, turn: int) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise DataError(
            f"environment {ref}: step (turn {turn}) returned reward {value!r}; it must be a "
            "finite number."
        )
    return float(value)


def _scalars(info: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-safe scalar entries of ``info`` (rollout metadata is written to dumps)."""
    return {
        str(k): v
        for k, v in info.items()
        if isinstance(v, str | bool | int) or (isinstance(v, float) and math.isfinite(v))
    }
