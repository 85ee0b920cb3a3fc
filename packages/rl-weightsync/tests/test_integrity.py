"""Self-verifying manifests and exclusive version creation, for both disk transports.

Each refusal is checked against a real receiver: the target's tensors, version and load count,
and (delta) the local checkpoint's bytes are compared before and after.
"""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.errors import WeightSyncError
from rl_core.testing.weight_transport import (
    DictTarget,
    assert_bitwise_equal,
    next_weights,
    sample_weights,
)
from rl_core.types import WeightUpdate
from rl_weightsync import _fs
from rl_weightsync.disk_delta import DiskDeltaTransport
from rl_weightsync.disk_full import DiskFullTransport
from rl_weightsync.manifest import MANIFEST_FORMAT_VERSION, Manifest

Transport = DiskFullTransport | DiskDeltaTransport
Q = "model.layers.0.self_attn.q_proj.weight"


class Setup:
    """A sender and a receiver on one sync directory; the receiver holds v1, v2 is published."""

    def __init__(self, tmp_path: Path, kind: str) -> None:
        sync = tmp_path / "sync"
        self.local = tmp_path / "local"
        if kind == "full":
            self.sender: Transport = DiskFullTransport(
                DiskFullTransport.Config(directory=sync, keep_versions=4)
            )
            self.receiver: Transport = DiskFullTransport(DiskFullTransport.Config(directory=sync))
        else:
            self.sender = DiskDeltaTransport(DiskDeltaTransport.Config(directory=sync))
            self.receiver = DiskDeltaTransport(
                DiskDeltaTransport.Config(directory=sync, local_dir=self.local)
            )
        self.w1 = sample_weights()
        self.w2 = next_weights(self.w1, 2)
        self.target = DictTarget()
        self.receiver.apply(self.sender.publish(1, self.w1.items()), self.target)
        self.u2 = self.sender.publish(2, self.w2.items())
        self.vdir = Path(self.u2.location)

    def local_bytes(self) -> bytes | None:
        f = self.local / "model.safetensors"
        return f.read_bytes() if f.exists() else None

    def refused(self, match: str, target: Any = None) -> WeightSyncError:
        """Apply v2, expect a refusal matching ``match``, and check nothing changed."""
        target = self.target if target is None else target
        before = {k: v.clone() for k, v in self.target.tensors.items()}
        local = self.local_bytes()
        with pytest.raises(WeightSyncError, match=match) as info:
            self.receiver.apply(self.u2, target)
        assert self.target.weight_version == 1 and self.target.load_calls == 1
        assert_bitwise_equal(self.target.tensors, before)
        assert self.local_bytes() == local
        return info.value

    def accepted(self) -> None:
        """After the damage is undone (or absent), v2 applies bitwise equal."""
        self.receiver.apply(self.u2, self.target)
        assert self.target.weight_version == 2
        assert_bitwise_equal(self.target.tensors, self.w2)


@pytest.fixture(params=["full", "delta"])
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> Setup:
    return Setup(tmp_path, request.param)


def _drop_entry(m: dict[str, Any], *, counts: bool, names: bool) -> None:
    (entry,) = [e for e in m["tensors"] if e["name"] == Q]
    m["tensors"].remove(entry)
    if names:
        m["names"].remove(Q)
    if counts:
        m["num_entries"] -= 1
        m["num_tensors"] = len(m["names"])


# -- manifest classes -----------------------------------------------------------------------------


def test_removed_entry_raw_edit_refused(setup: Setup) -> None:
    """Deleting one tensor's line from the manifest breaks its checksum of itself."""
    path = setup.vdir / "manifest.json"
    lines = path.read_text().splitlines(keepends=True)
    (row,) = [i for i, line in enumerate(lines) if f'"name": "{Q}"' in line]
    del lines[row]
    path.write_text("".join(lines).replace("},\n]", "}\n]"))
    setup.refused("manifest_checksum does not match")


@pytest.mark.parametrize("fix", ["nothing", "counts", "counts_and_names"])
def test_removed_entry_resigned_refused(setup: Setup, edit_manifest, fix: str) -> None:
    """A removed entry re-signed by a buggy sender: the counts, the name set, or the payload
    (the file still holds the tensor / its bytes are left over in delta.bin) refuse it."""
    edit_manifest(
        setup.vdir,
        lambda m: _drop_entry(m, counts=fix != "nothing", names=fix == "counts_and_names"),
    )
    match = {
        "nothing": "counts disagree",
        "counts": "names without an entry" if isinstance(setup.sender, DiskFullTransport) else "",
        "counts_and_names": "tensor names differ|does not list|bytes after the last entry",
    }[fix]
    if fix == "counts" and isinstance(setup.sender, DiskDeltaTransport):
        match = "previous entry ends|bytes after the last entry"  # the gap in delta.bin
    setup.refused(match)


