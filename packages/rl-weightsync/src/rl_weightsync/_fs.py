"""Atomic file-system helpers shared by the disk transports (private).

Version creation is exclusive: a writer stages the whole version (payload, manifest, and the
``COMPLETE`` marker last) in a private temporary directory, then publishes it with a rename that
never replaces an existing directory (``renameat2(RENAME_NOREPLACE)``; where the file system lacks
it, an existence check plus ``rename``, which fails onto a non-empty directory). Of two writers of
one version exactly one wins; the other gets a :class:`WeightSyncError` and its staged directory
is removed. A version directory that is visible is always whole.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rl_core.errors import WeightSyncError
from rl_core.lora import ADAPTER_KEY
from rl_weightsync.bucketing import iter_buckets, tensor_nbytes
from rl_weightsync.checksum import tensor_checksum
from rl_weightsync.manifest import Manifest, TensorEntry, dtype_name

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"
_VERSION_RE = re.compile(r"^weight_v(\d{6,})$")


def version_dirname(version: int) -> str:
    """``weight_v000042``."""
    return f"weight_v{version:06d}"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_synced(path: Path, data: bytes) -> None:
    """Write and fsync."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary sibling, fsync, rename over ``path``, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    write_bytes_synced(tmp, text.encode())
    os.replace(tmp, path)
    fsync_path(path.parent)


def complete_versions(directory: Path) -> list[int]:
    """Versions under ``directory`` whose completion marker exists, ascending."""
    if not directory.is_dir():
        return []
    out = []
    for child in directory.iterdir():
        m = _VERSION_RE.match(child.name)
        if m and (child / COMPLETE).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def all_versions(directory: Path) -> list[int]:
    """Versions under ``directory`` with or without marker, ascending."""
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for c in directory.iterdir() if (m := _VERSION_RE.match(c.name)))


