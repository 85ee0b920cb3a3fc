"""Shared pieces: bucketing, manifest round trip and validation, path checks, checksums."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rl_core.errors import WeightSyncError
from rl_weightsync.bucketing import iter_buckets
from rl_weightsync.checksum import tensor_checksum, verify_checksum
from rl_weightsync.manifest import Manifest, TensorEntry, safe_join


def test_buckets_respect_budget_and_order() -> None:
    tensors = [
        (f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([3, 3, 10, 1, 1, 0])
    ]
    buckets = list(iter_buckets(tensors, bucket_bytes=24))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    assert list(iter_buckets([], 10)) == []
    with pytest.raises(WeightSyncError, match="bucket_bytes"):
        list(iter_buckets(tensors, 0))


def test_manifest_round_trip_and_validation() -> None:
    m = Manifest(
        version=8,
        base_version=7,
        kind="delta",
        tensors=(
            TensorEntry(
                name="a.weight",
                dtype="bfloat16",
                shape=(4, 2),
                checksum="xxh3_128:00",
                file="d.bin",
                encoding="xor",
                offset=0,
                length=5,
            ),
            TensorEntry(
                name="b",
                dtype="float32",
                shape=(),
                checksum="xxh3_128:11",
                file="d.bin",
                encoding="overwrite",
                offset=5,
                length=3,
            ),
        ),
        names=("a.weight", "b", "c"),
        extra={"compression": "zstd"},
    )
    back = Manifest.from_json(m.to_json(), source="m.json", expect_version=8)
    assert back == m and back.num_tensors == 3
    assert back.tensors[0].nbytes == 16 and back.tensors[1].nbytes == 4
    with pytest.raises(WeightSyncError, match="holds weight version 8, expected 9"):
        Manifest.from_json(m.to_json(), source="m.json", expect_version=9)
    with pytest.raises(WeightSyncError, match="not valid JSON"):
        Manifest.from_json(m.to_json()[:-20], source="m.json")
    with pytest.raises(WeightSyncError, match="m.json: format_version 99 is not supported"):
        Manifest.from_json(
            m.to_json().replace('"format_version": 2', '"format_version": 99'), source="m.json"
        )
    with pytest.raises(WeightSyncError, match="manifest_checksum does not match"):
        Manifest.from_json(m.to_json().replace('"float32"', '"float31"'), source="m.json")


def test_safe_join_refuses_escapes(tmp_path: Path) -> None:
    root = tmp_path / "sync"
    root.mkdir()
    assert (
        safe_join(root, "weight_v000001/model.safetensors", version=1)
        == root.resolve() / "weight_v000001/model.safetensors"
    )
    for bad in ("../x", "/etc/passwd", "a/../../x", ""):
        with pytest.raises(WeightSyncError, match="outside the sync directory"):
            safe_join(root, bad, version=3, tensor="w")
    os.symlink(tmp_path, root / "link")
    with pytest.raises(WeightSyncError, match="resolves to"):
        safe_join(root, "link/x", version=3)


def test_checksum_sees_single_bit_and_dtype_bytes() -> None:
    t = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    digest = tensor_checksum(t)
    assert digest.startswith("xxh3_128:") and len(digest) == len("xxh3_128:") + 32
    verify_checksum(t, digest, name="w", version=1)
    u = t.clone()
    u[0] = -0.0
    with pytest.raises(WeightSyncError, match="tensor 'w' of weight version 4: checksum mismatch"):
        verify_checksum(u, digest, name="w", version=4)
    assert tensor_checksum(torch.tensor(1.0)) != tensor_checksum(torch.empty(0))
