"""Watching an agent run (issue 33): what the sessions did (turns, tool calls, ill-formed calls,
template mismatches, tool errors) is aggregated into each step's ``rollout/agent/*`` metrics and
the report; ``rl-train show`` reads a rollout dump and shows a session turn by turn with its
loss-mask regions. (``agent_metrics`` itself is tested in packages/rl-buffer/tests/test_rollout.py.)"""

from __future__ import annotations

import json
import textwrap

import pytest
from rich.console import Console

from rl_trainer.cli import main
from rl_trainer.ops.report import build_figure
from rl_trainer.show import mask_regions, show_samples


def test_report_draws_the_agent_panel_only_for_agent_runs():
    plain = [{"phase": "rl", "step": 1, "rollout/reward_mean": 0.5}]
    agent = [{**plain[0], "rollout/agent/turns_mean": 2.0, "rollout/agent/tool_errors": 1.0}]
    titles = [ax.get_title() for ax in build_figure({"a": agent}).axes]
    assert any(t.startswith("Agent sessions") for t in titles)
    titles = [ax.get_title() for ax in build_figure({"a": plain}).axes]
    assert not any(t.startswith("Agent sessions") for t in titles)


def test_mask_regions():
    assert mask_regions([1, 1, 0, 0, 0, 1]) == [(0, 2, 1), (2, 5, 0), (5, 6, 1)]
    assert mask_regions([]) == []


AGENT = """
import openai


def solve(task):
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    msgs = task.messages
    r = client.chat.completions.create(model=task.model, messages=msgs, max_tokens=3)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "TOOL RESULT 42"}]
    client.chat.completions.create(model=task.model, messages=msgs, max_tokens=3)
    return {"reward": 1.0, "tool_errors": 1}
"""


def test_agent_run_logs_agent_metrics_and_show_reads_its_dump(tmp_path, tiny_recipe_dict):
    pytest.importorskip("aiohttp")
    pytest.importorskip("openai")
    (tmp_path / "watch_agent.py").write_text(textwrap.dedent(AGENT))
    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    recipe = tiny_recipe_dict(run_dir)
    recipe["generator"] = {"type": "hf", "stop_on_eos": False}
    recipe["reward"] = {"type": "session_reward"}
    recipe["rollout"]["generate_fn"] = {"type": "agent", "program": "watch_agent.py:solve"}
    recipe["rollout"]["dump_dir"] = str(dump)
    recipe["rl"] = {"steps": 1}
    recipe["eval"] = {"every": 0}
    path = tmp_path / "agent.yaml"
    path.write_text(json.dumps(recipe))
    assert main(["run", str(path), "--no-report"]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (rl,) = [r for r in rows if r["phase"] == "rl" and r["step"] == 1]
    assert rl["rollout/agent/sessions"] == 4 and rl["rollout/agent/turns_mean"] == 2.0
    assert rl["rollout/agent/tool_errors"] == 4 and rl["rollout/agent/tool_calls"] == 0

    console = Console(record=True, width=200)
    assert show_samples(dump, console=console) == 1
    out = console.export_text()
    assert "RL step 1" in out and "model 0" not in out  # the summary only, without --turns
    first = json.loads((dump / "step_000001.jsonl").read_text().splitlines()[1])
    session = first["rollouts"][0]["metadata"]["session"]
    console = Console(record=True, width=200)
    show_samples(dump, session=session, console=console)
    out = console.export_text()
    assert f"session {session}" in out and "session_turns 2" in out and "tool_errors 1" in out
    # Turn by turn: model turn 0, the tool result and template glue (not trained), model turn 1.
    assert out.index("model 0") < out.index("tool / template") < out.index("model 1")
    assert "TOOL RESULT 42" in out
    with pytest.raises(Exception, match="no rollout of session 'nope'"):
        show_samples(dump, session="nope", console=console)
