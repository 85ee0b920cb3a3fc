"""HFPolicy at long context: log-probs from hidden states in chunks (values and gradients equal
the model's own full logits), only under the loss mask when asked, and activation checkpointing
(gradients unchanged)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.errors import ConfigError
from rl_core.testing.policy import PolicyConformance, random_batch
from rl_core.types import TrainBatch
from rl_hf import HFPolicy, TinyModelSpec, build_tiny_model

VOCAB = 260


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings (the LM head is the embedding matrix)."""
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(arch="qwen2"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untied LM head."""
    spec = TinyModelSpec(arch="llama", hidden_size=32, tie_word_embeddings=False, seed=1)
    return build_tiny_model(tmp_path_factory.mktemp("llama"), spec)


class TestHFPolicySmallChunks(PolicyConformance):
    """The whole policy contract with the head applied three positions at a time."""

    @pytest.fixture
    def policy(self, llama_dir: Path) -> HFPolicy:
        return HFPolicy(HFPolicy.Config(model_path=str(llama_dir), lr=1e-2, logprob_chunk_tokens=3))


def _batch() -> TrainBatch:
    batch = random_batch(VOCAB, [9, 14, 5, 11], seed=4)
    # A prompt of 3 tokens per sequence is not trained on.
    mask_T = batch.loss_mask.clone()
    for start in batch.cu_seqlens[:-1].tolist():
        mask_T[start : start + 3] = 0
    return dataclasses.replace(batch, loss_mask=mask_T, loss_weights=mask_T / mask_T.sum())


def _grads(policy: HFPolicy, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """log-probs, entropy and the gradients of a loss on both (one micro-batch, no step)."""
    policy.model.zero_grad(set_to_none=True)
    logp_T, ent_T = policy._packed_logprobs(batch, with_entropy=True)
    assert ent_T is not None
    g = torch.Generator().manual_seed(0)
    w_2T = torch.randn(2, logp_T.shape[0], generator=g) * batch.loss_mask
    ((logp_T * w_2T[0]).sum() + 0.3 * (ent_T * w_2T[1]).sum()).backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return logp_T.detach(), ent_T.detach(), grads


def _assert_same_grads(a: dict, b: dict, atol: float, rtol: float) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("model", ["qwen_dir", "llama_dir"])
def test_chunked_equals_full_logits(model: str, request: pytest.FixtureRequest) -> None:
    """Tied and untied heads, a temperature: chunked log-probs, entropy and every parameter's
    gradient equal those through the model's own ``[T, V]`` logits."""
    path = str(request.getfixturevalue(model))
    full = HFPolicy(HFPolicy.Config(model_path=path, temperature=0.7, logprob_chunk_tokens=0))
    chunked = HFPolicy(HFPolicy.Config(model_path=path, temperature=0.7, logprob_chunk_tokens=4))
    batch = _batch()
    ref, got = _grads(full, batch), _grads(chunked, batch)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
    _assert_same_grads(got[2], ref[2], atol=1e-5, rtol=1e-4)


def test_chunked_equals_full_logits_bfloat16(qwen_dir: Path) -> None:
    """bf16 weights: equal within bf16 rounding (the head's matmul runs in bf16 either way)."""
    cfg = {"model_path": str(qwen_dir), "dtype": "bfloat16"}
    full = HFPolicy(HFPolicy.Config(**cfg, logprob_chunk_tokens=0))
    chunked = HFPolicy(HFPolicy.Config(**cfg, logprob_chunk_tokens=5))
    batch = _batch()
    ref, got = _grads(full, batch), _grads(chunked, batch)
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref[1], atol=1e-4, rtol=1e-4)
    _assert_same_grads(got[2], ref[2], atol=2e-2, rtol=5e-2)


def test_loss_mask_positions_only(llama_dir: Path) -> None:
    """``logprob_positions="loss_mask"``: equal values under the mask, 0 elsewhere, and the
    same step loss and gradient norm (losses read only masked positions)."""
    path = str(llama_dir)
    every = HFPolicy(HFPolicy.Config(model_path=path, logprob_chunk_tokens=4))
    masked = HFPolicy(
        HFPolicy.Config(model_path=path, logprob_chunk_tokens=4, logprob_positions="loss_mask")
    )
    batch = _batch()
    all_T = every.compute_logprobs(batch, with_entropy=True)
    some_T = masked.compute_logprobs(batch, with_entropy=True)
    on_T = batch.loss_mask > 0
    assert (all_T.logprobs[~on_T][1:] != 0).any()
    assert (some_T.logprobs[~on_T] == 0).all() and (some_T.entropy[~on_T] == 0).all()
    torch.testing.assert_close(some_T.logprobs[on_T], all_T.logprobs[on_T], atol=1e-6, rtol=0)
    torch.testing.assert_close(some_T.entropy[on_T], all_T.entropy[on_T], atol=1e-6, rtol=0)
    _assert_same_grads(_grads(masked, batch)[2], _grads(every, batch)[2], atol=1e-6, rtol=1e-5)


def _saved_bytes(policy: HFPolicy, batch: TrainBatch) -> int:
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy._packed_logprobs(batch, with_entropy=False)
    return total[0]


@pytest.mark.parametrize("chunk", [0, 4])
def test_activation_checkpointing_same_gradients(qwen_dir: Path, chunk: int) -> None:
    """Recomputing layer activations keeps less for backward and leaves log-probs, entropy and
    every gradient unchanged (and the whole step's loss and grad norm)."""
    cfg = {"model_path": str(qwen_dir), "logprob_chunk_tokens": chunk, "lr": 1e-3}
    plain = HFPolicy(HFPolicy.Config(**cfg))
    ckpt = HFPolicy(HFPolicy.Config(**cfg, activation_checkpointing=True))
    batch = _batch()
    assert _saved_bytes(ckpt, batch) < 0.7 * _saved_bytes(plain, batch)
    ref, got = _grads(plain, batch), _grads(ckpt, batch)
    torch.testing.assert_close(got[0], ref[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], ref[1], atol=0, rtol=0)
    _assert_same_grads(got[2], ref[2], atol=1e-7, rtol=1e-6)
    assert all(not m.training for m in ckpt.model.modules() if isinstance(m, torch.nn.Dropout))


def test_head_it_cannot_reproduce_is_refused(tmp_path: Path) -> None:
    """A config with logit soft-capping (applied by the model's own forward) cannot be scored
    from hidden states: a ConfigError naming the field, unless the full-logits path is chosen."""
    path = build_tiny_model(tmp_path / "m", TinyModelSpec(arch="llama", hidden_size=32))
    cfg = json.loads((path / "config.json").read_text())
    cfg["final_logit_softcapping"] = 30.0
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="logprob_chunk_tokens"):
        HFPolicy(HFPolicy.Config(model_path=str(path), logprob_chunk_tokens=1024))
    HFPolicy(HFPolicy.Config(model_path=str(path), logprob_chunk_tokens=0))


def test_config_ranges() -> None:
    with pytest.raises(ConfigError, match="logprob_chunk_tokens"):
        HFPolicy.Config(model_path="x", logprob_chunk_tokens=-1)
    with pytest.raises(ConfigError, match="logprob_positions"):
        HFPolicy.Config(model_path="x", logprob_positions="prompt")  # type: ignore[arg-type]