def new_temp_dir(directory: Path, version: int) -> Path:
    """A fresh hidden temporary directory inside ``directory`` (same file system as the target)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-{version_dirname(version)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


@contextlib.contextmanager
def staged_version(directory: Path, version: int) -> Iterator[Path]:
    """A fresh temporary directory to write ``version`` into; removed if the body raises, so a
    failed publish leaves nothing behind (commit it with :func:`commit_version`)."""
    tmp = new_temp_dir(directory, version)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit_version(tmp: Path, directory: Path, version: int, manifest: Manifest) -> Path:
    """Write ``manifest`` into the staged ``tmp``, then publish it as ``version``'s directory
    (:func:`commit_dir`: marker last, exclusive rename); returns that directory."""
    write_bytes_synced(tmp / MANIFEST, manifest.to_json().encode())
    final = directory / version_dirname(version)
    commit_dir(tmp, final, what=f"weight version {version}")
    return final


def commit_dir(tmp: Path, final: Path, *, what: str) -> None:
    """Write the completion marker last inside the staged ``tmp``, fsync it, and rename it to
    ``final`` unless ``final`` already exists (then WeightSyncError; ``tmp`` is left for the
    caller's :func:`staged_version` to remove)."""
    write_bytes_synced(tmp / COMPLETE, b"")
    fsync_path(tmp)
    try:
        rename_noreplace(tmp, final)
    except FileExistsError:
        raise WeightSyncError(
            f"publish of {what} refused: {str(final)!r} already exists (another publisher wrote "
            "this version first, or a crashed one left it behind). Nothing was changed; publish "
            "a higher version, or remove the directory if no receiver uses it"
        ) from None
    fsync_path(final.parent)


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Any:
    """glibc's ``renameat2`` (Linux >= 3.15, glibc >= 2.28), or ``None``."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` atomically; FileExistsError if ``dst`` exists (even empty)."""
    fn = _renameat2()
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
        # The file system does not support RENAME_NOREPLACE: fall back below.
    rename_checked(src, dst)


def rename_checked(src: Path, dst: Path) -> None:
    """Fallback of :func:`rename_noreplace`: refuse an existing ``dst``, then ``rename``, which
    fails onto a non-empty directory, so two writers staging whole versions never both win."""
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
            raise FileExistsError(e.errno, e.strerror, str(dst)) from None
        raise


def remove_version_dir(path: Path) -> None:
    """Remove the marker first (readers stop trusting it), then the directory."""
    with contextlib.suppress(OSError):
        (path / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def prune(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete versions and remove older ones. Staging directories
    (``.tmp-*``) are left alone: one may belong to a writer still running in another process."""
    done = complete_versions(directory)
    for v in done[:-keep] if keep > 0 else done:
        remove_version_dir(directory / version_dirname(v))


def write_safetensors_checkpoint(
    out_dir: Path,
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int,
    checksum: str,
    version: int,
) -> list[TensorEntry]:
    """Write ``model.safetensors`` or shards + index into ``out_dir`` (fsynced); return entries."""
    shards = list(iter_buckets(named_tensors, max_shard_bytes)) or [[]]
    n = len(shards)
    entries: list[TensorEntry] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {name: t.contiguous() for name, t in shard}
        save_file(
            tensors, str(out_dir / fname), metadata={"format": "pt", "weight_version": str(version)}
        )
        fsync_path(out_dir / fname)
        for name, t in shard:
            weight_map[name] = fname
            entries.append(
                TensorEntry(
                    name=name,
                    dtype=dtype_name(t.dtype),
                    shape=tuple(t.shape),
                    checksum=tensor_checksum(t, checksum),
                    file=fname,
                )
            )
    if n > 1:
        total = sum(tensor_nbytes(t) for _, t in named_tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_bytes_synced(out_dir / INDEX, json.dumps(index, indent=2).encode())
    return entries


def copy_assets(source: Path | None, out_dir: Path, patterns: Iterable[str]) -> None:
    """Copy config/tokenizer files matching ``patterns`` from ``source`` (weights excluded)."""
    if source is None:
        return
    if not source.is_dir():
        raise WeightSyncError(
            f"assets_dir {str(source)!r} is not a directory; point it at the Hugging Face "
            "checkpoint the engines started from (config.json, tokenizer files)"
        )
    for pattern in patterns:
        for f in sorted(source.glob(pattern)):
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX:
                shutil.copyfile(f, out_dir / f.name)
                fsync_path(out_dir / f.name)


def read_manifest(version_dir: Path, version: int) -> Manifest:
    """Read and validate ``manifest.json`` of a version directory."""
    path = version_dir / MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise WeightSyncError(
            f"weight version {version}: {str(path)!r} is missing; the version is incomplete or was "
            "pruned. Apply a newer version or republish"
        ) from None
    except OSError as e:
        raise WeightSyncError(
            f"weight version {version}: cannot read {str(path)!r} ({e}); fix the file's "
            "permissions or republish the version"
        ) from None
    return Manifest.from_json(data, source=str(path), expect_version=version)


def read_complete_manifest(directory: Path, version: int, transport: str) -> Manifest:
    """The verified manifest of complete ``version`` under ``directory``.

    Raises:
        WeightSyncError: no complete version there (naming the directory), or a bad manifest.
    """
    vdir = directory / version_dirname(version)
    if not (vdir / COMPLETE).is_file():
        raise WeightSyncError(
            f"weight version {version}: no complete version at {str(vdir)!r} (never published, "
            f"still being written, or pruned); the {transport} transport's newest_version() "
            "names the newest one"
        )
    return read_manifest(vdir, version)


def recorded_marker(manifest: Manifest) -> dict[str, Any]:
    """The adapter marker the sender recorded in ``manifest`` (as update metadata), or ``{}``."""
    marker = manifest.extra.get(ADAPTER_KEY)
    return {ADAPTER_KEY: marker} if marker is not None else {}
