"""In-process weight transport: the trainer and the generator share one Python process.

The embedded default of the ``local`` runtime. ``publish`` keeps a detached copy of the weights
(the trainer goes on training the originals), ``receive`` hands the copy to the generator after
checking the version and the checksums::

    transport = InProcessTransport(InProcessTransport.Config(keep_versions=2))
    update = transport.publish(policy.version, policy.named_weights())
    transport.apply(update, generator)          # generator.load_weights(..., version=...)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rl_core.config import PositiveInt
from rl_core.errors import WeightSyncError
from rl_core.interfaces import WeightTransport
from rl_core.types import WeightUpdate
from rl_weightsync.adapter import check_update_kind, publish_extra
from rl_weightsync.checksum import CHECKSUM_ALGORITHMS, tensor_checksum, verify_checksum

__all__ = ["InProcessTransport"]


@dataclass(frozen=True, slots=True)
class _Stored:
    tensors: tuple[tuple[str, torch.Tensor], ...]
    checksums: tuple[str, ...] | None
    extra: dict[str, Any]


class InProcessTransport(WeightTransport):
    """Keeps the last ``keep_versions`` published versions in memory, as detached copies.

    Receivers refuse a version that is not newer than theirs (a replay or an out-of-order update)
    and a version that was never published here or has been pruned. With ``verify`` on, every
    tensor is checked against the checksum taken at publish time before anything is yielded.
    The tensors yielded are the transport's own copies: treat them as read-only.
    """

    name: ClassVar[str] = "inprocess"

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`InProcessTransport`."""

        keep_versions: PositiveInt = 2
        """How many of the newest published versions stay available to receivers (>= 1)."""
        device: str | None = "cpu"
        """Where copies are kept; ``None`` keeps each tensor on its own device."""
        verify: bool = True
        """Checksum every tensor at publish and verify it at receive."""
        checksum: str = "xxh3_128"
        """Checksum algorithm when ``verify`` is on (see ``rl_weightsync.checksum``)."""

    def __init__(self, config: Config | None = None) -> None:
        """Build from ``config`` (defaults when omitted); raises WeightSyncError on bad values."""
        self.config = config if config is not None else self.Config()
        if self.config.keep_versions < 1:
            raise WeightSyncError(
                f"InProcessTransport.Config.keep_versions: expected an int >= 1, got "
                f"{self.config.keep_versions!r}. Set keep_versions to 1 or more"
            )
        if self.config.verify and self.config.checksum not in CHECKSUM_ALGORITHMS:
            raise WeightSyncError(
                f"InProcessTransport.Config.checksum: unknown algorithm {self.config.checksum!r}; "
                f"use one of {sorted(CHECKSUM_ALGORITHMS)}"
            )
        self._versions: OrderedDict[int, _Stored] = OrderedDict()
        self._last_version: int | None = None
        self._lock = threading.Lock()

    @property
    def versions(self) -> tuple[int, ...]:
        """Versions currently held, oldest first."""
        with self._lock:
            return tuple(self._versions)

    def publish(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> WeightUpdate:
        """Copy ``named_tensors`` as ``version`` (must exceed every earlier published version).

        ``metadata`` goes into the returned update (e.g. the adapter marker of
        :func:`rl_core.lora.with_adapter`; see :mod:`rl_weightsync.adapter`)."""
        with self._lock:
            last = self._last_version
        if last is not None and version <= last:
            raise WeightSyncError(
                f"publish of weight version {version} refused: version {last} was already "
                "published and versions must increase. Publish with a version above "
                f"{last} (e.g. the policy's step counter)"
            )
        copies: list[tuple[str, torch.Tensor]] = []
        seen: set[str] = set()
        for name, tensor in named_tensors:
            if name in seen:
                raise WeightSyncError(
                    f"publish of weight version {version}: tensor {name!r} appears twice; "
                    "named_tensors must yield each name once"
                )
            if not isinstance(tensor, torch.Tensor):
                raise WeightSyncError(
                    f"publish of weight version {version}: {name!r} is a "
                    f"{type(tensor).__name__}, not a torch.Tensor"
                )
            seen.add(name)
            device = self.config.device if self.config.device is not None else tensor.device
            copy = tensor.detach().to(
                device=device, copy=True, memory_format=torch.contiguous_format
            )
            copies.append((name, copy))
        extra = publish_extra(seen, metadata, version=version)
        checksums = (
            tuple(tensor_checksum(t, self.config.checksum) for _, t in copies)
            if self.config.verify
            else None
        )
        with self._lock:
            if self._last_version is not None and version <= self._last_version:
                raise WeightSyncError(
                    f"publish of weight version {version} refused: version "
                    f"{self._last_version} was published concurrently; versions must increase"
                )
            self._versions[version] = _Stored(tuple(copies), checksums, extra)
            self._last_version = version
            while len(self._versions) > self.config.keep_versions:
                self._versions.popitem(last=False)
        nbytes = sum(t.numel() * t.element_size() for _, t in copies)
        return WeightUpdate(
            version=version,
            base_version=None,
            transport=self.name,
            location=f"inprocess:{id(self):x}",
            metadata={
                **(metadata or {}),
                "payload": extra["payload"],
                "num_tensors": len(copies),
                "bytes": nbytes,
            },
        )

    def receive(
        self, update: WeightUpdate, *, current_version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Verified tensors of ``update``; refuses replays, stale and unknown versions."""
        stored = self._check(update, current_version)
        return iter(stored.tensors)

    def _check(self, update: WeightUpdate, current_version: int) -> _Stored:
        version = update.version
        if update.transport != self.name:
            raise WeightSyncError(
                f"weight version {version}: update made by transport {update.transport!r}, "
                f"not {self.name!r}; pass it to the transport that published it"
            )
        if version <= current_version:
            raise WeightSyncError(
                f"weight version {version} refused: the receiver is already on version "
                f"{current_version} (replayed or out-of-order update). Apply only newer updates"
            )
        with self._lock:
            stored = self._versions.get(version)
            held = tuple(self._versions)
        if stored is None:
            raise WeightSyncError(
                f"weight version {version} is not held by this transport (held: {list(held)}); "
                "it was never published here or has been pruned. Apply the newest update, or "
                "raise InProcessTransport.Config.keep_versions"
            )
        check_update_kind(update, [n for n, _ in stored.tensors], stored.extra)
        if stored.checksums is not None:
            for (name, tensor), digest in zip(stored.tensors, stored.checksums):
                verify_checksum(tensor, digest, name=name, version=version)
        return stored

    def close(self) -> None:
        """Drop every held version."""
        with self._lock:
            self._versions.clear()