def test_extra_entry_resigned_refused(setup: Setup, edit_manifest) -> None:
    """An entry (and name) the payload does not hold: the name set differs from the held one."""

    def add(m: dict[str, Any]) -> None:
        extra = dict(m["tensors"][0], name="model.ghost.weight")
        m["tensors"].append(extra)
        m["names"] = sorted([*m["names"], "model.ghost.weight"])
        m["num_entries"] += 1
        m["num_tensors"] += 1

    edit_manifest(setup.vdir, add)
    err = setup.refused("model.ghost.weight")
    assert "weight version 2" in str(err)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_edited_manifest_byte_refused(setup: Setup, where: str) -> None:
    """Any edited byte is refused (bad JSON, or a checksum mismatch); restoring it applies."""
    path = setup.vdir / "manifest.json"
    good = path.read_bytes()
    raw = bytearray(good)
    # Edit a digit or letter inside a value so the JSON often stays valid.
    cands = [i for i, b in enumerate(raw) if chr(b) in "0123456789abcdef"]
    i = {"start": cands[0], "middle": cands[len(cands) // 2], "end": cands[-1]}[where]
    raw[i] = ord("7") if raw[i] != ord("7") else ord("8")
    path.write_bytes(bytes(raw))
    setup.refused("manifest_checksum does not match|not valid JSON|format")
    path.write_bytes(good)
    setup.accepted()


@pytest.mark.parametrize("field", ["num_tensors", "num_entries"])
def test_count_mismatch_refused(setup: Setup, edit_manifest, field: str) -> None:
    edit_manifest(setup.vdir, lambda m: m.update({field: m[field] + 1}))
    err = setup.refused("counts disagree with the lists")
    assert field in str(err)


def test_old_format_refused_naming_file_and_fix(setup: Setup, edit_manifest) -> None:
    edit_manifest(setup.vdir, lambda m: m.update(format_version=1))
    err = setup.refused("format_version 1 is not supported")
    assert str(setup.vdir / "manifest.json") in str(err) and "upgrade the sender" in str(err)
    assert MANIFEST_FORMAT_VERSION == 2


def test_truncated_manifest_refused(setup: Setup) -> None:
    path = setup.vdir / "manifest.json"
    path.write_bytes(path.read_bytes()[:-40])
    setup.refused("not valid JSON")


def test_payload_extra_safetensors_file_refused(tmp_path: Path) -> None:
    """An unlisted safetensors file in a full version would be loaded by an engine: refused."""
    s = Setup(tmp_path, "full")
    (s.vdir / "model-extra.safetensors").write_bytes((s.vdir / "model.safetensors").read_bytes())
    s.refused("does not list")


def test_delta_payload_appended_bytes_refused(tmp_path: Path) -> None:
    s = Setup(tmp_path, "delta")
    with open(s.vdir / "delta.bin", "ab") as f:
        f.write(b"\0" * 5)
    s.refused("5 bytes after the last entry")


def test_full_name_set_differs_from_previous_version(tmp_path: Path) -> None:
    """disk_full: a version without one tensor is refused by a receiver holding it (target
    reports names; or the receiver knows the names of the version it holds), and taken by a
    target that reports exactly the new names."""
    sync = tmp_path / "sync"
    sender = DiskFullTransport(DiskFullTransport.Config(directory=sync, keep_versions=4))
    receiver = DiskFullTransport(DiskFullTransport.Config(directory=sync))
    w1 = sample_weights()
    w2 = {k: v for k, v in next_weights(w1, 2).items() if k != Q}
    target = DictTarget()
    receiver.apply(sender.publish(1, w1.items()), target)
    u2 = sender.publish(2, w2.items())
    before = {k: v.clone() for k, v in target.tensors.items()}
    with pytest.raises(WeightSyncError, match=rf"missing from the update: \['{Q}'\]"):
        receiver.apply(u2, target)
    assert target.weight_version == 1 and target.load_calls == 1
    assert_bitwise_equal(target.tensors, before)

    class Anonymous:  # reports no names: the receiver's own record decides
        weight_version = 1

        def load_weights(self, named_tensors: Any, *, version: int) -> None:
            raise AssertionError("must not be called")

    fresh = DiskFullTransport(DiskFullTransport.Config(directory=sync))  # reads v1's manifest
    for recv in (receiver, fresh):
        with pytest.raises(WeightSyncError, match="of the version this receiver holds"):
            recv.apply(u2, Anonymous())
    matching = DictTarget({k: v for k, v in w1.items() if k != Q}, version=1)
    receiver.apply(u2, matching)
    assert_bitwise_equal(matching.tensors, w2)


# -- exclusive version creation -----------------------------------------------------------------


def _make(kind: str, sync: Path, base: Path) -> Transport:
    if kind == "full":
        return DiskFullTransport(DiskFullTransport.Config(directory=sync, keep_versions=100))
    return DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=sync, base_checkpoint=base, keep_versions=100)
    )


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {"a": torch.full((64,), float(seed)), "b": torch.arange(8.0) + seed}


def _publish_one(kind: str, sync: Path, base: Path, version: int, seed: int) -> str:
    """Publish; return "ok" or the WeightSyncError's message (anything else propagates)."""
    transport = _make(kind, sync, base)
    try:
        transport.publish(version, _weights(seed).items())
    except WeightSyncError as e:
        return f"refused: {e}"
    return "ok"


