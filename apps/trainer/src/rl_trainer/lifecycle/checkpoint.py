"""Atomic, checksummed checkpoints that resume a run exactly.

Layout::

    <run_dir>/checkpoints/step_000040/
        policy/            weights (Hugging Face format), optimizer state, and for the
                           Megatron policy its distributed checkpoint (policy/megatron_dist/)
        critic/            the critic, when the run has one
        trainer_state.pt   step, phase, weight version, data cursors, buffer, RNG states, the
                           resolved config and the data digest: plain data and tensors, read
                           with ``torch.load(weights_only=True)`` (nothing in it runs code)
        config.yaml        the resolved config the checkpoint was written with
        MANIFEST.json      relative path, size and xxh3_128 of every file above
        COMPLETE           written last: the directory name and the manifest's xxh3_128

A checkpoint is written into ``.tmp-step_000040``: the models and the trainer state, then every
file is hashed and fsynced, the manifest written, ``COMPLETE`` written, and the directory renamed
into place. Readers only consider directories that hold ``COMPLETE``.

Every byte of a checkpoint is covered: each file by its size and checksum in the manifest, the
manifest by the checksum in ``COMPLETE``, and ``COMPLETE`` by its exact expected contents. A file
the manifest does not list is damage too (a loader could read it). :func:`resume_checkpoint`
checks the newest checkpoint with :func:`verify_checkpoint` before anything is loaded; a damaged
one is either skipped for the newest intact one (``checkpoint.on_damaged: fallback``, with a
warning naming each damaged file) or refused (``refuse``) with a :class:`CheckpointError`.

Checkpoints written before manifests existed (``COMPLETE`` holds only the directory name and there
is no ``MANIFEST.json``) cannot be verified; they are resumed with a :class:`CheckpointWarning`
saying so, and the run's next checkpoint has a manifest.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import xxhash

from rl_core.errors import CheckpointError

__all__ = [
    "CheckpointWarning",
    "Verdict",
    "capture_rng",
    "convert_trainer_state",
    "latest_checkpoint",
    "load_trainer_state",
    "plain_state",
    "restore_rng",
    "resume_checkpoint",
    "run_dir_write_error",
    "verify_checkpoint",
    "write_checkpoint",
]

MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
TRAINER_STATE = "trainer_state.pt"
TRAINER_STATE_FORMAT = 2
"""``trainer_state.pt`` format: 2 holds only plain data and tensors (read with
``weights_only=True``); 1 (no ``format`` key) pickled NumPy RNG state and was read with pickle."""
_STEP_DIR = re.compile(r"step_(\d+)")
_CHUNK = 8 << 20  # bytes read at a time while hashing


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped as damaged, or resumed without a manifest to verify it against."""


