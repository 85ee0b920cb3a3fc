"""Adapter-only updates on every transport: peft-named LoRA tensors, the marker of
``rl_core.lora.with_adapter`` kept from publish to receive, deltas between adapter versions, and
the refusals of updates that mix adapters and full weights (:class:`MixedUpdateError`)."""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from rl_core.lora import LoRAConfig, adapter_of, peft_name, with_adapter
from rl_core.testing.weight_transport import DictTarget
from rl_core.types import WeightUpdate
from rl_weightsync import (
    BroadcastTransport,
    DiskDeltaTransport,
    DiskFullTransport,
    InProcessTransport,
)
from rl_weightsync.adapter import ADAPTER, WEIGHTS, MixedUpdateError, payload_kind

LORA = LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"), name="task")
MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj")


def adapter(seed: int) -> dict[str, torch.Tensor]:
    """A rank-2 adapter on two 8x8 projections, peft names."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in MODULES:
        out[peft_name(m, "A")] = torch.randn(2, 8, generator=g)
        out[peft_name(m, "B")] = torch.randn(8, 2, generator=g)
    return out


def full_weights(seed: int) -> dict[str, torch.Tensor]:
    """The two projections' full weights."""
    g = torch.Generator().manual_seed(seed)
    return {f"{m}.weight": torch.randn(8, 8, generator=g) for m in MODULES}


def marker() -> dict:
    """The metadata of an adapter-only update of :data:`LORA`."""
    return dict(
        with_adapter(
            WeightUpdate(version=0, base_version=None, transport=""), LORA, "tiny"
        ).metadata
    )


def unmarked(update: WeightUpdate) -> WeightUpdate:
    """``update`` with the adapter marker dropped (a sender that forgot it)."""
    meta = {k: v for k, v in update.metadata.items() if k != "lora_adapter"}
    return dataclasses.replace(update, metadata=meta)


Pair = tuple[object, object]


def _inprocess(tmp_path: Path) -> Pair:
    t = InProcessTransport()
    return t, t


def _disk_full(tmp_path: Path) -> Pair:
    cfg = DiskFullTransport.Config(directory=tmp_path / "sync")
    return DiskFullTransport(cfg), DiskFullTransport(cfg)


def _disk_delta(tmp_path: Path) -> Pair:
    sync = tmp_path / "sync"
    return (
        DiskDeltaTransport(DiskDeltaTransport.Config(directory=sync)),
        DiskDeltaTransport(DiskDeltaTransport.Config(directory=sync, local_dir=tmp_path / "local")),
    )


PAIRS: dict[str, Callable[[Path], Pair]] = {
    "inprocess": _inprocess,
    "disk_full": _disk_full,
    "disk_delta": _disk_delta,
}


@pytest.fixture(params=sorted(PAIRS))
def pair(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pair]:
    sender, receiver = PAIRS[request.param](tmp_path)
    yield sender, receiver
    sender.close()  # type: ignore[attr-defined]
    receiver.close()  # type: ignore[attr-defined]


def test_payload_kind_from_names() -> None:
    assert payload_kind(list(adapter(0)), version=1) == ADAPTER
    assert payload_kind(list(full_weights(0)), version=1) == WEIGHTS
    with pytest.raises(MixedUpdateError, match="2 model tensors"):
        payload_kind([*adapter(0), *full_weights(0)], version=1)


def test_adapter_versions_round_trip(pair: Pair) -> None:
    """v1 published with the marker, v2 marked after publish: both arrive whole and marked; the
    target holds exactly the adapter tensors of v2."""
    sender, receiver = pair
    a1, a2 = adapter(1), adapter(1)
    a2[peft_name(MODULES[0], "B")] = a2[peft_name(MODULES[0], "B")] + 0.5  # one tensor moves
    target = DictTarget()
    u1 = sender.publish(1, a1.items(), metadata=marker())  # type: ignore[attr-defined]
    assert adapter_of(u1) is not None and adapter_of(u1).lora.rank == 2  # type: ignore[union-attr]
    assert u1.metadata["payload"] == ADAPTER
    receiver.apply(u1, target)  # type: ignore[attr-defined]
    u2 = with_adapter(sender.publish(2, a2.items()), LORA, "tiny")  # type: ignore[attr-defined]
    receiver.apply(u2, target)  # type: ignore[attr-defined]
    assert target.weight_version == 2 and set(target.tensors) == set(a2)
    for n, t in a2.items():
        torch.testing.assert_close(target.tensors[n], t, rtol=0, atol=0)
    assert adapter_of(u2).name == "task"  # type: ignore[union-attr]


def test_unmarked_adapter_and_marked_weights_refused(pair: Pair) -> None:
    sender, receiver = pair
    with pytest.raises(MixedUpdateError, match="model weights"):
        sender.publish(1, full_weights(0).items(), metadata=marker())  # type: ignore[attr-defined]
    target = DictTarget()
    u1 = sender.publish(2, adapter(1).items(), metadata=marker())  # type: ignore[attr-defined]
    with pytest.raises(MixedUpdateError, match="not marked as adapter-only"):
        receiver.apply(unmarked(u1), target)  # type: ignore[attr-defined]
    assert target.weight_version == 0 and not target.tensors
    u2 = with_adapter(sender.publish(3, full_weights(0).items()), LORA)  # type: ignore[attr-defined]
    with pytest.raises(MixedUpdateError, match="holds full model weights"):
        receiver.apply(u2, target)  # type: ignore[attr-defined]
    assert target.weight_version == 0


