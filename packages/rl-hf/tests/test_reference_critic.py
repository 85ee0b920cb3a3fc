"""HFCritic (value model) and ValueLoss: alignment, packing, learning, clipping, checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core import registry
from rl_core.algorithms import ValueLoss
from rl_core.errors import CheckpointError, ConfigError
from rl_core.interfaces import Critic, ValueLossFn
from rl_core.testing.policy import pack_sequences, random_batch
from rl_hf import HFCritic, HFPolicy, TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(arch="qwen2"))


def _critic(model_dir: Path, **kw) -> HFCritic:
    return HFCritic(HFCritic.Config(model_path=str(model_dir), lr=kw.pop("lr", 1e-2), **kw))


def _with_targets(batch, returns_T, old_values_T=None):
    old = torch.zeros_like(returns_T) if old_values_T is None else old_values_T
    return dataclasses.replace(batch, returns=returns_T * batch.loss_mask, old_values=old)


def test_registered_and_typed(model_dir):
    assert registry.resolve("rl.critics", "hf") is HFCritic
    assert registry.resolve("rl.losses", "value") is ValueLoss
    critic = _critic(model_dir)
    assert isinstance(critic, Critic) and isinstance(ValueLoss(), ValueLossFn)


def test_fresh_critic_values_are_zero_and_aligned(model_dir):
    critic = _critic(model_dir)
    batch = random_batch(200, [5, 3, 7], seed=1)
    values_T = critic.compute_values(batch)
    assert values_T.shape == (15,) and values_T.dtype == torch.float32
    assert torch.count_nonzero(values_T) == 0  # zero-initialised head
    # one step towards returns of 1 makes values non-zero except at sequence starts
    critic.train_step(_with_targets(batch, torch.ones(15)), ValueLoss(ValueLoss.Config(clip=None)))
    values_T = critic.compute_values(batch)
    starts = batch.cu_seqlens[:-1]
    assert torch.all(values_T[starts] == 0)
    assert torch.all(values_T[batch.loss_mask > 0] != 0)


def test_value_at_t_depends_only_on_tokens_before_t(model_dir):
    critic = _critic(model_dir)
    batch = random_batch(200, [8], seed=2)
    critic.train_step(_with_targets(batch, torch.ones(8)), ValueLoss(ValueLoss.Config(clip=None)))
    before_T = critic.compute_values(batch)
    tokens = batch.tokens.clone()
    tokens[4] = (tokens[4] + 1) % 200
    after_T = critic.compute_values(pack_sequences([tokens]))
    torch.testing.assert_close(after_T[:5], before_T[:5], rtol=0, atol=1e-6)  # V(t<=4): t<4 only
    assert not torch.allclose(after_T[5:], before_T[5:])


def test_packing_and_micro_batches_do_not_change_values(model_dir):
    critic = _critic(model_dir)
    batch = random_batch(200, [6, 4, 9], seed=3)
    critic.train_step(_with_targets(batch, torch.ones(19)), ValueLoss(ValueLoss.Config(clip=None)))
    packed_T = critic.compute_values(batch)
    split_T = critic.compute_values(dataclasses.replace(batch, micro_batch_bounds=(0, 1, 3)))
    torch.testing.assert_close(split_T, packed_T, rtol=0, atol=1e-5)
    alone_T = critic.compute_values(pack_sequences([batch.tokens[6:10]]))
    torch.testing.assert_close(alone_T, packed_T[6:10], rtol=0, atol=1e-5)


def test_critic_learns_returns(model_dir):
    critic = _critic(model_dir, lr=3e-3)
    batch = random_batch(200, [6, 6, 6, 6], seed=4)
    # return = 1 on the first two sequences, -1 on the others
    returns_T = torch.cat([torch.full((6,), s) for s in (1.0, 1.0, -1.0, -1.0)])
    loss_fn = ValueLoss(ValueLoss.Config(clip=None))
    errors = []
    for _ in range(30):
        old_T = critic.compute_values(batch)
        m = critic.train_step(_with_targets(batch, returns_T, old_T), loss_fn)
        errors.append(m["value_error"])
    assert errors[-1] < 0.25 * errors[0]
    values_T = critic.compute_values(batch)
    on = batch.loss_mask > 0
    assert torch.all((values_T[on] > 0) == (returns_T[on] > 0))
    assert critic.version == 30


def test_value_clipping_bounds_the_update_signal():
    values_T = torch.tensor([0.0, 0.5, 2.0], requires_grad=True)
    batch = pack_sequences([[1, 2, 3]])
    batch = dataclasses.replace(
        batch,
        returns=torch.tensor([0.0, 3.0, 3.0]),
        old_values=torch.tensor([0.0, 0.0, 0.0]),
    )
    out = ValueLoss(ValueLoss.Config(clip=0.2))(values_T, batch)
    w = batch.loss_weights
    # token 1: V=0.5 unclipped (2.5^2) < clipped (0.2 -> 2.8^2): clipped term wins
    # token 2: V=2.0 unclipped (1.0^2) < clipped (2.8^2): clipped term wins
    expected = 0.5 * (w[1] * 2.8**2 + w[2] * 2.8**2)
    assert float(out.loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    assert out.metrics["value_clipfrac"] == pytest.approx(float(w[1] + w[2]))
    out.loss.backward()
    assert torch.all(values_T.grad == 0)  # the clipped branch passes no gradient to V
    with pytest.raises(ConfigError, match="returns and TrainBatch.old_values"):
        ValueLoss()(values_T, pack_sequences([[1, 2, 3]]))
    with pytest.raises(ConfigError, match="clip"):
        ValueLoss.Config(clip=0.0)


def test_save_load_round_trip_and_resume(model_dir, tmp_path):
    batch = random_batch(200, [5, 5], seed=5)
    targets = _with_targets(batch, torch.ones(10))
    loss_fn = ValueLoss(ValueLoss.Config(clip=None))
    a = _critic(model_dir)
    a.train_step(targets, loss_fn)
    a.save(tmp_path / "ckpt")
    a.train_step(targets, loss_fn)
    b = _critic(model_dir)
    b.load(tmp_path / "ckpt")
    assert b.version == 1
    b.train_step(targets, loss_fn)
    torch.testing.assert_close(b.compute_values(batch), a.compute_values(batch), rtol=0, atol=0)
    # a policy directory is not a critic checkpoint
    policy_dir = tmp_path / "policy"
    HFPolicy(HFPolicy.Config(model_path=str(model_dir))).save(policy_dir)
    with pytest.raises(CheckpointError, match="not a critic checkpoint"):
        _critic(model_dir).load(policy_dir)
