"""DiskFullTransport: conformance, layout, atomicity, pruning and failure cases."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_core.errors import WeightSyncError
from rl_core.testing.weight_transport import (
    DictTarget,
    WeightTransportConformance,
    assert_bitwise_equal,
    next_weights,
    sample_weights,
)
from rl_core.types import WeightUpdate
from rl_weightsync.disk_full import DiskFullTransport, DiskWeightTarget


def flip_bit(path: Path, tensor: str) -> None:
    """Flip the lowest bit of the first byte of ``tensor`` in a safetensors file."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    start = 8 + n + header[tensor]["data_offsets"][0]
    raw[start] ^= 1
    path.write_bytes(bytes(raw))


class TestDiskFullConformance(WeightTransportConformance):
    supports_corruption_injection = True

    @pytest.fixture
    def transport(self, tmp_path: Path) -> DiskFullTransport:
        return DiskFullTransport(
            DiskFullTransport.Config(directory=tmp_path / "sync", keep_versions=3)
        )

    @pytest.fixture
    def receiver(self, transport: DiskFullTransport) -> DiskFullTransport:
        return DiskFullTransport(DiskFullTransport.Config(directory=transport.directory))

    def corrupt(self, transport: DiskFullTransport, update: WeightUpdate) -> str:
        name = "model.layers.0.self_attn.q_proj.weight"
        flip_bit(Path(update.location) / "model.safetensors", name)
        return name


@pytest.fixture
def assets(tmp_path: Path) -> Path:
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"not copied")
    return d


def test_layout_is_a_hf_checkpoint(tmp_path: Path, assets: Path) -> None:
    t = DiskFullTransport(DiskFullTransport.Config(directory=tmp_path / "sync", assets_dir=assets))
    weights = sample_weights()
    update = t.publish(3, weights.items())
    vdir = Path(update.location)
    assert vdir.name == "weight_v000003"
    assert sorted(p.name for p in vdir.iterdir()) == [
        "COMPLETE",
        "config.json",
        "manifest.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert_bitwise_equal(load_file(str(vdir / "model.safetensors")), weights)
    assert not [p for p in (tmp_path / "sync").iterdir() if p.name.startswith(".tmp")]


def test_sharded_with_index(tmp_path: Path) -> None:
    t = DiskFullTransport(
        DiskFullTransport.Config(directory=tmp_path / "sync", max_shard_bytes=300)
    )
    weights = sample_weights()
    update = t.publish(1, weights.items())
    vdir = Path(update.location)
    index = json.loads((vdir / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    assert sorted(index["weight_map"]) == sorted(weights)
    target = DictTarget()
    t.apply(update, target)
    assert_bitwise_equal(target.tensors, weights)


def test_keeps_last_k_and_serve_dtype(tmp_path: Path) -> None:
    t = DiskFullTransport(
        DiskFullTransport.Config(
            directory=tmp_path / "sync", keep_versions=2, serve_dtype="bfloat16"
        )
    )
    w = sample_weights()
    for v in (1, 2, 3):
        w = next_weights(w, v)
        update = t.publish(v, w.items())
    assert t.versions == [2, 3]
    target = DictTarget()
    t.apply(update, target)
    assert {x.dtype for x in target.tensors.values()} == {torch.bfloat16}
    assert torch.equal(target.tensors["lm_head.weight"], w["lm_head.weight"].to(torch.bfloat16))


def test_incomplete_version_is_invisible(tmp_path: Path) -> None:
    t = DiskFullTransport(DiskFullTransport.Config(directory=tmp_path / "sync"))
    update = t.publish(1, sample_weights().items())
    (Path(update.location) / "COMPLETE").unlink()
    with pytest.raises(WeightSyncError, match="no complete checkpoint"):
        t.apply(update, DictTarget())


@pytest.mark.parametrize("damage", ["truncate", "missing", "bitflip"])
def test_damaged_file_refused_target_intact(tmp_path: Path, damage: str) -> None:
    t = DiskFullTransport(DiskFullTransport.Config(directory=tmp_path / "sync", keep_versions=3))
    w1 = sample_weights()
    target = DictTarget()
    t.apply(t.publish(1, w1.items()), target)
    update = t.publish(2, next_weights(w1, 2).items())
    f = Path(update.location) / "model.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:-9])
    elif damage == "missing":
        f.unlink()
    else:
        flip_bit(f, "lm_head.weight")
    with pytest.raises(WeightSyncError, match=r"tensor '[^']+' of weight version 2") as info:
        t.apply(update, target)
    if damage == "bitflip":
        assert "lm_head.weight" in str(info.value)
    assert target.weight_version == 1 and target.load_calls == 1
    assert_bitwise_equal(target.tensors, w1)


def test_manifest_path_outside_sync_dir_refused(tmp_path: Path, edit_manifest) -> None:
    t = DiskFullTransport(DiskFullTransport.Config(directory=tmp_path / "sync"))
    update = t.publish(1, sample_weights().items())
    (tmp_path / "evil.safetensors").write_bytes(b"")
    (Path(update.location) / "model.safetensors").rename(tmp_path / "model.safetensors")

    def escape(m: dict) -> None:
        for e in m["tensors"]:
            e["file"] = "../../evil.safetensors"

    edit_manifest(Path(update.location), escape)
    with pytest.raises(WeightSyncError, match="outside the sync directory"):
        t.apply(update, DictTarget())


class _DiskTarget:
    def __init__(self) -> None:
        self._version = 0
        self.paths: list[str] = []

    @property
    def weight_version(self) -> int:
        return self._version

    def load_weights_from_disk(self, path: str, *, version: int) -> None:
        self.paths.append(path)
        self._version = version


def test_disk_target_gets_verified_directory(tmp_path: Path) -> None:
    t = DiskFullTransport(DiskFullTransport.Config(directory=tmp_path / "sync", keep_versions=3))
    target = _DiskTarget()
    assert isinstance(target, DiskWeightTarget)
    u1 = t.publish(1, sample_weights().items())
    t.apply(u1, target)
    assert target.paths == [u1.location] and target.weight_version == 1
    u2 = t.publish(2, sample_weights(2).items())
    flip_bit(Path(u2.location) / "model.safetensors", "lm_head.weight")
    with pytest.raises(WeightSyncError, match=r"lm_head\.weight"):
        t.apply(u2, target)
    assert target.weight_version == 1 and len(target.paths) == 1


def test_sender_restart_continues_versions(tmp_path: Path) -> None:
    cfg = DiskFullTransport.Config(directory=tmp_path / "sync")
    DiskFullTransport(cfg).publish(4, sample_weights().items())
    with pytest.raises(WeightSyncError, match="version 4 already exists"):
        DiskFullTransport(cfg).publish(4, sample_weights().items())
