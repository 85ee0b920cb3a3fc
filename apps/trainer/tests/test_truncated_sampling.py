"""Top-p sampling through rl-train: the policy is built with rollout.sampling's top_p, so its
log-probs equal the HF engine's (train/mismatch ~ 0); refusals name the field and the fix."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rl_core.errors import ConfigError
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.step import truncation


def _recipe(make, run_dir, **sampling):
    return make(
        run_dir,
        seed=3,
        rollout={
            "prompts_per_step": 2,
            "n_samples": 2,
            "sampling": {"temperature": 1.0, "max_new_tokens": 4, **sampling},
        },
        rl={"steps": 1},
        eval={"every": 0},
    )


def test_top_p_run_scores_the_truncated_distribution(tmp_path, tiny_recipe_dict) -> None:
    trainer = Trainer(load_trainer_config(_recipe(tiny_recipe_dict, tmp_path / "r", top_p=0.8)))
    records = trainer.run()
    assert (trainer.policy.config.top_p, trainer.policy.config.top_k) == (0.8, 0)
    step = next(r for r in records if r["phase"] == "rl" and "train/mismatch" in r)
    assert step["train/mismatch"] < 1e-4, step["train/mismatch"]


def test_untruncated_sampling_leaves_the_policy_untouched(tiny_recipe_dict, tmp_path) -> None:
    cfg = load_trainer_config(_recipe(tiny_recipe_dict, tmp_path / "r"))
    assert truncation.policy_overrides(cfg, cfg.policy) == {}
    cfg = load_trainer_config(_recipe(tiny_recipe_dict, tmp_path / "r", top_k=5))
    assert truncation.policy_overrides(cfg, cfg.policy) == {"top_p": 1.0, "top_k": 5}


class NoTopP:
    """A policy type whose Config cannot renormalise (no top_p/top_k)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        model_path: str = ""


def test_policy_without_top_p_is_refused(tiny_recipe_dict, tmp_path) -> None:
    cfg = load_trainer_config(_recipe(tiny_recipe_dict, tmp_path / "r", top_p=0.9))
    cfg.policy.type = f"{__file__}:NoTopP"
    with pytest.raises(ConfigError, match=r"rollout\.sampling.*no top_p/top_k"):
        truncation.policy_overrides(cfg, cfg.policy)


def test_correction_against_untruncated_engine_logprobs_is_refused(tiny_recipe_dict, tmp_path):
    recipe = _recipe(tiny_recipe_dict, tmp_path / "r", top_p=0.9)
    recipe["algorithm"] = {"loss": {"correction": "tis"}}
    cfg = load_trainer_config(recipe)
    truncation.check_generator(cfg)  # hf returns truncated log-probs: fine
    cfg.generator.type = "rl_core.testing.fake_generator:FakeGenerator"
    with pytest.raises(ConfigError, match=r"algorithm\.loss\.correction"):
        truncation.check_generator(cfg)
