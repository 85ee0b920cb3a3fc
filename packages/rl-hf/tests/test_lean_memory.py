"""The lowest-memory full fine-tuning setting of HFPolicy (issue #36; docs/performance.md §11):
small log-prob chunks, activation checkpointing and the per-tensor AdamW loop together train to
the same weights as the defaults, within float rounding, on the tiny model; and the option that
has glibc return a step's freed blocks at once (``host_mmap_threshold``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from rl_core.errors import ConfigError
from rl_core.testing.policy import random_batch, sft_loss
from rl_hf import HFPolicy, TinyModelSpec, build_tiny_model

LEAN = {"logprob_chunk_tokens": 4, "activation_checkpointing": True, "adamw_impl": "for_loop"}
"""benchmarks/memory_floor.py's ``lean`` configuration (128-token chunks there; 4 here, so the
tiny batches span several chunks)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings, as SmolLM2: the head's gradient and the embedding's share one tensor."""
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(arch="qwen2"))


def _train(model_dir: Path, steps: int = 3, **overrides) -> tuple[dict, list]:
    policy = HFPolicy(HFPolicy.Config(model_path=str(model_dir), lr=1e-2, **overrides))
    vocab = policy.model_shape.vocab_size
    metrics = []
    for step in range(steps):
        batch = random_batch(vocab, [7, 5, 9], seed=step, micro_batch_bounds=(0, 2, 3))
        metrics.append(policy.train_step(batch, sft_loss))
    return {n: t.clone() for n, t in policy.named_weights()}, metrics


def test_lean_setting_trains_like_the_default(model_dir: Path) -> None:
    ref, ref_metrics = _train(model_dir)
    lean, lean_metrics = _train(model_dir, **LEAN)
    moved = max((ref[n] - _train(model_dir, steps=0)[0][n]).abs().max().item() for n in ref)
    assert moved > 1e-3  # three steps of lr 1e-2 move the weights by far more than the tolerance
    # Adam divides by sqrt(v): float-rounding differences in small gradients move a weight by
    # up to ~1e-5 here (the same bound as fused AdamW against the loop, test_policy_optimizer)
    assert max((lean[n] - ref[n]).abs().max().item() for n in ref) < 1e-4
    for a, b in zip(lean_metrics, ref_metrics):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


_FREED = """
import sys, torch
from rl_hf._allocator import set_mmap_threshold
if sys.argv[1] != "0":
    assert set_mmap_threshold(int(sys.argv[1]))
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 2**10
for _ in range(2):  # glibc raises its threshold to 16 MB after the first free of a 16 MB block
    x = torch.ones(4 * 2**20); del x
a = torch.ones(4 * 2**20); b = torch.ones(4 * 2**20)
held = rss()
del a  # below b: glibc's heap can hand it back only if it was mapped on its own
print(held - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_mmap_threshold_returns_freed_blocks(tmp_path: Path) -> None:
    """``host_mmap_threshold``: a freed 16 MB tensor below a live one leaves the RSS at once;
    with glibc's own (dynamic) threshold it stays in the heap (in a fresh process each: the
    setting is process-wide)."""

    def released_mb(threshold: int) -> float:
        out = subprocess.run(
            [sys.executable, "-c", _FREED, str(threshold)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        return float(out.stdout.split()[-1])

    assert released_mb(0) < 4
    assert released_mb(131072) > 12


def test_mmap_threshold_config(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy sets the threshold when built (only when asked); out of range is refused."""
    from rl_hf import policy as policy_mod

    calls: list[int] = []
    monkeypatch.setattr(policy_mod, "set_mmap_threshold", calls.append)
    HFPolicy(HFPolicy.Config(model_path=str(model_dir)))
    assert calls == []
    HFPolicy(HFPolicy.Config(model_path=str(model_dir), host_mmap_threshold=131072))
    assert calls == [131072]
    with pytest.raises(ConfigError, match="host_mmap_threshold"):
        HFPolicy.Config(model_path="x", host_mmap_threshold=64 * 2**20)
    with pytest.raises(ConfigError, match="host_mmap_threshold"):
        HFPolicy.Config(model_path="x", host_mmap_threshold=-1)
