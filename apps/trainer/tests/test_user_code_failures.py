"""User code that fails (rewards, group rewards, rollout functions, filters) is reported with its
component, how many rollouts of how many failed, and the user's own file and line; a round in
which every rollout failed stops the run at once."""

from __future__ import annotations

import logging
import re
import sys
import textwrap
from pathlib import Path

import pytest

from rl_buffer.sampler import SamplingExhaustedError
from rl_core.errors import ConfigError, RewardError, RLError
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer

# Eval at RL step 0 runs the reward before the first round; max_prompts 0 keeps these runs to
# the training rounds (the eval path has its own test).
NO_EVAL = {"max_prompts": 0, "every": 0}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A function ``(name, source) -> Path``: writes ``<name>.py`` (dedented) to an importable
    directory, as a user's reward or rollout module would be; removed from ``sys.modules``
    afterwards."""
    code_dir = tmp_path / "user_code"
    code_dir.mkdir()
    monkeypatch.syspath_prepend(str(code_dir))
    names = []

    def write(name: str, source: str) -> Path:
        path = code_dir / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        names.append(name)
        return path

    yield write
    for name in names:
        sys.modules.pop(name, None)


def _line_of(path: Path, text: str) -> int:
    """The 1-based line of ``path`` holding ``text``."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_reward_raising_on_every_rollout_stops_after_one_round(
    tmp_path, tiny_recipe_dict, user_module
):
    path = user_module(
        "ucf_raise_all",
        """
        CALLS = []

        def score(prompt, response, rollout):
            CALLS.append(rollout.sample_id)
            return 1 / 0
        """,
    )
    cfg = load_trainer_config(
        tiny_recipe_dict(tmp_path / "run", reward={"type": "ucf_raise_all:score"}, eval=NO_EVAL)
    )
    trainer = Trainer(cfg)
    with pytest.raises(RewardError) as info:
        trainer.run()
    msg = str(info.value)
    import ucf_raise_all

    assert len(ucf_raise_all.CALLS) == 4  # one round (2 prompts x 2 samples), no retries
    assert "step 1, round 1: 4 of 4 rollouts failed" in msg
    assert "reward (type 'ucf_raise_all:score')" in msg
    assert "ZeroDivisionError: division by zero" in msg
    assert f"{path}:{_line_of(path, 'return 1 / 0')} in score" in msg
    assert "`return 1 / 0`" in msg


def test_reward_raising_on_some_rollouts_is_counted_and_logged_once(
    tmp_path, tiny_recipe_dict, user_module, caplog
):
    path = user_module(
        "ucf_raise_some",
        """
        def score(prompt, response, rollout):
            if rollout.sample_id.endswith("/1"):
                raise ValueError("no label for " + prompt.uid)
            return 1.0
        """,
    )
    cfg = load_trainer_config(
        tiny_recipe_dict(tmp_path / "run", reward={"type": "ucf_raise_some:score"}, eval=NO_EVAL)
    )
    with caplog.at_level(logging.WARNING, logger="rl_trainer.loop"):
        records = Trainer(cfg).run()
    steps = [r for r in records if r["phase"] == "rl" and r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]  # the run goes on
    for r in steps:
        # one sample of each of the two prompts per round, and at least one round per step
        assert r["rollout/failed/reward_error"] >= 2
        assert r["rollout/failed/reward_error"] % 2 == 0
    warnings = [rec.getMessage() for rec in caplog.records if "reward_error" in rec.getMessage()]
    assert len(warnings) == 1, warnings  # logged once, not once per round
    assert "step 1, round 1: 2 of 4 rollouts failed" in warnings[0]
    assert f"{path}:{_line_of(path, 'raise ValueError')} in score" in warnings[0]
    assert "ValueError: no label for" in warnings[0]


def test_reward_returning_none_is_a_failure_with_its_cause(tmp_path, tiny_recipe_dict, user_module):
    path = user_module(
        "ucf_none",
        """
        def score(prompt, response, rollout):
            if response == prompt.label:
                return 1.0
        """,
    )
    cfg = load_trainer_config(
        tiny_recipe_dict(tmp_path / "run", reward={"type": "ucf_none:score"}, eval=NO_EVAL)
    )
    with pytest.raises(RewardError) as info:
        Trainer(cfg).run()
    msg = str(info.value)
    assert "4 reward_invalid from reward (type 'ucf_none:score')" in msg
    assert "returned None; a reward returns a float or a mapping with a 'reward' key" in msg
    assert f"score is defined at {path}:{_line_of(path, 'def score')}" in msg  # where it is defined


def test_reward_with_wrong_signature_says_how_it_is_called(tmp_path, tiny_recipe_dict, user_module):
    user_module("ucf_sig", "def score(a, b):\n    return 0.0\n")
    cfg = load_trainer_config(
        tiny_recipe_dict(tmp_path / "run", reward={"type": "ucf_sig:score"}, eval=NO_EVAL)
    )
    with pytest.raises(ConfigError) as info:
        Trainer(cfg)
    assert str(info.value).startswith("reward: 'ucf_sig:score' takes (a, b)")
    assert "the trainer calls it as score(prompt, response, rollout)" in str(info.value)


@pytest.mark.parametrize(
    ("section", "call"),
    [
        ({"group_reward": {"type": "ucf_sig2:fn"}}, "fn(prompt, responses, rollouts)"),
        ({"rollout": {"generate_fn": {"type": "ucf_sig2:fn"}}}, "fn(prompt, ctx)"),
        ({"rollout": {"filters": [{"type": "ucf_sig2:fn"}]}}, "fn(group)"),
    ],
)
def test_every_user_seam_checks_its_signature(
    tmp_path, tiny_recipe_dict, user_module, section, call
):
    user_module("ucf_sig2", "def fn(a, b, c, d):\n    return None\n")
    recipe = tiny_recipe_dict(tmp_path / "run", eval=NO_EVAL)
    for key, value in section.items():
        recipe[key] = {**recipe.get(key, {}), **value} if key == "rollout" else value
    with pytest.raises(ConfigError, match=re.escape(f"calls it as {call}")):
        Trainer(load_trainer_config(recipe))


