"""The versioned manifest every disk transport writes next to its payload, and path checks.

A manifest says which weight version a directory holds, which version it applies to (deltas),
and for every tensor its name, dtype, shape, file and checksum of the *new* bytes::

    {"format": "rl-weightsync-manifest", "format_version": 1, "kind": "delta",
     "version": 8, "base_version": 7, "checksum": "xxh3_128",
     "tensors": [{"name": "model.layers.0.mlp.up_proj.weight", "dtype": "bfloat16",
                  "shape": [64, 16], "checksum": "xxh3_128:...", "file": "deltas.bin",
                  "encoding": "xor", "offset": 0, "length": 731}]}

Paths in a manifest are relative to its directory and checked by :func:`safe_join` before use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rl_core.errors import WeightSyncError

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_FORMAT_VERSION",
    "Manifest",
    "TensorEntry",
    "dtype_from_name",
    "dtype_name",
    "safe_join",
]

MANIFEST_FORMAT = "rl-weightsync-manifest"
"""Value of the ``format`` field."""
MANIFEST_FORMAT_VERSION = 1
"""Manifest layout version this code reads and writes."""

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; raises WeightSyncError for unsupported dtypes."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise WeightSyncError(
            f"dtype {dtype} is not supported by rl-weightsync; supported: {sorted(_DTYPES)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises WeightSyncError for unknown names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise WeightSyncError(
            f"unknown dtype {name!r} in manifest; supported: {sorted(_DTYPES)}"
        ) from None


def safe_join(
    root: str | os.PathLike[str], relative: str, *, version: int, tensor: str | None = None
) -> Path:
    """``root / relative``, refusing absolute paths, ``..`` and symlinks that leave ``root``."""
    what = (
        f"tensor {tensor!r} of weight version {version}" if tensor else f"weight version {version}"
    )
    rel = Path(relative)
    if not relative or rel.is_absolute() or ".." in rel.parts or relative.startswith(("/", "\\")):
        raise WeightSyncError(
            f"{what}: manifest path {relative!r} is outside the sync directory {str(root)!r}; "
            "manifest paths must be relative and stay inside it. The manifest is corrupt or "
            "forged: republish the version"
        )
    base = Path(root).resolve()
    full = (base / rel).resolve()
    if not full.is_relative_to(base):
        raise WeightSyncError(
            f"{what}: manifest path {relative!r} resolves to {str(full)!r}, outside the sync "
            f"directory {str(base)!r}; republish the version without symlinks leaving it"
        )
    return full


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """One tensor of a manifest."""

    name: str
    """Hugging Face name."""
    dtype: str
    """Dtype name of the tensor as served (e.g. ``"bfloat16"``)."""
    shape: tuple[int, ...]
    """Shape; ``()`` for a 0-d tensor."""
    checksum: str
    """Digest ``"<algorithm>:<hex>"`` of the tensor's new raw bytes."""
    file: str = ""
    """File holding the payload, relative to the manifest's directory."""
    encoding: str = "full"
    """``full`` (plain bytes), ``xor`` or ``overwrite`` (deltas)."""
    offset: int = 0
    """Byte offset of the payload in ``file`` (delta files)."""
    length: int = 0
    """Byte length of the (compressed) payload in ``file`` (delta files)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the decoded tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What a version directory holds; serialised as ``manifest.json``."""

    version: int
    """Weight version this directory produces."""
    base_version: int | None
    """For deltas the version they apply to; ``None`` for a full checkpoint."""
    kind: str
    """``full`` or ``delta``."""
    tensors: tuple[TensorEntry, ...]
    """Every tensor of a full checkpoint, or the changed tensors of a delta."""
    checksum: str = "xxh3_128"
    """Checksum algorithm used for the entries."""
    num_tensors: int = 0
    """Total tensors of the model (a delta lists only the changed ones)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Transport-specific details (encoding, compression, byte counts)."""

    def to_json(self) -> str:
        """Serialise (stable key order, one tensor per line)."""
        head = {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_FORMAT_VERSION,
            "kind": self.kind,
            "version": self.version,
            "base_version": self.base_version,
            "checksum": self.checksum,
            "num_tensors": self.num_tensors,
            "extra": dict(self.extra),
        }
        rows = [
            json.dumps(
                {
                    "name": e.name,
                    "dtype": e.dtype,
                    "shape": list(e.shape),
                    "checksum": e.checksum,
                    "file": e.file,
                    "encoding": e.encoding,
                    "offset": e.offset,
                    "length": e.length,
                }
            )
            for e in self.tensors
        ]
        body = json.dumps(head)[:-1]
        return body + ', "tensors": [\n' + ",\n".join(rows) + "\n]}\n"

    @classmethod
    def from_json(cls, text: str, *, source: str, expect_version: int | None = None) -> Manifest:
        """Parse and validate; errors name ``source`` and the bad field."""
        where = f"manifest {source}"
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise WeightSyncError(
                f"{where}: not valid JSON ({e}); the file is truncated or corrupt, republish the "
                "version"
            ) from None
        if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
            raise WeightSyncError(f"{where}: field 'format' must be {MANIFEST_FORMAT!r}")
        if raw.get("format_version") != MANIFEST_FORMAT_VERSION:
            raise WeightSyncError(
                f"{where}: format_version {raw.get('format_version')!r} is not supported (this "
                f"rl-weightsync reads {MANIFEST_FORMAT_VERSION}); use the same rl-weightsync "
                "version on sender and receivers"
            )
        try:
            version = int(raw["version"])
            base = raw["base_version"]
            base = None if base is None else int(base)
            kind = str(raw["kind"])
            entries = tuple(
                TensorEntry(
                    name=str(t["name"]),
                    dtype=str(t["dtype"]),
                    shape=tuple(int(d) for d in t["shape"]),
                    checksum=str(t["checksum"]),
                    file=str(t.get("file", "")),
                    encoding=str(t.get("encoding", "full")),
                    offset=int(t.get("offset", 0)),
                    length=int(t.get("length", 0)),
                )
                for t in raw["tensors"]
            )
        except (KeyError, TypeError, ValueError) as e:
            raise WeightSyncError(
                f"{where}: missing or malformed field ({e!r}); republish the version"
            ) from None
        if kind not in ("full", "delta"):
            raise WeightSyncError(f"{where}: field 'kind' must be 'full' or 'delta', got {kind!r}")
        if (kind == "delta") != (base is not None):
            raise WeightSyncError(
                f"{where}: a delta needs base_version and a full checkpoint has none"
            )
        if expect_version is not None and version != expect_version:
            raise WeightSyncError(
                f"{where}: holds weight version {version}, expected {expect_version}; the "
                "directory was renamed or overwritten, republish the version"
            )
        for e in entries:
            dtype_from_name(e.dtype)
            if e.offset < 0 or e.length < 0 or any(d < 0 for d in e.shape):
                raise WeightSyncError(
                    f"{where}: tensor {e.name!r} has a negative offset, length or dimension"
                )
        return cls(
            version=version,
            base_version=base,
            kind=kind,
            tensors=entries,
            checksum=str(raw.get("checksum", "xxh3_128")),
            num_tensors=int(raw.get("num_tensors", len(entries))),
            extra=dict(raw.get("extra", {})),
        )
