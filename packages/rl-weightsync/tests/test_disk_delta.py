"""DiskDeltaTransport: conformance, codecs, chain rules, in-place apply and failure cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rl_core.errors import WeightSyncError
from rl_core.testing.weight_transport import (
    DictTarget,
    WeightTransportConformance,
    assert_bitwise_equal,
    next_weights,
    sample_weights,
)
from rl_core.types import WeightUpdate
from rl_weightsync.checksum import tensor_bytes
from rl_weightsync.disk_delta import DiskDeltaTransport, decode_delta, encode_delta
from rl_weightsync.manifest import Manifest

Q = "model.layers.0.self_attn.q_proj.weight"


def _flip_in_blob(update: WeightUpdate, name: str) -> None:
    vdir = Path(update.location)
    manifest = Manifest.from_json((vdir / "manifest.json").read_text(), source="m")
    (entry,) = [e for e in manifest.tensors if e.name == name]
    raw = bytearray((vdir / entry.file).read_bytes())
    raw[entry.offset + entry.length // 2] ^= 0x10
    (vdir / entry.file).write_bytes(bytes(raw))


def _pair(tmp_path: Path, **kw: object) -> tuple[DiskDeltaTransport, DiskDeltaTransport]:
    sync = tmp_path / "sync"
    sender = DiskDeltaTransport(DiskDeltaTransport.Config(directory=sync, **kw))
    receiver = DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=sync, local_dir=tmp_path / "local", **kw)
    )
    return sender, receiver


class TestDiskDeltaConformance(WeightTransportConformance):
    supports_delta = True
    supports_corruption_injection = True

    @pytest.fixture
    def transport(self, tmp_path: Path) -> DiskDeltaTransport:
        return DiskDeltaTransport(DiskDeltaTransport.Config(directory=tmp_path / "sync"))

    @pytest.fixture
    def receiver(self, transport: DiskDeltaTransport, tmp_path: Path) -> DiskDeltaTransport:
        return DiskDeltaTransport(
            DiskDeltaTransport.Config(directory=transport.directory, local_dir=tmp_path / "local")
        )

    def corrupt(self, transport: DiskDeltaTransport, update: WeightUpdate) -> str:
        assert update.base_version is not None
        _flip_in_blob(update, Q)
        return Q


class TestDiskDeltaOverwriteConformance(TestDiskDeltaConformance):
    @pytest.fixture
    def transport(self, tmp_path: Path) -> DiskDeltaTransport:
        return DiskDeltaTransport(
            DiskDeltaTransport.Config(directory=tmp_path / "sync", encoding="overwrite")
        )

    @pytest.fixture
    def receiver(self, transport: DiskDeltaTransport, tmp_path: Path) -> DiskDeltaTransport:
        return DiskDeltaTransport(
            DiskDeltaTransport.Config(
                directory=transport.directory, local_dir=tmp_path / "local", encoding="overwrite"
            )
        )


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_codec_round_trip(encoding: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    old = (torch.randn(37, generator=g) * 50).to(dtype)
    new = old.clone()
    new[[0, 5, 36]] = (torch.randn(3, generator=g) * 50).to(dtype)
    ob, nb = tensor_bytes(old), tensor_bytes(new)
    blob = encode_delta(ob, nb, itemsize=old.element_size(), encoding=encoding)
    assert blob is not None
    out = decode_delta(ob, blob, itemsize=old.element_size(), encoding=encoding)
    assert out.tobytes() == nb.tobytes()
    assert ob.tobytes() == tensor_bytes(old).tobytes()  # old untouched
    assert encode_delta(ob, ob.copy(), itemsize=old.element_size(), encoding=encoding) is None
    with pytest.raises(ValueError):
        decode_delta(
            ob[: -old.element_size()], blob, itemsize=old.element_size(), encoding=encoding
        )


def test_overwrite_dense_change_falls_back_to_all_values() -> None:
    old = torch.randn(1000)
    new = old + 1e-3
    ob, nb = tensor_bytes(old), tensor_bytes(new)
    blob = encode_delta(ob, nb, itemsize=4, encoding="overwrite")
    assert blob is not None and len(blob) <= 1.05 * nb.size
    assert decode_delta(ob, blob, itemsize=4, encoding="overwrite").tobytes() == nb.tobytes()
    # idempotent: applying to the new bytes again gives the same result
    assert decode_delta(nb, blob, itemsize=4, encoding="overwrite").tobytes() == nb.tobytes()


def test_unchanged_tensors_are_not_written_and_delta_is_small(tmp_path: Path) -> None:
    sender, receiver = _pair(tmp_path)
    w1 = {"a": torch.randn(256, 64), "b": torch.randn(64)}
    w2 = {"a": w1["a"].clone(), "b": w1["b"].clone()}
    w2["a"][3, :5] += 1e-3
    target = DictTarget()
    receiver.apply(sender.publish(1, w1.items()), target)
    u2 = sender.publish(2, w2.items())
    assert u2.base_version == 1 and u2.metadata["changed_tensors"] == 1
    assert u2.metadata["bytes"] < 0.05 * u2.metadata["full_bytes"]
    receiver.apply(u2, target)
    assert_bitwise_equal(target.tensors, w2)
    assert_bitwise_equal(load_file(str(tmp_path / "local" / "model.safetensors")), w2)


def test_seeded_from_base_checkpoint_and_serve_dtype(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    w0 = {"w": torch.randn(8, 8), "n": torch.randn(8)}
    save_file({k: v.to(torch.bfloat16) for k, v in w0.items()}, str(base / "model.safetensors"))
    (base / "config.json").write_text("{}")
    sender, receiver = _pair(tmp_path, base_checkpoint=base, serve_dtype="bfloat16")
    w1 = {k: v + 0.5 for k, v in w0.items()}  # fp32 master weights
    update = sender.publish(1, w1.items())
    assert update.base_version == 0
    target = DictTarget({k: v.to(torch.bfloat16) for k, v in w0.items()}, version=0)
    receiver.apply(update, target)
    assert_bitwise_equal(target.tensors, {k: v.to(torch.bfloat16) for k, v in w1.items()})
    assert (tmp_path / "local" / "config.json").is_file()


def test_full_every_resets_chain_for_late_joiner(tmp_path: Path) -> None:
    sender, _ = _pair(tmp_path, full_every=3, keep_versions=2)
    w = sample_weights()
    kinds = []
    for v in range(1, 6):
        w = next_weights(w, v)
        kinds.append(sender.publish(v, w.items()).metadata["kind"])
    assert kinds == ["full", "delta", "full", "delta", "delta"]
    assert [int(p.name[-6:]) for p in sorted((tmp_path / "sync").glob("weight_v*"))] == [3, 4, 5]
    late = DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=tmp_path / "sync", local_dir=tmp_path / "late")
    )
    target = DictTarget()
    for v in (3, 4, 5):
        late.apply(WeightUpdate(version=v, base_version=None, transport="disk_delta"), target)
    assert_bitwise_equal(target.tensors, w)


def _setup_v2(tmp_path: Path) -> tuple[DiskDeltaTransport, DictTarget, WeightUpdate, dict, bytes]:
    sender, receiver = _pair(tmp_path, keep_versions=5)
    w1 = sample_weights()
    target = DictTarget()
    receiver.apply(sender.publish(1, w1.items()), target)
    u2 = sender.publish(2, next_weights(w1, 2).items())
    local_bytes = (tmp_path / "local" / "model.safetensors").read_bytes()
    return receiver, target, u2, w1, local_bytes


def _assert_intact(tmp_path: Path, target: DictTarget, w1: dict, local_bytes: bytes) -> None:
    assert target.weight_version == 1 and target.load_calls == 1
    assert_bitwise_equal(target.tensors, w1)
    assert (tmp_path / "local" / "model.safetensors").read_bytes() == local_bytes
    assert json.loads((tmp_path / "local" / "rl_weightsync_state.json").read_text())["version"] == 1


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "missing"])
def test_damaged_delta_refused_local_intact(tmp_path: Path, damage: str) -> None:
    receiver, target, u2, w1, local_bytes = _setup_v2(tmp_path)
    f = Path(u2.location) / "delta.bin"
    if damage == "bitflip":
        _flip_in_blob(u2, Q)
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-3])
    else:
        f.unlink()
    with pytest.raises(WeightSyncError, match=r"tensor '[^']+' of weight version 2") as info:
        receiver.apply(u2, target)
    if damage == "bitflip":
        assert Q in str(info.value)
    _assert_intact(tmp_path, target, w1, local_bytes)


def test_wrong_base_refused(tmp_path: Path, edit_manifest) -> None:
    receiver, target, u2, w1, local_bytes = _setup_v2(tmp_path)
    edit_manifest(Path(u2.location), lambda m: m.update(base_version=0))
    with pytest.raises(WeightSyncError, match="version 2 is a delta on version 0"):
        receiver.apply(u2, target)
    _assert_intact(tmp_path, target, w1, local_bytes)


def test_local_checkpoint_on_other_version_refused(tmp_path: Path) -> None:
    receiver, _, u2, w1, _ = _setup_v2(tmp_path)
    (tmp_path / "local" / "rl_weightsync_state.json").write_text('{"version": 0, "writing": null}')
    with pytest.raises(WeightSyncError, match=r"local checkpoint .* is on version 0"):
        receiver.apply(u2, DictTarget(w1, version=1))
    (tmp_path / "local" / "rl_weightsync_state.json").write_text('{"version": 1, "writing": 2}')
    with pytest.raises(WeightSyncError, match="half-written"):
        receiver.apply(u2, DictTarget(w1, version=1))


def test_manifest_path_outside_sync_dir_refused(tmp_path: Path, edit_manifest) -> None:
    receiver, target, u2, w1, local_bytes = _setup_v2(tmp_path)

    def escape(m: dict) -> None:
        for e in m["tensors"]:
            e["file"] = "../../local/model.safetensors"

    edit_manifest(Path(u2.location), escape)
    with pytest.raises(WeightSyncError, match=r"of weight version 2: payload file '\.\./\.\./"):
        receiver.apply(u2, target)
    _assert_intact(tmp_path, target, w1, local_bytes)


def test_target_load_failure_then_retry_rereads_local(tmp_path: Path) -> None:
    receiver, target, u2, _, _ = _setup_v2(tmp_path)

    class Failing(DictTarget):
        def load_weights(self, named_tensors, *, version):  # type: ignore[no-untyped-def]
            raise RuntimeError("engine busy")

    failing = Failing(target.tensors, version=1)
    with pytest.raises(RuntimeError):
        receiver.apply(u2, failing)
    receiver.apply(u2, target)  # local already on 2, target on 1: reread + verify
    expected = next_weights(sample_weights(), 2)
    assert target.weight_version == 2
    assert_bitwise_equal(target.tensors, expected)


class _DiskTarget:
    def __init__(self) -> None:
        self._version = 0
        self.loaded: list[tuple[str, int]] = []

    @classmethod
    def at(cls, version: int) -> _DiskTarget:
        t = cls()
        t._version = version
        return t

    @property
    def weight_version(self) -> int:
        return self._version

    def load_weights_from_disk(self, path: str, *, version: int) -> None:
        self.loaded.append((path, version))
        self._version = version


def test_disk_target_loads_local_checkpoint(tmp_path: Path) -> None:
    sender, receiver = _pair(tmp_path)
    w = sample_weights()
    target = _DiskTarget()
    for v in (1, 2):
        w = next_weights(w, v) if v > 1 else w
        receiver.apply(sender.publish(v, w.items()), target)
    assert target.loaded == [(str(tmp_path / "local"), 1), (str(tmp_path / "local"), 2)]
    assert_bitwise_equal(load_file(str(tmp_path / "local" / "model.safetensors")), w)


def test_colocated_receivers_share_one_local_dir(tmp_path: Path) -> None:
    sender, first = _pair(tmp_path)
    second = DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=tmp_path / "sync", local_dir=tmp_path / "local")
    )
    targets = [DictTarget(), DictTarget()]
    w = sample_weights()
    for v in (1, 2, 3):
        w = next_weights(w, v) if v > 1 else w
        update = sender.publish(v, w.items())
        for receiver, target in zip((first, second), targets):
            receiver.apply(update, target)  # the second finds the local dir already on v
            assert target.weight_version == v
            assert_bitwise_equal(target.tensors, w)
    assert_bitwise_equal(load_file(str(tmp_path / "local" / "model.safetensors")), w)


@pytest.mark.parametrize("change", ["added", "removed"])
def test_name_set_change_is_a_full_version_refused_by_a_holding_receiver(
    tmp_path: Path, change: str
) -> None:
    """A new or vanished tensor makes the sender write a full version; a receiver holding the old
    name set refuses it (the target would keep a stale tensor, or get one it lacks) with its
    weights, version and local checkpoint intact; a fresh receiver takes it."""
    sender, receiver = _pair(tmp_path)
    small, big = {"a": torch.ones(4)}, {"a": torch.ones(4) * 2, "b": torch.arange(3.0)}
    w1, w2 = (small, big) if change == "added" else (big, small)
    target = DictTarget()
    receiver.apply(sender.publish(1, w1.items()), target)
    local_bytes = (tmp_path / "local" / "model.safetensors").read_bytes()
    u2 = sender.publish(2, w2.items())
    assert u2.base_version is None and u2.metadata["kind"] == "full"
    with pytest.raises(WeightSyncError, match=r"weight version 2 refused: its \d tensor names"):
        receiver.apply(u2, target)
    assert target.weight_version == 1 and target.load_calls == 1
    assert_bitwise_equal(target.tensors, w1)
    assert (tmp_path / "local" / "model.safetensors").read_bytes() == local_bytes
    # A target that reports no names cannot be checked against itself: the local checkpoint's
    # names (what this receiver holds) decide.
    with pytest.raises(WeightSyncError, match="of the version this receiver holds"):
        receiver.apply(u2, _DiskTarget.at(1))
    fresh = DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=tmp_path / "sync", local_dir=tmp_path / "fresh")
    )
    new_target = DictTarget()
    fresh.apply(u2, new_target)
    assert_bitwise_equal(new_target.tensors, w2)
    assert_bitwise_equal(load_file(str(tmp_path / "fresh" / "model.safetensors")), w2)


class TestDiskDeltaPlanesConformance(TestDiskDeltaConformance):
    @pytest.fixture
    def transport(self, tmp_path: Path) -> DiskDeltaTransport:
        return DiskDeltaTransport(
            DiskDeltaTransport.Config(directory=tmp_path / "sync", layout="planes")
        )


def _entries(update: WeightUpdate) -> list[dict]:
    return [
        json.loads(line.rstrip(","))
        for line in (Path(update.location) / "manifest.json").read_text().splitlines()[1:-1]
    ]


@pytest.mark.parametrize("layout", ["bytes", "planes"])
def test_layout_recorded_per_entry_and_both_apply(tmp_path: Path, layout: str) -> None:
    """``planes`` is named in each entry; ``bytes`` writes entries exactly as before the field
    existed (no ``layout`` key), and a receiver applies both bitwise."""
    sender, receiver = _pair(tmp_path, layout=layout)
    w1 = {"a": torch.randn(64, 32).to(torch.bfloat16), "b": torch.randn(33)}
    w2 = {k: (v.float() + 1e-2 * torch.randn(v.shape)).to(v.dtype) for k, v in w1.items()}
    target = DictTarget()
    receiver.apply(sender.publish(1, w1.items()), target)
    u2 = sender.publish(2, w2.items())
    rows = _entries(u2)
    assert len(rows) == 2 and all(r["encoding"] == "xor" for r in rows)
    if layout == "bytes":
        assert all("layout" not in r for r in rows)
    else:
        assert all(r["layout"] == "planes" for r in rows)
    receiver.apply(u2, target)
    assert_bitwise_equal(target.tensors, w2)
    assert_bitwise_equal(load_file(str(tmp_path / "local" / "model.safetensors")), w2)


def test_layout_mismatch_or_unknown_layout_refused(tmp_path: Path, edit_manifest) -> None:
    sender, receiver = _pair(tmp_path, keep_versions=5, layout="planes")
    w1 = sample_weights()
    target = DictTarget()
    receiver.apply(sender.publish(1, w1.items()), target)
    u2 = sender.publish(2, next_weights(w1, 2).items())
    local_bytes = (tmp_path / "local" / "model.safetensors").read_bytes()
    assert {r.get("layout") for r in _entries(u2)} == {"planes"}

    def as_bytes(m: dict) -> None:
        m["tensors"][0].pop("layout")

    edit_manifest(Path(u2.location), as_bytes)
    with pytest.raises(WeightSyncError, match="cannot decode its xor payload"):
        receiver.apply(u2, target)
    _assert_intact(tmp_path, target, w1, local_bytes)

    def unknown(m: dict) -> None:
        m["tensors"][0]["layout"] = "columns"

    edit_manifest(Path(u2.location), unknown)
    with pytest.raises(WeightSyncError, match="layout 'columns'.*same version on sender"):
        receiver.apply(u2, target)
    _assert_intact(tmp_path, target, w1, local_bytes)
    with pytest.raises(WeightSyncError, match="Config.layout"):
        DiskDeltaTransport(DiskDeltaTransport.Config(directory=tmp_path, layout="columns"))
