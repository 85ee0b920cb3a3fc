"""Checksums and raw bytes of tensors.

Every transport verifies the bytes a receiver is about to load against a checksum computed by the
sender. The default is xxh3-128 (fast, non-cryptographic: it catches bit flips and truncation,
not an attacker)::

    digest = tensor_checksum(t)                 # "xxh3_128:5f0c..."
    verify_checksum(t, digest, name="w", version=3)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import xxhash

from rl_core.errors import WeightSyncError

__all__ = [
    "CHECKSUM_ALGORITHMS",
    "bytes_checksum",
    "tensor_bytes",
    "tensor_checksum",
    "verify_checksum",
]


def _xxh3_128(data: memoryview | bytes | np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _xxh3_64(data: memoryview | bytes | np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(data)


CHECKSUM_ALGORITHMS: dict[str, Callable[[memoryview | bytes | np.ndarray], str]] = {
    "xxh3_128": _xxh3_128,
    "xxh3_64": _xxh3_64,
}
"""Checksum algorithms by name; a digest string is ``"<name>:<hex>"``."""


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The raw bytes of ``tensor`` (moved to CPU, made contiguous) as a flat ``uint8`` array.

    Zero-copy for a contiguous CPU tensor; works for 0-d and empty tensors and for dtypes numpy
    lacks (bfloat16), because the view is taken in torch before converting.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def bytes_checksum(data: memoryview | bytes | np.ndarray, algorithm: str = "xxh3_128") -> str:
    """Digest ``"<algorithm>:<hex>"`` of a byte buffer."""
    try:
        fn = CHECKSUM_ALGORITHMS[algorithm]
    except KeyError:
        raise WeightSyncError(
            f"unknown checksum algorithm {algorithm!r}; use one of {sorted(CHECKSUM_ALGORITHMS)}"
        ) from None
    return f"{algorithm}:{fn(data)}"


def tensor_checksum(tensor: torch.Tensor, algorithm: str = "xxh3_128") -> str:
    """Digest ``"<algorithm>:<hex>"`` of the raw bytes of ``tensor``."""
    return bytes_checksum(tensor_bytes(tensor), algorithm)


def verify_checksum(
    data: torch.Tensor | memoryview | bytes | np.ndarray, expected: str, *, name: str, version: int
) -> None:
    """Raise :class:`WeightSyncError` naming ``name`` and ``version`` unless the digest matches."""
    algorithm, sep, _ = expected.partition(":")
    if not sep:
        raise WeightSyncError(
            f"tensor {name!r} of weight version {version}: malformed checksum {expected!r} "
            "(expected '<algorithm>:<hex>'); the manifest is corrupt, republish the version"
        )
    buf = tensor_bytes(data) if isinstance(data, torch.Tensor) else data
    actual = bytes_checksum(buf, algorithm)
    if actual != expected:
        raise WeightSyncError(
            f"tensor {name!r} of weight version {version}: checksum mismatch (expected "
            f"{expected}, got {actual}); the payload is corrupt or truncated. The receiver stays on "
            "its previous version; republish the version or resync from a full checkpoint"
        )
