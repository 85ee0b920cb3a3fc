"""The trainer's root config: recipes, overrides and clear errors."""

from __future__ import annotations

import pytest

from rl_core.errors import BackendNotFoundError, ConfigError, DataError, RLError
from rl_trainer.cli import main, recipe_path
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer

TINY = {
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
}


def _recipe(tmp_path, **extra):
    base = {
        "run_dir": str(tmp_path / "run"),
        "model": {"init": TINY},
        "task": {"type": "reverse", "n_train": 40, "n_eval": 8},
        "logging": {"tensorboard": False, "progress": False},
    }
    base.update(extra)
    return base


def test_bundled_demo_recipe_loads():
    cfg = load_trainer_config(
        recipe_path("demo"), ["rl.steps=7", "rollout.sampling.max_new_tokens=9"]
    )
    assert cfg.rl.steps == 7 and cfg.rollout.sampling.max_new_tokens == 9
    assert cfg.task is not None and cfg.task.type == "reverse"


def test_unknown_field_names_its_path(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.n_sample: unknown field of RolloutConfig"):
        load_trainer_config(_recipe(tmp_path), ["rollout.n_sample=4"])
    with pytest.raises(ConfigError, match=r"rl\.steps: expected int"):
        load_trainer_config(_recipe(tmp_path), ["rl.steps=many"])


def test_needs_data_and_model(tmp_path):
    with pytest.raises(ConfigError, match="task: set a built-in task"):
        load_trainer_config({"model": {"init": TINY}})
    with pytest.raises(ConfigError, match="model: set model.path"):
        load_trainer_config({"task": {"type": "reverse"}})


def test_unknown_backend_and_component_option(tmp_path):
    cfg = load_trainer_config(_recipe(tmp_path, generator={"type": "warp_drive"}))
    with pytest.raises(
        BackendNotFoundError, match=r"generator\.type: unknown rl.generators backend 'warp_drive'"
    ):
        Trainer(cfg)
    cfg = load_trainer_config(_recipe(tmp_path, policy={"type": "hf", "learning_rate": 1}))
    with pytest.raises(ConfigError, match=r"policy\.learning_rate: unknown field"):
        Trainer(cfg)
    with pytest.raises(ConfigError, match=r"task\.n_train: expected int"):  # at load already
        load_trainer_config(_recipe(tmp_path, task={"type": "reverse", "n_train": "x"}))


def test_malformed_data_line_names_file_and_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "ab=", "label": "ba"}\n{"prompt": "cd=", "label": \n')
    cfg = load_trainer_config(
        {
            "run_dir": str(tmp_path / "run"),
            "model": {"init": TINY},
            "data": {"train": {"type": "jsonl", "path": str(data)}},
            "reward": {"type": "rl_trainer.tasks:position_match"},
            "logging": {"tensorboard": False, "progress": False},
        }
    )
    with pytest.raises(DataError, match=r"train\.jsonl:2"):
        Trainer(cfg)


def test_missing_key_names_the_key(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "ab=", "label": "ba"}\n')
    cfg = load_trainer_config(
        {
            "run_dir": str(tmp_path / "run"),
            "model": {"init": TINY},
            "data": {"train": {"type": "jsonl", "path": str(data)}},
            "reward": {"type": "rl_trainer.tasks:position_match"},
            "logging": {"tensorboard": False, "progress": False},
        }
    )
    with pytest.raises(DataError, match="prompt"):
        Trainer(cfg)


def test_reward_with_wrong_signature_fails_at_load(tmp_path):
    cfg = load_trainer_config(
        _recipe(tmp_path, reward={"type": "rl_trainer.tasks:Task.write_splits"})
    )
    with pytest.raises(RLError, match="reward"):
        Trainer(cfg)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    code = main(["run", "no_such_recipe"])
    assert code == 2
    assert "no bundled recipe of that name" in capsys.readouterr().err


def test_configuration_reference_is_current():
    """docs/configuration.md is generated from the dataclasses; regenerate it after a change:
    python -m rl_trainer.docgen > docs/configuration.md"""
    from pathlib import Path

    from rl_trainer.docgen import render

    doc = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
    assert doc.read_text() == render()


def test_async_fields_validate(tmp_path):
    cfg = load_trainer_config(_recipe(tmp_path), ["rl.async_generation=true", "rl.max_staleness=2"])
    assert cfg.rl.async_generation is True and cfg.rl.max_staleness == 2
    assert load_trainer_config(_recipe(tmp_path)).rl.async_generation is False
    with pytest.raises(ConfigError, match=r"rl\.max_staleness: must be >= 0"):
        load_trainer_config(_recipe(tmp_path), ["rl.max_staleness=-1"])
    with pytest.raises(ConfigError, match=r"buffer\.max_staleness: .*set rl\.max_staleness"):
        load_trainer_config(_recipe(tmp_path, buffer={"type": "group", "max_staleness": 1}))


def test_async_local_runs_split_the_threads(tmp_path):
    """On the local runtime an async run's generator generates with half the threads (it
    runs beside the trainer on the same cores); in a process of its own the trainer keeps the
    other half. A recipe's own generator.threads, a sync run, one thread or the ray runtime
    leave both alone."""
    from rl_trainer.assembly import thread_split
    from rl_trainer.build import with_defaults

    def cfg(**extra):
        return load_trainer_config(recipe_path("demo"), [f"{k}={v}" for k, v in extra.items()])

    # In process: said explicitly, the demo's 400 steps would choose the generator process.
    on = {"rl.async_generation": "true", "runtime.generator_process": "false"}
    proc = {**on, "runtime.generator_process": "true"}
    assert thread_split(cfg(threads=2, **on)) == (2, 1)
    assert thread_split(cfg(threads=5, **on)) == (5, 2)
    assert thread_split(cfg(threads=2, **proc)) == (1, 1)
    assert thread_split(cfg(threads=5, **proc)) == (3, 2)
    assert thread_split(cfg(threads=1, **proc)) == (1, None)
    assert thread_split(cfg(threads=4)) == (4, None)
    assert thread_split(cfg(threads=4, **on, **{"runtime.type": "ray"})) == (4, None)
    mine = cfg(threads=4, **on, **{"generator.threads": 3})
    spec = with_defaults("generator", mine.generator, threads=thread_split(mine)[1])
    assert spec.options["threads"] == 3  # the recipe's setting wins
    spec = with_defaults("generator", cfg(threads=4, **on).generator, threads=2)
    assert spec.options["threads"] == 2


def test_generator_process_needs_the_local_runtime(tmp_path):
    with pytest.raises(ConfigError, match="runtime.generator_process"):
        load_trainer_config(
            recipe_path("demo"), ["runtime.type=ray", "runtime.generator_process=true"]
        )
