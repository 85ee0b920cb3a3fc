"""Tool use learns end to end: a short fixed-seed run of the calculator recipe (multi-turn
CalculatorRollout, observation tokens with loss mask 0) raises the held-out reward; and an
unmodified OpenAI-client agent program trains through the agent adapter."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from rl_trainer.cli import recipe_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning_checks import CHECKS, assert_learns

# A shortened calculator recipe for CI: smaller batches, fewer steps (see the recipe for the
# full run and its numbers; the thresholds' margins over seeds are in learning_checks).
SHORT = list(CHECKS["calculator"].overrides)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_calculator_tool_use_learns(tmp_path, cli):
    run_dir = tmp_path / "calc"
    sets = [f"run_dir={run_dir}", *SHORT]
    proc = cli("run", str(recipe_path("calculator")), *[a for s in sets for a in ("--set", s)])
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    records = _records(run_dir)
    evals = [r for r in records if r.get("eval/reward_mean") is not None]
    assert evals[0]["phase"] == "rl" and evals[0]["step"] == 0
    # It learned to call the tool (the warm-up model calls it about half of the time) and the
    # held-out reward rose.
    assert_learns("calculator", records)


AGENT = '''
import openai
from rl_agents import AgentTask


def solve(task: AgentTask) -> float:
    """Two chat turns with the stock OpenAI client; reward: the reply starts like the label."""
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    msgs = task.messages
    r = client.chat.completions.create(model=task.model, messages=msgs, max_tokens=4)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "again"}]
    r = client.chat.completions.create(model=task.model, messages=msgs, max_tokens=4)
    text = r.choices[0].message.content or ""
    return float(bool(text) and text[:1] == str(task.prompt.label)[:1])
'''


@pytest.mark.slow
def test_agent_program_trains_through_the_adapter(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the trainer imports my_agent from here
    (tmp_path / "my_agent.py").write_text(textwrap.dedent(AGENT))
    run_dir = tmp_path / "agent"
    recipe = tmp_path / "agent.yaml"
    recipe.write_text(
        textwrap.dedent(
            f"""
            run_dir: {run_dir}
            seed: 2
            model:
              init: {{arch: qwen2, hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1,
                      intermediate_size: 64}}
            task: {{type: reverse, n_train: 64, n_eval: 4, min_len: 2, max_len: 3}}
            reward: {{type: session_reward}}
            rollout:
              prompts_per_step: 2
              n_samples: 2
              sampling: {{temperature: 1.0, max_new_tokens: 4}}
              generate_fn: {{type: agent, program: "my_agent:solve", timeout_s: 120}}
            rl: {{steps: 2}}
            eval: {{every: 0}}
            logging: {{tensorboard: false, progress: false}}
            """
        )
    )
    proc = cli("run", str(recipe), cwd=tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    rl = [r for r in _records(run_dir) if r["phase"] == "rl" and r["step"] > 0]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        assert not any(k.startswith("rollout/failed/") for k in r), r
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert r["rollout/response_len_mean"] > 4  # two merged turns: model + template glue
