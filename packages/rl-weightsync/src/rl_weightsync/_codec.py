"""The lossless delta codec of :class:`~rl_weightsync.disk_delta.DiskDeltaTransport`: XOR or
overwrite deltas of raw tensor bytes, zstd-compressed.

Two layouts of an ``xor`` delta (the manifest entry's ``layout`` says which one a blob uses):

- ``bytes`` (the original format): one zstd frame of the XOR bytes.
- ``planes``: the XOR split into byte planes, plane ``j`` = byte ``j`` of every element. After a
  small optimizer step the sign/exponent planes are almost all zero and the low mantissa planes
  near-random, so each plane is stored on its own: ``zero`` (nothing stored), ``raw`` (see
  :data:`RAW_RATIO`; applying it is a plain XOR) or one zstd frame. The blob::

      b"RLXP" | u8 format (1) | u8 planes k | u8 raw group g
      | (k - g) x (u8 mode, u64 stored length) | raw group (n * g bytes) | payloads

  The lowest ``g`` planes, when all raw, are stored interleaved (``g`` in 1, 2, 4, 8) so one
  cast XOR applies them. Measured (``benchmarks/weightsync.py``, ``codec_layouts``): applying
  planes is 1.25-1.5x faster than ``bytes`` per core after an lr 1e-5 step (bf16 and fp32) with
  20% / 4% smaller deltas; after a tiny step (bf16 lr 1e-6: 4% of the bytes change) one frame
  applies faster, which ``auto`` picks.

``overwrite`` deltas have one layout (``bytes``).
"""

from __future__ import annotations

import contextlib
import struct
import threading
from typing import Any

import numpy as np
import zstandard

__all__ = ["LAYOUTS", "RAW_RATIO", "decode_delta", "encode_delta", "layout_of"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_local = threading.local()
_ALL = 2**64 - 1

LAYOUTS = ("bytes", "planes")
"""Layouts of an ``xor`` delta: one zstd frame of the XOR bytes, or its byte planes.
:func:`encode_delta` also takes ``auto`` (planes, or bytes for a very sparse XOR)."""
RAW_RATIO = 0.9
"""A plane whose zstd frame at a negative ("fast") level, where literals are not Huffman-coded,
is larger than this fraction of the plane is stored raw: only zero runs make a plane worth
decompressing (Huffman-only gains of 15-30% on near-random mantissa bytes decode at ~1 GB/s)."""
_MAGIC = b"RLXP"
_PLANES_FORMAT = 1
_ZERO, _RAW, _ZSTD = 0, 1, 2
_PLANE_HEAD = struct.Struct("<BQ")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SPARSE = 0.1
"""``auto``: an XOR whose planes (none raw) compress below this fraction is stored as one frame
(``bytes``): zstd's zero-run copies dominate there and the planes' recombination passes cost
more than they save (bf16 at lr 1e-6: 0.044 of full; bytes 1.16 GB/s, planes 0.93 GB/s)."""
_BLOCK = 1 << 17
"""Elements per block of the byte-plane decode: every pass of a block stays in the L2 cache
(unblocked whole-tensor passes measured 15% slower on 32 MB tensors)."""


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
    old: np.ndarray,
    new: np.ndarray,
    *,
    itemsize: int,
    encoding: str,
    level: int = 1,
    layout: str = "bytes",
    raw_ratio: float = RAW_RATIO,
) -> bytes | None:
    """zstd-compressed delta from ``old`` to ``new`` raw bytes, or ``None`` if they are equal.

    ``xor``: ``old ^ new``, in ``layout`` (see the module doc; a plane whose zstd frame is over
    ``raw_ratio`` of its size is stored raw; ``auto`` picks ``planes`` or, for a very sparse XOR,
    ``bytes``: :func:`layout_of` tells which). ``overwrite``: ``[count u64][positions u32|u64 ...][new elements]``
    over elements of ``itemsize`` bytes, or ``[2**64-1][all new bytes]`` when that is smaller
    (a dense change); both forms are idempotent.
    """
    if layout not in (*LAYOUTS, "auto"):
        raise ValueError(f"layout {layout!r} is not one of {(*LAYOUTS, 'auto')}")
    if encoding == "xor":
        x = np.bitwise_xor(_wide(old), _wide(new))
        if not x.any():
            return None
        if layout != "bytes":
            blob = _encode_planes(
                x.view(np.uint8), itemsize, level, raw_ratio, auto=layout == "auto"
            )
            if blob is not None:
                return blob
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


