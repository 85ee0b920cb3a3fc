"""``rl-train new``: the task template is complete, consistent and never overwrites anything."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from rl_core.errors import ConfigError
from rl_core.types import Prompt
from rl_trainer.cli import main
from rl_trainer.scaffold import TEMPLATE_FILES, write_task


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_new_writes_the_template_with_the_name(tmp_path, capsys):
    assert main(["new", "demo_task", "--dir", str(tmp_path)]) == 0
    out = tmp_path / "demo_task"
    assert sorted(p.name for p in out.iterdir()) == sorted(TEMPLATE_FILES)
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert recipe["run_dir"] == "runs/demo_task"
    assert "${name}" not in (out / "README.md").read_text()
    assert recipe["reward"] == {"type": "reward.py:score"}
    assert recipe["model"]["init"] and "path" not in recipe["model"]  # no download
    for split in ("train", "eval"):  # relative paths, next to the recipe
        assert recipe["data"][split]["path"] == f"{split}.jsonl"
    assert "rl-train check" in capsys.readouterr().out


def test_template_data_is_consistent_and_the_reward_scores_labels_1(tmp_path):
    out = write_task("t", tmp_path)
    train, evals = _rows(out / "train.jsonl"), _rows(out / "eval.jsonl")
    assert len(train) >= 24 and len(evals) >= 16
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}  # held out
    spec = importlib.util.spec_from_file_location("template_reward", out / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for r in train + evals:
        assert r["label"] == r["prompt"].removeprefix("Reverse: ")[::-1]
        p = Prompt(uid="x", input=r["prompt"], token_ids=(1,), label=r["label"])
        assert module.score(p, r["label"], None) == 1.0
        assert module.score(p, "", None) == 0.0
        assert 0.0 <= module.score(p, r["label"][::-1] + "x", None) < 1.0


def test_new_refuses_an_existing_non_empty_directory(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists"):
        write_task("t", tmp_path)
    assert (tmp_path / "t" / "keep.txt").read_text() == "mine"
    assert main(["new", "t", "--dir", str(tmp_path)]) == 2


@pytest.mark.parametrize("name", ["", "a/b", "../up", ".hidden"])
def test_new_refuses_names_that_are_not_plain(tmp_path, name):
    with pytest.raises(ConfigError, match="plain name"):
        write_task(name, tmp_path)