def _check_race(kind: str, sync: Path, base: Path, version: int, results: list[str]) -> None:
    winners = [i for i, r in enumerate(results) if r == "ok"]
    assert len(winners) == 1, results
    for r in results:
        if r != "ok":
            assert r.startswith("refused: publish of weight version") and "already exists" in r, r
    vdir = sync / _fs.version_dirname(version)
    assert (vdir / _fs.COMPLETE).is_file()
    # whole and exactly the winner's weights
    receiver = _make(kind, sync, base)
    if isinstance(receiver, DiskDeltaTransport):
        receiver.local_dir = sync.parent / f"local-{sync.name}"
    target = DictTarget(_weights(0), version=version - 1)
    receiver.apply(
        WeightUpdate(version=version, base_version=None, transport=receiver.name), target
    )
    assert_bitwise_equal(target.tensors, _weights(winners[0] + 1))
    leftovers = [p.name for p in sync.iterdir() if p.name.startswith(".tmp")]
    assert not leftovers, leftovers


def _base(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    save_file(_weights(0), str(base / "model.safetensors"))
    return base


@pytest.fixture(params=["renameat2", "fallback"])
def rename_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run with RENAME_NOREPLACE, and with the existence-check + rename fallback."""
    if request.param == "fallback":
        monkeypatch.setattr(_fs, "_renameat2", lambda: None)
    else:
        assert _fs._renameat2() is not None, "glibc without renameat2: only the fallback runs"
    return request.param


@pytest.mark.parametrize("kind", ["full", "delta"])
def test_racing_publishers_threads(tmp_path: Path, kind: str, rename_path: str) -> None:
    base = _base(tmp_path)
    for rnd in range(25):
        sync = tmp_path / f"sync{rnd}"
        n = 3
        barrier = threading.Barrier(n)
        results: list[str] = [""] * n

        def run(i: int, sync: Path, barrier: threading.Barrier, results: list[str]) -> None:
            barrier.wait()
            results[i] = _publish_one(kind, sync, base, 1, i + 1)

        threads = [threading.Thread(target=run, args=(i, sync, barrier, results)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _check_race(kind, sync, base, 1, results)


def _proc_main(kind: str, sync: Path, base: Path, i: int, barrier: Any, queue: Any) -> None:
    barrier.wait()
    try:
        queue.put((i, _publish_one(kind, sync, base, 1, i + 1)))
    except BaseException as e:  # report raw exceptions to the parent, which fails on them
        queue.put((i, f"raw {type(e).__name__}: {e}"))


@pytest.mark.parametrize("kind", ["full", "delta"])
def test_racing_publishers_processes(tmp_path: Path, kind: str, rename_path: str) -> None:
    ctx = multiprocessing.get_context("fork")
    base = _base(tmp_path)
    for rnd in range(8):
        sync = tmp_path / f"sync{rnd}"
        n = 2
        barrier, queue = ctx.Barrier(n), ctx.Queue()
        procs = [
            ctx.Process(target=_proc_main, args=(kind, sync, base, i, barrier, queue))
            for i in range(n)
        ]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        _check_race(kind, sync, base, 1, [got[i] for i in range(n)])


def test_existing_empty_version_dir_is_not_replaced(tmp_path: Path, rename_path: str) -> None:
    """A plain rename would replace an empty directory (e.g. one a writer that crashed, or an
    operator, left); the commit refuses it instead and removes its staged directory. (The
    senders' "versions must increase" pre-check is bypassed to reach the commit itself.)"""
    sync = tmp_path / "sync"
    (sync / _fs.version_dirname(1)).mkdir(parents=True)
    manifest = Manifest(version=1, base_version=None, kind="full", tensors=(), names=())
    with (
        pytest.raises(WeightSyncError, match=r"weight_v000001' already exists"),
        _fs.staged_version(sync, 1) as tmp,
    ):
        _fs.commit_version(tmp, sync, 1, manifest)
    assert list((sync / _fs.version_dirname(1)).iterdir()) == []
    assert not [p for p in sync.iterdir() if p.name.startswith(".tmp")]


def test_loser_keeps_its_delta_snapshot(tmp_path: Path) -> None:
    """A delta sender that lost the race did not advance its snapshot: publishing the next
    version after the winner's is refused for its version, then works for a higher one."""
    base = _base(tmp_path)
    sync = tmp_path / "sync"
    winner, loser = _make("delta", sync, base), _make("delta", sync, base)
    winner.publish(1, _weights(1).items())
    with pytest.raises(WeightSyncError, match="version 1 already exists"):
        loser.publish(1, _weights(2).items())
    assert loser._snapshot_version == 0


def test_race_helper_detects_two_winners(tmp_path: Path) -> None:
    """The race check itself fails when two publishers both report success."""
    base = _base(tmp_path)
    sync = tmp_path / "sync"
    _publish_one("full", sync, base, 1, 1)
    with pytest.raises(AssertionError):
        _check_race("full", sync, base, 1, ["ok", "ok"])
