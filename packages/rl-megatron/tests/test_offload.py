"""MegatronPolicy ``offload``/``onload`` in a world of one: every storage of the weights, DDP's
gradient buffer and the optimizer state (under the distributed optimizer too) leaves the device and
comes back bitwise, and training continues identically after offload cycles. fp32 on CPU; bf16
(fp32 master weights in the optimizer) ``gpu``-marked, with ``torch.cuda.memory_allocated``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from rl_core.testing.policy import random_batch, sft_loss
from rl_megatron import MegatronPolicy

VARIANTS = [
    pytest.param("float32", False, id="fp32"),
    pytest.param("float32", True, id="fp32-distopt"),
    pytest.param("bfloat16", False, id="bf16", marks=pytest.mark.gpu),
    pytest.param("bfloat16", True, id="bf16-distopt", marks=pytest.mark.gpu),
]


def _policy(path: Path, dtype: str, distopt: bool) -> MegatronPolicy:
    return MegatronPolicy(
        MegatronPolicy.Config(
            model_path=str(path), lr=1e-2, dtype=dtype, use_distributed_optimizer=distopt
        )  # type: ignore[arg-type]
    )


def _state(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    return {
        f"{kind}:{name}": t.detach().to("cpu", copy=True).reshape(-1).view(torch.uint8)
        for kind, name, t in policy.tracked_tensors()
        if t is not None
    }


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _batch(policy: MegatronPolicy, seed: int):
    return random_batch(policy.model_shape.vocab_size, [7, 5, 9], seed=seed)


@pytest.mark.parametrize(("dtype", "distopt"), VARIANTS)
def test_offload_round_trip_and_training_continues(
    model_dirs: dict[str, Path], dtype: str, distopt: bool
) -> None:
    """Offload leaves none of the tracked storages resident (on CUDA: ``memory_allocated``
    drops by at least the bytes moved), onload restores every byte (master weights and Adam
    moments included), and steps after two cycles match, bitwise, a policy that never
    offloaded."""
    path = model_dirs["qwen2"]
    plain, cycled = _policy(path, dtype, distopt), _policy(path, dtype, distopt)
    kinds = set()
    for step in range(3):
        batch = _batch(plain, step)
        m_plain = plain.train_step(batch, sft_loss)
        m_cycled = cycled.train_step(batch, sft_loss)
        assert m_plain["loss"] == m_cycled["loss"], step
        for _ in range(step):
            before = _state(cycled)
            cuda = torch.cuda.is_available()
            allocated = torch.cuda.memory_allocated() if cuda else 0
            cycled.offload()
            cycled.offload()  # a no-op
            assert cycled.resident_storages() == []
            moved = cycled.offloader.moved_bytes
            kinds |= set(moved)
            if cuda:
                assert allocated - torch.cuda.memory_allocated() >= sum(moved.values())
            cycled.onload()
            _assert_bitwise(before, _state(cycled))
    assert kinds == {"weights", "grads", "optimizer"}
    _assert_bitwise(_state(plain), _state(cycled))
    probe = _batch(plain, 99)
    assert torch.equal(
        plain.compute_logprobs(probe).logprobs, cycled.compute_logprobs(probe).logprobs
    )


@pytest.mark.parametrize(("dtype", "distopt"), VARIANTS[:2])
def test_offload_grads_off_keeps_the_gradient_buffer(
    model_dirs: dict[str, Path], dtype: str, distopt: bool
) -> None:
    """``offload.grads = false`` keeps DDP's gradient buffer (and only it) resident."""
    policy = _policy(model_dirs["qwen2"], dtype, distopt)
    policy.config.offload.grads = False
    policy.train_step(_batch(policy, 0), sft_loss)
    grad_bytes = sum(b.grad_data.untyped_storage().nbytes() for b in policy.model.buffers)
    policy.offload()
    resident = policy.resident_storages()
    assert {s.kind for s in resident} == {"grads"}
    assert sum(s.nbytes for s in resident) == grad_bytes > 0
    policy.onload()
