"""Agent runs that hold (issue 33), through the trainer on the tiny model: partial rollouts
with a plain (``def``) agent program and 64 sessions per step complete, in lockstep and in
continuous mode, and their partial-resume counters count the agent's resumed turns (before: the
sync agents took every worker of asyncio's default executor, which the agent server needs to
render requests, and every session ran into its timeout); the first Ctrl-C stops a run whose
agent hangs (before: it waited for the step to end, forever)."""

from __future__ import annotations

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
import time

import openai


def solve(task):
    '''Two chat turns with the stock, synchronous OpenAI client.'''
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
    tmp_path, tiny_recipe_dict, mode
):
    run_dir = tmp_path / "run"
    module = _agent_module(tmp_path, f"serving_agent_{mode}")
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
    t0 = time.monotonic()
    Trainer(load_trainer_config(recipe)).run()
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert time.monotonic() - t0 < 60  # before: every session timed out (60 s) at step 1
    for r in rows:
        assert not any(k.startswith("rollout/failed/") for k in r), r
        assert r["rollout/staleness_max"] <= 1
        # Watch: every step logs what the sessions did (two chat turns each, no tool calls).
        assert r["rollout/agent/sessions"] == 64 and r["rollout/agent/turns_mean"] == 2.0
        assert r["rollout/agent/tool_calls"] == 0 and "rollout/agent/ill_formed" in r
    # The weight releases cut agent turns short and the counters say so.
    assert sum(r["rollout/partial_interruptions"] for r in rows) >= 1
    assert sum(r["rollout/partial_resumed"] for r in rows) >= 1


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
