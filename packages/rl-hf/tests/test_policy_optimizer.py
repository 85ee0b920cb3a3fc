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


def test_compile_model_compiles_each_decoder_layer_in_place(model_dir: Path) -> None:
    """``compile_model`` (scope ``layers``, the default) compiles every decoder block in place:
    the model's forward, its parameter names and weights are unchanged; ``model`` scope wraps the
    forward instead; off by default."""
    eager = HFPolicy(HFPolicy.Config(model_path=str(model_dir)))
    cfg = HFPolicy.Config(model_path=str(model_dir), compile_model=True, compile_warmup=False)
    compiled = HFPolicy(cfg)
    assert eager.compiled_modules == []
    assert compiled.compiled_modules == ["model.layers.0", "model.layers.1"]
    for name in compiled.compiled_modules:
        assert compiled.model.get_submodule(name)._compiled_call_impl is not None
    assert not hasattr(compiled.model.forward, "_torchdynamo_orig_callable")
    assert [n for n, _ in compiled.named_weights()] == [n for n, _ in eager.named_weights()]
    whole = HFPolicy(
        HFPolicy.Config(
            model_path=str(model_dir),
            compile_model=True,
            compile_scope="model",
            compile_warmup=False,
        )
    )
    assert whole.compiled_modules == ["forward"]
    assert hasattr(whole.model.forward, "_torchdynamo_orig_callable")


def test_unknown_compile_scope_names_the_field(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="policy.compile_scope"):
        HFPolicy.Config(model_path=str(model_dir), compile_scope="blocks")  # type: ignore[arg-type]


@pytest.mark.parametrize("context", [64, 32768])
def test_compiled_policy_warms_up_at_build_and_matches_eager(tmp_path: Path, context: int) -> None:
    """The start-up compile covers short and long packed rows (longer than a small model's
    ``max_position_embeddings``; 8000 tokens, which recompiled after a warm-up on short rows
    only, at any context) with one trace each: train steps of 3 to 40 sequences compile nothing
    more, and log-probs, losses and the updated weights equal eager ones within float rounding."""
    from torch._dynamo.utils import counters

    spec = TinyModelSpec(arch="qwen2", max_position_embeddings=context)
    path = str(build_tiny_model(tmp_path / "m", spec))
    torch._dynamo.reset()
    counters.clear()
    compiled = HFPolicy(HFPolicy.Config(model_path=path, lr=1e-3, compile_model=True))
    assert compiled.compile_warmup_s > 0
    compiles = counters["aot_autograd"]["total"]
    assert compiles >= 1
    # Each warm-up trace became a graph: none was thrown away and traced again (before
    # compiled_call, the layers' float constants restarted the first trace: 3 traces, 2 graphs).
    assert compiles == counters["stats"]["unique_graphs"], dict(counters["stats"])
    eager = HFPolicy(HFPolicy.Config(model_path=path, lr=1e-3))
    vocab = eager.model_shape.vocab_size
    for step, lengths in enumerate([[6, 9, 4], [8] * 40, [5] * 12, [200] * 40]):  # 19 - 8000
        batch = random_batch(vocab, lengths, seed=step)
        want = eager.compute_logprobs(batch).logprobs
        got = compiled.compute_logprobs(batch).logprobs
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        m_eager = eager.train_step(batch, sft_loss)
        m_comp = compiled.train_step(batch, sft_loss)
        assert m_comp["loss"] == pytest.approx(m_eager["loss"], rel=1e-5)
        assert m_comp["grad_norm"] == pytest.approx(m_eager["grad_norm"], rel=1e-4)
    # compute_logprobs runs without gradients: one more graph, once; train steps add none
    assert counters["aot_autograd"]["total"] <= compiles + 1
    for (name, w_c), (_, w_e) in zip(compiled.named_weights(), eager.named_weights()):
        assert torch.allclose(w_c, w_e, atol=1e-5), name
