"""Group a stream of ``(name, tensor)`` pairs into buckets under a byte budget.

Used for safetensors shards and broadcast buckets::

    for bucket in iter_buckets(policy.named_weights(), bucket_bytes=512 << 20):
        send(bucket)                     # list of (name, tensor), total <= 512 MiB

A tensor larger than the budget travels alone in its own bucket. Order is preserved.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from rl_core.errors import WeightSyncError

__all__ = ["iter_buckets", "tensor_nbytes"]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (``numel * element_size``)."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive buckets of at most ``bucket_bytes`` (one oversized tensor per bucket)."""
    if bucket_bytes < 1:
        raise WeightSyncError(f"bucket_bytes: expected an int >= 1, got {bucket_bytes!r}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        n = tensor_nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket
