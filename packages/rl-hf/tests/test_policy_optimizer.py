"""HFPolicy's AdamW implementations: foreach (the default) is bitwise the for-loop, fused is equal
within float rounding, and a checkpoint resumes under the configured implementation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.errors import ConfigError
from rl_core.testing.policy import random_batch, sft_loss
from rl_hf import HFPolicy, TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(arch="qwen2"))


def _train(model_dir: Path, impl: str, steps: int = 3) -> dict[str, torch.Tensor]:
    policy = HFPolicy(HFPolicy.Config(model_path=str(model_dir), lr=1e-2, adamw_impl=impl))
    vocab = policy.model_shape.vocab_size
    for step in range(steps):
        batch = random_batch(vocab, [7, 5, 9], seed=step, micro_batch_bounds=(0, 2, 3))
        policy.train_step(batch, sft_loss)
    return {n: t.clone() for n, t in policy.named_weights()}


def test_foreach_is_bitwise_the_for_loop_and_fused_is_close(model_dir: Path) -> None:
    ref = _train(model_dir, "for_loop")
    foreach = _train(model_dir, "foreach")
    fused = _train(model_dir, "fused")
    assert all(torch.equal(foreach[n], ref[n]) for n in ref)
    # 3 steps of lr 1e-2 move weights by up to 3e-2; fused differs by float rounding only
    assert max((fused[n] - ref[n]).abs().max().item() for n in ref) < 1e-4
    assert any(not torch.equal(_train(model_dir, "for_loop", 2)[n], ref[n]) for n in ref)


def test_resume_uses_the_configured_implementation(model_dir: Path, tmp_path: Path) -> None:
    fused = HFPolicy(HFPolicy.Config(model_path=str(model_dir), adamw_impl="fused"))
    fused.train_step(random_batch(fused.model_shape.vocab_size, [6, 4]), sft_loss)
    fused.save(tmp_path / "ckpt")
    again = HFPolicy(HFPolicy.Config(model_path=str(model_dir), adamw_impl="foreach"))
    again.load(tmp_path / "ckpt")
    group = again.optimizer.param_groups[0]
    assert group["foreach"] is True and not group["fused"]
    again.train_step(random_batch(again.model_shape.vocab_size, [6, 4], seed=1), sft_loss)


def test_unknown_implementation_names_the_field(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="policy.adamw_impl"):
        HFPolicy.Config(model_path=str(model_dir), adamw_impl="apex")  # type: ignore[arg-type]


def test_compile_model_compiles_only_the_forward(model_dir: Path) -> None:
    """``compile_model`` wraps the instance's forward in ``torch.compile`` (nothing runs until
    the first step, whose timing docs/performance.md reports); off by default."""
    eager = HFPolicy(HFPolicy.Config(model_path=str(model_dir)))
    compiled = HFPolicy(HFPolicy.Config(model_path=str(model_dir), compile_model=True))
    assert not hasattr(eager.model.forward, "_torchdynamo_orig_callable")
    assert hasattr(compiled.model.forward, "_torchdynamo_orig_callable")
    assert [n for n, _ in compiled.named_weights()] == [n for n, _ in eager.named_weights()]