def test_disk_delta_between_adapter_versions(tmp_path: Path) -> None:
    """The second adapter version is a delta on the first (only the moved tensor is written);
    the target still receives the whole adapter."""
    sender, receiver = _disk_delta(tmp_path)
    a1 = adapter(1)
    a2 = dict(a1)
    a2[peft_name(MODULES[1], "A")] = a1[peft_name(MODULES[1], "A")] * 1.01
    target = DictTarget()
    receiver.apply(sender.publish(1, a1.items(), metadata=marker()), target)
    u2 = sender.publish(2, a2.items(), metadata=marker())
    assert u2.base_version == 1 and u2.metadata["kind"] == "delta"
    assert u2.metadata["changed_tensors"] == 1
    seen: list[list[str]] = []
    orig = target.load_weights

    def spy(named, *, version):  # type: ignore[no-untyped-def]
        named = list(named)
        seen.append([n for n, _ in named])
        orig(named, version=version)

    target.load_weights = spy  # type: ignore[method-assign]
    receiver.apply(u2, target)
    assert sorted(seen[0]) == sorted(a2)
    torch.testing.assert_close(
        target.tensors[peft_name(MODULES[1], "A")], a2[peft_name(MODULES[1], "A")]
    )


def test_disk_delta_refuses_adapter_delta_on_full_weights(tmp_path: Path, edit_manifest) -> None:
    """A (forged) adapter delta whose base version holds full weights, and the reverse."""
    sync, local = tmp_path / "sync", tmp_path / "local"
    sender = DiskDeltaTransport(DiskDeltaTransport.Config(directory=sync))
    sender.publish(1, adapter(1).items(), metadata=marker())
    u2 = sender.publish(2, adapter(2).items(), metadata=marker())
    assert u2.metadata["kind"] == "delta"
    w_sync = tmp_path / "weights"
    w_sender = DiskDeltaTransport(DiskDeltaTransport.Config(directory=w_sync))
    w_receiver = DiskDeltaTransport(DiskDeltaTransport.Config(directory=w_sync, local_dir=local))
    target = DictTarget()
    w_receiver.apply(w_sender.publish(1, full_weights(0).items()), target)  # local: weights v1
    receiver = DiskDeltaTransport(DiskDeltaTransport.Config(directory=sync, local_dir=local))
    with pytest.raises(MixedUpdateError, match="adapter-only delta on version 1, which holds full"):
        receiver.apply(u2, target)
    assert target.weight_version == 1
    # the reverse: a full-weights delta on a local checkpoint holding an adapter
    local2 = tmp_path / "local2"
    a_sync = tmp_path / "adapter3"
    a_sender = DiskDeltaTransport(DiskDeltaTransport.Config(directory=a_sync))
    a_receiver = DiskDeltaTransport(DiskDeltaTransport.Config(directory=a_sync, local_dir=local2))
    a_target = DictTarget()
    a_receiver.apply(a_sender.publish(3, adapter(3).items(), metadata=marker()), a_target)
    w3 = w_sender.publish(3, full_weights(1).items())
    assert w3.metadata["kind"] == "delta"
    edit_manifest(Path(w3.location), lambda m: m.update(base_version=3, version=4))
    (Path(w3.location)).rename(w_sync / "weight_v000004")
    w4 = dataclasses.replace(w3, version=4, base_version=3, location=str(w_sync / "weight_v000004"))
    w_rcv2 = DiskDeltaTransport(DiskDeltaTransport.Config(directory=w_sync, local_dir=local2))
    with pytest.raises(MixedUpdateError, match="full-weights delta on version 3, which holds an"):
        w_rcv2.apply(w4, a_target)
    assert a_target.weight_version == 3


def test_disk_full_adapter_never_loaded_from_disk(tmp_path: Path) -> None:
    """A disk target (engine loading checkpoint directories) gets an adapter's tensors through
    ``load_weights``: the version directory is not a model checkpoint."""

    class Both(DictTarget):
        def load_weights_from_disk(self, path: str, *, version: int) -> None:
            raise AssertionError("an adapter directory was loaded as a model checkpoint")

    sender, receiver = _disk_full(tmp_path)
    target = Both()
    receiver.apply(sender.publish(1, adapter(1).items(), metadata=marker()), target)
    assert set(target.tensors) == set(adapter(1))


def test_broadcast_adapter_and_refusal() -> None:
    """Broadcast: the marker is posted in the header; an unmarked adapter update is refused
    by the receiver before any bucket moves."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sender, receiver = (
        BroadcastTransport(BroadcastTransport.Config(rank=r, world_size=2, port=port, timeout_s=60))
        for r in (0, 1)
    )
    threads = [threading.Thread(target=t.connect) for t in (sender, receiver)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    try:
        target = DictTarget()
        u1 = sender.publish(1, adapter(1).items(), metadata=marker())
        receiver.apply(u1, target)
        assert set(target.tensors) == set(adapter(1)) and target.weight_version == 1
        u2 = sender.publish(2, adapter(2).items())
        with pytest.raises(MixedUpdateError, match="not marked"):
            receiver.apply(u2, target)
        u3 = with_adapter(sender.publish(3, adapter(3).items()), LORA)
        receiver.apply(u3, target)
        torch.testing.assert_close(
            target.tensors[peft_name(MODULES[0], "A")], adapter(3)[peft_name(MODULES[0], "A")]
        )
    finally:
        sender.close()
        receiver.close()


def test_marker_differing_from_the_published_one_refused(pair: Pair) -> None:
    sender, receiver = pair
    u = sender.publish(1, adapter(1).items(), metadata=marker())  # type: ignore[attr-defined]
    other = with_adapter(u, dataclasses.replace(LORA, alpha=99.0))
    target = DictTarget()
    with pytest.raises(MixedUpdateError, match="differs from the one published"):
        receiver.apply(other, target)  # type: ignore[attr-defined]
    receiver.apply(u, target)  # type: ignore[attr-defined]
    assert target.weight_version == 1
