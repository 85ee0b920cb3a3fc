"""PPO with a critic in the trainer: GAE on critic values, the critic's own step, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.errors import ConfigError
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer


def _recipe(make, run_dir, rl_steps=6, **extra):
    sections = {
        "task": {"type": "reverse", "n_train": 64, "n_eval": 4, "min_len": 2, "max_len": 3},
        "policy": {"type": "hf", "lr": 1e-3},
        "sft": {"steps": 6, "batch_size": 16, "lr": 3e-3},
        "critic": {"type": "hf", "lr": 1e-2},
        # every response earns 1 (an empty match): GAE returns are 1 on every response token
        "reward": {"type": "format_match", "pattern": "^"},
        "rollout": {
            "prompts_per_step": 4,
            "n_samples": 2,
            "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        },
        "algorithm": {
            "advantage": "gae",
            "advantage_options": {"gamma": 1.0, "lam": 1.0},
            "value_loss": {"clip": 0.5},
        },
        "rl": {"steps": rl_steps},
        "eval": {"every": 0},
        "checkpoint": {"every": 3, "keep": 2},
    }
    sections.update(extra)
    return make(run_dir, seed=7, **sections)


def _final_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def test_ppo_with_critic_trains_the_value_model_and_resumes_exactly(tmp_path, tiny_recipe_dict):
    full = tmp_path / "full"
    records = Trainer(load_trainer_config(_recipe(tiny_recipe_dict, full, rl_steps=6))).run()
    steps = [r for r in records if r["phase"] == "rl" and "critic/value_error" in r]
    assert len(steps) == 6
    # the critic starts at 0 (zero head, error 1 against returns of 1) and moves towards 1
    assert steps[0]["critic/value_mean"] == pytest.approx(0.0, abs=1e-6)
    assert steps[0]["critic/value_error"] == pytest.approx(1.0, abs=1e-6)
    errors = [r["critic/value_error"] for r in steps]
    assert errors[-1] < 0.5 * errors[0], errors
    assert all(r["critic/grad_norm"] > 0 for r in steps)
    ckpt = sorted((full / "checkpoints").glob("step_*"))[-1]
    assert (ckpt / "critic" / "value_head.pt").is_file()

    # kill-free resume: stop after step 3 (a checkpoint), resume to 6: identical weights/metrics
    part = tmp_path / "part"
    Trainer(load_trainer_config(_recipe(tiny_recipe_dict, part, rl_steps=3))).run()
    resumed = Trainer(
        load_trainer_config(_recipe(tiny_recipe_dict, part, rl_steps=6)), resume=True
    ).run()
    a, b = _final_weights(full), _final_weights(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    want = [r for r in records if r["phase"] == "rl" and r["step"] > 3]
    got = [r for r in resumed if r["phase"] == "rl" and r["step"] > 3]

    def strip(r):
        return {k: v for k, v in r.items() if not k.startswith("perf/")}

    assert [strip(r) for r in got] == [strip(r) for r in want]
    assert json.dumps(got[0]["critic/value_error"])  # a plain float


def test_critic_config_errors(tiny_recipe_dict):
    with pytest.raises(ConfigError, match="'gae' needs critic values"):
        load_trainer_config(_recipe(tiny_recipe_dict, "x", critic=None))
    r = _recipe(tiny_recipe_dict, "x")
    r["algorithm"] = {"advantage": "grpo"}
    with pytest.raises(ConfigError, match="critic: set, but algorithm.advantage is 'grpo'"):
        load_trainer_config(r)
