"""The generator process boots while the policy is built (issue 36: the two start-ups overlap
instead of adding up), and a policy that cannot be built leaves no generator process behind."""

from __future__ import annotations

import multiprocessing

import pytest

pytest.importorskip("transformers")

from rl_core.errors import ConfigError
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.phases import rl as rl_phase


def _children() -> list[str]:
    return [p.name for p in multiprocessing.active_children()]


def _recipe(tiny_recipe_dict, run_dir):
    recipe = tiny_recipe_dict(run_dir, threads=2)
    recipe["rl"] = {"steps": 1, "async_generation": True}
    recipe["runtime"] = {"generator_process": True}
    recipe["eval"] = {"every": 0}
    return recipe


def test_the_generator_process_is_started_before_the_policy_is_built(
    tmp_path, tiny_recipe_dict, monkeypatch
):
    seen: list[list[str]] = []
    real = rl_phase.build_policy

    def build_policy(*args, **kwargs):
        seen.append(_children())
        return real(*args, **kwargs)

    monkeypatch.setattr(rl_phase, "build_policy", build_policy)
    records = Trainer(load_trainer_config(_recipe(tiny_recipe_dict, tmp_path / "run"))).run()
    assert [r["step"] for r in records if r.get("phase") == "rl" and r.get("step")] == [1]
    assert "rl-generator" in seen[0]  # booting while the policy builds (before: spawned after)
    assert "rl-generator" not in _children()  # closed with the run


def test_a_policy_that_fails_to_build_closes_the_started_generator(
    tmp_path, tiny_recipe_dict, monkeypatch
):
    def build_policy(*args, **kwargs):
        raise ConfigError("policy.lr: broken on purpose")

    monkeypatch.setattr(rl_phase, "build_policy", build_policy)
    with pytest.raises(ConfigError, match="broken on purpose"):
        Trainer(load_trainer_config(_recipe(tiny_recipe_dict, tmp_path / "run"))).run()
    assert "rl-generator" not in _children()
