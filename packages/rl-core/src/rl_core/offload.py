"""Moving a model's state off the accelerator and back, bitwise (``Policy.offload``/``onload``).

In a colocated run the trainer and the rollout engine share the GPUs: while the engine
generates, the policy's weights, gradients and optimizer state (fp32 master weights and Adam
moments included) must leave the device, and come back unchanged before the next step. This
module does that at the level of tensor *storages*, the way FSDP frees and re-allocates its
flat parameters::

    offloader = StorageOffloader(OffloadConfig(weights=True, grads=True, optimizer=True))
    offloader.offload(tracked)      # tracked: (kind, name, tensor) of everything to move
    ...                             # the device memory is free (torch.cuda.memory_allocated drops)
    offloader.onload()              # same storages, same bytes

``offload`` copies each distinct storage once into a host buffer (pinned on CUDA, reused
across cycles) and frees the device storage in place with ``untyped_storage().resize_(0)``.
``onload`` resizes the same storage back and copies the bytes in. Because the
storage object survives, views the offloader does not know about (Megatron's ``main_grad``
views into its gradient buffer, tied weights, a transport's detached views) are valid again
after ``onload``; *between* the two calls only the tracked tensors may be used (they read the
host copy), an untracked view of a freed storage must not be touched.

A storage that cannot be resized in place (a CPU tensor memory-mapped from a safetensors file)
is released by dropping its references instead, and ``onload`` gives its tensors a fresh,
resizable storage; from then on it is freed in place like the others.

Storages are deduplicated, and the first kind that names one decides whether it moves: pass the
weights first, so an fp32 optimizer whose parameters *are* the model's weights moves them only
when ``weights`` is on.

Why not ``torch_memory_saver``: it (0.0.10 on PyPI, a CUDA-only C++ extension) keeps virtual
addresses stable by allocating through its own CUDA allocator hooks, which must be active
when the model is *built* (its ``region`` context) and which needs ``LD_PRELOAD`` or a matching
CUDA build; it cannot run on CPU, so none of its behaviour would be tested here. Storage
resizing needs nothing but torch, works on CPU and CUDA alike, and the stable-address property
is not needed because the trainer re-reads its tensors after ``onload``. SGLang uses
``torch_memory_saver`` inside its own server for ``release_memory_occupation``; that is
independent of this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = [
    "OffloadConfig",
    "OffloadKind",
    "Offloadable",
    "ResidentStorage",
    "StorageOffloader",
    "TrackedTensors",
]

OffloadKind = Literal["weights", "grads", "optimizer"]
"""What a tracked tensor is: model ``weights`` (parameters and buffers), ``grads`` (gradients
and gradient buffers) or ``optimizer`` state (master weights, Adam moments, step counters)."""


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    """What :meth:`~rl_core.interfaces.Policy.offload` moves off the device (each kind is moved or
    kept whole)."""

    weights: bool = True
    """Parameters and buffers of the model."""
    grads: bool = True
    """Gradient storage that outlives a step (Megatron's gradient buffer; HF's gradients are
    freed after every step, so there is nothing to move)."""
    optimizer: bool = True
    """Optimizer state: Adam moments, fp32 master weights of a bf16 model (sharded under the
    distributed optimizer), step counters."""
    pin_memory: bool = True
    """Host copies of CUDA storages are page-locked (faster copies; they stay allocated across
    cycles so the pinning cost is paid once)."""
    empty_cache: bool = True
    """After freeing, drop cuBLAS's workspaces and return the CUDA caching allocator's free
    blocks to the driver so another process (the colocated SGLang server) can use them."""

    def enabled(self, kind: OffloadKind) -> bool:
        """Whether tensors of ``kind`` are moved."""
        return bool(getattr(self, kind))


@dataclass(frozen=True, slots=True)
class ResidentStorage:
    """A tracked storage that holds device memory (see :meth:`StorageOffloader.resident`)."""

    kind: OffloadKind
    """The kind of the first tensor that named it."""
    name: str
    """The name of that tensor."""
    device: str
    """Where the bytes are."""
    nbytes: int
    """Its size in bytes."""


@dataclass(slots=True)
class _Entry:
    """One distinct storage being moved."""

    kind: OffloadKind
    name: str
    device: torch.device
    nbytes: int
    storage: torch.UntypedStorage | None
    host: torch.Tensor
    aliases: list[tuple[torch.Tensor, torch.dtype, int, tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=list
    )


def _view(
    storage: torch.UntypedStorage,
    device: torch.device,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return _view(storage, storage.device, torch.uint8, 0, (storage.nbytes(),), (1,))


class StorageOffloader:
    """Moves the storages of tracked tensors to host buffers and back (module docstring)."""

    def __init__(self, config: OffloadConfig | None = None) -> None:
        """``config``: which kinds move (default: all)."""
        self.config = config or OffloadConfig()
        """The kinds moved and the copy settings."""
        self._entries: list[_Entry] = []
        self._host: dict[str, torch.Tensor] = {}  # reused host buffers, by first tensor name
        self.offloaded = False
        """Whether the tracked state is on the host now."""
        self.moved_bytes: dict[str, int] = {}
        """Bytes moved by the last :meth:`offload`, per kind."""

    def offload(self, tracked: Iterable[tuple[OffloadKind, str, torch.Tensor | None]]) -> None:
        """Move the storages of ``tracked`` (``(kind, name, tensor)``; ``None`` tensors are
        skipped) to the host and free them on the device. A second call before
        :meth:`onload` does nothing."""
        if self.offloaded:
            return
        by_storage: dict[tuple[str, int], _Entry | None] = {}
        seen: set[int] = set()
        used: set[str] = set()
        for kind, name, tensor in tracked:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            key = (str(storage.device), storage.data_ptr())
            if key not in by_storage:
                if not self.config.enabled(kind) or (
                    storage.device.type != "cpu" and not storage.resizable()
                ):
                    # The first kind to name a storage decides; a device storage that cannot
                    # be resized (imported through DLPack, say) stays where it is.
                    by_storage[key] = None
                    continue
                host = self._host_buffer(name, storage)
                used.add(name)
                by_storage[key] = _Entry(
                    kind, name, storage.device, storage.nbytes(), storage, host
                )
            entry = by_storage[key]
            if entry is not None:
                entry.aliases.append(
                    (
                        tensor,
                        tensor.dtype,
                        tensor.storage_offset(),
                        tuple(tensor.shape),
                        tuple(tensor.stride()),
                    )
                )
        self._entries = [e for e in by_storage.values() if e is not None]
        for e in self._entries:
            assert e.storage is not None
            e.host.copy_(_bytes_view(e.storage), non_blocking=e.host.is_pinned())
        self._synchronize()
        self.moved_bytes = {}
        for e in self._entries:
            self.moved_bytes[e.kind] = self.moved_bytes.get(e.kind, 0) + e.nbytes
            if e.device.type == "cpu":
                # The "device" is the host: the tensors read the host copy meanwhile (never
                # a freed storage). On an accelerator they keep their device: assigning a
                # host tensor to a parameter's .data would drop its gradient accumulator and
                # the hooks on it (Megatron's DDP accumulates into main_grad through them).
                host_storage = e.host.untyped_storage()
                for tensor, dtype, offset, size, stride in e.aliases:
                    tensor.data = _view(host_storage, e.host.device, dtype, offset, size, stride)
            else:
                e.aliases.clear()
            assert e.storage is not None
            if e.storage.resizable():
                e.storage.resize_(0)
            else:  # memory-mapped: freed once unreferenced; onload gives it a new storage
                e.storage = None
        for name in set(self._host) - used:
            del self._host[name]  # a tensor that no longer exists (e.g. a dropped gradient)
        self._empty_cache()
        self.offloaded = True

    def onload(self) -> None:
        """Bring every storage moved by :meth:`offload` back, bitwise, and point the tracked
        tensors at it. Does nothing when nothing is offloaded."""
        if not self.offloaded:
            return
        for e in self._entries:
            if e.storage is None:
                e.storage = torch.empty(
                    e.nbytes, dtype=torch.uint8, device=e.device
                ).untyped_storage()
            else:
                e.storage.resize_(e.nbytes)
            _bytes_view(e.storage).copy_(e.host, non_blocking=e.host.is_pinned())
        self._synchronize()
        for e in self._entries:
            assert e.storage is not None
            for tensor, dtype, offset, size, stride in e.aliases:
                tensor.data = _view(e.storage, e.device, dtype, offset, size, stride)
            e.aliases.clear()  # no references kept while on the device
            e.storage = None
        self._entries = []
        self.offloaded = False

    def resident(
        self, tracked: Iterable[tuple[OffloadKind, str, torch.Tensor | None]]
    ) -> list[ResidentStorage]:
        """The distinct storages of ``tracked`` that hold memory outside this offloader's host
        buffers: after :meth:`offload`, exactly what stayed (kinds switched off, tensors not
        tracked at offload time); before it, everything."""
        ours = {("cpu", buf.untyped_storage().data_ptr()) for buf in self._host.values()}
        out: dict[tuple[str, int], ResidentStorage] = {}
        for kind, name, tensor in tracked:
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            key = (str(storage.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in ours or key in out:
                continue
            out[key] = ResidentStorage(kind, name, str(storage.device), storage.nbytes())
        return list(out.values())

    @property
    def host_bytes(self) -> int:
        """Bytes of the host buffers kept for reuse."""
        return sum(buf.numel() for buf in self._host.values())

    def _host_buffer(self, name: str, storage: torch.UntypedStorage) -> torch.Tensor:
        buf = self._host.get(name)
        if buf is not None and buf.numel() == storage.nbytes():
            return buf
        pin = self.config.pin_memory and storage.device.type == "cuda"
        buf = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
        self._host[name] = buf
        return buf

    def _synchronize(self) -> None:
        if any(e.device.type == "cuda" for e in self._entries):
            torch.cuda.synchronize()

    def _empty_cache(self) -> None:
        if self.config.empty_cache and any(e.device.type == "cuda" for e in self._entries):
            # cuBLAS/cuBLASLt keep per-handle workspaces (32 MiB + 1 MiB on an H100) live in
            # the caching allocator after the first matmul; they are re-created on the next.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()


TrackedTensors = Iterator[tuple[OffloadKind, str, torch.Tensor | None]]
"""``(kind, name, tensor)`` of every tensor of a model's state (``None`` where absent)."""


