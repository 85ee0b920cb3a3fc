"""Agent runs that hold (issue 33), through the trainer on the tiny model: partial rollouts
with a plain (``def``) agent program and 64 sessions per step complete, in lockstep and in
continuous mode, and their partial-resume counters count the agent's resumed turns (before: the
sync agents took every worker of asyncio's default executor, which the agent server needs to
render requests, and every session ran into its timeout); the first Ctrl-C stops a run whose
agent hangs (before: it waited for the step to end, forever).

The partial-rollout test does not leave its interruption to timing (before, on a quiet machine
the second round sometimes finished before step 1's release and nothing was cut): the first
session of the second round, which generates on version 0 while step 1 trains, pauses the
engine, so that round's turns are queued in it, in flight on version 0, when version 1 is
released; the engine resumes once it serves a newer version, which only the abort on release
and the catch-up of the partial-rollout machinery bring about."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer

AGENT = """
import asyncio
import threading
import time

import openai

TRAINER = None  # set by the partial-rollout test: the run whose engine the second round holds
ROUND_SESSIONS = 0  # sessions per round: the next session starts the second round
HOLD_LIMIT_S = 30.0  # a hold that sees no newer version by then ends (and the test fails)
HELD = []  # (version served when the engine was paused, version served when it resumed)
_lock = threading.Lock()
_sessions = 0


def hold_engine_until_a_newer_version():
    '''Pause the engine, so every request sent from now on stays queued in it (in flight), until
    it serves a newer weight version; a watcher thread then resumes it. Called as the second
    round starts (no turn of it has reached the engine: it still serves version 0), a round
    that step 1, hence the release of version 1, does not wait for. Only the partial-rollout
    machinery (abort on release, catch-up, resume) brings a paused engine to version 1.
    HFGenerator.pause and resume only flip a flag under a threading lock, so this thread may
    run them on an event loop of its own.'''
    engine = TRAINER.generator
    paused_at = engine.weight_version
    asyncio.run(engine.pause())

    def watch():
        deadline = time.monotonic() + HOLD_LIMIT_S
        while engine.weight_version == paused_at and time.monotonic() < deadline:
            time.sleep(0.005)
        HELD.append((paused_at, engine.weight_version))
        asyncio.run(engine.resume())

    threading.Thread(target=watch, name="hold-watcher", daemon=True).start()


def solve(task):
    '''Two chat turns with the stock, synchronous OpenAI client. In the partial-rollout test
    the first session of the second round holds the engine before any turn of that round.'''
    global _sessions
    with _lock:  # the other sessions of the round send nothing before the engine is paused
        _sessions += 1
        if TRAINER is not None and _sessions == ROUND_SESSIONS + 1:
            hold_engine_until_a_newer_version()
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    msgs = task.messages
    r = client.chat.completions.create(model=task.model, messages=msgs, max_tokens=6)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "again"}]
    r = client.chat.completions.create(model=task.model, messages=msgs, max_tokens=6)
    return float(len(r.choices[0].message.content or "") % 2)


def hang(task):
    '''One chat turn, then it never returns (a stuck tool, a lost connection).'''
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=2)
    open(task.prompt.metadata.get("marker", "{marker}"), "a").close()
    time.sleep(3600)
"""


def _agent_module(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(AGENT).replace("{marker}", str(tmp_path / "hung")))
    return str(path)


def _rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl" and r["step"]]


@pytest.mark.parametrize("mode", ["lockstep", "continuous"])
def test_partial_rollouts_with_sync_agents_at_64_sessions_complete(
    tmp_path, tiny_recipe_dict, mode, monkeypatch
):
    run_dir = tmp_path / "run"
    name = f"serving_agent_{mode}"
    module = _agent_module(tmp_path, name)
    # The trainer imports the program's file under its module name: import it first, so the
    # agent can see the run (its engine) and the test what the holding session saw.
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    agent = importlib.import_module(name)
    recipe = tiny_recipe_dict(run_dir, seed=2)
    recipe["generator"] = {"type": "hf", "stop_on_eos": False}
    recipe["reward"] = {"type": "session_reward"}
    recipe["rollout"] = {
        "prompts_per_step": 16,
        "n_samples": 4,  # 64 sessions per step, sync agents: 10x asyncio's default workers
        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        "generate_fn": {"type": "agent", "program": f"{module}:solve", "timeout_s": 60},
    }
    recipe["rl"] = {
        "steps": 2,
        "async_generation": True,
        "partial_rollouts": True,
        "max_staleness": 1,
        "async_mode": mode,
    }
    recipe["eval"] = {"every": 0}
    recipe["runtime"] = {"generator_process": False}  # the agent pauses the in-process engine
    t0 = time.monotonic()
    trainer = Trainer(load_trainer_config(recipe))
    agent.TRAINER, agent.ROUND_SESSIONS = trainer, 64
    try:
        trainer.run()
    finally:
        sys.modules.pop(name, None)
    # The first second-round session held the engine on version 0 and saw it serve version 1:
    # the release came while that round's turns were queued in the engine, and only the abort
    # and catch-up on release move a held engine.
    assert agent.HELD == [(0, 1)], f"the held engine served {agent.HELD}: no release cut the turns"
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert time.monotonic() - t0 < 60  # before: every session timed out (60 s) at step 1
    for r in rows:
        assert not any(k.startswith("rollout/failed/") for k in r), r
        assert r["rollout/staleness_max"] <= 1
        # Watch: every step logs what the sessions did (two chat turns each, no tool calls).
        assert r["rollout/agent/sessions"] == 64 and r["rollout/agent/turns_mean"] == 2.0
        assert r["rollout/agent/tool_calls"] == 0 and "rollout/agent/ill_formed" in r
    # The release cut the held round's turns short (step 2 trains that round) and the
    # counters say so.
    assert rows[1]["rollout/partial_interruptions"] >= 1
    assert rows[1]["rollout/partial_resumed"] >= 1


def test_first_ctrl_c_stops_a_run_whose_agent_hangs(tmp_path, tiny_recipe_dict):
    run_dir = tmp_path / "run"
    module = _agent_module(tmp_path, "hanging_agent")
    recipe = tiny_recipe_dict(run_dir)
    recipe["reward"] = {"type": "session_reward"}
    recipe["rollout"]["generate_fn"] = {
        "type": "agent",
        "program": f"{module}:hang",
        "timeout_s": 3600,
    }
    recipe["eval"] = {"every": 0}
    path = tmp_path / "hang.yaml"
    path.write_text(json.dumps(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl_trainer.cli", "run", str(path), "--no-report"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "hung").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the agent never made its call"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # once
        out, _ = proc.communicate(timeout=30)  # before: it never ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, out
    assert "RunStopped" in out and "after a stop signal" in out and "--resume" in out, out
