"""MegatronCritic in this process (a world of one): values and value-loss steps equal HFCritic's,
checkpoints round-trip with the value head."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rl_core import registry
from rl_core.algorithms import ValueLoss
from rl_core.errors import CheckpointError
from rl_core.interfaces import Critic
from rl_core.testing.policy import random_batch
from rl_hf import HFCritic
from rl_megatron.critic import MegatronCritic


def _targets(batch, critic):
    """Returns of +1/-1 per sequence (by parity) around the critic's current values."""
    seq = batch.seq_index()
    returns_T = torch.where(seq % 2 == 0, 1.0, -1.0) * batch.loss_mask
    return dataclasses.replace(batch, returns=returns_T, old_values=critic.compute_values(batch))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # tied and untied embeddings
def test_values_and_steps_match_hf_critic(arch: str, model_dirs: dict[str, Path]) -> None:
    path = str(model_dirs[arch])
    kw = {"lr": 1e-2, "grad_clip": 1.0}
    mine = MegatronCritic(MegatronCritic.Config(model_path=path, **kw))
    ref = HFCritic(HFCritic.Config(model_path=path, **kw))
    assert isinstance(mine, Critic) and registry.resolve("rl.critics", "megatron") is MegatronCritic
    batch = random_batch(
        mine.model_shape.vocab_size, [6, 9, 4, 8], seed=4, micro_batch_bounds=(0, 1, 4)
    )
    assert torch.count_nonzero(mine.compute_values(batch)) == 0  # zero-initialised head
    loss_fn = ValueLoss(ValueLoss.Config(clip=0.5))
    for _ in range(3):
        m_mine = mine.train_step(_targets(batch, mine), loss_fn)
        m_ref = ref.train_step(_targets(batch, ref), loss_fn)
        assert m_mine["loss"] == pytest.approx(m_ref["loss"], rel=1e-4, abs=1e-7)
        assert m_mine["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-4)
        assert m_mine["value_error"] == pytest.approx(m_ref["value_error"], rel=1e-4)
    v_mine, v_ref = mine.compute_values(batch), ref.compute_values(batch)
    assert torch.count_nonzero(v_ref) > 0
    torch.testing.assert_close(v_mine, v_ref, atol=2e-5, rtol=0)
    assert mine.version == 3


def test_checkpoint_round_trip(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = str(model_dirs["qwen2"])
    critic = MegatronCritic(MegatronCritic.Config(model_path=path, lr=1e-2))
    batch = random_batch(critic.model_shape.vocab_size, [5, 7], seed=5)
    loss_fn = ValueLoss()
    critic.train_step(_targets(batch, critic), loss_fn)
    critic.save(tmp_path / "ckpt")
    critic.train_step(_targets(batch, critic), loss_fn)
    second = critic.compute_values(batch)
    critic.load(tmp_path / "ckpt")
    assert critic.version == 1
    critic.train_step(_targets(batch, critic), loss_fn)
    torch.testing.assert_close(critic.compute_values(batch), second, atol=0, rtol=0)
    # the reference critic reads the same head and weights
    ref = HFCritic(HFCritic.Config(model_path=str(tmp_path / "ckpt")))
    ref.load(tmp_path / "ckpt", with_optimizer=False)
    critic.load(tmp_path / "ckpt")
    torch.testing.assert_close(
        ref.compute_values(batch), critic.compute_values(batch), atol=2e-5, rtol=0
    )
    with pytest.raises(CheckpointError, match="not a critic checkpoint"):
        critic.load(Path(path))
