"""Full Hugging Face checkpoints on disk, one directory per version.

The sender writes ``<directory>/weight_v000007/`` holding ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), the config and tokenizer files copied from ``assets_dir``, a
``manifest.json`` with per-tensor checksums, the name set and a checksum of itself, and a
``COMPLETE`` marker written last. The directory is built under a private temporary name and
renamed into place by a rename that never replaces an existing version, so readers never see a
partial version and of two publishers of one version exactly one wins::

    sender = DiskFullTransport(DiskFullTransport.Config(directory="/shared/sync", assets_dir="ckpt/"))
    update = sender.publish(7, policy.named_weights())
    # on a rollout host, with the same directory mounted:
    receiver = DiskFullTransport(DiskFullTransport.Config(directory="/shared/sync"))
    receiver.apply(update, generator)     # or a DiskWeightTarget: loads from the directory

Each version directory is itself a valid Hugging Face checkpoint (e.g. for SGLang's
``/update_weights_from_disk``). A receiver verifies the manifest, that the safetensors files hold
exactly the tensors it lists, every checksum, and that the name set equals the one it holds
(:func:`~rl_weightsync.manifest.check_name_set`) before it touches the target.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from safetensors import safe_open

from rl_core.config import PositiveInt
from rl_core.errors import WeightSyncError
from rl_core.interfaces import WeightTarget, WeightTransport
from rl_core.types import WeightUpdate
from rl_weightsync import _fs
from rl_weightsync.adapter import ADAPTER, check_update_kind, publish_extra
from rl_weightsync.checksum import CHECKSUM_ALGORITHMS, verify_checksum
from rl_weightsync.manifest import Manifest, check_name_set, dtype_from_name, safe_join

__all__ = [
    "DEFAULT_ASSET_PATTERNS",
    "DiskFullTransport",
    "DiskWeightTarget",
    "NamedWeightTarget",
    "cast_for_serving",
    "target_weight_names",
]

DEFAULT_ASSET_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges.txt",
    "*.model",
    "chat_template*",
)
"""Files copied from ``assets_dir`` into every full checkpoint."""


@runtime_checkable
class DiskWeightTarget(Protocol):
    """A target that loads a verified Hugging Face checkpoint directory itself.

    Disk transports call ``load_weights_from_disk`` instead of materialising tensors, e.g. an
    SGLang generator forwarding the path to ``/update_weights_from_disk``.
    """

    @property
    def weight_version(self) -> int:
        """Version of the weights currently loaded."""
        ...

    def load_weights_from_disk(self, path: str, *, version: int) -> None:
        """Load the checkpoint at ``path`` (verified, complete) and set ``version``."""
        ...


@runtime_checkable
class NamedWeightTarget(Protocol):
    """Optional capability of a target: it reports the tensor names it holds.

    Receivers then check an update's full name set against the target itself, and may take a full
    checkpoint whose names differ from the previous version's when they equal the target's.
    """

    @property
    def weight_names(self) -> Collection[str]:
        """Names of the tensors currently loaded (empty: nothing loaded yet)."""
        ...


def target_weight_names(target: object) -> frozenset[str] | None:
    """The names ``target`` reports (:class:`NamedWeightTarget`), or ``None``."""
    return frozenset(target.weight_names) if isinstance(target, NamedWeightTarget) else None


def cast_for_serving(
    named_tensors: Iterable[tuple[str, torch.Tensor]], serve_dtype: str | None, *, version: int
) -> list[tuple[str, torch.Tensor]]:
    """CPU copies of the tensors, floating ones cast to ``serve_dtype`` (``None`` keeps dtypes)."""
    dtype = dtype_from_name(serve_dtype) if serve_dtype else None
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for name, t in named_tensors:
        if name in seen:
            raise WeightSyncError(
                f"publish of weight version {version}: tensor {name!r} appears twice; "
                "named_tensors must yield each name once"
            )
        if not isinstance(t, torch.Tensor):
            raise WeightSyncError(
                f"publish of weight version {version}: {name!r} is a {type(t).__name__}, "
                "not a torch.Tensor"
            )
        seen.add(name)
        t = t.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(device="cpu", dtype=dtype)
        else:
            t = t.to(device="cpu", copy=True)
        out.append((name, t.contiguous()))
    return out


def _check_payload_files(version_dir: Path, manifest: Manifest) -> dict[str, list]:
    """The manifest's entries by file, after checking that the safetensors files of the directory
    are exactly the ones the manifest names (an engine loading the directory reads them all) and
    that a sharded checkpoint's index maps every name to the manifest's file."""
    version = manifest.version
    by_file: dict[str, list] = {}
    for e in manifest.tensors:
        by_file.setdefault(e.file, []).append(e)
    present = {p.name for p in version_dir.glob("*.safetensors")}
    extra = sorted(present - set(by_file))
    if extra:
        raise WeightSyncError(
            f"weight version {version}: {str(version_dir)!r} holds {extra} that its manifest does "
            "not list (unverified tensors an engine would load); republish the version"
        )
    index_path = version_dir / _fs.INDEX
    if index_path.exists() or len(by_file) > 1:
        expected = {e.name: e.file for e in manifest.tensors}
        try:
            weight_map = json.loads(index_path.read_bytes())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise WeightSyncError(
                f"weight version {version}: cannot read the shard index {str(index_path)!r} "
                f"({exc!r}); republish the version"
            ) from None
        if weight_map != expected:
            raise WeightSyncError(
                f"weight version {version}: the shard index {str(index_path)!r} does not map "
                "exactly the manifest's tensors to the manifest's files; republish the version"
            )
    return by_file


def load_checkpoint_tensors(
    version_dir: Path, manifest: Manifest
) -> list[tuple[str, torch.Tensor]]:
    """Read every tensor of a full checkpoint and verify the file set, that each file holds
    exactly the tensors the manifest puts there, and each tensor's dtype, shape and checksum."""
    version = manifest.version
    by_file = _check_payload_files(version_dir, manifest)
    out: dict[str, torch.Tensor] = {}
    for fname, entries in by_file.items():
        path = safe_join(version_dir, fname, version=version, tensor=entries[0].name)
        if not path.is_file():
            raise WeightSyncError(
                f"tensor {entries[0].name!r} of weight version {version}: file {str(path)!r} is "
                "missing; the version is incomplete or was pruned. Republish it or apply a newer one"
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                held = set(f.keys())
                listed = {e.name for e in entries}
                if held != listed:
                    raise WeightSyncError(
                        f"weight version {version}: {str(path)!r} holds tensors "
                        f"{sorted(held - listed)[:5]} the manifest does not list there and lacks "
                        f"{sorted(listed - held)[:5]} it does; republish the version"
                    )
                for e in entries:
                    out[e.name] = f.get_tensor(e.name)
        except WeightSyncError:
            raise
        except Exception as exc:  # safetensors raises its own error types for bad files
            raise WeightSyncError(
                f"tensor {entries[0].name!r} of weight version {version}: cannot read "
                f"{str(path)!r} ({exc}); the file is truncated or corrupt. Republish the version"
            ) from None
    result = []
    for e in manifest.tensors:
        t = out[e.name]
        if t.dtype != dtype_from_name(e.dtype) or tuple(t.shape) != e.shape:
            raise WeightSyncError(
                f"tensor {e.name!r} of weight version {version}: file holds {t.dtype} "
                f"{tuple(t.shape)}, manifest says {e.dtype} {e.shape}; republish the version"
            )
        verify_checksum(t, e.checksum, name=e.name, version=version)
        result.append((e.name, t))
    return result


class DiskFullTransport(WeightTransport):
    """A complete, atomically written Hugging Face safetensors checkpoint per version."""

    name: ClassVar[str] = "disk_full"

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`DiskFullTransport`."""

        directory: str | Path
        """Shared sync directory (sender writes, receivers read); created if missing."""
        keep_versions: PositiveInt = 2
        """Complete versions kept; older ones are removed after each publish (>= 1)."""
        assets_dir: str | Path | None = None
        """Hugging Face checkpoint whose config and tokenizer files are copied into each version."""
        asset_patterns: tuple[str, ...] = field(default_factory=lambda: DEFAULT_ASSET_PATTERNS)
        """Glob patterns of the files copied from ``assets_dir``."""
        max_shard_bytes: PositiveInt = 5 << 30
        """Largest safetensors shard; more bytes produce shards plus an index."""
        serve_dtype: str | None = None
        """Cast floating tensors to this dtype (``"bfloat16"``) before writing; ``None`` keeps them."""
        checksum: str = "xxh3_128"
        """Per-tensor checksum algorithm."""

    def __init__(self, config: Config) -> None:
        """Build from ``config``; raises WeightSyncError naming a bad field."""
        self.config = config
        if config.keep_versions < 1:
            raise WeightSyncError(
                f"DiskFullTransport.Config.keep_versions: expected an int >= 1, got {config.keep_versions!r}"
            )
        if config.checksum not in CHECKSUM_ALGORITHMS:
            raise WeightSyncError(
                f"DiskFullTransport.Config.checksum: unknown algorithm {config.checksum!r}; use one "
                f"of {sorted(CHECKSUM_ALGORITHMS)}"
            )
        if config.serve_dtype is not None:
            dtype_from_name(config.serve_dtype)
        self.directory = Path(config.directory)
        self._lock = threading.Lock()
        self._names: dict[int, frozenset[str]] = {}

    @property
    def versions(self) -> list[int]:
        """Complete versions present in the directory, ascending."""
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
        manifest: what a receiver in another process that only sees the directory applies.

        Raises:
            WeightSyncError: ``version`` is not complete in the directory (never published,
                still being written, pruned) or its manifest fails verification.
        """
        manifest = _fs.read_complete_manifest(self.directory, version, self.name)
        return WeightUpdate(
            version=version,
            base_version=None,
            transport=self.name,
            location=str(self.version_dir(version)),
            metadata={
                **_fs.recorded_marker(manifest),
                "payload": manifest.extra.get("payload", "weights"),
                "num_tensors": len(manifest.tensors),
                "bytes": manifest.extra.get("bytes", 0),
            },
        )

    def publish(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> WeightUpdate:
        """Write ``version`` as a full checkpoint (atomic), then prune old versions.

        ``metadata`` goes into the returned update; an adapter marker
        (:func:`rl_core.lora.with_adapter`) is also recorded in the manifest
        (:mod:`rl_weightsync.adapter`)."""
        with self._lock:
            existing = _fs.all_versions(self.directory)
            if existing and version <= existing[-1]:
                raise WeightSyncError(
                    f"publish of weight version {version} refused: version {existing[-1]} already "
                    f"exists in {str(self.directory)!r} and versions must increase. Publish a "
                    f"version above {existing[-1]} or use a fresh directory"
                )
            tensors = cast_for_serving(named_tensors, self.config.serve_dtype, version=version)
            kind = publish_extra([n for n, _ in tensors], metadata, version=version)
            with _fs.staged_version(self.directory, version) as tmp:
                entries = _fs.write_safetensors_checkpoint(
                    tmp,
                    tensors,
                    max_shard_bytes=self.config.max_shard_bytes,
                    checksum=self.config.checksum,
                    version=version,
                )
                assets = Path(self.config.assets_dir) if self.config.assets_dir else None
                _fs.copy_assets(assets, tmp, self.config.asset_patterns)
                nbytes = sum(e.nbytes for e in entries)
                manifest = Manifest(
                    version=version,
                    base_version=None,
                    kind="full",
                    tensors=tuple(entries),
                    names=tuple(sorted(e.name for e in entries)),
                    checksum=self.config.checksum,
                    extra={"bytes": nbytes, **kind},
                )
                final = _fs.commit_version(tmp, self.directory, version, manifest)
            _fs.prune(self.directory, self.config.keep_versions)
        return WeightUpdate(
            version=version,
            base_version=None,
            transport=self.name,
            location=str(final),
            metadata={
                **(metadata or {}),
                "payload": kind["payload"],
                "num_tensors": len(entries),
                "bytes": nbytes,
            },
        )

    def _check(
        self, update: WeightUpdate, current_version: int, target: object = None
    ) -> tuple[Path, Manifest, str]:
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
        vdir = self.version_dir(version)
        if not (vdir / _fs.COMPLETE).is_file():
            raise WeightSyncError(
                f"weight version {version}: no complete checkpoint at {str(vdir)!r} (never "
                "published, still being written, or pruned). Apply the newest update, or raise "
                "DiskFullTransport.Config.keep_versions"
            )
        manifest = _fs.read_manifest(vdir, version)
        kind = check_update_kind(update, manifest.names, manifest.extra)
        check_name_set(
            manifest,
            current_version=current_version,
            held=self._held_names(current_version),
            target_names=target_weight_names(target),
        )
        return vdir, manifest, kind

    def _held_names(self, version: int) -> frozenset[str] | None:
        """Names of ``version`` as this receiver verified them, else as its (verified) manifest
        in the directory says; ``None`` when unknown (a base checkpoint, or pruned)."""
        with self._lock:
            if version in self._names:
                return self._names[version]
        vdir = self.version_dir(version)
        if version > 0 and (vdir / _fs.COMPLETE).is_file():
            try:
                return frozenset(_fs.read_manifest(vdir, version).names)
            except WeightSyncError:
                return None
        return None

    def _verified(self, manifest: Manifest) -> None:
        with self._lock:
            self._names[manifest.version] = frozenset(manifest.names)
            while len(self._names) > 4:
                del self._names[min(self._names)]

    def receive(
        self, update: WeightUpdate, *, current_version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """All tensors of ``update``, read and verified before the first is yielded."""
        vdir, manifest, _ = self._check(update, current_version)
        tensors = load_checkpoint_tensors(vdir, manifest)
        self._verified(manifest)
        return iter(tensors)

    def apply(self, update: WeightUpdate, target: WeightTarget | DiskWeightTarget) -> None:
        """Verify everything (manifest, name set, files, checksums), then load into ``target``
        (from the directory for a :class:`DiskWeightTarget`); a refusal leaves it untouched.
        An adapter-only version always goes through ``load_weights`` (its directory is not a
        model checkpoint)."""
        vdir, manifest, kind = self._check(update, target.weight_version, target)
        tensors = load_checkpoint_tensors(vdir, manifest)  # every byte verified before loading
        self._verified(manifest)
        if isinstance(target, DiskWeightTarget) and kind != ADAPTER:
            target.load_weights_from_disk(str(vdir), version=update.version)
        else:
            target.load_weights(tensors, version=update.version)
