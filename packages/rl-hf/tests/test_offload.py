"""HFPolicy / HFCritic ``offload``/``onload``: what leaves the device, bitwise round trips, and
training that continues identically after any number of cycles. Each test runs on CPU (where the
"device" and the host are the same memory, so the contract is checked by accounting for tensor
storages) and, ``gpu``-marked, on CUDA (where ``torch.cuda.memory_allocated`` is measured)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import dataclasses

from rl_core.algorithms import ValueLoss
from rl_core.offload import OffloadConfig
from rl_core.testing.policy import random_batch, sft_loss
from rl_hf import HFCritic, HFPolicy, TinyModelSpec, build_tiny_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(arch="qwen2"))


def _policy(path: Path, device: str, **offload: bool) -> HFPolicy:
    return HFPolicy(
        HFPolicy.Config(
            model_path=str(path), lr=1e-2, device=device, offload=OffloadConfig(**offload)
        )
    )


def _batch(policy: HFPolicy, seed: int):
    return random_batch(policy.model_shape.vocab_size, [7, 5, 9], seed=seed)


def _state(policy: HFPolicy) -> dict[str, torch.Tensor]:
    """A CPU copy of every tracked tensor (weights, grads, optimizer state) by name."""
    return {
        f"{kind}:{name}": t.detach().to("cpu", copy=True)
        for kind, name, t in policy.tracked_tensors()
        if t is not None
    }


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(
            a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)
        ), name


@pytest.mark.parametrize("device", DEVICES)
def test_offload_frees_every_storage_and_onload_is_bitwise(model_dir: Path, device: str) -> None:
    """After ``offload`` no tracked storage holds memory outside the offloader's host copies,
    the original device storages are resized to 0 (same storage objects come back in
    ``onload``), and every weight and AdamW moment returns bit for bit."""
    policy = _policy(model_dir, device)
    policy.train_step(_batch(policy, 0), sft_loss)  # AdamW state exists from here on
    assert any(kind == "optimizer" for kind, _, _ in policy.tracked_tensors())
    for _ in range(2):  # the 1st cycle replaces memory-mapped CPU storages by resizable ones
        before = _state(policy)
        originals = {
            (kind, name): t.untyped_storage()
            for kind, name, t in policy.tracked_tensors()
            if t is not None
        }
        policy.offload()
        assert policy.is_offloaded
        assert policy.resident_storages() == []
        moved = policy.offloader.moved_bytes
        assert moved["weights"] > 0 and moved["optimizer"] >= 2 * moved["weights"] - 1024
        freed = [s for s in originals.values() if s.resizable()]
        policy.onload()
        assert not policy.is_offloaded
        _assert_bitwise(before, _state(policy))
        assert all(t.device.type == device for _, _, t in policy.tracked_tensors() if t is not None)
    # Second cycle: every storage was resizable, so each was freed in place and restored.
    assert freed and len(freed) == len(originals)
    policy.offload()
    assert all(s.nbytes() == 0 for s in freed)
    policy.onload()
    assert all(s.nbytes() > 0 for s in freed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kept", ["weights", "optimizer"])
def test_offload_config_keeps_the_kinds_switched_off(
    model_dir: Path, device: str, kept: str
) -> None:
    """A kind switched off stays on the device, whole, and is the only thing resident."""
    policy = _policy(model_dir, device, **{kept: False})
    policy.train_step(_batch(policy, 1), sft_loss)
    expected = sum(
        s.nbytes for s in policy.resident_storages() if s.kind == kept
    )  # measured before offload: every storage of that kind
    policy.offload()
    resident = policy.resident_storages()
    assert {s.kind for s in resident} == {kept}
    assert sum(s.nbytes for s in resident) == expected > 0
    assert kept not in policy.offloader.moved_bytes
    policy.onload()


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_memory_drops_to_the_bound(model_dir: Path, device: str) -> None:
    """On CUDA, ``memory_allocated`` after ``offload`` drops by the bytes moved (to what stayed:
    nothing tracked), and comes back after ``onload``. On CPU the same is checked through the
    storages' sizes."""
    if device == "cuda":  # what other tests left, and cuBLAS's workspace (a first matmul)
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
    policy = _policy(model_dir, device)
    policy.train_step(_batch(policy, 2), sft_loss)
    if device == "cuda":
        torch.cuda.synchronize()
        on_device = torch.cuda.memory_allocated()
        policy.offload()
        after = torch.cuda.memory_allocated()
        moved = sum(policy.offloader.moved_bytes.values())
        assert on_device - after >= moved  # every moved byte was freed
        # nothing of the policy's state is left on the GPU (slack: 4 KiB of small blocks)
        assert after - baseline <= 4096, (after, baseline)
        assert after <= baseline  # cuBLAS's workspaces are dropped too
        policy.onload()  # every moved byte is back (cuBLAS re-creates its workspace lazily)
        assert torch.cuda.memory_allocated() - after >= moved
    else:
        tracked = sum(s.nbytes for s in policy.resident_storages())
        policy.offload()
        assert sum(policy.offloader.moved_bytes.values()) == tracked
        assert policy.offloader.host_bytes == tracked
        policy.onload()
        assert sum(s.nbytes for s in policy.resident_storages()) == tracked


@pytest.mark.parametrize("device", DEVICES)
@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cycles=st.lists(st.integers(0, 3), min_size=3, max_size=3))
def test_training_continues_identically_after_offload_cycles(
    model_dir: Path, device: str, cycles: list[int]
) -> None:
    """Steps interleaved with any number of offload/onload cycles (a repeated ``offload`` is a
    no-op) give bitwise the losses, weights and optimizer state of a run without any."""
    plain, cycled = _policy(model_dir, device), _policy(model_dir, device)
    for step, n in enumerate(cycles):
        batch = _batch(plain, 10 + step)
        m_plain = plain.train_step(batch, sft_loss)
        m_cycled = cycled.train_step(batch, sft_loss)
        assert m_plain["loss"] == m_cycled["loss"] and m_plain["grad_norm"] == m_cycled["grad_norm"]
        for _ in range(n):
            cycled.offload()
            cycled.offload()
            cycled.onload()
        cycled.onload()
    _assert_bitwise(_state(plain), _state(cycled))
    probe = _batch(plain, 99)
    assert torch.equal(
        plain.compute_logprobs(probe).logprobs, cycled.compute_logprobs(probe).logprobs
    )


@pytest.mark.parametrize("device", DEVICES)
def test_critic_offload_moves_the_value_head(model_dir: Path, device: str) -> None:
    """The critic's value head (outside the HF model) and its optimizer state move too."""
    critic = HFCritic(HFCritic.Config(model_path=str(model_dir), lr=1e-2, device=device))
    batch = _batch(critic, 3)
    n = batch.tokens.shape[0]
    targets = dataclasses.replace(batch, returns=batch.loss_mask, old_values=torch.zeros(n))
    critic.train_step(targets, ValueLoss(ValueLoss.Config(clip=None)))
    before = _state(critic)
    assert any(name.startswith("extra.") for name in (k.split(":", 1)[1] for k in before))
    critic.offload()
    assert critic.resident_storages() == []
    head = critic.value_head.weight.untyped_storage()  # freed in place or moved to the host
    hosts = {b.untyped_storage().data_ptr() for b in critic.offloader._host.values()}
    assert head.nbytes() == 0 or head.data_ptr() in hosts
    critic.onload()
    _assert_bitwise(before, _state(critic))
    assert critic.value_head.weight.device.type == device