def capture_rng() -> dict[str, Any]:
    """The Python, NumPy and torch RNG states, as plain data and tensors (loadable with
    ``torch.load(weights_only=True)``: no pickled objects)."""
    version, mt, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": int(version), "state": list(mt), "gauss": gauss},
        "numpy": {
            "key": str(key),
            "state": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` returned."""
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    np.random.set_state(
        (
            npy["key"],
            npy["state"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])


def plain_state(obj: Any, where: str = "trainer_state") -> Any:
    """``obj`` as what ``torch.load(weights_only=True)`` reads back unchanged: dicts, lists,
    tuples, str, int, float, bool, None and tensors (NumPy scalars become Python numbers).

    Raises :class:`CheckpointError` naming the key path of anything else (an object would need
    pickle, which runs code when read)."""
    if obj is None or isinstance(obj, str | bool | int | float | torch.Tensor):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str | int):
                raise CheckpointError(
                    f"{where}: key {k!r} is a {type(k).__name__}; checkpoint state keys must be "
                    "str or int."
                )
            out[k] = plain_state(v, f"{where}.{k}")
        return out
    if isinstance(obj, list | tuple):
        items = [plain_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise CheckpointError(
        f"{where}: a {type(obj).__name__} cannot go into a checkpoint (only str, numbers, "
        "lists, dicts and tensors load without running code); keep prompt labels, metadata and "
        "reward components to JSON types."
    )


# ----------------------------------------------------------------------------- files and hashes
def _hash_file(path: Path, *, fsync: bool = False) -> tuple[int, str]:
    """Size in bytes and xxh3_128 hex digest of ``path`` (fsynced after reading if asked)."""
    h = xxhash.xxh3_128()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def _payload_files(checkpoint: Path) -> Iterator[str]:
    """Relative POSIX paths of every file under ``checkpoint`` but the manifest and marker."""
    for p in sorted(checkpoint.rglob("*")):
        rel = p.relative_to(checkpoint).as_posix()
        if rel not in (MARKER, MANIFEST) and not p.is_dir():
            yield rel


def _fsync_dirs(root: Path) -> None:
    for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _marker_text(name: str, manifest_digest: str) -> str:
    return f"{name}\n{MANIFEST} xxh3_128={manifest_digest}\n"


def _write_manifest(directory: Path, name: str) -> None:
    """Hash and fsync every file of ``directory``, then write the manifest and the marker."""
    files = []
    for rel in _payload_files(directory):
        size, digest = _hash_file(directory / rel, fsync=True)
        files.append({"path": rel, "size": size, "xxh3_128": digest})
    manifest = json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1) + "\n"
    for fname, text in (
        (MANIFEST, manifest),
        (MARKER, _marker_text(name, xxhash.xxh3_128_hexdigest(manifest.encode()))),
    ):
        with (directory / fname).open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    _fsync_dirs(directory)


def _step_dirs(root: Path) -> list[Path]:
    """``step_<N>`` directories under ``root`` holding a marker, oldest first (by N)."""
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir() and (p / MARKER).exists()
    ]
    return [p for _, p in sorted(found)]


def umask_mode() -> int:
    """The mode a plain new file of this process gets (``0o666`` less the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def match_umask(directory: Path) -> None:
    """Give every file under ``directory`` the umask's mode: some writers (safetensors) create
    their files ``0600`` through a temporary file, unlike the rest of the run's files."""
    mode = umask_mode()
    for p in directory.rglob("*"):
        if p.is_file() and not p.is_symlink() and (p.stat().st_mode & 0o777) != mode:
            p.chmod(mode)


def _fs_limits(directory: Path) -> str:
    """What the file system and the process allow in ``directory`` (free space, file-size
    limit), for errors whose writer does not say why it failed (torch's zip writer)."""
    import resource

    notes = []
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        notes.append(f"this process's file-size limit (ulimit -f) is {soft} bytes")
    d = directory
    while not d.exists() and d != d.parent:
        d = d.parent
    with contextlib.suppress(OSError):
        st = os.statvfs(d)
        notes.append(f"{st.f_bavail * st.f_frsize} bytes are free on {d}")
        if st.f_flag & os.ST_RDONLY:
            notes.append(f"{d} is on a read-only file system")
    return "; ".join(notes)


def _fs_cause(e: BaseException, directory: Path | None = None) -> str:
    """What went wrong writing a file, in words, with the fix."""
    if isinstance(e, OSError) and e.errno is not None:
        hints = {
            errno.ENOSPC: "the disk is full; free space or point run_dir at a larger disk",
            errno.EDQUOT: "the disk quota is exceeded; free space or raise the quota",
            errno.EROFS: "the file system is read-only; point run_dir at a writable directory",
            errno.EACCES: "no permission to write there; fix its permissions or change run_dir",
            errno.EPERM: "no permission to write there; fix its permissions or change run_dir",
            errno.EFBIG: "the file-size limit (ulimit -f) is too low for the checkpoint; raise it",
        }
        hint = hints.get(e.errno, "fix the file system or change run_dir")
        return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}; {hint}"
    found = _fs_limits(directory) if directory is not None else ""
    return (
        f"{type(e).__name__}: {e}; {found + '; ' if found else ''}check free space (df), write "
        "permission and the file-size limit (ulimit -f) of that directory"
    )


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


def run_dir_write_error(e: OSError, run_dir: Path) -> CheckpointError | None:
    """A :class:`CheckpointError` naming the file and the cause when ``e`` is a failed write of
    a file under ``run_dir`` (full disk, read-only, no permission, file-size limit); else
    ``None`` (the error is not the run directory's)."""
    if e.errno not in _WRITE_ERRNOS or not e.filename:
        return None
    path = Path(os.fsdecode(e.filename)).absolute()
    if not path.is_relative_to(run_dir.absolute()):
        return None
    return CheckpointError(
        f"{path}: cannot be written ({_fs_cause(e)}). The newest complete checkpoint is "
        "unchanged; fix the cause and continue with --resume."
    )


def write_checkpoint(
    run_dir: Path,
    step_index: int,
    *,
    save_models: Mapping[str, Callable[[Path], None]],
    trainer_state: dict[str, Any],
    keep: int,
    files: Mapping[str, str] | None = None,
) -> Path:
    """Write checkpoint ``step_index`` atomically with its manifest and prune all but the newest
    ``keep``.

    ``save_models`` maps a sub-directory name (``policy``, ``critic``) to the function that writes
    that model into it. ``trainer_state`` must be plain data and tensors (:func:`plain_state`);
    ``files`` maps more file names to their text (the run's ``config.yaml``).
    A file-system failure (read-only, full disk, file-size limit) raises :class:`CheckpointError`
    naming the path and the cause; the partial ``.tmp-step_N`` directory is removed and never
    taken for a checkpoint (readers only consider directories with ``COMPLETE``).
    """
    root = run_dir / "checkpoints"
    name = f"step_{step_index:06d}"
    final = root / name
    tmp = root / f".tmp-{name}"
    state = {"format": TRAINER_STATE_FORMAT, **plain_state(trainer_state)}
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for name_, save in save_models.items():
            save(tmp / name_)
        torch.save(state, tmp / TRAINER_STATE)
        for fname, text in (files or {}).items():
            (tmp / fname).write_text(text)
        match_umask(tmp)
        _write_manifest(tmp, name)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except CheckpointError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint {tmp} not written: {e}") from e
    except Exception as e:  # OSError, torch's RuntimeError, SafetensorError: a write failed
        shutil.rmtree(tmp, ignore_errors=True)
        where = getattr(e, "filename", None) or tmp
        raise CheckpointError(
            f"{where}: cannot write checkpoint {final.name} ({_fs_cause(e, root)}). Nothing of "
            "it is kept; the newest complete checkpoint is unchanged."
        ) from e
    done = _step_dirs(root)
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (partial ones are ignored; not verified)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    done = _step_dirs(root)
    return done[-1] if done else None


# ----------------------------------------------------------------------------- verification
@dataclass(frozen=True, slots=True)
class Verdict:
    """What :func:`verify_checkpoint` found in one checkpoint."""

    checkpoint: Path
    """The checkpoint directory."""
    problems: tuple[str, ...]
    """One line per damaged, missing or stray file, each starting with the file's path."""
    verified: bool
    """False for a checkpoint written before manifests existed: nothing could be checked."""

    @property
    def intact(self) -> bool:
        """No problem found."""
        return not self.problems


def verify_checkpoint(checkpoint: Path) -> Verdict:
    """Check every file of a complete ``checkpoint`` against its manifest.

    Sizes are compared first, then the xxh3_128 of each file whose size matches. Files the
    manifest lists but the directory lacks, and files the directory holds but the manifest does
    not list, are problems too.
    """
    marker, manifest_path = checkpoint / MARKER, checkpoint / MANIFEST
    try:
        marker_bytes = marker.read_bytes()
        manifest_bytes = manifest_path.read_bytes() if manifest_path.exists() else None
    except OSError as e:
        return Verdict(checkpoint, (f"{e.filename}: unreadable ({e.strerror})",), True)
    if manifest_bytes is None:
        if marker_bytes == f"{checkpoint.name}\n".encode():
            return Verdict(checkpoint, (), False)  # written before manifests existed
        return Verdict(checkpoint, (f"{manifest_path}: missing ({marker} records one)",), True)
    manifest_digest = xxhash.xxh3_128_hexdigest(manifest_bytes)
    if marker_bytes != _marker_text(checkpoint.name, manifest_digest).encode():
        recorded = re.search(rb"xxh3_128=([0-9a-f]{32})\n", marker_bytes)
        if (
            recorded is None
            or marker_bytes != _marker_text(checkpoint.name, recorded.group(1).decode()).encode()
        ):
            problem = (
                f"{marker}: damaged marker (expected {_marker_text(checkpoint.name, '<hex>')!r}, "
                f"found {marker_bytes[:200]!r})"
            )
        else:
            problem = (
                f"{manifest_path}: xxh3_128 {manifest_digest}, but {marker} records "
                f"{recorded.group(1).decode()} (the manifest or the marker is damaged)"
            )
        return Verdict(checkpoint, (problem,), True)
    manifest = json.loads(manifest_bytes)  # intact: its checksum matched
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(
            f"{manifest_path}: manifest format {manifest.get('format')!r}, this rl-trainer reads "
            f"format {MANIFEST_FORMAT}; resume with the rl-trainer version that wrote it."
        )
    problems = []
    listed = set()
    for entry in manifest["files"]:
        rel, size, digest = entry["path"], entry["size"], entry["xxh3_128"]
        listed.add(rel)
        path = checkpoint / rel
        if not path.is_file():
            problems.append(f"{path}: missing (the manifest lists {size} bytes)")
            continue
        actual_size = path.stat().st_size
        if actual_size != size:
            problems.append(f"{path}: {actual_size} bytes, the manifest says {size}")
            continue
        try:
            _, actual = _hash_file(path)
        except OSError as e:
            problems.append(f"{path}: unreadable ({e.strerror})")
            continue
        if actual != digest:
            problems.append(f"{path}: xxh3_128 {actual}, the manifest says {digest}")
    problems.extend(
        f"{checkpoint / rel}: not in the manifest (a stray file a loader could read)"
        for rel in _payload_files(checkpoint)
        if rel not in listed
    )
    return Verdict(checkpoint, tuple(problems), True)


def _set_aside(checkpoint: Path) -> Path:
    """Rename a damaged checkpoint to ``damaged-<name>`` (kept for inspection, never resumed)."""
    target = checkpoint.with_name(f"damaged-{checkpoint.name}")
    n = 1
    while target.exists():
        n += 1
        target = checkpoint.with_name(f"damaged-{checkpoint.name}-{n}")
    try:
        checkpoint.rename(target)
    except OSError as e:
        raise CheckpointError(
            f"{checkpoint}: damaged, and it cannot be set aside as {target.name} "
            f"({_fs_cause(e)}). Make {checkpoint.parent} writable, or resume with "
            "checkpoint.on_damaged=refuse to see what is damaged."
        ) from e
    return target


def resume_checkpoint(
    run_dir: Path, *, on_damaged: Literal["fallback", "refuse"] = "fallback"
) -> Path | None:
    """The newest intact checkpoint of ``run_dir`` to resume from (None if it has none at all).

    Each complete checkpoint is verified, newest first. A damaged one raises a
    :class:`CheckpointError` naming its damaged files when ``on_damaged`` is ``"refuse"``; with
    ``"fallback"`` it is renamed to ``damaged-<name>`` (so neither this resume nor pruning ever
    picks it up again), a :class:`CheckpointWarning` names its damaged files, and the next older
    one is tried. Raises :class:`CheckpointError` when every checkpoint is damaged.
    """
    root = run_dir / "checkpoints"
    candidates = _step_dirs(root) if root.is_dir() else []
    if not candidates:
        return None
    damaged: list[Verdict] = []
    chosen: Verdict | None = None
    for ckpt in reversed(candidates):
        verdict = verify_checkpoint(ckpt)
        if verdict.intact:
            chosen = verdict
            break
        if on_damaged == "refuse":
            raise CheckpointError(
                f"{ckpt}: damaged checkpoint, not resumed:\n  "
                + "\n  ".join(verdict.problems)
                + f"\nDelete {ckpt} to resume from the checkpoint before it, or set "
                "checkpoint.on_damaged=fallback to do that automatically."
            )
        damaged.append(verdict)
    if chosen is None:
        raise CheckpointError(
            f"{root}: every checkpoint is damaged, nothing to resume:\n  "
            + "\n  ".join(p for v in damaged for p in v.problems)
            + f"\nRestore {root} from a copy, or start the run over without --resume."
        )
    for verdict in damaged:
        aside = _set_aside(verdict.checkpoint)
        warnings.warn(
            f"{verdict.checkpoint}: damaged checkpoint, not resumed (kept as {aside}):\n  "
            + "\n  ".join(verdict.problems)
            + f"\nResuming from {chosen.checkpoint} instead.",
            CheckpointWarning,
            stacklevel=2,
        )
    if not chosen.verified:
        warnings.warn(
            f"{chosen.checkpoint}: written before checkpoints had a {MANIFEST}; resuming from it "
            "unverified. The run's next checkpoint is checksummed.",
            CheckpointWarning,
            stacklevel=2,
        )
    return chosen.checkpoint


def _old_format(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: {why}: it was written by an older rl-trainer in a format that is read with "
        "pickle, which can run code, so it is not loaded. If you trust where this checkpoint "
        f"came from, convert it once: rl-train convert-checkpoint {path.parent} --trust"
    )


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """Read ``trainer_state.pt`` of a complete checkpoint with ``weights_only=True``: plain data
    and tensors only, nothing in the file can run code. A file of the old pickled format is
    refused with how to convert it (:func:`convert_trainer_state`)."""
    if not (checkpoint / MARKER).exists():
        raise CheckpointError(f"{checkpoint}: incomplete checkpoint (no {MARKER} marker).")
    path = checkpoint / TRAINER_STATE
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Weights only load failed" in str(e):
            raise _old_format(path, "holds pickled objects") from None
        raise CheckpointError(
            f"{path}: cannot be read ({type(e).__name__}: {e}). Delete {checkpoint} to resume "
            "from the checkpoint before it."
        ) from e
    except Exception as e:  # a damaged zip or pickle stream raises many types
        raise CheckpointError(
            f"{path}: cannot be read ({type(e).__name__}: {e}). Delete {checkpoint} to resume "
            "from the checkpoint before it."
        ) from e
    if not isinstance(state, dict) or state.get("format") != TRAINER_STATE_FORMAT:
        fmt = state.get("format") if isinstance(state, dict) else type(state).__name__
        if isinstance(state, dict) and isinstance(fmt, int) and fmt > TRAINER_STATE_FORMAT:
            raise CheckpointError(
                f"{path}: trainer state format {fmt}, this rl-trainer reads "
                f"{TRAINER_STATE_FORMAT}; resume with the rl-trainer version that wrote it."
            )
        raise _old_format(path, f"trainer state format {fmt!r}")
    return state


def convert_trainer_state(checkpoint: Path, *, trust: bool) -> Path:
    """Rewrite an old (pickled) ``trainer_state.pt`` of ``checkpoint`` in the current format
    and re-checksum the checkpoint; returns the file.

    Reading the old file unpickles it, which runs whatever code it names: only with ``trust``
    (the user vouches for the file), else :class:`CheckpointError`. A checkpoint with a
    manifest must pass its checksums first.
    """
    path = checkpoint / TRAINER_STATE
    if not trust:
        raise CheckpointError(
            f"{path}: converting unpickles the file, which runs any code it names; pass --trust "
            "only for a checkpoint you or someone you trust wrote."
        )
    if not path.is_file() or not (checkpoint / MARKER).is_file():
        raise CheckpointError(f"{checkpoint}: not a complete checkpoint (no {TRAINER_STATE}).")
    verdict = verify_checkpoint(checkpoint)
    if not verdict.intact:
        raise CheckpointError(
            f"{checkpoint}: damaged, not converted:\n  " + "\n  ".join(verdict.problems)
        )
    try:
        load_trainer_state(checkpoint)
        return path  # already the current format
    except CheckpointError:
        pass
    old = torch.load(path, weights_only=False, map_location="cpu")  # trusted by the user
    rng = old.get("rng", {})
    if isinstance(rng.get("numpy"), tuple):  # format 1: getstate() tuples
        key, keys, pos, has_gauss, cached = rng["numpy"]
        version, mt, gauss = rng["python"]
        rng = {
            "python": {"version": int(version), "state": list(mt), "gauss": gauss},
            "numpy": {
                "key": str(key),
                "state": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": rng["torch"],
        }
    new = {**old, "rng": rng}
    new.pop("format", None)
    new = {"format": TRAINER_STATE_FORMAT, **plain_state(new)}
    tmp = path.with_name(f".{TRAINER_STATE}.tmp")
    torch.save(new, tmp)
    tmp.replace(path)
    if verdict.verified:
        _write_manifest(checkpoint, checkpoint.name)
    return path
