"""Rollout functions (``rollout.generate_fn``) checked at load, and the per-sample seed a naive
one gets (issue 31): a plain (not async) function is a ConfigError before any model is built,
in ``check`` and ``run``; ``check`` calls it once and reports an empty or wrong return. (That a
function passing ``ctx.sampling`` to every ``ctx.generate`` samples differently per sample is
tested in packages/rl-buffer/tests/test_rollout.py.)"""

from __future__ import annotations

import sys
import textwrap

import pytest
import yaml

from rl_core.errors import ConfigError, RLError
from rl_trainer.check import check_recipe
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer


@pytest.fixture
def rollout_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for n in names:
        sys.modules.pop(n, None)


def _recipe(tmp_path, tiny_recipe_dict, fn_type: str):
    recipe = tiny_recipe_dict(tmp_path / "run", eval={"every": 0})
    recipe["rollout"]["generate_fn"] = {"type": fn_type}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


SYNC = """
from rl_buffer.rollout import rollout_from_result

def solve(prompt, ctx):  # forgot `async`
    return []
"""

EMPTY = """
async def solve(prompt, ctx):
    return []
"""


def test_plain_function_is_refused_at_load(tmp_path, tiny_recipe_dict, rollout_module):
    rollout_module("rf_sync", SYNC)
    path = _recipe(tmp_path, tiny_recipe_dict, "rf_sync:solve")
    with pytest.raises(
        ConfigError, match=r"rollout.generate_fn: '.*rf_sync(.py)?:solve' is not async"
    ):
        Trainer(load_trainer_config(path))  # at assembly: before the policy or generator
    report = check_recipe(path, rows=1)
    assert any(
        f.where == "rollout.generate_fn" and "async def solve(prompt, ctx)" in f.message
        for f in report.problems
    ), report.findings


def test_empty_return_is_a_check_problem_and_a_named_run_error(
    tmp_path, tiny_recipe_dict, rollout_module
):
    rollout_module("rf_empty", EMPTY)
    path = _recipe(tmp_path, tiny_recipe_dict, "rf_empty:solve")
    report = check_recipe(path, rows=1)
    (problem,) = [f for f in report.problems if f.where == "rollout.generate_fn"]
    assert "returned an empty list" in problem.message
    with pytest.raises(RLError, match="rollout_fn_invalid.*returned an empty list"):
        Trainer(load_trainer_config(path)).run()


def test_a_good_rollout_function_passes_check(tmp_path, tiny_recipe_dict, rollout_module):
    rollout_module(
        "rf_good",
        """
        from rl_buffer.rollout import rollout_from_result

        async def solve(prompt, ctx):
            out = []
            for k in range(ctx.n_samples):
                res = await ctx.generate(prompt.token_ids, request_id=f"{prompt.uid}/{k}")
                out.append(rollout_from_result(prompt, res, f"{prompt.uid}/{k}"))
            return out
        """,
    )
    report = check_recipe(_recipe(tmp_path, tiny_recipe_dict, "rf_good:solve"), rows=1)
    assert not [f for f in report.problems if f.where == "rollout.generate_fn"], report.findings
