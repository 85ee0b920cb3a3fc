"""The versioned manifest every disk transport writes next to its payload, and path checks.

A manifest says which weight version a directory holds, which version it applies to (deltas),
the full set of tensor names of the model at that version, and for every tensor it carries its
name, dtype, shape, file and checksum of the *new* bytes; it ends with a checksum of itself::

    {"format": "rl-weightsync-manifest", "format_version": 2, "kind": "delta",
     "version": 8, "base_version": 7, "checksum": "xxh3_128",
     "num_tensors": 2, "num_entries": 1, "extra": {...},
     "manifest_checksum": "xxh3_128:...",
     "names": ["lm_head.weight", "model.layers.0.mlp.up_proj.weight"],
     "tensors": [{"name": "model.layers.0.mlp.up_proj.weight", "dtype": "bfloat16",
                  "shape": [64, 16], "checksum": "xxh3_128:...", "file": "delta.bin",
                  "encoding": "xor", "layout": "planes", "offset": 0, "length": 731}]}

``layout`` (how an ``xor`` payload is laid out: ``bytes``, one zstd frame of the XOR, or
``planes``, its byte planes; see :mod:`rl_weightsync._codec`) is written only when it is not
``bytes``, so manifests of the original layout are unchanged and still read.

``manifest_checksum`` is the xxh3-128 of the canonical JSON of every other field (keys sorted,
no whitespace), so an edited, truncated or reordered manifest is refused before anything in it is
trusted. :meth:`Manifest.from_json` then checks that ``num_tensors`` counts ``names``,
``num_entries`` counts ``tensors``, no name appears twice, a full checkpoint lists exactly
``names`` and a delta only names from it.

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
from rl_weightsync._codec import LAYOUTS
from rl_weightsync.checksum import CHECKSUM_ALGORITHMS, bytes_checksum

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_FORMAT_VERSION",
    "Manifest",
    "TensorEntry",
    "canonical_json",
    "check_name_set",
    "dtype_from_name",
    "dtype_name",
    "safe_join",
    "sign",
]

MANIFEST_FORMAT = "rl-weightsync-manifest"
"""Value of the ``format`` field."""
MANIFEST_FORMAT_VERSION = 2
"""Manifest layout version this code reads and writes (2: self-checksum, name set, counts)."""
MANIFEST_CHECKSUM = "xxh3_128"
"""Algorithm of the manifest's checksum of itself."""
_ENTRY_ENCODINGS = ("full", "xor", "overwrite")

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
    layout: str = "bytes"
    """Payload layout: ``bytes`` (one zstd frame), or ``planes`` (byte planes; ``xor`` only)."""
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


