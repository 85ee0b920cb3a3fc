"""Agent subprocesses cannot read each other's session keys: each runs in a PID namespace and
``/proc`` of its own (:mod:`rl_agents.tools.private`), so another agent's
``/proc/<pid>/environ`` (where ``OPENAI_API_KEY`` lives) cannot be named. Proven on raw
processes (with the unwrapped control showing the leak the test would catch), through
:class:`~rl_agents.AgentRollout` with two concurrent agents, and for an unprivileged trainer."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

import rl_agents
import rl_core
from rl_agents.tools.private import private_argv, private_available
from rl_core.interfaces import Generator, RolloutContext
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Prompt,
    RolloutStatus,
    SamplingParams,
)

needs_private = pytest.mark.skipif(
    not private_available(),
    reason="unshare --pid --fork --mount-proc / setpriv do not work here: commands run "
    "unwrapped (a warning says so)",
)

# Looks for a key in every environment it can reach in /proc for ~2 s; prints what it saw.
_SNOOP = r"""
import os, sys, time
want = sys.argv[1].encode()
seen = set()
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read():
                    seen.add(pid)
        except OSError:
            pass
    time.sleep(0.05)
print(len([p for p in os.listdir("/proc") if p.isdigit()]), "found" if seen else "none")
"""


def _snoop(wrap, secret: str) -> str:
    """Start a process holding ``secret`` in its environment and a snooper looking for it,
    both through ``wrap``; the snooper's verdict."""
    holder = subprocess.Popen(wrap(["sleep", "10"]), env={**os.environ, "OPENAI_API_KEY": secret})
    try:
        time.sleep(0.2)
        out = subprocess.run(
            wrap([sys.executable, "-c", _SNOOP, f"OPENAI_API_KEY={secret}", "1.5"]),
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "OPENAI_API_KEY": "mine"},
        )
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1]


@needs_private
def test_wrapped_processes_cannot_read_each_others_environment():
    secret = uuid.uuid4().hex
    assert _snoop(list, secret) == "found"  # the leak, unwrapped: the check can fail
    assert _snoop(private_argv, secret) == "none"


class _Echo(Generator):
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def weight_version(self) -> int:
        return 0

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        ids = (*self.tokenizer.encode("ok", add_special_tokens=False), self.tokenizer.eos_token_id)
        return [
            GenerationResult(
                request_id=r.request_id,
                output_ids=ids,
                output_logprobs=tuple(-0.5 for _ in ids),
                finish_reason=FinishReason.STOP,
                weight_version=0,
            )
            for r in requests
        ]

    async def update_weights(self, update, transport) -> None:
        raise NotImplementedError


@needs_private
def test_concurrent_agents_do_not_see_each_others_session_keys(tmp_path: Path):
    """Two agents of one prompt run at once; each looks for any other session's key in /proc
    for 2 s (reward 1.0 when it finds one) and then uses its own."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("openai")
    from rl_agents import AgentRollout
    from rl_hf import build_tokenizer

    script = tmp_path / "agent.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, os, time
            import openai
            mine = os.environ["OPENAI_API_KEY"].encode()
            others = set()
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                for pid in os.listdir("/proc"):
                    try:
                        with open(f"/proc/{pid}/environ", "rb") as f:
                            env = f.read().split(b"\\0")
                    except OSError:
                        continue
                    for kv in env:
                        if kv.startswith(b"OPENAI_API_KEY=") and kv[15:] != mine:
                            others.add(kv[15:])
                time.sleep(0.05)
            client = openai.OpenAI(max_retries=0)
            client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            print(json.dumps({"reward": 1.0 if others else 0.0}))
            """
        )
    )
    tok = build_tokenizer()
    fn = AgentRollout(AgentRollout.Config(command=[sys.executable, str(script)], timeout_s=120))
    ctx = RolloutContext(
        generator=_Echo(tok),
        tokenizer=tok,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=2),
        n_samples=2,
        policy_version=0,
    )
    prompt = Prompt(uid="u0", input="hi", token_ids=(1, 2), label="x")

    async def main():
        try:
            return await fn(prompt, ctx)
        finally:
            await fn.aclose()

    rollouts = asyncio.run(main())
    assert len(rollouts) == 2
    assert all(r.status != RolloutStatus.FAILED for r in rollouts), [
        r.metadata.get("failure") for r in rollouts
    ]
    assert [r.reward for r in rollouts] == [0.0, 0.0]


_HELPER = r"""
import json, os, subprocess, sys
sys.path[:0] = json.loads(sys.argv[1])
from rl_agents.tools.private import private_argv, private_available
if not private_available():
    print(json.dumps({"available": False})); sys.exit()
secret = "k" + os.urandom(8).hex()
holder = subprocess.Popen(private_argv(["sleep", "10"]), env={**os.environ, "OPENAI_API_KEY": secret})
import time; time.sleep(0.2)
snoop = sys.stdin.read()
out = subprocess.run(private_argv([sys.executable, "-c", snoop, "OPENAI_API_KEY=" + secret, "1"]),
                     capture_output=True, text=True)
holder.kill()
print(json.dumps({"available": True, "verdict": out.stdout.split()[-1:], "err": out.stderr}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to an unprivileged trainer needs root")
def test_unprivileged_trainer_agents_are_wrapped_too(uid: int = 0x50000002):
    """An unprivileged trainer's wrapper adds a user namespace; the key stays hidden."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    src = [str(Path(m.__file__).parents[1]) for m in (rl_agents, rl_core)]
    if python is None:
        pytest.skip("no system python3 for the unprivileged helper")
    proc = subprocess.run(
        [python, "-c", _HELPER, json.dumps(src)],
        input=_SNOOP,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/tmp",
        env={**os.environ, "HOME": "/tmp"},
        user=uid,
        group=uid,
        extra_groups=[],
    )
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip(f"the system python3 cannot import rl_agents' sources: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if not r["available"]:
        pytest.skip("no user namespaces here for an unprivileged user")
    assert r["verdict"] == ["none"], r