class Offloadable:
    """``offload``/``onload`` for a policy or critic whose ``config.offload`` is an
    :class:`OffloadConfig`: a subclass lists its state in :meth:`tracked_tensors` (weights
    first: a storage's first kind decides whether it moves) and a :class:`StorageOffloader`
    does the rest."""

    config: Any

    def tracked_tensors(self) -> TrackedTensors:
        """``(kind, name, tensor)`` of every tensor of the state; a subclass provides it."""
        raise NotImplementedError

    @property
    def offloader(self) -> StorageOffloader:
        """The storage mover (built on first use from ``config.offload``)."""
        found = self.__dict__.get("_offloader")
        if found is None:
            found = StorageOffloader(self.config.offload)
            self.__dict__["_offloader"] = found
        return found

    @property
    def is_offloaded(self) -> bool:
        """Whether the state selected by ``config.offload`` is off the device now."""
        found = self.__dict__.get("_offloader")
        return bool(found is not None and found.offloaded)

    def offload(self) -> None:
        """Move the state ``config.offload`` selects off the device and free its device memory;
        a no-op when already offloaded (local to the process: no collective)."""
        self.offloader.offload(self.tracked_tensors())

    def onload(self) -> None:
        """Bring back, bitwise, what :meth:`offload` moved; a no-op when nothing is offloaded."""
        self.offloader.onload()

    def resident_storages(self) -> list[ResidentStorage]:
        """Storages of the tracked state still holding memory outside the offloader's host
        copies (after :meth:`offload`: only kinds switched off)."""
        return self.offloader.resident(self.tracked_tensors())