def canonical_json(obj: Any) -> bytes:
    """The bytes a manifest checksum covers: keys sorted, no whitespace, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _get(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``raw[key]`` checked against ``kind`` (bool is not an int); errors name the field."""
    if key not in raw:
        raise WeightSyncError(f"{where}: field {key!r} is missing; republish the version")
    value = raw[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise WeightSyncError(
            f"{where}: field {key!r} must be {' or '.join(k.__name__ for k in kinds)}, got "
            f"{value!r}; the manifest is corrupt, republish the version"
        )
    return value


def _entry(raw: Any, where: str) -> TensorEntry:
    if not isinstance(raw, dict):
        raise WeightSyncError(f"{where}: must be an object, got {raw!r}; republish the version")
    shape = _get(raw, "shape", list, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise WeightSyncError(f"{where}: field 'shape' must be a list of ints, got {shape!r}")
    return TensorEntry(
        name=_get(raw, "name", str, where),
        dtype=_get(raw, "dtype", str, where),
        shape=tuple(shape),
        checksum=_get(raw, "checksum", str, where),
        file=_get(raw, "file", str, where),
        encoding=_get(raw, "encoding", str, where),
        layout=_get(raw, "layout", str, where) if "layout" in raw else "bytes",
        offset=_get(raw, "offset", int, where),
        length=_get(raw, "length", int, where),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What a version directory holds; serialised as ``manifest.json`` with a checksum of itself."""

    version: int
    """Weight version this directory produces."""
    base_version: int | None
    """For deltas the version they apply to; ``None`` for a full checkpoint."""
    kind: str
    """``full`` or ``delta``."""
    tensors: tuple[TensorEntry, ...]
    """Every tensor of a full checkpoint, or the changed tensors of a delta."""
    names: tuple[str, ...]
    """Every tensor name of the model at ``version``, sorted (a delta lists only the changed
    tensors in ``tensors``; this is the whole set a receiver must end up holding)."""
    checksum: str = "xxh3_128"
    """Checksum algorithm used for the entries."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Transport-specific details (encoding, compression, byte counts)."""

    @property
    def num_tensors(self) -> int:
        """Total tensors of the model at ``version`` (``len(names)``)."""
        return len(self.names)

    def body(self) -> dict[str, Any]:
        """Every serialised field except ``manifest_checksum`` (what that checksum covers)."""
        return {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_FORMAT_VERSION,
            "kind": self.kind,
            "version": self.version,
            "base_version": self.base_version,
            "checksum": self.checksum,
            "num_tensors": len(self.names),
            "num_entries": len(self.tensors),
            "extra": dict(self.extra),
            "names": list(self.names),
            "tensors": [
                {
                    "name": e.name,
                    "dtype": e.dtype,
                    "shape": list(e.shape),
                    "checksum": e.checksum,
                    "file": e.file,
                    "encoding": e.encoding,
                    **({"layout": e.layout} if e.layout != "bytes" else {}),
                    "offset": e.offset,
                    "length": e.length,
                }
                for e in self.tensors
            ],
        }

    def to_json(self) -> str:
        """Serialise with ``manifest_checksum`` (stable key order, one tensor per line)."""
        body = self.body()
        names, rows = body.pop("names"), body.pop("tensors")
        body["manifest_checksum"] = sign(self.body())
        head = json.dumps(body)[:-1]
        return (
            f'{head}, "names": {json.dumps(names)}, "tensors": [\n'
            + ",\n".join(json.dumps(r) for r in rows)
            + "\n]}\n"
        )

    @classmethod
    def from_json(
        cls, text: str | bytes, *, source: str, expect_version: int | None = None
    ) -> Manifest:
        """Parse and validate: the manifest's own checksum first, then every field, the counts
        and the name set. Errors name ``source``, the bad field, and the fix."""
        where = f"manifest {source}"
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
            raise WeightSyncError(
                f"{where}: not valid JSON ({e}); the file is truncated or corrupt, republish the "
                "version"
            ) from None
        if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
            raise WeightSyncError(
                f"{where}: field 'format' must be {MANIFEST_FORMAT!r}; this is not an "
                "rl-weightsync manifest or it is corrupt, republish the version"
            )
        fv = raw.get("format_version")
        if fv != MANIFEST_FORMAT_VERSION:
            hint = (
                "it was written by an older rl-weightsync (format 1 has no checksum of itself "
                "and no name set): upgrade the sender to this rl-weightsync and republish, or "
                "clear the sync directory"
                if isinstance(fv, int) and fv < MANIFEST_FORMAT_VERSION
                else "use the same rl-weightsync version on sender and receivers"
            )
            raise WeightSyncError(
                f"{where}: format_version {fv!r} is not supported (this rl-weightsync reads "
                f"{MANIFEST_FORMAT_VERSION}); {hint}"
            )
        digest = _get(raw, "manifest_checksum", str, where)
        del raw["manifest_checksum"]
        algorithm = digest.partition(":")[0]
        if (
            algorithm not in CHECKSUM_ALGORITHMS
            or bytes_checksum(canonical_json(raw), algorithm) != digest
        ):
            raise WeightSyncError(
                f"{where}: manifest_checksum does not match the manifest's content (edited, "
                "truncated or corrupt manifest); nothing of this version was applied. Republish "
                "the version"
            )
        return cls._validate(raw, where, expect_version)

    @classmethod
    def _validate(cls, raw: dict[str, Any], where: str, expect_version: int | None) -> Manifest:
        version = _get(raw, "version", int, where)
        base = _get(raw, "base_version", (int, type(None)), where)
        kind = _get(raw, "kind", str, where)
        algorithm = _get(raw, "checksum", str, where)
        extra = _get(raw, "extra", dict, where)
        names_raw = _get(raw, "names", list, where)
        rows = _get(raw, "tensors", list, where)
        num_tensors = _get(raw, "num_tensors", int, where)
        num_entries = _get(raw, "num_entries", int, where)
        if not all(isinstance(n, str) for n in names_raw):
            raise WeightSyncError(f"{where}: field 'names' must be a list of strings")
        entries = tuple(_entry(t, f"{where}: tensors[{i}]") for i, t in enumerate(rows))
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
        if num_tensors != len(names_raw) or num_entries != len(entries):
            raise WeightSyncError(
                f"{where}: counts disagree with the lists: num_tensors={num_tensors} for "
                f"{len(names_raw)} names, num_entries={num_entries} for {len(entries)} tensor "
                "entries (an entry was added or removed); republish the version"
            )
        names = frozenset(names_raw)
        if len(names) != len(names_raw):
            dup = sorted({n for n in names_raw if names_raw.count(n) > 1})
            raise WeightSyncError(f"{where}: names {dup[:5]} appear twice in 'names'")
        listed = [e.name for e in entries]
        if len(set(listed)) != len(listed):
            dup = sorted({n for n in listed if listed.count(n) > 1})
            raise WeightSyncError(f"{where}: tensors {dup[:5]} have two entries; republish")
        unknown = sorted(set(listed) - names)
        missing = sorted(names - set(listed)) if kind == "full" else []
        if unknown or missing:
            raise WeightSyncError(
                f"{where}: tensor entries and 'names' disagree (entries not in names: "
                f"{unknown[:5]}, names without an entry: {missing[:5]}); a full checkpoint must "
                "list every name once. Republish the version"
            )
        for e in entries:
            dtype_from_name(e.dtype)
            if e.offset < 0 or e.length < 0 or any(d < 0 for d in e.shape):
                raise WeightSyncError(
                    f"{where}: tensor {e.name!r} has a negative offset, length or dimension"
                )
            if e.encoding not in _ENTRY_ENCODINGS or (kind == "full" and e.encoding != "full"):
                raise WeightSyncError(
                    f"{where}: tensor {e.name!r} has encoding {e.encoding!r}; expected one of "
                    f"{_ENTRY_ENCODINGS} ('full' in a full checkpoint)"
                )
            if e.layout not in LAYOUTS or (e.layout != "bytes" and e.encoding != "xor"):
                raise WeightSyncError(
                    f"{where}: tensor {e.name!r} has layout {e.layout!r} with encoding "
                    f"{e.encoding!r}; expected one of {LAYOUTS} ('planes' only for xor). "
                    "The manifest is corrupt or from a newer rl-weightsync: use the same version "
                    "on sender and receivers"
                )
        return cls(
            version=version,
            base_version=base,
            kind=kind,
            tensors=entries,
            names=tuple(names_raw),
            checksum=algorithm,
            extra=dict(extra),
        )


def sign(body: Mapping[str, Any]) -> str:
    """``manifest_checksum`` of a manifest body (:meth:`Manifest.body`)."""
    return bytes_checksum(canonical_json(body), MANIFEST_CHECKSUM)


def check_name_set(
    manifest: Manifest,
    *,
    current_version: int,
    held: frozenset[str] | None,
    target_names: frozenset[str] | None = None,
) -> None:
    """Refuse ``manifest`` if applying it could leave a tensor stale or unknown on the receiver.

    ``held``: the names of the version the receiver holds (``None`` when it cannot know, e.g. a
    fresh receiver). ``target_names``: the names the target itself reports (``None`` when it does
    not). A delta must name exactly what is held (and what the target holds). A full checkpoint
    must too, unless the target reports exactly the checkpoint's names (or holds nothing yet):
    then every tensor of the target is overwritten and none can stay stale.
    """
    if target_names is not None and (target_names or manifest.kind == "delta"):
        _refuse_names(manifest, current_version, target_names, "the target reports")
        if manifest.kind == "full":
            return
    if held is not None:
        _refuse_names(manifest, current_version, held, "of the version this receiver holds")


def _refuse_names(manifest: Manifest, current: int, have: frozenset[str], who: str) -> None:
    new = frozenset(manifest.names)
    if have == new:
        return
    gone, added = sorted(have - new), sorted(new - have)
    raise WeightSyncError(
        f"weight version {manifest.version} refused: its {len(new)} tensor names differ from "
        f"the {len(have)} names {who} (current version {current}; missing from the update: "
        f"{gone[:5]}{' ...' if len(gone) > 5 else ''}, not held: {added[:5]}"
        f"{' ...' if len(added) > 5 else ''}). Applying it would leave tensors stale; the "
        "receiver stays on its version. If the model's parameters really changed, restart the "
        "engines from a checkpoint of the new model; otherwise publish every tensor"
    )
