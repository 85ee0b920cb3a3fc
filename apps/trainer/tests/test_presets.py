"""Every algorithm preset recipe (``rl-train run grpo`` ... ``opd``) builds and runs two RL steps end to
end on the demo's task with small overrides, with finite metrics and its algorithm's own."""

from __future__ import annotations

import math

import pytest

from rl_hf import TinyModelSpec, build_tiny_model
from rl_trainer.cli import recipe_path
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer


def parity_reward(prompt, response, rollout) -> float:
    """A reward that varies across a random model's samples, so no group is dropped as flat."""
    return float(sum(rollout.tokens[rollout.response_start :]) % 3) / 2


# preset -> metrics that must be in every RL step's record (besides the common ones)
PRESETS = {
    "grpo": ["train/kl", "train/pg_clipfrac"],
    "dr_grpo": ["train/pg_clipfrac"],
    "dapo": ["rollout/overlong_penalty_mean", "rollout/dynamic_filter/keep_rate"],
    "gspo": ["train/pg_clipfrac", "train/ppo_kl"],
    "reinforce_pp": ["train/kl"],
    "rloo": ["train/kl"],
    "ppo": ["critic/value_error", "critic/value_mean", "critic/clipfrac", "train/pg_clipfrac"],
    "opd": ["distill/reverse_kl", "distill/teacher_logp_mean"],
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_runs_two_steps(name, tmp_path, tiny_recipe_dict):
    tiny = tiny_recipe_dict(tmp_path)["model"]["init"]  # the trainer tests' one-layer model
    teacher = []
    if name == "opd":  # a teacher of the student's shape with other weights
        spec = TinyModelSpec(**{**tiny, "seed": int(tiny.get("seed", 0)) + 1})
        teacher = [f"teacher.path={build_tiny_model(tmp_path / 'teacher', spec)}"]
    preset = load_trainer_config(recipe_path(name), teacher)
    minis = preset.rl.mini_batches_per_step
    init = ", ".join(f"{k}: {v}" for k, v in tiny.items())
    overrides = [
        f"run_dir={tmp_path}",
        "rl.steps=2",
        "sft.steps=0",
        f"model.init={{{init}}}",
        "task.n_train=64",
        "task.n_eval=4",
        f"rollout.prompts_per_step={2 * minis}",
        "rollout.n_samples=2",
        "rollout.sampling.max_new_tokens=6",
        "eval.every=0",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"reward.type={__file__}:parity_reward",
    ]
    if preset.rollout.overlong_penalty is not None:
        overrides.append("rollout.overlong_penalty.band=2")
    overrides += teacher
    cfg = load_trainer_config(recipe_path(name), overrides)
    trainer = Trainer(cfg)
    steps = [r for r in trainer.run() if r["phase"] == "rl" and r["step"]]
    assert [r["step"] for r in steps] == [1, 2]
    assert trainer.policy.version == 2 * preset.rl.updates_per_step
    for r in steps:
        assert r["train/optimizer_steps"] == preset.rl.updates_per_step
        for key in ["train/loss", "train/grad_norm", "rollout/reward_mean", *PRESETS[name]]:
            assert key in r, (name, key, sorted(r))
            assert math.isfinite(r[key]), (name, key, r[key])