def test_failing_filter_stops_the_run_with_its_cause(tmp_path, tiny_recipe_dict, user_module):
    path = user_module(
        "ucf_filter",
        """
        def keep(group):
            return group.rollouts[99].reward
        """,
    )
    recipe = tiny_recipe_dict(tmp_path / "run", eval=NO_EVAL)
    recipe["rollout"]["filters"] = [{"type": "ucf_filter:keep"}]
    with pytest.raises(RLError) as info:
        Trainer(load_trainer_config(recipe)).run()
    msg = str(info.value)
    assert "step 1, round 1: 4 of 4 rollouts failed" in msg
    assert "rollout.filters[0] (type 'ucf_filter:keep')" in msg
    assert "IndexError" in msg
    assert f"{path}:{_line_of(path, 'rollouts[99]')} in keep" in msg


def test_filter_returning_a_bool_is_a_failure(tmp_path, tiny_recipe_dict, user_module):
    user_module("ucf_filter_bool", "def keep(group):\n    return True\n")
    recipe = tiny_recipe_dict(tmp_path / "run", eval=NO_EVAL)
    recipe["rollout"]["filters"] = [{"type": "ucf_filter_bool:keep"}]
    with pytest.raises(RLError, match="returned bool True for prompt .*; a filter returns None"):
        Trainer(load_trainer_config(recipe)).run()


def test_failing_generate_fn_stops_the_run_with_its_cause(tmp_path, tiny_recipe_dict, user_module):
    path = user_module(
        "ucf_rollout",
        """
        async def solve(prompt, ctx):
            raise RuntimeError("tool server is down")
        """,
    )
    recipe = tiny_recipe_dict(tmp_path / "run", eval=NO_EVAL)
    recipe["rollout"]["generate_fn"] = {"type": "ucf_rollout:solve"}
    with pytest.raises(RLError) as info:
        Trainer(load_trainer_config(recipe)).run()
    msg = str(info.value)
    assert "4 of 4 rollouts failed" in msg  # 2 prompts x n_samples 2
    assert "4 rollout_fn_error from rollout.generate_fn (type 'ucf_rollout:solve')" in msg
    assert "RuntimeError: tool server is down" in msg
    assert f"{path}:{_line_of(path, 'raise RuntimeError')} in solve" in msg


def test_failing_reward_in_eval_stops_at_step_0(tmp_path, tiny_recipe_dict, user_module):
    user_module("ucf_eval", "def score(prompt, response, rollout):\n    raise KeyError('x')\n")
    cfg = load_trainer_config(tiny_recipe_dict(tmp_path / "run", reward={"type": "ucf_eval:score"}))
    with pytest.raises(RewardError, match=r"eval at step 0: 6 of 6 rollouts failed"):
        Trainer(cfg).run()


def test_max_rounds_blames_the_filters_when_they_drop_everything(
    tmp_path, tiny_recipe_dict, user_module
):
    user_module("ucf_drop", "def drop(group):\n    return 'not_today'\n")
    recipe = tiny_recipe_dict(tmp_path / "run", eval=NO_EVAL)
    recipe["rollout"].update(filters=[{"type": "ucf_drop:drop"}], max_rounds=2)
    with pytest.raises(SamplingExhaustedError) as info:
        Trainer(load_trainer_config(recipe)).run()
    msg = str(info.value)
    assert msg.startswith("rollout.max_rounds: 2 generation rounds kept only 0 of 2 groups.")
    assert "The filters dropped" in msg and "not_today" in msg


def test_max_rounds_blames_failures_when_they_lose_the_groups(
    tmp_path, tiny_recipe_dict, user_module
):
    # Only the first rollout scores: the round does not fail completely, but its one group
    # cannot fill a step of two.
    path = user_module(
        "ucf_mostly",
        """
        CALLS = []

        def score(prompt, response, rollout):
            CALLS.append(rollout.sample_id)
            if len(CALLS) > 1:
                raise ValueError("flaky judge")
            return 1.0
        """,
    )
    recipe = tiny_recipe_dict(tmp_path / "run", reward={"type": "ucf_mostly:score"}, eval=NO_EVAL)
    recipe["rollout"].update(max_rounds=1, prompts_per_step=2)
    with pytest.raises(RewardError) as info:
        Trainer(load_trainer_config(recipe)).run()
    msg = str(info.value)
    assert msg.startswith("rollout.max_rounds: 1 generation round kept only 1 of 2 groups.")
    assert "3 of 4 rollouts failed" in msg
    assert f"{path}:{_line_of(path, 'flaky judge')} in score" in msg


def test_async_generation_stops_with_the_same_report(tmp_path, tiny_recipe_dict, user_module):
    path = user_module(
        "ucf_async",
        """
        def score(prompt, response, rollout):
            raise ValueError("judge offline")
        """,
    )
    recipe = tiny_recipe_dict(tmp_path / "run", reward={"type": "ucf_async:score"}, eval=NO_EVAL)
    recipe["rl"] = {"steps": 3, "async_generation": True, "max_staleness": 1}
    with pytest.raises(RewardError) as info:
        Trainer(load_trainer_config(recipe)).run()
    assert "step 1, round 1: 4 of 4 rollouts failed" in str(info.value)
    assert f"{path}:{_line_of(path, 'judge offline')} in score" in str(info.value)
