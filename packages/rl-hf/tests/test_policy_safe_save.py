"""HFPolicy.save never loses weights to a failed conversion, and a model whose config cannot be
saved is refused when the policy is built, before any training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file
from transformers import PretrainedConfig

from rl_core.errors import CheckpointError, ConfigError
from rl_core.testing.policy import random_batch, sft_loss
from rl_hf import HFPolicy, TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(arch="qwen2"))


def _trained(model_dir: Path) -> HFPolicy:
    policy = HFPolicy(HFPolicy.Config(model_path=str(model_dir), lr=1e-2))
    policy.train_step(random_batch(policy.model_shape.vocab_size, [5, 7], seed=0), sft_loss)
    return policy


def test_failed_conversion_keeps_the_weights(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    policy = _trained(model_dir)

    def refuse(*args, **kwargs):
        raise TypeError("Object of type device is not JSON serializable")

    monkeypatch.setattr(type(policy.model), "save_pretrained", refuse)
    out = tmp_path / "final_model"
    with pytest.raises(CheckpointError) as info:
        policy.save(out, with_optimizer=False)
    msg = str(info.value)
    assert str(out / "model.safetensors") in msg
    assert "TypeError" in msg and "not JSON serializable" in msg
    saved = load_file(str(out / "model.safetensors"))
    live = dict(policy.named_weights())
    assert saved.keys() == live.keys()
    assert all(torch.equal(saved[k], live[k]) for k in live)
    # nothing half-converted is left next to the weights
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_save_writes_the_same_weights_as_before(model_dir: Path, tmp_path: Path) -> None:
    """The raw file is replaced by transformers' own; the directory loads as a policy."""
    policy = _trained(model_dir)
    policy.save(tmp_path / "m", with_optimizer=True)
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", "rl_policy_state.pt"} <= names
    assert not any(n.startswith(".") or n.endswith(".tmp") for n in names)
    other = HFPolicy(HFPolicy.Config(model_path=str(tmp_path / "m"), lr=1e-2))
    other.load(tmp_path / "m", with_optimizer=True)
    assert other.version == policy.version == 1
    mine, theirs = dict(policy.named_weights()), dict(other.named_weights())
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_unsaveable_config_fails_at_build(model_dir: Path, monkeypatch) -> None:
    def refuse(self, *args, **kwargs):
        raise TypeError("Object of type function is not JSON serializable")

    # (to_json_file: the writer save_pretrained uses; to_json_string also serves repr and logs)
    monkeypatch.setattr(PretrainedConfig, "to_json_file", refuse)
    with pytest.raises(ConfigError) as info:
        HFPolicy(HFPolicy.Config(model_path=str(model_dir), lr=1e-2))
    msg = str(info.value)
    assert str(model_dir) in msg and "cannot be saved" in msg and "not JSON serializable" in msg
