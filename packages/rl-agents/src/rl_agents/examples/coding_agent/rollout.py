"""The coding-agent rollout: an unmodified agent program (a subprocess using the official
``openai`` client) against the agent server, its shell tool in a sandbox, its reward from
hidden unit tests.

Per sample (one agent session):

1. open a session on the :class:`~rl_agents.server.AgentServer` and a sandbox
   :class:`~rl_agents.tools.sandbox.Episode` (a private root, the agent's workspace);
2. run ``command`` (default: :mod:`rl_agents.examples.coding_agent.agent`) with
   ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (the session id), ``RL_TASK`` (the prompt's
   ``input`` only: the hidden tests stay here), ``AGENT_WORKSPACE`` (the root) and
   ``AGENT_SHELL_PREFIX`` (``python -m rl_agents.tools --root ROOT --config ... --``: every shell
   command runs in the sandbox, under its limits);
3. copy the file the label names (``solution.py``) into a *fresh* sandbox root with the hidden
   tests (:func:`~rl_agents.examples.coding_agent.tasks.test_script`), so the agent cannot
   touch them, and run them there: reward = tests passed / tests;
4. finish the session: its rollouts (merged turns, exact tokens and log-probs) carry the reward
   (``metadata["session_reward"]``, train with ``reward: {type: session_reward}``),
   ``tests_passed``, ``tool_calls`` and ``sandbox`` (the isolation that ran);
5. with ``episodes_dir`` set, write the episode as JSON (``<episodes_dir>/<session>.json``):
   the task, every turn (prompt and output token counts, log-prob sum, the text sampled, the
   tool calls, weight version), the files the agent left, the test output and the reward.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shlex
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rl_agents.examples.coding_agent.tasks import test_script
from rl_agents.rollout import AgentRollout
from rl_agents.session import Session
from rl_agents.tools.sandbox import Episode, Sandbox
from rl_core.config import PositiveFloat, PositiveInt
from rl_core.errors import ConfigError, DataError
from rl_core.interfaces import RolloutContext
from rl_core.types import Prompt, Rollout

__all__ = ["CodingAgentRollout"]

_AGENT = [sys.executable, "-m", "rl_agents.examples.coding_agent.agent"]


class CodingAgentRollout:
    """GenerateFn: ``ctx.n_samples`` coding-agent sessions per prompt; see the module
    docstring."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`CodingAgentRollout`."""

        command: list[str] = field(default_factory=lambda: list(_AGENT))
        """The agent program (argv); the default is the bundled openai-client agent."""
        max_turns: PositiveInt = 4
        """Model calls per session at most (``AGENT_MAX_TURNS``; the server also refuses more
        than ``server.max_turns``)."""
        max_tokens: PositiveInt = 256
        """Tokens per model call at most (``AGENT_MAX_TOKENS``)."""
        timeout_s: PositiveFloat = 300.0
        """Seconds one session may take; then the agent is killed and its rollouts fail."""
        sandbox: dict[str, Any] = field(default_factory=dict)
        """Options of :class:`~rl_agents.tools.sandbox.Sandbox.Config` for the shell tool and
        the hidden tests."""
        server: dict[str, Any] | None = None
        """Options of :class:`~rl_agents.server.AgentServer.Config`."""
        episodes_dir: str | None = None
        """Write each episode as JSON here (e.g. ``<run_dir>/episodes``); ``None``: do not."""

        def __post_init__(self) -> None:
            if not self.command or not all(isinstance(a, str) for a in self.command):
                raise ConfigError(
                    f"generate_fn.command: a non-empty list of strings, got {self.command!r}."
                )

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or CodingAgentRollout.Config()
        try:
            self.sandbox = Sandbox(Sandbox.Config(**self.config.sandbox))
        except TypeError as e:
            raise ConfigError(
                f"generate_fn.sandbox: {e}; see rl_agents.tools.Sandbox.Config for the options."
            ) from None
        self._agents = AgentRollout(
            AgentRollout.Config(command=list(self.config.command), server=self.config.server)
        )
        """Owns the agent server (started on the first call)."""

    async def aclose(self) -> None:
        """Stop the server."""
        await self._agents.aclose()

    async def __call__(self, prompt: Prompt, ctx: RolloutContext) -> list[Rollout]:
        """Run ``ctx.n_samples`` sessions concurrently; all their rollouts."""
        label = prompt.label
        if not isinstance(label, dict) or not isinstance(label.get("tests"), list):
            raise DataError(
                f"prompt {prompt.uid}: label must be {{'file': 'solution.py', 'tests': [...]}} "
                f"(hidden tests), got {label!r}; see rl_agents.examples.coding_agent.tasks."
            )
        server = await self._agents.ensure_server(ctx)
        runs = await asyncio.gather(
            *(self._session(server, prompt, ctx, k) for k in range(ctx.n_samples))
        )
        return [r for rs in runs for r in rs]

    async def _session(self, server, prompt: Prompt, ctx: RolloutContext, k: int) -> list[Rollout]:
        c = self.config
        sid = f"{prompt.uid}/{k}/{uuid.uuid4().hex[:8]}"
        sampling = ctx.sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=(sampling.seed * 1_009 + k) & 0x7FFFFFFF)
        session = server.open_session(sid, sampling=sampling, metadata={"sample": k})
        failure: str | None = None
        reward: float | None = None
        record: dict[str, Any] = {"session": sid, "prompt_uid": prompt.uid, "task": prompt.input}
        with self.sandbox.episode() as ep:
            try:
                record["agent"] = await self._run_agent(server, sid, prompt, ep)
                passed, total, test_out = await asyncio.to_thread(self._grade, ep, prompt.label)
                reward = passed / total if total else 0.0
                record.update(tests_passed=passed, tests_total=total, test_output=test_out)
            except TimeoutError:
                failure = f"agent_timeout: session ran over {c.timeout_s}s"
            except RuntimeError as e:  # the agent program failed
                failure = f"agent_error: {e}"
            record["files"] = _listing(ep)
        record.update(
            reward=reward,
            failure=failure,
            sandbox=self.sandbox.isolation,
            turns=_turns(session, server),
        )
        meta = {
            "sandbox": self.sandbox.isolation,
            "tests_passed": record.get("tests_passed", 0),
        }
        rollouts = server.finish_session(
            sid,
            prompt_uid=prompt.uid,
            prompt_ids=prompt.token_ids,
            reward=reward if failure is None else None,
            failure=failure,
            metadata=meta,
        )
        if c.episodes_dir is not None:
            d = Path(c.episodes_dir)
            d.mkdir(parents=True, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", sid)
            (d / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
        return rollouts

    async def _run_agent(self, server, sid: str, prompt: Prompt, ep: Episode) -> dict[str, Any]:
        c = self.config
        box = json.dumps(asdict(self.sandbox.config))
        prefix = [sys.executable, "-m", "rl_agents.tools", "--root", str(ep.root)]
        prefix += ["--config", box, "--"]
        env = {
            **os.environ,
            "OPENAI_BASE_URL": server.base_url,
            "OPENAI_API_KEY": sid,
            "RL_TASK": json.dumps({"input": prompt.input}, default=str),
            "AGENT_WORKSPACE": str(ep.root),
            "AGENT_SHELL_PREFIX": shlex.join(prefix),
            "AGENT_MAX_TURNS": str(c.max_turns),
            "AGENT_MAX_TOKENS": str(c.max_tokens),
            "AGENT_MODEL": server.config.model_name,
        }
        from rl_agents.tools.private import private_argv  # its own PID namespace: no key leak

        proc = await asyncio.create_subprocess_exec(
            *private_argv(c.command),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=ep.root,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), c.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{c.command[0]} exited with {proc.returncode}: {stderr[-500:]}")
        return {"stdout": stdout[-4000:], "stderr": stderr[-4000:]}

    def _grade(self, ep: Episode, label: dict[str, Any]) -> tuple[int, int, str]:
        """Run the hidden tests on the agent's file in a fresh root."""
        name = str(label.get("file", "solution.py"))
        tests = [str(t) for t in label["tests"]]
        source = ep.read_file(name)
        if source is None:
            return 0, len(tests), f"{name} was not written"
        module = Path(name).stem
        with self.sandbox.episode({name: source, "run_tests.py": test_script(tests, module)}) as g:
            res = g.exec([self.sandbox.python, "run_tests.py"])
        lines = res.stdout.strip().splitlines()
        try:
            result = json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            result = {}
        passed = int(result.get("passed", 0)) if isinstance(result, dict) else 0
        return min(passed, len(tests)), len(tests), (res.stdout + res.stderr)[-2000:]


def _turns(session: Session, server) -> list[dict[str, Any]]:
    """The session's turns as JSON-able records."""
    out = []
    for t in session.turns:
        r = t.result
        out.append(
            {
                "prompt_tokens": len(t.prompt_ids),
                "output_tokens": len(r.output_ids),
                "output_ids": list(r.output_ids),
                "logprob_sum": float(sum(r.output_logprobs)),
                "finish_reason": str(r.finish_reason),
                "weight_version": r.weight_version,
                "text": t.output_text,
                "tool_calls": list(t.tool_call_ids),
                "ill_formed": t.ill_formed,
            }
        )
    return out


def _listing(ep: Episode) -> dict[str, str]:
    """The files the agent left (text, first 2000 characters each)."""
    out = {}
    for p in sorted(ep.root.rglob("*")):
        if p.is_file() and len(out) < 20:
            out[str(p.relative_to(ep.root))] = p.read_text(errors="replace")[:2000]
    return out
