"""Agent serving that holds (issue 33): many sessions of a plain (``def``) agent program
complete (they run on daemon threads of their own, not asyncio's few default workers, which the
server needs to render requests), ``max_sessions`` caps the sessions running at once, a
cancelled session kills its subprocess, and an unmodified Anthropic-client agent finds the
server from what its environment holds (``ANTHROPIC_BASE_URL`` is the root, not ``/v1``)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

from rl_agents import AgentRollout, AgentTask  # noqa: E402
from rl_core.errors import ConfigError  # noqa: E402
from rl_core.interfaces import RolloutContext  # noqa: E402
from rl_core.types import Prompt, RolloutStatus, SamplingParams  # noqa: E402
from rl_hf import HFGenerator, build_tiny_model, build_tokenizer  # noqa: E402
from rl_hf.tiny import TinyModelSpec  # noqa: E402

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def hf_gen(tmp_path_factory, tok):
    path = build_tiny_model(
        tmp_path_factory.mktemp("serving_tiny"),
        TinyModelSpec(
            hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
        ),
    )
    gen = HFGenerator(HFGenerator.Config(model_path=str(path)))
    yield gen
    asyncio.run(gen.close())


def plain_agent(task: AgentTask) -> float:
    """A sync two-turn agent on the stock OpenAI client (blocks its thread on each call)."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    msgs = task.messages
    r = client.chat.completions.create(model=task.model, messages=msgs, max_tokens=4)
    msgs += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "again"},
    ]
    client.chat.completions.create(model=task.model, messages=msgs, max_tokens=4)
    return 1.0


