"""The delta codec (``rl_weightsync._codec``): bitwise round trips of both ``xor`` layouts, the
original single-frame format still decoding, incompressible planes stored raw, and malformed
byte-plane blobs refused."""

from __future__ import annotations

import struct
from unittest import mock

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_weightsync import _codec
from rl_weightsync._codec import decode_delta, encode_delta, layout_of
from rl_weightsync.checksum import tensor_bytes

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float64]


def _step(n: int, dtype: torch.dtype, lr: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw bytes of N(0, 0.02) weights before and after a +-lr step on every element."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -lr, lr)
    if dtype == torch.int8:
        old = torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)
        new = torch.where(sign > 0, old, old ^ 1)
        return tensor_bytes(old), tensor_bytes(new)
    return tensor_bytes(w.to(dtype)), tensor_bytes((w + sign).to(dtype))


def _planes_header(blob: bytes) -> tuple[int, int, list[tuple[int, int]]]:
    """(planes k, raw group g, [(mode, length)] of planes g..k-1) of a ``planes`` blob."""
    assert blob[:4] == b"RLXP"
    _, k, g = struct.unpack_from("<BBB", blob, 4)
    return k, g, [struct.unpack_from("<BQ", blob, 7 + 9 * i) for i in range(k - g)]


@pytest.mark.parametrize("layout", ["bytes", "planes", "auto"])
@pytest.mark.parametrize("n", [1, 37, 4097, 2 * _codec._BLOCK + 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_xor_round_trip_is_bitwise(dtype: torch.dtype, n: int, layout: str) -> None:
    old, new = _step(n, dtype, lr=1e-3)
    isz = torch.empty((), dtype=dtype).element_size()
    blob = encode_delta(old, new, itemsize=isz, encoding="xor", layout=layout)
    assert blob is not None
    used = layout_of(blob)
    assert used == layout or layout == "auto"
    kept = old.copy()
    out = decode_delta(old, blob, itemsize=isz, encoding="xor", layout=used)
    assert out.tobytes() == new.tobytes()
    assert old.tobytes() == kept.tobytes()  # old untouched
    with pytest.raises(ValueError):  # a blob decoded on a tensor of another size
        decode_delta(old[:-isz], blob, itemsize=isz, encoding="xor", layout=used)
    # into a given array, and in place
    given = np.full_like(old, 7)
    assert decode_delta(old, blob, itemsize=isz, encoding="xor", layout=used, out=given) is given
    assert given.tobytes() == new.tobytes()
    inplace = old.copy()
    decode_delta(inplace, blob, itemsize=isz, encoding="xor", layout=used, out=inplace)
    assert inplace.tobytes() == new.tobytes()


@pytest.mark.parametrize("dense", [False, True])
def test_overwrite_into_given_array_and_in_place(dense: bool) -> None:
    old, new = _step(5000, torch.float32, lr=1e-3)
    if not dense:
        new = old.copy()
        new[40:48] ^= 0xFF
    blob = encode_delta(old, new, itemsize=4, encoding="overwrite")
    assert blob is not None
    given = np.zeros_like(old)
    assert decode_delta(old, blob, itemsize=4, encoding="overwrite", out=given) is given
    assert given.tobytes() == new.tobytes()
    inplace = old.copy()
    decode_delta(inplace, blob, itemsize=4, encoding="overwrite", out=inplace)
    assert inplace.tobytes() == new.tobytes()
    with pytest.raises(ValueError, match="out must be uint8"):
        decode_delta(old, blob, itemsize=4, encoding="overwrite", out=given.view(np.uint32))


@pytest.mark.parametrize("layout", ["bytes", "planes", "auto"])
def test_empty_and_unchanged_tensors_have_no_delta(layout: str) -> None:
    empty = np.empty(0, dtype=np.uint8)
    assert encode_delta(empty, empty, itemsize=2, encoding="xor", layout=layout) is None
    old, _ = _step(99, torch.bfloat16, lr=1e-3)
    assert encode_delta(old, old.copy(), itemsize=2, encoding="xor", layout=layout) is None


@settings(max_examples=150, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 4, 8]),
    data=st.binary(min_size=1, max_size=600),
    mask=st.binary(min_size=1, max_size=600),
    raw_ratio=st.floats(0.0, 1.5),
    layout=st.sampled_from(["bytes", "planes", "auto"]),
    block=st.sampled_from([1, 3, 64, 1 << 17]),
)
def test_random_bytes_round_trip(
    itemsize: int, data: bytes, mask: bytes, raw_ratio: float, layout: str, block: int
) -> None:
    """Any bytes (lengths not a multiple of the item size included), any sparsity, decoded in
    blocks of any size (the last one short)."""
    old = np.frombuffer(data, dtype=np.uint8)
    flips = np.resize(np.frombuffer(mask, dtype=np.uint8), old.size)
    new = old ^ flips
    blob = encode_delta(
        old, new, itemsize=itemsize, encoding="xor", layout=layout, raw_ratio=raw_ratio
    )
    if not flips.any():
        assert blob is None
        return
    assert blob is not None
    inplace = old.copy()
    with mock.patch.object(_codec, "_BLOCK", block):
        out = decode_delta(old, blob, itemsize=itemsize, encoding="xor", layout=layout_of(blob))
        decode_delta(
            inplace, blob, itemsize=itemsize, encoding="xor", layout=layout_of(blob), out=inplace
        )
    assert out.tobytes() == new.tobytes() and inplace.tobytes() == new.tobytes()


