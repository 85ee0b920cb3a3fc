"""Fuzz the disk transports' receivers with damaged manifests and payloads.

A receiver on version 1 is given version 2 after random damage: manifest entries deleted,
duplicated, reordered or edited (dtype, shape, name, offsets, counts), re-signed as a buggy sender
would or not; manifest or payload bytes flipped, truncated, appended or the file deleted. Whatever
happens, ``apply`` either raises WeightSyncError and leaves the target (tensors, version, load
count) and the local checkpoint exactly as they were, or it loads exactly the published v2.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_core.errors import WeightSyncError
from rl_core.testing.weight_transport import (
    DictTarget,
    assert_bitwise_equal,
    sample_weights,
)
from rl_core.types import WeightUpdate
from rl_weightsync.disk_delta import DiskDeltaTransport
from rl_weightsync.disk_full import DiskFullTransport
from rl_weightsync.manifest import sign

W1 = sample_weights()
W2 = sample_weights(seed=7)  # every non-empty tensor differs from W1: a stale one shows
V2 = "weight_v000002"


@cache
def _published(kind: str) -> Path:
    """A sync dir with v1 and v2 and (delta) a local checkpoint on v1, built once per kind."""
    root = Path(tempfile.mkdtemp(prefix=f"rlws-fuzz-{kind}-"))
    if kind == "full":
        sender: Any = DiskFullTransport(DiskFullTransport.Config(directory=root / "sync"))
        receiver: Any = DiskFullTransport(DiskFullTransport.Config(directory=root / "sync"))
    else:
        sender = DiskDeltaTransport(DiskDeltaTransport.Config(directory=root / "sync"))
        receiver = DiskDeltaTransport(
            DiskDeltaTransport.Config(directory=root / "sync", local_dir=root / "local")
        )
    receiver.apply(sender.publish(1, W1.items()), DictTarget())
    sender.publish(2, W2.items())
    return root


def _receiver(kind: str, root: Path) -> Any:
    if kind == "full":
        return DiskFullTransport(DiskFullTransport.Config(directory=root / "sync"))
    return DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=root / "sync", local_dir=root / "local")
    )


# -- mutations ----------------------------------------------------------------------------------

_DTYPES = ["float32", "bfloat16", "float16", "int8", "uint8", "float64", "bool", "float31"]


@st.composite
def manifest_edit(draw: st.DrawFn) -> tuple[str, ...]:
    """One structural edit of the parsed manifest, as a tuple of plain values."""
    op = draw(
        st.sampled_from(
            [
                "delete",
                "remove_tensor",
                "remove_tensor",
                "remove_tensor",
                "add_tensor",
                "duplicate",
                "swap",
                "dtype",
                "shape",
                "rename",
                "offset",
                "length",
                "checksum",
                "encoding",
                "drop_name",
                "add_name",
                "num_tensors",
                "num_entries",
                "kind",
                "base_version",
                "version",
            ]
        )
    )
    i = draw(st.integers(0, 50))
    j = draw(st.integers(0, 50))
    text = draw(st.sampled_from([*_DTYPES, "model.scalar", "x", "", "lm_head.weight"]))
    n = draw(st.integers(-2, 70))
    return (op, str(i), str(j), text, str(n))


def _apply_edit(m: dict[str, Any], edit: tuple[str, ...]) -> None:
    op, i_s, j_s, text, n_s = edit
    rows, i, j, n = m["tensors"], int(i_s), int(j_s), int(n_s)
    row = rows[i % len(rows)] if rows else None
    if op == "delete" and rows:
        rows.pop(i % len(rows))
    elif op == "remove_tensor" and row:  # entry and name: consistent apart from the payload
        rows.remove(row)
        if row["name"] in m["names"]:  # an earlier drop_name may have taken it
            m["names"].remove(row["name"])
    elif op == "add_tensor" and row:
        name = f"{row['name']}.{text}"
        if name not in m["names"]:
            rows.insert(j % (len(rows) + 1), dict(row, name=name))
            m["names"] = sorted([*m["names"], name])
    elif op == "duplicate" and row:
        rows.insert(j % (len(rows) + 1), dict(row))
    elif op == "swap" and rows:
        a, b = i % len(rows), j % len(rows)
        rows[a], rows[b] = rows[b], rows[a]
    elif op == "dtype" and row:
        row["dtype"] = text if text in _DTYPES else "float16"
    elif op == "shape" and row:
        shape = row["shape"]
        row["shape"] = [*shape, 1] if n % 3 == 0 else (shape[:-1] if shape else [n]) or [n]
        if n % 3 == 1 and shape:
            row["shape"] = [*shape[:-1], max(shape[-1] + (1 if n > 0 else -1), 0)]
    elif op == "rename" and row:
        row["name"] = text
    elif op in ("offset", "length") and row:
        row[op] = max(row[op] + n - 35, 0)
    elif op == "checksum" and row:
        row["checksum"] = row["checksum"][:-1] + ("0" if row["checksum"][-1] != "0" else "1")
    elif op == "encoding" and row:
        row["encoding"] = ["full", "xor", "overwrite", "zip"][n % 4]
    elif op == "drop_name" and m["names"]:
        m["names"].pop(i % len(m["names"]))
    elif op == "add_name":
        m["names"].append(text or "model.new")
    elif op in ("num_tensors", "num_entries", "version"):
        m[op] = n
    elif op == "kind":
        m["kind"] = "full" if m["kind"] == "delta" else "delta"
    elif op == "base_version":
        m["base_version"] = None if n % 2 else n % 3


def _write_manifest(vdir: Path, edits: list[tuple[str, ...]], resign: bool, fix: bool) -> None:
    path = vdir / "manifest.json"
    m = json.loads(path.read_text())
    m.pop("manifest_checksum")
    for edit in edits:
        _apply_edit(m, edit)
    if fix:  # a careful buggy sender also fixes the counts
        m["num_tensors"], m["num_entries"] = len(m["names"]), len(m["tensors"])
    m["manifest_checksum"] = sign(m) if resign else "xxh3_128:" + "0" * 32
    path.write_text(json.dumps(m))


def _damage_bytes(path: Path, how: str, pos: int, byte: int) -> None:
    if not path.exists():
        return
    raw = bytearray(path.read_bytes())
    if how == "delete":
        path.unlink()
        return
    if how == "append":
        raw += bytes([byte]) * (pos % 7 + 1)
    elif raw and how == "flip":
        raw[pos % len(raw)] ^= byte or 1
    elif how == "truncate":
        raw = raw[: pos % (len(raw) + 1)]
    path.write_bytes(bytes(raw))


byte_damage = st.tuples(
    st.sampled_from(["manifest.json", "payload"]),
    st.sampled_from(["flip", "truncate", "append", "delete"]),
    st.integers(0, 1 << 20),
    st.integers(0, 255),
)


# -- the property -------------------------------------------------------------------------------


def _check(kind: str, damage: Any) -> None:
    src = _published(kind)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copytree(src / "sync", root / "sync")
        if (src / "local").exists():
            shutil.copytree(src / "local", root / "local")
        vdir = root / "sync" / V2
        damage(vdir)
        local = root / "local" / "model.safetensors"
        local_before = local.read_bytes() if local.exists() else None
        target = DictTarget(W1, version=1)
        update = WeightUpdate(version=2, base_version=None, transport=_receiver(kind, root).name)
        try:
            _receiver(kind, root).apply(update, target)
        except WeightSyncError:
            assert target.weight_version == 1 and target.load_calls == 0
            assert_bitwise_equal(target.tensors, W1)
            assert (local.read_bytes() if local.exists() else None) == local_before
            return
        assert target.weight_version == 2
        assert_bitwise_equal(target.tensors, W2)


# Derandomized so a fresh-clone CI run is reproducible (a random draw once found a bug in the
# edit helper above, not in the library); RL_FUZZ_RANDOM=1 explores new examples.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
    derandomize=os.environ.get("RL_FUZZ_RANDOM") != "1",
)


@pytest.mark.parametrize("kind", ["full", "delta"])
@FUZZ
@given(
    edits=st.lists(manifest_edit(), min_size=1, max_size=3),
    resign=st.booleans(),
    fix=st.booleans(),
)
def test_fuzz_manifest_edits(kind: str, edits: list[tuple[str, ...]], resign: bool, fix: bool):
    _check(kind, lambda vdir: _write_manifest(vdir, edits, resign, fix))


@pytest.mark.parametrize("kind", ["full", "delta"])
@FUZZ
@given(damages=st.lists(byte_damage, min_size=1, max_size=3))
def test_fuzz_bytes(kind: str, damages: list[tuple[str, str, int, int]]) -> None:
    payload = "model.safetensors" if kind == "full" else "delta.bin"

    def damage(vdir: Path) -> None:
        for which, how, pos, byte in damages:
            _damage_bytes(vdir / (payload if which == "payload" else which), how, pos, byte)

    _check(kind, damage)


@pytest.mark.parametrize("kind", ["full", "delta"])
def test_undamaged_copy_applies(kind: str) -> None:
    """The harness itself: with no damage the copied v2 applies bitwise equal."""
    _check(kind, lambda vdir: None)