def _prompt(tok, i: int = 0) -> Prompt:
    msgs = [{"role": "user", "content": f"Count to {i + 3}."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tuple(tok.encode(text, add_special_tokens=False))
    return Prompt(uid=f"u{i}", input=msgs, token_ids=ids, label="x")


def _run_step(fn, gen, tok, prompts: int, n: int):
    """One step's rollouts: every prompt's sessions at once, as the trainer runs them."""

    async def main():
        ctx = RolloutContext(
            generator=gen, tokenizer=tok, sampling=SAMPLING, n_samples=n, policy_version=0
        )
        try:
            runs = await asyncio.gather(*(fn(_prompt(tok, i), ctx) for i in range(prompts)))
        finally:
            await fn.aclose()
        return [r for rs in runs for r in rs]

    return asyncio.run(main())


def test_sixty_four_plain_agent_sessions_complete(hf_gen, tok):
    # Before: the sync agents took every worker of asyncio's default executor and blocked on
    # the server, whose request rendering waits for a worker of that same pool: every session
    # ran into its timeout.
    fn = AgentRollout(AgentRollout.Config(program=f"{__name__}:plain_agent", timeout_s=30))
    t0 = time.monotonic()
    rollouts = _run_step(fn, hf_gen, tok, prompts=16, n=4)
    assert time.monotonic() - t0 < 30
    assert len({r.rollout_id for r in rollouts}) == 64
    assert [r.metadata.get("failure") for r in rollouts if r.status == RolloutStatus.FAILED] == []
    assert all(r.reward == 1.0 and r.metadata["session_turns"] == 2 for r in rollouts)
    assert fn.peak_running > 6  # more than the default executor's workers ran at once


def test_max_sessions_caps_the_sessions_running_at_once(hf_gen, tok):
    fn = AgentRollout(
        AgentRollout.Config(program=f"{__name__}:plain_agent", timeout_s=30, max_sessions=3)
    )
    rollouts = _run_step(fn, hf_gen, tok, prompts=4, n=3)
    assert len({r.rollout_id for r in rollouts}) == 12
    assert all(r.status != RolloutStatus.FAILED for r in rollouts)
    assert fn.peak_running == 3


@pytest.mark.parametrize("field", ["max_sessions", "max_subprocesses"])
@pytest.mark.parametrize("value", [0, -2, True, 1.5])
def test_concurrency_limits_are_checked(field, value):
    with pytest.raises(ConfigError, match=f"generate_fn.{field}"):
        AgentRollout.Config(program=f"{__name__}:plain_agent", **{field: value})


def test_a_cancelled_session_kills_its_subprocess(hf_gen, tok, tmp_path: Path):
    beat = tmp_path / "beat"
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time
            while True:
                with open({str(beat)!r}, "a") as f:
                    f.write("x")
                time.sleep(0.05)
            """
        )
    )
    fn = AgentRollout(AgentRollout.Config(command=[sys.executable, str(script)], timeout_s=120))

    async def main():
        ctx = RolloutContext(
            generator=hf_gen, tokenizer=tok, sampling=SAMPLING, n_samples=1, policy_version=0
        )
        task = asyncio.ensure_future(fn(_prompt(tok), ctx))
        for _ in range(200):
            await asyncio.sleep(0.05)
            if beat.exists():
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await fn.aclose()

    asyncio.run(main())
    time.sleep(0.3)
    size = beat.stat().st_size
    time.sleep(0.5)
    assert beat.stat().st_size == size  # the process is gone, not left running


ANTHROPIC_AGENT = """
import json, os, sys
import anthropic

task = json.loads(sys.stdin.read())
client = anthropic.Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY from env
msg = client.messages.create(
    model=os.environ["RL_MODEL"], max_tokens=4, messages=task["input"]
)
assert msg.type == "message" and msg.role == "assistant", msg
print(json.dumps({"reward": 0.25, "stop": msg.stop_reason}))
"""


def test_unmodified_anthropic_client_agent_completes_a_session(hf_gen, tok, tmp_path: Path):
    pytest.importorskip("anthropic")
    script = tmp_path / "claude_agent.py"
    script.write_text(textwrap.dedent(ANTHROPIC_AGENT))
    fn = AgentRollout(AgentRollout.Config(command=[sys.executable, str(script)], timeout_s=120))
    rollouts = _run_step(fn, hf_gen, tok, prompts=1, n=2)
    assert [r.metadata.get("failure") for r in rollouts] == [None, None]
    assert all(r.reward == 0.25 and r.metadata["session_turns"] == 1 for r in rollouts)


def anthropic_program(task: AgentTask) -> float:
    """An Anthropic-client program given only the task's URL and key."""
    import anthropic

    client = anthropic.Anthropic(
        base_url=task.anthropic_base_url, api_key=task.api_key, max_retries=0
    )
    client.messages.create(model=task.model, max_tokens=4, messages=task.messages)
    return 0.5


def test_anthropic_client_program_uses_the_tasks_root_url(hf_gen, tok):
    pytest.importorskip("anthropic")
    fn = AgentRollout(AgentRollout.Config(program=f"{__name__}:anthropic_program", timeout_s=60))
    (r,) = _run_step(fn, hf_gen, tok, prompts=1, n=1)
    assert r.status != RolloutStatus.FAILED and r.reward == 0.5, r.metadata.get("failure")


def test_task_urls_and_env():
    task = AgentTask(
        base_url="http://127.0.0.1:9/v1",
        api_key="s1",
        model="policy",
        prompt=Prompt(uid="p", input="x", token_ids=(1,)),
    )
    assert task.root_url == task.anthropic_base_url == "http://127.0.0.1:9"
    assert task.openai_base_url == "http://127.0.0.1:9/v1"
    assert task.env() == {
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "OPENAI_API_KEY": "s1",
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:9",
        "ANTHROPIC_API_KEY": "s1",
        "RL_SERVER_URL": "http://127.0.0.1:9",
        "RL_MODEL": "policy",
    }


def reporting_agent(task: AgentTask) -> dict:
    """Reports a failed tool call with its reward."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=2)
    return {"reward": 0.5, "tool_errors": 2}


def test_agents_report_tool_errors_with_their_reward(hf_gen, tok, tmp_path: Path):
    fn = AgentRollout(AgentRollout.Config(program=f"{__name__}:reporting_agent", timeout_s=60))
    (r,) = _run_step(fn, hf_gen, tok, prompts=1, n=1)
    assert r.reward == 0.5 and r.metadata["tool_errors"] == 2
    assert r.metadata["session_turns"] == 1 and r.metadata["tool_calls"] == 0
    script = tmp_path / "report.py"
    script.write_text('import json; print(json.dumps({"reward": 1.0, "tool_errors": 3}))\n')
    fn = AgentRollout(AgentRollout.Config(command=[sys.executable, str(script)], timeout_s=60))
    (r,) = _run_step(fn, hf_gen, tok, prompts=1, n=1)
    # No model call: a failed session, but the report's counts are kept.
    assert r.metadata["tool_errors"] == 3
    script.write_text('import json; print(json.dumps({"reward": 1.0, "tool_errors": -1}))\n')
    (r,) = _run_step(fn, hf_gen, tok, prompts=1, n=1)
    assert r.status == RolloutStatus.FAILED and "tool_errors=-1" in r.metadata["failure"]


def test_sandbox_max_concurrent_caps_the_commands_running_at_once():
    from concurrent.futures import ThreadPoolExecutor

    from rl_agents.tools.sandbox import Sandbox

    box = Sandbox(Sandbox.Config(max_concurrent=2, accept_weak_isolation=True))
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: box.run("import time; time.sleep(0.3)"), range(6)))
    assert all(r.ok for r in results), results
    assert box.peak_running == 2 and box.running == 0
    with pytest.raises(ConfigError, match="sandbox.max_concurrent"):
        Sandbox.Config(max_concurrent=0)