def test_original_single_frame_deltas_still_decode() -> None:
    """A blob as the original codec wrote it (one level-1 zstd frame of old ^ new, no header)
    decodes with the default layout, and ``bytes`` still writes exactly that."""
    old, new = _step(1001, torch.bfloat16, lr=1e-3)
    legacy = zstandard.ZstdCompressor(level=1).compress(old ^ new)
    assert layout_of(legacy) == "bytes"
    assert decode_delta(old, legacy, itemsize=2, encoding="xor").tobytes() == new.tobytes()
    assert encode_delta(old, new, itemsize=2, encoding="xor", layout="bytes") == legacy
    with pytest.raises(ValueError, match="bad magic"):  # a layout mismatch is refused
        decode_delta(old, legacy, itemsize=2, encoding="xor", layout="planes")


def test_incompressible_planes_are_stored_raw_and_zero_planes_not_at_all() -> None:
    # fp32, lr 1e-5 on N(0, 0.02): the two low mantissa bytes near-random, the top byte almost
    # always unchanged.
    old, new = _step(1 << 14, torch.float32, lr=1e-5)
    blob = encode_delta(old, new, itemsize=4, encoding="xor", layout="planes")
    assert blob is not None
    k, g, planes = _planes_header(blob)
    assert (k, g) == (4, 2)  # planes 0 and 1 raw, stored interleaved
    assert [m for m, _ in planes] == [2, 2]  # planes 2 and 3 zstd
    assert planes[1][1] < 0.05 * (1 << 14)
    # A change confined to the low byte of bf16: plane 1 is a zero plane (no bytes).
    old16 = np.arange(4096, dtype=np.uint16)
    new16 = old16 ^ np.uint16(1)
    blob = encode_delta(
        old16.view(np.uint8), new16.view(np.uint8), itemsize=2, encoding="xor", layout="planes"
    )
    assert blob is not None
    k, g, planes = _planes_header(blob)
    assert (k, g) == (2, 0) and planes[1] == (0, 0)
    out = decode_delta(old16.view(np.uint8), blob, itemsize=2, encoding="xor", layout="planes")
    assert out.tobytes() == new16.tobytes()
    # Random XOR: every plane raw, the blob is the XOR plus a header.
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, (2, 8000), dtype=np.uint8)
    blob = encode_delta(a, b, itemsize=4, encoding="xor", layout="planes")
    assert blob is not None and _planes_header(blob)[:2] == (4, 4) and len(blob) == 7 + 8000
    assert (
        decode_delta(a, blob, itemsize=4, encoding="xor", layout="planes").tobytes() == b.tobytes()
    )


def test_auto_layout_keeps_one_frame_for_a_very_sparse_xor() -> None:
    old, new = _step(1 << 14, torch.bfloat16, lr=1e-3)
    assert layout_of(encode_delta(old, new, itemsize=2, encoding="xor", layout="auto")) == "planes"
    sparse = old.copy()
    sparse[::997] ^= 1
    blob = encode_delta(old, sparse, itemsize=2, encoding="xor", layout="auto")
    assert blob is not None and layout_of(blob) == "bytes"


@pytest.mark.parametrize(
    "damage",
    ["truncate", "extend", "magic", "format", "planes", "mode", "length"],
)
def test_malformed_plane_blobs_are_refused(damage: str) -> None:
    old, new = _step(4096, torch.float32, lr=1e-4)
    blob = bytearray(encode_delta(old, new, itemsize=4, encoding="xor", layout="planes") or b"")
    if damage == "truncate":
        blob = blob[:-1]
    elif damage == "extend":
        blob += b"\0"
    elif damage == "magic":
        blob[0] ^= 1
    elif damage == "format":
        blob[4] = 9
    elif damage == "planes":
        blob[5] = 2
    elif damage == "mode":
        blob[7] = 7
    else:  # a plane's stored length off by one (the payloads no longer tile the blob)
        struct.pack_into("<Q", blob, 8, struct.unpack_from("<Q", blob, 8)[0] + 1)
    with pytest.raises((ValueError, zstandard.ZstdError)):
        decode_delta(old, bytes(blob), itemsize=4, encoding="xor", layout="planes")


def test_layout_arguments_are_checked() -> None:
    old, new = _step(64, torch.bfloat16, lr=1e-3)
    with pytest.raises(ValueError, match="layout"):
        encode_delta(old, new, itemsize=2, encoding="xor", layout="columns")
    with pytest.raises(ValueError, match="layout"):
        decode_delta(old, b"", itemsize=2, encoding="overwrite", layout="planes")
