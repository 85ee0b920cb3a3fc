"""PPO epochs and mini-batches in the trainer (:mod:`rl_trainer.step.ppo_updates`): one epoch and one
mini-batch is the old single-step path bit for bit; more updates make the ratio and clipping
act, advance the version once per update and keep the staleness arithmetic consistent."""

from __future__ import annotations

import pytest
import torch

from rl_core.errors import ConfigError
from rl_core.types import TrainBatch
from rl_hf.policy import HFPolicy
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.step import ppo_updates


def parity_reward(prompt, response, rollout) -> float:
    """A reward that varies across samples of a random model (so advantages are nonzero)."""
    return float(sum(rollout.tokens[rollout.response_start :]) % 3) / 2


def _recipe(make, run_dir, *, rl=None, **extra):
    sections = {
        "policy": {"type": "hf", "lr": 3e-3},
        "reward": {"type": f"{__file__}:parity_reward"},
        "rollout": {
            "prompts_per_step": 4,
            "n_samples": 2,
            "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        },
        "algorithm": {"loss": {"eps_clip_low": 0.02}},
        "rl": {"steps": 2, **(rl or {})},
        "eval": {"every": 0},
    }
    sections.update(extra)
    return make(run_dir, seed=3, **sections)


def _final_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def _strip(records):
    return [
        {k: v for k, v in r.items() if not k.startswith("perf/")}
        for r in records
        if r["phase"] == "rl" and r["step"]
    ]


def test_one_epoch_one_mini_batch_is_the_single_step_path(tmp_path, tiny_recipe_dict, monkeypatch):
    """The previous ``train`` stage, verbatim: one policy step (then one critic step) on the
    batch ``rl_batch`` built. The new path must reproduce its weights and metrics exactly."""
    critic = {
        "critic": {"type": "hf", "lr": 1e-2},
        "algorithm": {"advantage": "gae", "loss": {"eps_clip_low": 0.02}},
    }
    new_dir, old_dir = tmp_path / "new", tmp_path / "old"
    new = Trainer(load_trainer_config(_recipe(tiny_recipe_dict, new_dir, **critic))).run()

    def single_step(cfg, models, parts, batch, groups):
        m = models.policy.train_step(batch, parts.loss_fn)
        cm = models.critic.train_step(batch, parts.value_loss_fn)
        return m, cm, 1

    monkeypatch.setattr(ppo_updates, "optimize", single_step)
    old = Trainer(load_trainer_config(_recipe(tiny_recipe_dict, old_dir, **critic))).run()
    assert _strip(new) == _strip(old)
    assert all(r["train/optimizer_steps"] == 1 for r in _strip(new))
    a, b = _final_weights(new_dir), _final_weights(old_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_later_updates_clip_and_versions_advance_per_update(
    tmp_path, tiny_recipe_dict, monkeypatch
):
    updates: list[tuple[TrainBatch, dict[str, float]]] = []
    train_step = HFPolicy.train_step

    def recording(self, batch, loss_fn):
        m = train_step(self, batch, loss_fn)
        updates.append((batch, m))
        return m

    monkeypatch.setattr(HFPolicy, "train_step", recording)
    rl = {"ppo_epochs": 3, "mini_batches_per_step": 2}
    trainer = Trainer(load_trainer_config(_recipe(tiny_recipe_dict, tmp_path, rl=rl)))
    records = _strip(trainer.run())
    assert len(updates) == 2 * 6
    assert trainer.policy.version == trainer.generator.weight_version == 12
    for r, step_updates in zip(records, (updates[:6], updates[6:]), strict=True):
        assert r["train/optimizer_steps"] == 6
        metrics = [m for _, m in step_updates]
        assert r["train/pg_clipfrac"] == pytest.approx(sum(m["pg_clipfrac"] for m in metrics) / 6)
        assert r["train/ppo_kl"] == pytest.approx(sum(m["ppo_kl"] for m in metrics) / 6)
        # the first update starts from the old policy: ratio 1, nothing clipped
        assert metrics[0]["pg_clipfrac"] == 0.0
        assert metrics[0]["ppo_kl"] == pytest.approx(0.0, abs=1e-6)
        for batch, _ in step_updates:
            # whole groups: 2 of the 4 prompts (2 samples each); weights are a mean per mini-batch
            assert batch.num_sequences == 4
            assert float(batch.loss_weights.sum()) == pytest.approx(1.0, abs=1e-6)
            assert batch.old_logprobs is not None
        # the two mini-batches are disjoint and cover the step's rollouts
        ids = [set(b.sample_ids) for b, _ in step_updates[:2]]
        assert not ids[0] & ids[1] and len(ids[0] | ids[1]) == 8
        assert [set(b.sample_ids) for b, _ in step_updates[2:4]] == ids  # same split each epoch
    later = [m for _, m in updates[1:6] + updates[7:]]
    assert any(m["pg_clipfrac"] > 0 for m in later)
    assert any(abs(m["ppo_kl"]) > 1e-5 for m in later)


def test_async_generation_counts_staleness_in_rl_steps(tmp_path, tiny_recipe_dict):
    rl = {
        "steps": 3,
        "ppo_epochs": 2,
        "async_generation": True,
        "max_staleness": 1,
    }
    trainer = Trainer(load_trainer_config(_recipe(tiny_recipe_dict, tmp_path, rl=rl)))
    records = _strip(trainer.run())
    assert trainer.policy.version == 6
    # step 1 trains on version 0 data; steps 2 and 3 on data one RL step (2 versions) old
    assert [r["rollout/staleness_max"] for r in records] == [0, 1, 1]
    assert all(r["train/optimizer_steps"] == 2 for r in records)


def test_take_sequences_reorders_every_per_token_field():
    batch = TrainBatch(
        tokens=torch.arange(7),
        cu_seqlens=torch.tensor([0, 3, 5, 7]),
        loss_mask=torch.tensor([0.0, 1, 1, 0, 1, 0, 1]),
        loss_weights=torch.full((7,), 0.25),
        advantages=torch.arange(7, dtype=torch.float32),
        old_logprobs=-torch.arange(7, dtype=torch.float32),
        sample_ids=("a", "b", "c"),
    )
    out = ppo_updates.take_sequences(batch, [2, 0], micro_batch_bounds=(0, 1, 2))
    assert out.tokens.tolist() == [5, 6, 0, 1, 2]
    assert out.cu_seqlens.tolist() == [0, 2, 5]
    assert out.advantages.tolist() == [5, 6, 0, 1, 2]
    assert out.old_logprobs.tolist() == [-5, -6, -0.0, -1, -2]
    assert out.loss_mask.tolist() == [0, 1, 0, 1, 1]
    assert out.sample_ids == ("c", "a") and out.micro_batch_bounds == (0, 1, 2)
    assert out.ref_logprobs is None


def test_mini_batches_must_divide_the_groups(tmp_path, tiny_recipe_dict):
    with pytest.raises(ConfigError, match="mini_batches_per_step: 3 does not divide"):
        load_trainer_config(_recipe(tiny_recipe_dict, tmp_path, rl={"mini_batches_per_step": 3}))
