"""Lossless weight deltas on disk, applied in place into a host-local checkpoint.

The sender keeps a CPU snapshot of the last published version (seeded from the checkpoint the
engines started from, or from the first publish, which is written in full). Each later version is
a directory ``weight_v000008/`` with ``delta.bin`` (one zstd frame per changed tensor) and a
``manifest.json`` naming its base version and the checksum of every changed tensor's new bytes::

    sender = DiskDeltaTransport(DiskDeltaTransport.Config(
        directory="/shared/sync", base_checkpoint="ckpt/", serve_dtype="bfloat16"))
    update = sender.publish(8, policy.named_weights())          # delta on version 7

    # every rollout host:
    receiver = DiskDeltaTransport(DiskDeltaTransport.Config(
        directory="/shared/sync", local_dir="/local/ckpt", base_checkpoint="ckpt/"))
    receiver.apply(update, generator)    # patch /local/ckpt in place, verify, then load

Encodings: ``xor`` (default; the XOR of old and new bytes, mostly zero bits after a small
optimizer step; must be applied exactly once on the right base) or ``overwrite`` (positions and
new values of the changed elements; idempotent). An ``xor`` payload is one zstd frame of the XOR
(layout ``bytes``) or its byte planes (``planes``; see ``Config.layout`` and ``_codec``). A full
version (the first publish, every ``full_every`` versions, after a sender restart, or when the
set of tensor names changes) resets the chain: receivers on any older version can take it and
later deltas build on it.

A receiver refuses a delta whose base is not its current version or whose name set differs from
its local checkpoint's, verifies the manifest (its own checksum, counts, names), that the entries
tile ``delta.bin`` exactly, and every tensor's checksum before writing anything into its local
checkpoint, and only then loads. Versions are published exclusively (see ``_fs``). A target with
``load_weights_from_disk`` (:class:`~rl_weightsync.disk_full.DiskWeightTarget`) is pointed at the
local checkpoint; any other target gets the changed tensors through ``load_weights``.

With ``serve_dtype`` the sender records it in every manifest; a receiver seeds its local
checkpoint from ``base_checkpoint`` cast to it (an fp32 base served in bf16), so receivers need
not repeat it. A receiver in another process gets each update's handle as JSON
(``dataclasses.asdict(update)``), or finds versions itself: :attr:`DiskDeltaTransport.versions`,
:meth:`~DiskDeltaTransport.newest_version` and :meth:`~DiskDeltaTransport.update_for` (as on
:class:`~rl_weightsync.disk_full.DiskFullTransport`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

import numpy as np
import torch
import zstandard
from safetensors.torch import load_file, save_file

from rl_core.config import NonNegInt, PositiveInt, Range
from rl_core.errors import WeightSyncError
from rl_core.interfaces import WeightTarget, WeightTransport
from rl_core.lora import adapter_of
from rl_core.types import WeightUpdate
from rl_weightsync import _fs
from rl_weightsync._codec import LAYOUTS, _compressor, decode_delta, encode_delta, layout_of
from rl_weightsync.adapter import (
    ADAPTER,
    check_delta_base,
    check_update_kind,
    payload_kind,
    publish_extra,
)
from rl_weightsync.checksum import (
    CHECKSUM_ALGORITHMS,
    bytes_checksum,
    tensor_bytes,
    verify_checksum,
)
from rl_weightsync.disk_full import (
    DEFAULT_ASSET_PATTERNS,
    DiskWeightTarget,
    cast_for_serving,
    load_checkpoint_tensors,
    target_weight_names,
)
from rl_weightsync.manifest import (
    Manifest,
    TensorEntry,
    check_name_set,
    dtype_from_name,
    dtype_name,
    safe_join,
)

__all__ = ["DiskDeltaTransport", "decode_delta", "encode_delta"]

DELTA_FILE = "delta.bin"
LOCAL_STATE = "rl_weightsync_state.json"
_ENCODINGS = ("xor", "overwrite")
_FLOAT_DTYPES = frozenset(
    {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
)
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def _read_st_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _local_layout(local_dir: Path) -> dict[str, tuple[Path, int, str, tuple[int, ...]]]:
    """name -> (file, absolute data offset, dtype name, shape) for a local safetensors checkpoint."""
    out = {}
    for f in sorted(local_dir.glob("*.safetensors")):
        start, header = _read_st_header(f)
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype = _ST_DTYPES.get(meta["dtype"], meta["dtype"])
            out[name] = (f, start + meta["data_offsets"][0], dtype, tuple(meta["shape"]))
    return out


def _read_local_tensors(local_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(local_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _read_delta_payload(vdir: Path, manifest: Manifest) -> dict[str, bytes]:
    """Each entry's compressed payload, after checking that the entries tile ``delta.bin``
    exactly: in order, no gap, no overlap, no byte left over (so nothing was dropped from the
    manifest or appended to the file)."""
    version = manifest.version
    first = manifest.tensors[0].name if manifest.tensors else None
    for e in manifest.tensors:
        if e.file != DELTA_FILE:
            raise WeightSyncError(
                f"tensor {e.name!r} of weight version {version}: payload file {e.file!r}, but a "
                f"delta keeps every payload in {DELTA_FILE!r}; republish the version"
            )
    path = safe_join(vdir, DELTA_FILE, version=version, tensor=first)
    try:
        data = path.read_bytes()
    except OSError as exc:
        who = (
            f"tensor {first!r} of weight version {version}"
            if first
            else f"weight version {version}"
        )
        raise WeightSyncError(
            f"{who}: payload file {str(path)!r} cannot be read ({exc.strerror}); republish the "
            "version or apply a full one"
        ) from None
    blobs: dict[str, bytes] = {}
    end = 0
    for e in manifest.tensors:
        if e.offset != end or e.offset + e.length > len(data):
            raise WeightSyncError(
                f"tensor {e.name!r} of weight version {version}: payload at bytes [{e.offset}, "
                f"{e.offset + e.length}) but the previous entry ends at {end} and {DELTA_FILE} "
                f"has {len(data)} bytes (truncated, or the manifest and payload disagree); "
                "republish the version"
            )
        blobs[e.name] = data[e.offset : e.offset + e.length]
        end = e.offset + e.length
    if end != len(data):
        raise WeightSyncError(
            f"weight version {version}: {str(path)!r} has {len(data) - end} bytes after the last "
            "entry the manifest lists (an entry was removed, or the file was appended to); "
            "republish the version"
        )
    return blobs


class DiskDeltaTransport(WeightTransport):
    """XOR or overwrite deltas, zstd-compressed and checksummed, applied in place on receivers."""

    name: ClassVar[str] = "disk_delta"

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`DiskDeltaTransport` (sender and receivers share most of them)."""

        directory: str | Path
        """Shared sync directory: the sender writes versions, receivers read them."""
        local_dir: str | Path | None = None
        """Receiver only: host-local checkpoint directory patched in place (engines load it)."""
        base_checkpoint: str | Path | None = None
        """Hugging Face checkpoint the engines started from: seeds the sender's snapshot and the
        receivers' local checkpoint as version ``base_version``. ``None``: the first publish is
        written in full."""
        base_version: NonNegInt = 0
        """Version of ``base_checkpoint``."""
        encoding: str = "xor"
        """``xor`` (apply exactly once) or ``overwrite`` (positions + values; idempotent)."""
        zstd_level: Annotated[int, Range(ge=-131072, le=22)] = 1
        """zstd compression level of the delta payloads."""
        layout: str = "auto"
        """Layout of ``xor`` payloads: ``bytes`` (one zstd frame of the XOR; the original
        format), ``planes`` (byte planes, near-random ones stored raw: faster to apply, smaller)
        or ``auto`` (planes, or bytes for a very sparse XOR where one frame applies faster).
        Receivers read every layout; the manifest records each tensor's. Receivers from before
        this field read only ``bytes``: publish ``bytes`` until every receiver is upgraded."""
        checksum: str = "xxh3_128"
        """Checksum of each changed tensor's new bytes."""
        serve_dtype: str | None = None
        """Dtype the engine serves (e.g. ``"bfloat16"``): deltas are taken after casting floating
        tensors to it, so fp32 master weights do not inflate the deltas."""
        full_every: NonNegInt = 0
        """Write a full checkpoint every this many versions (0: only when there is no base)."""
        keep_versions: PositiveInt = 4
        """Versions kept in ``directory``; the newest full checkpoint is always kept."""
        num_threads: PositiveInt = 2
        """Threads encoding / decoding tensors in parallel."""
        max_shard_bytes: PositiveInt = 5 << 30
        """Largest safetensors shard of a full version."""
        assets_dir: str | Path | None = None
        """Config/tokenizer files copied into full versions (default: ``base_checkpoint``)."""
        asset_patterns: tuple[str, ...] = field(default_factory=lambda: DEFAULT_ASSET_PATTERNS)
        """Glob patterns of the asset files."""

    def __init__(self, config: Config) -> None:
        """Build from ``config``; raises WeightSyncError naming a bad field."""
        self.config = config
        c = config
        if c.encoding not in _ENCODINGS:
            raise WeightSyncError(
                f"DiskDeltaTransport.Config.encoding: {c.encoding!r} is not one of {_ENCODINGS}"
            )
        if c.layout not in (*LAYOUTS, "auto"):
            raise WeightSyncError(
                f"DiskDeltaTransport.Config.layout: {c.layout!r} is not one of {(*LAYOUTS, 'auto')}"
            )
        if c.checksum not in CHECKSUM_ALGORITHMS:
            raise WeightSyncError(
                f"DiskDeltaTransport.Config.checksum: unknown algorithm {c.checksum!r}; use one of "
                f"{sorted(CHECKSUM_ALGORITHMS)}"
            )
        if c.keep_versions < 1 or c.num_threads < 1 or c.full_every < 0:
            raise WeightSyncError(
                "DiskDeltaTransport.Config: keep_versions and num_threads must be >= 1 and "
                f"full_every >= 0 (got {c.keep_versions}, {c.num_threads}, {c.full_every})"
            )
        if c.serve_dtype is not None:
            dtype_from_name(c.serve_dtype)
        self.directory = Path(c.directory)
        self.local_dir = Path(c.local_dir) if c.local_dir is not None else None
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._snapshot_version: int | None = None
        self._seeded = False
        self._lock = threading.Lock()

    # -- sender ---------------------------------------------------------------------------------

    def _seed_snapshot(self) -> None:
        if self._seeded:
            return
        self._seeded = True
        base = self.config.base_checkpoint
        if base is not None:
            tensors = _read_local_tensors(Path(base))
            if not tensors:
                raise WeightSyncError(
                    f"DiskDeltaTransport.Config.base_checkpoint: no *.safetensors in {str(base)!r}; "
                    "point it at the Hugging Face checkpoint the engines started from"
                )
            self._snapshot = dict(
                cast_for_serving(
                    tensors.items(), self.config.serve_dtype, version=self.config.base_version
                )
            )
            self._snapshot_version = self.config.base_version

    def publish(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> WeightUpdate:
        """Write ``version`` as a delta on the last published version (or in full, see class doc).

        ``metadata`` goes into the returned update; an adapter marker
        (:func:`rl_core.lora.with_adapter`) is also recorded in the manifest. A switch between
        adapter tensors and full weights changes the name set, so it is written in full."""
        with self._lock:
            self._seed_snapshot()
            existing = _fs.all_versions(self.directory)
            last = max(
                [*existing, self._snapshot_version if self._snapshot_version is not None else -1]
            )
            if (existing or self._snapshot_version is not None) and version <= last:
                raise WeightSyncError(
                    f"publish of weight version {version} refused: version {last} already exists "
                    f"(in {str(self.directory)!r} or as the base checkpoint) and versions must "
                    f"increase. Publish a version above {last}"
                )
            tensors = cast_for_serving(named_tensors, self.config.serve_dtype, version=version)
            extra = publish_extra([n for n, _ in tensors], metadata, version=version)
            if self.config.serve_dtype is not None:  # receivers seed their base with this cast
                extra["serve_dtype"] = self.config.serve_dtype
            snap = self._snapshot
            full = (
                snap is None
                or (bool(existing) and existing[-1] > (self._snapshot_version or 0))
                or (self.config.full_every > 0 and version % self.config.full_every == 0)
                or set(snap) != {n for n, _ in tensors}
            )
            if full:
                update = self._publish_full(version, tensors, extra)
            else:
                update = self._publish_delta(version, tensors, snap, extra)
            update = dataclasses.replace(update, metadata={**(metadata or {}), **update.metadata})
            self._snapshot = dict(tensors)
            self._snapshot_version = version
            self._prune()
        return update

    def _publish_full(
        self, version: int, tensors: list[tuple[str, torch.Tensor]], kind: dict[str, Any]
    ) -> WeightUpdate:
        with _fs.staged_version(self.directory, version) as tmp:
            entries = _fs.write_safetensors_checkpoint(
                tmp,
                tensors,
                max_shard_bytes=self.config.max_shard_bytes,
                checksum=self.config.checksum,
                version=version,
            )
            assets = self.config.assets_dir or self.config.base_checkpoint
            _fs.copy_assets(Path(assets) if assets else None, tmp, self.config.asset_patterns)
            nbytes = sum(e.nbytes for e in entries)
            manifest = Manifest(
                version=version,
                base_version=None,
                kind="full",
                tensors=tuple(entries),
                names=tuple(sorted(e.name for e in entries)),
                checksum=self.config.checksum,
                extra={"bytes": nbytes, "full_bytes": nbytes, **kind},
            )
            final = _fs.commit_version(tmp, self.directory, version, manifest)
        return WeightUpdate(
            version=version,
            base_version=None,
            transport=self.name,
            location=str(final),
            metadata={
                "payload": kind["payload"],
                "kind": "full",
                "num_tensors": len(entries),
                "bytes": nbytes,
                "full_bytes": nbytes,
            },
        )

    def _encode_one(
        self, item: tuple[str, torch.Tensor], snap: dict[str, torch.Tensor]
    ) -> tuple[str, str, str, bytes] | None:
        name, new = item
        new_b = tensor_bytes(new)
        old = snap.get(name)
        level = self.config.zstd_level
        if old is None or old.dtype != new.dtype or old.shape != new.shape:
            blob = _compressor(level).compress(new_b)
            return name, "full", "bytes", blob
        enc = self.config.encoding
        blob = encode_delta(
            tensor_bytes(old),
            new_b,
            itemsize=new.element_size(),
            encoding=enc,
            level=level,
            layout=self.config.layout,
        )
        if blob is None:
            return None
        return name, enc, layout_of(blob) if enc == "xor" else "bytes", blob

    def _publish_delta(
        self,
        version: int,
        tensors: list[tuple[str, torch.Tensor]],
        snap: dict[str, torch.Tensor],
        kind: dict[str, Any],
    ) -> WeightUpdate:
        base = self._snapshot_version
        assert base is not None
        by_name = dict(tensors)
        with ThreadPoolExecutor(self.config.num_threads) as pool:
            encoded = list(pool.map(lambda it: self._encode_one(it, snap), tensors))
            changed = [e for e in encoded if e is not None]
            sums = list(
                pool.map(
                    lambda e: bytes_checksum(tensor_bytes(by_name[e[0]]), self.config.checksum),
                    changed,
                )
            )
        entries, offset = [], 0
        for (name, enc, layout, blob), digest in zip(changed, sums):
            t = by_name[name]
            entries.append(
                TensorEntry(
                    name=name,
                    dtype=dtype_name(t.dtype),
                    shape=tuple(t.shape),
                    checksum=digest,
                    file=DELTA_FILE,
                    encoding=enc,
                    layout=layout,
                    offset=offset,
                    length=len(blob),
                )
            )
            offset += len(blob)
        full_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        manifest = Manifest(
            version=version,
            base_version=base,
            kind="delta",
            tensors=tuple(entries),
            names=tuple(sorted(by_name)),
            checksum=self.config.checksum,
            extra={
                "bytes": offset,
                "full_bytes": full_bytes,
                "compression": "zstd",
                "encoding": self.config.encoding,
                "layout": self.config.layout,
                **kind,
            },
        )
        with _fs.staged_version(self.directory, version) as tmp:
            with open(tmp / DELTA_FILE, "wb") as f:
                for *_, blob in changed:
                    f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            final = _fs.commit_version(tmp, self.directory, version, manifest)
        return WeightUpdate(
            version=version,
            base_version=base,
            transport=self.name,
            location=str(final),
            metadata={
                "payload": kind["payload"],
                "kind": "delta",
                "num_tensors": len(tensors),
                "changed_tensors": len(entries),
                "bytes": offset,
                "full_bytes": full_bytes,
            },
        )

    # -- lookup (sender and receivers) ------------------------------------------------------

    @property
    def versions(self) -> list[int]:
        """Complete versions present in the directory, ascending (as
        :attr:`DiskFullTransport.versions <rl_weightsync.disk_full.DiskFullTransport.versions>`)."""
        return _fs.complete_versions(self.directory)

    def version_dir(self, version: int) -> Path:
        """Directory of ``version`` (which may not exist)."""
        return self.directory / _fs.version_dirname(version)

    def newest_version(self) -> int | None:
        """The newest complete version in the directory (``None`` when there is none)."""
        done = self.versions
        return done[-1] if done else None

    def update_for(self, version: int) -> WeightUpdate:
        """The handle :meth:`publish` returned for ``version``, rebuilt from its verified
        manifest: what a receiver in another process that only sees the directory applies
        (a full version resets the chain; a delta applies on its ``base_version``).

        Raises:
            WeightSyncError: ``version`` is not complete in the directory (never published,
                still being written, pruned) or its manifest fails verification.
        """
        m = _fs.read_complete_manifest(self.directory, version, self.name)
        meta: dict[str, Any] = {
            **_fs.recorded_marker(m),
            "payload": m.extra.get("payload", "weights"),
            "kind": m.kind,
            "num_tensors": len(m.names),
        }
        if m.kind == "delta":
            meta["changed_tensors"] = len(m.tensors)
        meta["bytes"] = m.extra.get("bytes", 0)
        meta["full_bytes"] = m.extra.get("full_bytes", 0)
        return WeightUpdate(
            version=version,
            base_version=m.base_version,
            transport=self.name,
            location=str(self.version_dir(version)),
            metadata=meta,
        )

    def _prune(self) -> None:
        done = _fs.complete_versions(self.directory)
        keep = set(done[-self.config.keep_versions :])
        fulls = [v for v in done if self._is_full(v)]
        if fulls:
            keep.add(fulls[-1])
        for v in done:
            if v not in keep:
                _fs.remove_version_dir(self.directory / _fs.version_dirname(v))

    def _is_full(self, version: int) -> bool:
        vdir = self.directory / _fs.version_dirname(version)
        return not (vdir / DELTA_FILE).exists()

    # -- receiver -------------------------------------------------------------------------------

    def _require_local(self) -> Path:
        if self.local_dir is None:
            raise WeightSyncError(
                "DiskDeltaTransport.Config.local_dir is not set; receivers need a host-local "
                "checkpoint directory to apply deltas into"
            )
        return self.local_dir

    def local_version(self) -> int | None:
        """Version of the local checkpoint (seeding it from ``base_checkpoint`` if empty, its
        floating tensors cast to ``Config.serve_dtype`` when set)."""
        return self._seeded_local_version(self.config.serve_dtype)

    def _seed_local(self, serve_dtype: str | None) -> None:
        """Write ``base_checkpoint`` (floating tensors cast to ``serve_dtype``) as the local
        checkpoint at ``base_version``: the bytes the sender's deltas on that version start from."""
        base = Path(self.config.base_checkpoint)  # type: ignore[arg-type]
        tensors = _read_local_tensors(base)
        if not tensors:
            raise WeightSyncError(
                f"DiskDeltaTransport.Config.base_checkpoint: no *.safetensors in {str(base)!r}; "
                "point it at the Hugging Face checkpoint the engines started from"
            )
        cast = cast_for_serving(tensors.items(), serve_dtype, version=self.config.base_version)
        self._replace_local(cast, self.config.base_version, base)

    def _serve_dtype_of(self, manifest: Manifest) -> str | None:
        """The dtype the sender served ``manifest``'s version in (recorded in its ``extra``), else
        this receiver's ``Config.serve_dtype``; the two must agree when both are set."""
        sent = manifest.extra.get("serve_dtype")
        own = self.config.serve_dtype
        if (
            sent is not None
            and own is not None
            and dtype_from_name(str(sent)) != dtype_from_name(own)
        ):
            raise WeightSyncError(
                f"weight version {manifest.version}: DiskDeltaTransport.Config.serve_dtype is "
                f"{own!r} on this receiver but the sender serves {sent!r}; set the same "
                "serve_dtype on both sides (or leave it unset on receivers: they follow the sender)"
            )
        return str(sent) if sent is not None else own

    def _seeded_local_version(self, serve_dtype: str | None) -> int | None:
        """:meth:`local_version`, seeding from the base cast to ``serve_dtype``; a local checkpoint
        still on the base version whose floating tensors have another dtype (seeded before the
        serve dtype was known, or by an older rl-weightsync) is seeded again with the cast."""
        local = self._require_local()
        state = local / LOCAL_STATE
        if not state.is_file():
            if self.config.base_checkpoint is None:
                return None
            self._seed_local(serve_dtype)
        elif serve_dtype is not None and self.config.base_checkpoint is not None:
            raw = json.loads(state.read_text())
            if raw.get("writing") is None and int(raw["version"]) == self.config.base_version:
                want = dtype_name(dtype_from_name(serve_dtype))
                held = {d for _, _, d, _ in _local_layout(local).values()}
                if any(d in _FLOAT_DTYPES and d != want for d in held):
                    self._seed_local(serve_dtype)
        raw = json.loads(state.read_text())
        if raw.get("writing") is not None:
            raise WeightSyncError(
                f"local checkpoint {str(local)!r} was left half-written while applying weight "
                f"version {raw['writing']} (crash?); delete it and apply a full version, or "
                "restart from the base checkpoint"
            )
        return int(raw["version"])

    def _write_state(self, version: int, writing: int | None = None) -> None:
        local = self._require_local()
        _fs.atomic_write_text(
            local / LOCAL_STATE, json.dumps({"version": version, "writing": writing})
        )

    def _replace_local(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, assets: Path | None
    ) -> None:
        """Atomically swap in a local checkpoint holding ``tensors`` at ``version``."""
        local = self._require_local()
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.tmp-{version}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(
            {n: t.contiguous() for n, t in tensors},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        _fs.fsync_path(tmp / "model.safetensors")
        if assets is not None:
            _fs.copy_assets(assets, tmp, self.config.asset_patterns)
        _fs.write_bytes_synced(
            tmp / LOCAL_STATE, json.dumps({"version": version, "writing": None}).encode()
        )
        old = local.with_name(f".{local.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if local.exists():
            os.replace(local, old)
        os.replace(tmp, local)
        _fs.fsync_path(local.parent)
        shutil.rmtree(old, ignore_errors=True)

    def _check(self, update: WeightUpdate, current_version: int) -> tuple[Path, Manifest, str]:
        version = update.version
        if update.transport != self.name:
            raise WeightSyncError(
                f"weight version {version}: update made by transport {update.transport!r}, not "
                f"{self.name!r}; pass it to the transport that published it"
            )
        if version <= current_version:
            raise WeightSyncError(
                f"weight version {version} refused: the receiver is already on version "
                f"{current_version} (replayed or out-of-order update). Apply only newer updates"
            )
        vdir = self.directory / _fs.version_dirname(version)
        if not (vdir / _fs.COMPLETE).is_file():
            raise WeightSyncError(
                f"weight version {version}: no complete version at {str(vdir)!r} (never published, "
                "still being written, or pruned). Apply the newest full version, or raise "
                "DiskDeltaTransport.Config.keep_versions"
            )
        manifest = _fs.read_manifest(vdir, version)
        if manifest.kind == "delta" and manifest.base_version != current_version:
            raise WeightSyncError(
                f"weight version {version} is a delta on version {manifest.base_version}, but the "
                f"receiver is on version {current_version} (skipped or wrong-base update). Apply "
                f"version {current_version + 1} first, or wait for a full version"
            )
        return vdir, manifest, check_update_kind(update, manifest.names, manifest.extra)

    def receive(
        self, update: WeightUpdate, *, current_version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Apply ``update`` to the local checkpoint (verified first); yield the tensors it changed."""
        return iter(self._receive(update, current_version))

    def _receive(
        self, update: WeightUpdate, current_version: int, target: object = None
    ) -> list[tuple[str, torch.Tensor]]:
        vdir, manifest, kind = self._check(update, current_version)
        version = manifest.version
        target_names = target_weight_names(target)
        with self._lock, self._host_lock():
            if manifest.kind == "full":
                local_v = self._local_state_version()
                if local_v == version:  # a co-located rank already did it
                    check_name_set(
                        manifest,
                        current_version=current_version,
                        held=None,
                        target_names=target_names,
                    )
                    return self._reread_local(manifest)
                held = set(_local_layout(self._require_local())) if local_v is not None else None
                if held is not None and payload_kind(held, version=local_v or 0) != kind:
                    held = None  # adapter <-> full weights: the local checkpoint is replaced whole
                check_name_set(
                    manifest,
                    current_version=current_version,
                    held=frozenset(held) if held is not None else None,
                    target_names=target_names,
                )
                tensors = load_checkpoint_tensors(vdir, manifest)
                self._replace_local(tensors, version, vdir)
                return tensors
            local_v = self._seeded_local_version(self._serve_dtype_of(manifest))
            if local_v == version:  # patched earlier, the target failed to load: reread and verify
                check_name_set(
                    manifest,
                    current_version=current_version,
                    held=frozenset(_local_layout(self._require_local())),
                    target_names=target_names,
                )
                if kind == ADAPTER:
                    return self._reread_all(manifest)
                return self._reread_local(manifest)
            if local_v != manifest.base_version:
                raise WeightSyncError(
                    f"weight version {version} is a delta on version {manifest.base_version}, but "
                    f"the local checkpoint {str(self.local_dir)!r} is on version {local_v}; apply a "
                    "full version to resync"
                )
            local_names = list(_local_layout(self._require_local()))
            check_delta_base(version, kind, local_v, payload_kind(local_names, version=local_v))
            check_name_set(
                manifest,
                current_version=current_version,
                held=frozenset(_local_layout(self._require_local())),
                target_names=target_names,
            )
            changed = self._apply_delta(vdir, manifest)
            if kind == ADAPTER:  # adapters are small: targets get the whole adapter
                return self._reread_all(manifest)
            return changed

    @contextlib.contextmanager
    def _host_lock(self) -> Iterator[None]:
        """Exclusive lock on the local checkpoint across processes of this host (co-located
        ranks share one ``local_dir``: the first patches it, the others reread and verify)."""
        local = self._require_local()
        local.parent.mkdir(parents=True, exist_ok=True)
        with open(local.with_name(f".{local.name}.lock"), "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _local_state_version(self) -> int | None:
        state = self._require_local() / LOCAL_STATE
        if not state.is_file():
            return None
        raw = json.loads(state.read_text())
        return None if raw.get("writing") is not None else int(raw["version"])

    def _reread_all(self, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the local checkpoint (patched to ``manifest``; the tensors it changed
        verified again), in its name order."""
        self._reread_local(manifest)
        local = _read_local_tensors(self._require_local())
        return [(n, local[n]) for n in manifest.names]

    def _reread_local(self, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
        local = _read_local_tensors(self._require_local())
        out = []
        for e in manifest.tensors:
            t = local.get(e.name)
            if t is None:
                raise WeightSyncError(
                    f"tensor {e.name!r} of weight version {manifest.version} is missing from the "
                    "local checkpoint; apply a full version to resync"
                )
            verify_checksum(t, e.checksum, name=e.name, version=manifest.version)
            out.append((e.name, t))
        return out

    def _apply_delta(self, vdir: Path, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
        version = manifest.version
        local = self._require_local()
        layout = _local_layout(local)
        blobs = _read_delta_payload(vdir, manifest)

        def decode(e: TensorEntry) -> tuple[TensorEntry, np.ndarray, bool]:
            itemsize = dtype_from_name(e.dtype).itemsize
            slot = layout.get(e.name)
            in_place = slot is not None and slot[2] == e.dtype and slot[3] == e.shape
            try:
                if e.encoding == "full":
                    raw = zstandard.ZstdDecompressor().decompress(
                        blobs[e.name], max_output_size=e.nbytes
                    )
                    new = np.frombuffer(raw, dtype=np.uint8).copy()
                    if new.size != e.nbytes:
                        raise ValueError(f"decoded {new.size} bytes, expected {e.nbytes}")
                elif not in_place:
                    raise WeightSyncError(
                        f"tensor {e.name!r} of weight version {version}: a {e.encoding} delta needs "
                        f"the tensor as {e.dtype} {e.shape} in the local checkpoint, which has "
                        f"{slot[2:] if slot else 'no such tensor'} (wrong base); apply a full version"
                    )
                else:
                    f, off, _, _ = slot
                    old = np.fromfile(f, dtype=np.uint8, count=e.nbytes, offset=off)
                    if old.size != e.nbytes:
                        raise ValueError("local checkpoint file is truncated")
                    new = decode_delta(  # in place: old is this call's own copy
                        old,
                        blobs[e.name],
                        itemsize=itemsize,
                        encoding=e.encoding,
                        layout=e.layout,
                        out=old,
                    )
            except WeightSyncError:
                raise
            except (ValueError, zstandard.ZstdError) as exc:
                raise WeightSyncError(
                    f"tensor {e.name!r} of weight version {version}: cannot decode its "
                    f"{e.encoding} payload ({exc}); the file is corrupt or truncated. Republish "
                    "the version or apply a full one"
                ) from None
            verify_checksum(new, e.checksum, name=e.name, version=version)
            return e, new, in_place

        with ThreadPoolExecutor(self.config.num_threads) as pool:
            decoded = list(pool.map(decode, manifest.tensors))
        tensors = [
            (
                e.name,
                torch.from_numpy(new).view(dtype_from_name(e.dtype)).reshape(e.shape),
            )
            if new.size
            else (e.name, torch.empty(e.shape, dtype=dtype_from_name(e.dtype)))
            for e, new, _ in decoded
        ]
        # Everything verified: now write into the local checkpoint.
        base = manifest.base_version
        assert base is not None
        if all(in_place for _, _, in_place in decoded):
            self._write_state(base, writing=version)
            files: dict[Path, list[tuple[int, np.ndarray]]] = {}
            for e, new, _ in decoded:
                f, off, _, _ = layout[e.name]
                files.setdefault(f, []).append((off, new))
            for f, patches in files.items():
                fd = os.open(f, os.O_WRONLY)
                try:
                    for off, new in patches:
                        view, done = memoryview(new), 0  # no copy; a write may be partial
                        while done < len(view):
                            done += os.pwrite(fd, view[done:], off + done)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self._write_state(version)
        else:
            current = _read_local_tensors(local)
            current.update(dict(tensors))
            self._replace_local(current.items(), version, local)
        return tensors

    def apply(self, update: WeightUpdate, target: WeightTarget | DiskWeightTarget) -> None:
        """Patch the local checkpoint (verified), then load: from disk for a DiskWeightTarget,
        else the changed tensors through ``load_weights``. An adapter-only version always goes
        through ``load_weights``, with every tensor of the adapter."""
        tensors = self._receive(update, target.weight_version, target)
        adapter = adapter_of(update) is not None  # checked against the manifest by _receive
        if isinstance(target, DiskWeightTarget) and not adapter:
            target.load_weights_from_disk(str(self._require_local()), version=update.version)
        else:
            target.load_weights(tensors, version=update.version)