def layout_of(blob: bytes) -> str:
    """The layout of an ``xor`` blob of :func:`encode_delta` (from its first bytes): ``planes``
    or ``bytes``. Raises ``ValueError`` for neither."""
    head = bytes(memoryview(blob)[:4])
    if head == _MAGIC:
        return "planes"
    if head == _ZSTD_MAGIC:
        return "bytes"
    raise ValueError(f"blob starts with {head!r}: neither a byte-plane delta nor a zstd frame")


def decode_delta(
    old: np.ndarray,
    blob: bytes,
    *,
    itemsize: int,
    encoding: str,
    layout: str = "bytes",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """New raw bytes from ``old`` and a blob of :func:`encode_delta`, written to ``out`` (a new
    array by default; ``old`` itself to apply in place, which saves an allocation as large as
    the tensor) and returned. ``old`` is only modified when it is ``out``.

    ``layout`` is the one the blob was encoded with. Raises ``ValueError`` on a malformed blob
    (the caller names tensor and version); an in-place ``old`` is then partly patched.
    """
    if layout not in LAYOUTS or (layout == "planes" and encoding != "xor"):
        raise ValueError(f"layout {layout!r} of a {encoding} delta is not one of {LAYOUTS}")
    if out is not None and (out.dtype != np.uint8 or out.shape != old.shape):
        raise ValueError(f"out must be uint8 {old.shape}, got {out.dtype} {out.shape}")
    if layout == "planes":
        return _decode_planes(old, blob, itemsize, out)
    n = old.size
    ptype_size = 4 if n // max(itemsize, 1) < 2**32 else 8
    bound = n if encoding == "xor" else 8 + max(n, (n // itemsize) * (ptype_size + itemsize))
    size = zstandard.frame_content_size(blob)
    if size < 0 or size > bound:
        raise ValueError(f"frame content size {size} outside [0, {bound}]")
    if encoding == "xor":
        if size != n:
            raise ValueError(f"frame holds {size} bytes, expected {n}")
        with zstandard.ZstdDecompressor().stream_reader(blob) as reader:
            if out is old:  # stream the XOR through a small buffer into old
                buf = np.empty(min(n, 8 * _BLOCK), dtype=np.uint8)
                for start in range(0, n, buf.size):
                    part, x = old[start : start + buf.size], buf[: min(buf.size, n - start)]
                    _fill(reader, x)
                    np.bitwise_xor(_wide(part), _wide(x), out=_wide(part))
                return old
            out = np.empty_like(old) if out is None else out
            _fill(reader, out)  # decompress straight into the output, then XOR in place
        np.bitwise_xor(_wide(out), _wide(old), out=_wide(out))
        return out
    raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=bound)
    (count,) = struct.unpack_from("<Q", raw)
    if count == _ALL:
        if len(raw) != 8 + n:
            raise ValueError(f"dense overwrite payload of {len(raw)} bytes, expected {8 + n}")
        dense = np.frombuffer(raw, dtype=np.uint8, offset=8)
        if out is None:
            return dense.copy()
        np.copyto(out, dense)
        return out
    if len(raw) != 8 + count * (ptype_size + itemsize):
        raise ValueError(f"overwrite payload of {len(raw)} bytes does not hold {count} elements")
    ptype = np.uint32 if ptype_size == 4 else np.uint64
    pos = np.frombuffer(raw, dtype=ptype, count=count, offset=8)
    vals = np.frombuffer(raw, dtype=_UINT[itemsize], count=count, offset=8 + count * ptype_size)
    if count and int(pos.max()) >= n // itemsize:
        raise ValueError("overwrite position out of range")
    if out is None:
        out = old.copy()
    elif out is not old:
        np.copyto(out, old)
    out.view(_UINT[itemsize])[pos] = vals
    return out


def _planes_of(nbytes: int, itemsize: int) -> int:
    """Planes of a tensor of ``nbytes``: one per byte of an element (one plane for 1-byte
    elements or a byte count that is not a whole number of elements)."""
    return itemsize if itemsize in (2, 4, 8) and nbytes % itemsize == 0 else 1


def _le(width: int) -> np.dtype:
    """Little-endian unsigned integer of ``width`` bytes: byte ``j`` is bits ``8j..8j+7``."""
    return np.dtype(f"<u{width}")


def _encode_planes(
    x: np.ndarray, itemsize: int, level: int, raw_ratio: float, *, auto: bool
) -> bytes | None:
    """The ``planes`` blob of the XOR bytes ``x`` (see the module doc); ``None`` with ``auto``
    when the XOR is so sparse that one frame of it applies faster."""
    k = _planes_of(x.size, itemsize)
    n = x.size // k
    cols = x.reshape(n, k)
    coded: list[tuple[int, bytes | memoryview]] = []
    for j in range(k):
        plane = np.ascontiguousarray(cols[:, j])
        if not plane.any():
            coded.append((_ZERO, b""))
            continue
        # Probe at a negative level, which stores literals raw: a plane that only compresses
        # through Huffman-coded literals (near-random mantissa bytes) decodes at ~1 GB/s for a
        # 10-30% gain, so it is stored raw; zero runs (matches) are what pays.
        frame = _compressor(min(level, -1)).compress(plane)
        if len(frame) > raw_ratio * n:
            coded.append((_RAW, plane.data))
            continue
        coded.append((_ZSTD, frame if level < 0 else _compressor(level).compress(plane)))
    if (
        auto
        and all(m != _RAW for m, _ in coded)
        and sum(len(c) for _, c in coded) < _SPARSE * x.size
    ):
        return None
    g = 0  # the raw low planes, stored interleaved so one cast XOR applies them
    while 2 * max(g, 1) <= k and all(m == _RAW for m, _ in coded[: 2 * max(g, 1)]):
        g = 2 * max(g, 1)
    if g == 0 and coded[0][0] == _RAW:
        g = 1
    heads = [_PLANE_HEAD.pack(m, len(c)) for m, c in coded[g:]]
    group = [np.ascontiguousarray(cols[:, :g]).data] if g else []
    bodies = [c for _, c in coded[g:]]
    return b"".join([_MAGIC, struct.pack("<BBB", _PLANES_FORMAT, k, g), *heads, *group, *bodies])


def _fill(reader: Any, buf: np.ndarray) -> None:
    """Read exactly ``buf.size`` bytes of a zstd stream into ``buf``."""
    view, filled = memoryview(buf), 0
    while filled < buf.size:
        got = reader.readinto(view[filled:])
        if not got:
            raise ValueError(f"a zstd frame ended {buf.size - filled} bytes early")
        filled += got


def _read_planes(
    blob: bytes, nbytes: int, itemsize: int
) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Parse and check a ``planes`` header: ``(k, g, [(mode, offset, length)])``, the last
    for planes ``g..k-1``; the raw group (``n * g`` bytes) starts right after the header."""
    mv = memoryview(blob)
    if len(mv) < 7 or bytes(mv[:4]) != _MAGIC:
        raise ValueError("not a byte-plane delta (bad magic); is the manifest's layout right?")
    fmt, k, g = struct.unpack_from("<BBB", mv, 4)
    if fmt != _PLANES_FORMAT:
        raise ValueError(f"byte-plane format {fmt} is not supported (this code reads 1)")
    if k != _planes_of(nbytes, itemsize) or g not in (0, 1, 2, 4, 8) or g > k:
        raise ValueError(
            f"{k} planes with a raw group of {g}, expected {_planes_of(nbytes, itemsize)}"
        )
    n = nbytes // k
    off = 7 + (k - g) * _PLANE_HEAD.size
    if len(mv) < off:
        raise ValueError("byte-plane header truncated")
    off, planes = off + n * g, []
    for j in range(g, k):
        mode, length = _PLANE_HEAD.unpack_from(mv, 7 + (j - g) * _PLANE_HEAD.size)
        if mode not in (_ZERO, _RAW, _ZSTD) or (mode == _RAW and length != n):
            raise ValueError(f"plane {j}: bad mode {mode} or length {length}")
        if mode == _ZERO and length:
            raise ValueError(f"plane {j}: a zero plane stores {length} bytes")
        planes.append((mode, off, length))
        off += length
    if off != len(mv):
        raise ValueError(f"byte-plane payloads end at byte {off}, the blob has {len(mv)}")
    return k, g, planes


def _decode_planes(
    old: np.ndarray, blob: bytes, itemsize: int, out: np.ndarray | None
) -> np.ndarray:
    """New bytes from ``old`` and a ``planes`` blob, on ``k``-byte little-endian integers:
    ``new = old ^ group ^ (plane_g << 8g) ^ ...``, every cast inside numpy's ufuncs, a block of
    :data:`_BLOCK` elements at a time (zstd planes are streamed block by block).

    Of the variants measured (numpy or torch strided copies into byte columns then one wide XOR,
    torch casts, XOR into the byte columns of ``old``), the cast XORs were fastest for 2-byte
    elements and as fast for 4-byte ones.
    """
    k, g, planes = _read_planes(blob, old.size, itemsize)
    n = old.size // k
    group_off = 7 + (k - g) * _PLANE_HEAD.size  # the raw group follows the plane heads
    out = np.empty_like(old) if out is None else out
    if g == k:  # every plane raw: the XOR itself
        raw = np.frombuffer(blob, dtype=np.uint8, count=old.size, offset=group_off)
        np.bitwise_xor(_wide(old), _wide(raw), out=_wide(out))
        return out
    w = _le(k)
    old_w, out_w = old.view(w), out.view(w)
    mv = memoryview(blob)
    group = np.frombuffer(blob, dtype=_le(g), count=n, offset=group_off) if g else None
    with contextlib.ExitStack() as stack:
        sources: list[tuple[int, np.ndarray | None, Any]] = []
        for j, (mode, off, length) in zip(range(g, k), planes, strict=True):
            if mode == _RAW:
                sources.append((j, np.frombuffer(blob, dtype=np.uint8, count=n, offset=off), None))
            elif mode == _ZSTD:
                frame = mv[off : off + length]
                if zstandard.frame_content_size(frame) != n:
                    raise ValueError(f"plane {j}: frame does not hold {n} bytes")
                reader = zstandard.ZstdDecompressor().stream_reader(frame)
                sources.append((j, None, stack.enter_context(reader)))
        plane_buf = np.empty(min(n, _BLOCK), dtype=np.uint8)
        shift_buf = np.empty(min(n, _BLOCK), dtype=w)
        for start in range(0, n, _BLOCK):
            stop = min(n, start + _BLOCK)
            out_b = out_w[start:stop]
            if group is not None:
                np.bitwise_xor(old_w[start:stop], group[start:stop], out=out_b)  # cast in ufunc
            elif out is not old:
                np.copyto(out_b, old_w[start:stop])
            for j, raw, reader in sources:
                if raw is not None:
                    plane = raw[start:stop]
                else:
                    plane = plane_buf[: stop - start]
                    _fill(reader, plane)
                if j == 0:
                    np.bitwise_xor(out_b, plane, out=out_b)
                    continue
                shifted = shift_buf[: stop - start]
                np.left_shift(plane, 8 * j, out=shifted, dtype=w)
                np.bitwise_xor(out_b, shifted, out=out_b)
    return out
