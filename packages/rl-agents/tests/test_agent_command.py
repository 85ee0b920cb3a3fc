"""An agent ``command``: ``python`` is the trainer's own interpreter and a script path resolves
against the recipe's directory, not the working directory (issue 31)."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap

import yaml

from rl_agents.rollout import AgentRollout, AgentTask, resolve_command
from rl_core import registry
from rl_core.config import ComponentSpec, from_dict, load_config_file
from rl_core.types import Prompt

AGENT = """
import json, sys
task = json.loads(sys.stdin.read())
print(json.dumps({"exe": sys.executable, "label": task["label"]}))
print(json.dumps({"reward": 0.75}))
"""


def _built(tmp_path, command):
    recipe_dir = tmp_path / "recipes"
    recipe_dir.mkdir()
    (recipe_dir / "agent.py").write_text(textwrap.dedent(AGENT))
    path = recipe_dir / "r.yaml"
    path.write_text(yaml.safe_dump({"generate_fn": {"type": "agent", "command": command}}))
    raw = load_config_file(path)["generate_fn"]
    spec = ComponentSpec(type=raw["type"], options={k: v for k, v in raw.items() if k != "type"})
    return recipe_dir, registry.build("generate_fn", spec, field="rollout.generate_fn")


def test_python_is_sys_executable_and_script_resolves_beside_the_recipe(tmp_path, monkeypatch):
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the script is not in the working directory
    monkeypatch.setenv("PATH", str(tmp_path / "no-python-here"))
    recipe_dir, agent = _built(tmp_path, ["python", "agent.py", "--verbose"])
    assert isinstance(agent, AgentRollout)
    assert agent.argv == [sys.executable, str(recipe_dir / "agent.py"), "--verbose"]
    task = AgentTask(
        base_url="http://127.0.0.1:9/v1",
        api_key="s0",
        model="m",
        prompt=Prompt(uid="p0", input="hi", token_ids=(1,), label="L"),
    )
    reward, extra = asyncio.run(agent._run_command(task))
    assert reward == 0.75
    first = json.loads(extra["agent_stdout"].splitlines()[0])
    assert first == {"exe": sys.executable, "label": "L"}


def test_other_arguments_are_kept_as_written(tmp_path):
    assert resolve_command(["bash", "-c", "echo hi"]) == ["bash", "-c", "echo hi"]
    assert resolve_command(["/usr/bin/env", "python3", "missing.py"])[2] == "missing.py"
    cfg = from_dict(AgentRollout.Config, {"command": ["python3", "x.py"]})
    assert AgentRollout(cfg).argv[0] == sys.executable
