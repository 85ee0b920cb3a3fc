"""``--resume`` checks what it resumes: a changed learning rate, model shape or data content is
refused with the diff and the override; a changed step count proceeds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rl_core.errors import ConfigError
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer

ROWS = [("ab=", "ba"), ("cd=", "dc"), ("ef=", "fe"), ("gh=", "hg")]


def _write_data(path: Path, rows) -> None:
    path.write_text("".join(json.dumps({"prompt": p, "label": a}) + "\n" for p, a in rows))


def _recipe(make, run_dir: Path, data: Path, *, steps: int = 1, **sections) -> dict:
    recipe = make(
        run_dir,
        seed=4,
        rl={"steps": steps},
        eval={"every": 0},
        checkpoint={"every": 1, "keep": 2},
        data={"train": {"type": "jsonl", "path": str(data)}},
        reward={"type": "format_match", "pattern": "^"},
        policy={"type": "hf", "lr": 1e-4},
    )
    recipe.pop("task")
    for key, value in sections.items():
        recipe[key] = value
    return recipe


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_recipe_dict) -> tuple[Path, Path]:
    """A one-step run with its checkpoint, and its data file."""
    root = tmp_path_factory.mktemp("resume_checks")
    data = root / "train.jsonl"
    _write_data(data, ROWS)
    run_dir = root / "run"
    Trainer(load_trainer_config(_recipe(tiny_recipe_dict, run_dir, data))).run()
    return run_dir, data


@pytest.fixture
def copy(base, tmp_path) -> tuple[Path, Path]:
    run_dir, data = base
    shutil.copytree(run_dir, tmp_path / "run")
    shutil.copy(data, tmp_path / "train.jsonl")
    return tmp_path / "run", data  # the data path stays the one the checkpoint recorded


def _resume(make, run_dir, data, **kw) -> Trainer:
    return Trainer(load_trainer_config(_recipe(make, run_dir, data, **kw)), resume=True)


def test_a_changed_learning_rate_refuses_with_the_diff(copy, tiny_recipe_dict):
    run_dir, data = copy
    with pytest.raises(ConfigError) as err:
        _resume(tiny_recipe_dict, run_dir, data, policy={"type": "hf", "lr": 0.01})
    msg = str(err.value)
    assert "policy.lr: 0.0001 -> 0.01" in msg and "--allow-changed policy.lr" in msg
    # accepted knowingly, it proceeds
    trainer = Trainer(
        load_trainer_config(
            _recipe(tiny_recipe_dict, run_dir, data, steps=2, policy={"type": "hf", "lr": 0.01})
        ),
        resume=True,
        allow_changed=["policy.lr"],
    )
    trainer.release_run_dir()


def test_a_changed_model_shape_refuses(copy, tiny_recipe_dict):
    run_dir, data = copy
    model = tiny_recipe_dict(run_dir)["model"]
    bigger = {"init": {**model["init"], "intermediate_size": 128}}
    with pytest.raises(ConfigError, match=r"model\.init\.intermediate_size: 64 -> 128"):
        _resume(tiny_recipe_dict, run_dir, data, model=bigger)


def test_more_steps_proceed(copy, tiny_recipe_dict, caplog):
    run_dir, data = copy
    trainer = _resume(tiny_recipe_dict, run_dir, data, steps=2)
    assert "rl.steps changed: 1 -> 2" in caplog.text
    trainer.run()
    assert trainer.counters.rl_step == 2


def test_data_edited_with_the_same_row_count_refuses(copy, tiny_recipe_dict):
    run_dir, data = copy
    original = data.read_text()
    try:
        _write_data(data, [(p, a.upper()) for p, a in ROWS])  # same rows, other labels
        with pytest.raises(ConfigError, match=r"data\.train\.path \(content xxh3_128\)"):
            _resume(tiny_recipe_dict, run_dir, data, steps=2)
    finally:
        data.write_text(original)
