"""On-policy distillation through the trainer: a frozen teacher's reverse KL as the advantage."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_core.errors import ConfigError
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.step import teacher as teacher_mod

SAMPLING = {"temperature": 1.0, "max_new_tokens": 4}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_recipe_dict):
    """A teacher: the tiny model after a short SFT warm-up on the reverse task (no RL)."""
    run = tmp_path_factory.mktemp("teacher")
    recipe = tiny_recipe_dict(
        run,
        seed=3,
        sft={"steps": 40, "batch_size": 32, "lr": 1e-2},
        rl={"steps": 0},
        eval={"every": 0},
    )
    Trainer(load_trainer_config(recipe)).run()
    return run / "sft_model"


def _student(make, run_dir, teacher_path, steps, **teacher):
    """The student: the same initial model after a shorter warm-up (10 SFT steps), then OPD."""
    return make(
        run_dir,
        seed=3,
        sft={"steps": 10, "batch_size": 32, "lr": 1e-2},
        policy={"type": "hf", "lr": 3e-3},
        teacher={"type": "hf", "path": str(teacher_path), **teacher},
        rollout={"prompts_per_step": 16, "n_samples": 8, "sampling": SAMPLING},
        rl={"steps": steps},
        eval={"every": 0},
    )


def test_opd_advantage_is_the_reverse_kl_and_the_kl_falls(
    tmp_path, tiny_recipe_dict, teacher_dir, monkeypatch
):
    from rl_hf import HFPolicy

    seen = []
    original = teacher_mod.distill

    def spy(cfg, teacher, policy, batch):
        out = original(cfg, teacher, policy, batch)
        seen.append(dataclasses.replace(batch))
        return out

    monkeypatch.setattr(teacher_mod, "distill", spy)
    cfg = load_trainer_config(_student(tiny_recipe_dict, tmp_path / "s", teacher_dir, steps=10))
    records = Trainer(cfg).run()
    steps = [r for r in records if r["phase"] == "rl" and "distill/reverse_kl" in r]
    assert len(steps) == 10 and len(seen) == 10

    # Step 1, by hand: the student is its warm-up's model, the teacher the longer-trained one.
    batch = seen[0]
    student = HFPolicy(HFPolicy.Config(model_path=str(tmp_path / "s" / "sft_model")))
    teacher = HFPolicy(HFPolicy.Config(model_path=str(teacher_dir)))
    plain = dataclasses.replace(
        batch, old_logprobs=None, advantages=torch.zeros_like(batch.advantages)
    )
    s_T = student.compute_logprobs(plain).logprobs
    t_T = teacher.compute_logprobs(plain).logprobs
    on_T = batch.loss_mask > 0
    want_T = torch.where(on_T, -(s_T - t_T), torch.zeros_like(s_T))
    torch.testing.assert_close(batch.advantages, want_T, atol=1e-5, rtol=1e-5)
    assert float(on_T.sum()) > 0 and float(want_T[on_T].abs().sum()) > 0
    assert steps[0]["distill/reverse_kl"] == pytest.approx(
        float((s_T - t_T)[on_T].mean()), abs=1e-5
    )
    assert steps[0]["distill/teacher_logp_mean"] == pytest.approx(float(t_T[on_T].mean()), abs=1e-5)

    # The student moves towards the teacher: the reverse KL on its own samples falls.
    kl = [r["distill/reverse_kl"] for r in steps]
    assert sum(kl[-3:]) / 3 < 0.85 * sum(kl[:3]) / 3, kl


def test_opd_mixes_the_task_advantage_by_weight(
    tmp_path, tiny_recipe_dict, teacher_dir, monkeypatch
):
    seen = []
    original = teacher_mod.distill

    def spy(cfg, teacher, policy, batch):
        task = batch.advantages.clone()
        out = original(cfg, teacher, policy, batch)
        seen.append(
            (task, batch.advantages.clone(), batch.old_logprobs.clone(), batch.loss_mask, batch)
        )
        return out

    monkeypatch.setattr(teacher_mod, "distill", spy)
    recipe = _student(
        tiny_recipe_dict, tmp_path / "mix", teacher_dir, steps=1, coef=0.5, reward_weight=2.0
    )
    Trainer(load_trainer_config(recipe)).run()
    ((task_T, shaped_T, student_T, mask_T, batch),) = seen
    from rl_hf import HFPolicy

    teacher = HFPolicy(HFPolicy.Config(model_path=str(teacher_dir)))
    t_T = teacher.compute_logprobs(batch).logprobs
    on_T = mask_T > 0
    assert float(task_T[on_T].abs().sum()) > 0  # the task advantage is really in the mix
    want_T = torch.where(on_T, 2.0 * task_T - 0.5 * (student_T - t_T), torch.zeros_like(t_T))
    torch.testing.assert_close(shaped_T, want_T, atol=1e-5, rtol=1e-5)


def test_teacher_config_errors(tmp_path, tiny_recipe_dict, teacher_dir):
    with pytest.raises(ConfigError, match="teacher.path"):
        load_trainer_config(tiny_recipe_dict(tmp_path, teacher={"type": "hf"}))
    with pytest.raises(ConfigError, match="teacher.url"):
        load_trainer_config(tiny_recipe_dict(tmp_path, teacher={"type": "sglang"}))
    with pytest.raises(ConfigError, match="teacher.coef"):
        load_trainer_config(
            tiny_recipe_dict(tmp_path, teacher={"path": str(teacher_dir), "coef": 0})
        )
    with pytest.raises(ConfigError, match="teacher.path"):
        load_trainer_config(tiny_recipe_dict(tmp_path, teacher={"path": str(tmp_path / "nope")}))
