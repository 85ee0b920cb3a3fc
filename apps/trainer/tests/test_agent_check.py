"""``rl-train check`` on agent recipes (issue 33): a ``session_reward`` recipe no longer fails
on the dummy-response probe (a session reward scores a session, not a text): check dry-runs one
session of the agent (every generation answered with EOS) and scores it, or says why the probe
is skipped; an agent program beside the recipe loads without ``PYTHONPATH``, and a missing one
is reported with the paths searched."""

from __future__ import annotations

import textwrap

import pytest

from rl_trainer.check import check_recipe
from rl_trainer.cli import main, recipe_path

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

AGENT = """
import openai


def solve(task):
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    r = client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=4)
    return 0.5 if r.choices[0].message.content == "" else 0.25


def silent(task):
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    client.chat.completions.create(model=task.model, messages=task.messages, max_tokens=4)
    return None
"""


def _recipe(tmp_path, program: str, generate_fn: bool = True, write: bool = True) -> str:
    """A session-reward recipe in ``tmp_path`` with the agent module ``program`` names beside it
    (one module name per test: a module name imports once per process)."""
    if write:
        (tmp_path / f"{program.split(':')[0]}.py").write_text(textwrap.dedent(AGENT))
    gen = f'  generate_fn: {{type: agent, program: "{program}", timeout_s: 60}}\n' * generate_fn
    recipe = tmp_path / "agent.yaml"
    recipe.write_text(
        textwrap.dedent(
            f"""
            run_dir: {tmp_path / "run"}
            model:
              init: {{arch: qwen2, hidden_size: 32, num_layers: 1, num_heads: 2,
                      num_kv_heads: 1, intermediate_size: 64}}
            task: {{type: reverse, n_train: 16, n_eval: 2, min_len: 2, max_len: 3}}
            reward: {{type: session_reward}}
            rollout:
              prompts_per_step: 2
              n_samples: 2
              sampling: {{temperature: 1.0, max_new_tokens: 4}}
            """
        )
        + gen
    )
    return str(recipe)


def test_agent_recipe_passes_and_scores_a_dry_session(tmp_path, monkeypatch, capsys):
    # Run from elsewhere, no PYTHONPATH: the program is found beside the recipe.
    monkeypatch.chdir("/")
    recipe = _recipe(tmp_path, "check_agent_a:solve")
    report = check_recipe(recipe, rows=2)
    assert report.problems == [], report.problems
    (train,) = [f for f in report.findings if f.where == "reward on train"]
    # The agent got an empty reply (EOS at once) and reported 0.5: the session was scored.
    assert train.level == "note" and "scored 0.5, 0.5 (2 of 2 rollouts)" in train.message
    assert all(r.dummy_rewards == [None, None] for r in report.rows)
    assert main(["check", recipe]) == 0
    out = capsys.readouterr().out
    assert "prompts rendered, 0 scored (see the notes)" in out and "NOTE" in out


def test_a_session_without_reward_is_a_problem(tmp_path):
    report = check_recipe(_recipe(tmp_path, "check_agent_b:silent"), rows=1)
    (p,) = report.problems
    assert p.where == "reward on train" and "gave no reward" in p.message
    assert "reported no reward" in p.message  # SessionReward's own message, with the fix


def test_session_reward_without_an_agent_is_a_problem(tmp_path):
    report = check_recipe(_recipe(tmp_path, "", generate_fn=False, write=False), rows=1)
    assert any("no rollout.generate_fn runs sessions" in p.message for p in report.problems), (
        report.problems
    )


def test_missing_agent_module_names_the_paths_searched(tmp_path):
    report = check_recipe(_recipe(tmp_path, "no_such_agent:solve", write=False), rows=1)
    p = next(p for p in report.problems if p.where == "rollout.generate_fn")
    assert str(tmp_path / "no_such_agent.py") in p.message  # the recipe's directory, searched
    assert "on sys.path" in p.message
    assert f"put no_such_agent.py in {str(tmp_path)!r}" in p.message


def test_bundled_coding_agent_recipe_passes(tmp_path):
    report = check_recipe(recipe_path("coding_agent"), [f"run_dir={tmp_path / 'run'}"], rows=1)
    assert report.problems == [], report.problems
    (train,) = [f for f in report.findings if f.where == "reward on train"]
    assert train.level == "note" and "(2 of 2 rollouts)" in train.message
