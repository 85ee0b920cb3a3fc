"""Checks at load of what the model cannot honour (issue 31), raised by ``Trainer(...)`` before
the policy or generator is built: routing replay on a dense model; a prompt that with the
response budget passes the model's context (``max_position_embeddings``, not the tokenizer's
``model_max_length``), named by file and line."""

from __future__ import annotations

import json

import pytest

from rl_core.errors import ConfigError
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer


def test_routing_replay_on_a_dense_model_is_refused_at_load(tmp_path, tiny_recipe_dict):
    recipe = tiny_recipe_dict(tmp_path / "run")
    recipe["rollout"]["routing_replay"] = "record"
    with pytest.raises(ConfigError, match=r"rollout.routing_replay: 'record' needs a mixture"):
        Trainer(load_trainer_config(recipe))  # was refused only after the first generation


def _data_recipe(tmp_path, tiny_recipe_dict, rows, *, context, max_new):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tiny_recipe_dict(tmp_path / "run", eval={"every": 0})
    del recipe["task"]
    recipe["model"]["init"]["max_position_embeddings"] = context
    recipe["data"] = {"train": {"type": "jsonl", "path": str(data), "shuffle": False}}
    recipe["reward"] = {"type": "exact_match"}
    recipe["rollout"]["sampling"]["max_new_tokens"] = max_new
    return data, recipe


def test_prompt_past_the_models_context_is_refused_naming_its_line(tmp_path, tiny_recipe_dict):
    short = {"prompt": "ab", "label": "ba"}
    long = {"prompt": " ".join(["word"] * 80), "label": "x"}
    data, recipe = _data_recipe(
        tmp_path, tiny_recipe_dict, [short, short, long, short, long], context=64, max_new=8
    )
    cfg = load_trainer_config(recipe)
    with pytest.raises(ConfigError) as info:
        Trainer(cfg)
    msg = str(info.value)
    assert msg.startswith("data.train: 2 of 5 prompts do not fit the model's context")
    assert f"{data}:3 has " in msg  # the first offending row's file:line
    assert "rollout.sampling.max_new_tokens = 8 > 64 (max_position_embeddings" in msg
    assert "max_prompt_tokens: 56" in msg


def test_prompt_plus_budget_within_the_context_passes(tmp_path, tiny_recipe_dict):
    _, recipe = _data_recipe(
        tmp_path,
        tiny_recipe_dict,
        [{"prompt": "ab", "label": "ba"}] * 3,
        context=64,
        max_new=8,
    )
    trainer = Trainer(load_trainer_config(recipe))
    assert len(trainer.parts.train_data) == 3
    assert trainer.parts.train_data.state_dict()["position"] == 0  # the check left the cursor


def test_check_reports_both_before_any_weights(tmp_path, tiny_recipe_dict):
    """``rl-train check`` names the same problems (it builds no model)."""
    import yaml

    from rl_trainer.check import check_recipe

    long = {"prompt": " ".join(["word"] * 80), "label": "x"}
    data, recipe = _data_recipe(
        tmp_path, tiny_recipe_dict, [{"prompt": "ab", "label": "ba"}, long], context=64, max_new=8
    )
    recipe["rollout"]["routing_replay"] = "replay"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    report = check_recipe(path, rows=1)
    where = {f.where: f.message for f in report.problems}
    assert "needs a mixture-of-experts model" in where["rollout.routing_replay"]
    assert f"{data}:2 has " in where["data.train"]
    assert not (tmp_path / "run" / "init_model").exists()
