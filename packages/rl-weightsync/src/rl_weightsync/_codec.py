"""The lossless delta codec of :class:`~rl_weightsync.disk_delta.DiskDeltaTransport`: XOR or
overwrite deltas of raw tensor bytes, zstd-compressed."""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

__all__ = ["decode_delta", "encode_delta"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_local = threading.local()
_ALL = 2**64 - 1


def _compressor(level: int) -> zstandard.ZstdCompressor:
    key = f"c{level}"
    c = getattr(_local, key, None)
    if c is None:
        c = zstandard.ZstdCompressor(level=level)
        setattr(_local, key, c)
    return c


def _wide(buf: np.ndarray) -> np.ndarray:
    """View a uint8 buffer with the widest unsigned type its length allows (faster XOR)."""
    for size in (8, 4, 2):
        if buf.size % size == 0:
            return buf.view(_UINT[size])
    return buf


def encode_delta(
    old: np.ndarray, new: np.ndarray, *, itemsize: int, encoding: str, level: int = 1
) -> bytes | None:
    """zstd-compressed delta from ``old`` to ``new`` raw bytes, or ``None`` if they are equal.

    ``xor``: ``old ^ new``. ``overwrite``: ``[count u64][positions u32|u64 ...][new elements]``
    over elements of ``itemsize`` bytes, or ``[2**64-1][all new bytes]`` when that is smaller
    (a dense change); both forms are idempotent.
    """
    if encoding == "xor":
        x = np.bitwise_xor(_wide(old), _wide(new))
        if not x.any():
            return None
        return _compressor(level).compress(x)
    oe, ne = old.view(_UINT[itemsize]), new.view(_UINT[itemsize])
    pos = np.flatnonzero(oe != ne)
    if pos.size == 0:
        return None
    ptype = np.uint32 if ne.size < 2**32 else np.uint64
    if pos.size * (np.dtype(ptype).itemsize + itemsize) >= new.size:  # dense change: all values
        return _compressor(level).compress(struct.pack("<Q", _ALL) + new.tobytes())
    payload = b"".join(
        (struct.pack("<Q", pos.size), pos.astype(ptype).tobytes(), ne[pos].tobytes())
    )
    return _compressor(level).compress(payload)


def decode_delta(old: np.ndarray, blob: bytes, *, itemsize: int, encoding: str) -> np.ndarray:
    """New raw bytes from ``old`` and a blob of :func:`encode_delta` (``old`` is not modified).

    Raises ``ValueError`` on a malformed blob (the caller names tensor and version).
    """
    n = old.size
    ptype_size = 4 if n // max(itemsize, 1) < 2**32 else 8
    bound = n if encoding == "xor" else 8 + max(n, (n // itemsize) * (ptype_size + itemsize))
    size = zstandard.frame_content_size(blob)
    if size < 0 or size > bound:
        raise ValueError(f"frame content size {size} outside [0, {bound}]")
    if encoding == "xor":
        if size != n:
            raise ValueError(f"frame holds {size} bytes, expected {n}")
        out = np.empty_like(old)  # decompress straight into the output, then XOR in place
        view, filled = memoryview(out), 0
        with zstandard.ZstdDecompressor().stream_reader(blob) as reader:
            while filled < n:
                got = reader.readinto(view[filled:])
                if not got:
                    raise ValueError(f"decoded {filled} bytes, expected {n}")
                filled += got
        np.bitwise_xor(_wide(out), _wide(old), out=_wide(out))
        return out
    raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=bound)
    (count,) = struct.unpack_from("<Q", raw)
    if count == _ALL:
        if len(raw) != 8 + n:
            raise ValueError(f"dense overwrite payload of {len(raw)} bytes, expected {8 + n}")
        return np.frombuffer(raw, dtype=np.uint8, offset=8).copy()
    if len(raw) != 8 + count * (ptype_size + itemsize):
        raise ValueError(f"overwrite payload of {len(raw)} bytes does not hold {count} elements")
    ptype = np.uint32 if ptype_size == 4 else np.uint64
    pos = np.frombuffer(raw, dtype=ptype, count=count, offset=8)
    vals = np.frombuffer(raw, dtype=_UINT[itemsize], count=count, offset=8 + count * ptype_size)
    out = old.copy()
    elems = out.view(_UINT[itemsize])
    if count and int(pos.max()) >= elems.size:
        raise ValueError("overwrite position out of range")
    elems[pos] = vals
    return out
