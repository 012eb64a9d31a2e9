"""Property tests of mmcache.codec: exact round trips, and untrusted bytes never
raise anything but CorruptEntryError."""

from __future__ import annotations

import struct

import numpy as np
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mmcache.codec import HEADER_SIZE, MAGIC, VERSION, decode, encode, read_header, verify
from mmcache.errors import CorruptEntryError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = [
    "?", "u1", "i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8",
    ">u2", ">i4", ">f8",  # big-endian inputs are converted to little-endian
]  # fmt: skip

arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(
        np.dtype(dt),
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5),
        # Arbitrary bit patterns, NaN payloads included: compare bytes, not values.
        elements=None,
    )
)
samples = st.dictionaries(st.text(max_size=12), arrays, max_size=6)


def reseal(data: bytearray) -> bytes:
    hasher = xxhash.xxh3_64(bytes(data[:8]))
    hasher.update(bytes(data[16:]))
    data[8:16] = struct.pack("<Q", hasher.intdigest())
    return bytes(data)


def decode_or_corrupt(buf: bytes, *, verify_checksum: bool) -> None:
    """Decode; the only allowed failure is CorruptEntryError. A success must be sane."""
    try:
        out = decode(buf, verify=verify_checksum)
    except CorruptEntryError:
        assert not verify(buf) or not verify_checksum
        return
    total = 0
    for arr in out.values():
        assert isinstance(arr, np.ndarray)
        assert not arr.flags.writeable
        total += arr.nbytes
    assert total <= len(buf)


@SETTINGS
@given(samples, st.floats(0, 2e9), st.floats(0, 1e3))
def test_any_sample_round_trips_exactly(
    sample: dict[str, np.ndarray], ctime: float, cost: float
) -> None:
    buf = encode(sample, ctime=ctime, cost=cost)
    out = decode(buf)
    assert list(out) == list(sample)
    for name, arr in sample.items():
        expected = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"))
        assert out[name].dtype == expected.dtype
        assert out[name].shape == arr.shape
        assert out[name].tobytes() == expected.tobytes()
    header = read_header(buf)
    assert (header.ctime, header.cost, header.length) == (ctime, cost, len(buf))
    assert verify(buf)


@SETTINGS
@given(st.binary(max_size=600))
def test_arbitrary_bytes_only_raise_corrupt_entry_error(data: bytes) -> None:
    decode_or_corrupt(data, verify_checksum=True)
    decode_or_corrupt(data, verify_checksum=False)


@SETTINGS
@given(st.binary(max_size=400), st.booleans())
def test_bytes_behind_a_valid_preamble_only_raise_corrupt_entry_error(
    rest: bytes, sealed: bool
) -> None:
    # Get past the magic and version checks so that the deeper parsing is fuzzed.
    data = bytearray(struct.pack("<4sHH", MAGIC, VERSION, 0) + rest)
    if len(data) >= 24:
        struct.pack_into("<Q", data, 16, len(data))
    buf = reseal(data) if sealed and len(data) >= 16 else bytes(data)
    decode_or_corrupt(buf, verify_checksum=True)
    decode_or_corrupt(buf, verify_checksum=False)


@st.composite
def forged_entries(draw: st.DrawFn) -> bytes:
    """Structurally plausible entries with hostile field tables, checksum valid."""
    big = st.sampled_from([0, 1, 2, 3, 7, 64, 128, 2**31, 2**32 - 1, 2**62, 2**63, 2**64 - 1])
    nfields = draw(st.integers(0, 4))
    table = bytearray()
    for _ in range(draw(st.integers(0, 4))):
        ndim = draw(st.integers(0, 10))
        name = draw(st.binary(max_size=6))
        table += struct.pack(
            "<HBB", draw(st.one_of(st.just(len(name)), big.map(lambda v: v & 0xFFFF))),
            draw(st.integers(0, 16)), ndim,
        )  # fmt: skip
        for _ in range(ndim):
            table += struct.pack("<Q", draw(st.one_of(st.integers(0, 9), big)))
        table += struct.pack("<QQ", draw(st.one_of(st.integers(0, 512), big)), draw(big))
        table += name
    payload = draw(st.binary(max_size=300))
    length = HEADER_SIZE + len(table) + len(payload)
    head = struct.pack("<4sHHQQddII", MAGIC, VERSION, 0, 0, length, 0.0, 0.0, nfields, len(table))
    return reseal(bytearray(head + table + payload))


@SETTINGS
@given(forged_entries())
def test_forged_field_tables_only_raise_corrupt_entry_error(buf: bytes) -> None:
    decode_or_corrupt(buf, verify_checksum=True)
    decode_or_corrupt(buf, verify_checksum=False)


@SETTINGS
@given(samples, st.data())
def test_mutated_encodings_only_raise_corrupt_entry_error(
    sample: dict[str, np.ndarray], data: st.DataObject
) -> None:
    buf = bytearray(encode(sample))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["set", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, len(buf)))
        if op == "set" and pos < len(buf):
            buf[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[pos : pos + data.draw(st.integers(1, 8))]
        else:
            del buf[pos:]
    sealed = reseal(bytearray(buf)) if len(buf) >= 16 else bytes(buf)
    for candidate in (bytes(buf), sealed):
        decode_or_corrupt(candidate, verify_checksum=True)
        decode_or_corrupt(candidate, verify_checksum=False)


@SETTINGS
@given(samples, st.data())
def test_single_byte_flips_are_detected(sample: dict[str, np.ndarray], data: st.DataObject) -> None:
    buf = bytearray(encode(sample, ctime=1.0, cost=0.5))
    pos = data.draw(st.integers(0, len(buf) - 1))
    buf[pos] ^= data.draw(st.integers(1, 255))
    try:
        decode(bytes(buf))
    except CorruptEntryError:
        pass
    else:
        raise AssertionError(f"flip at byte {pos} of {len(buf)} went unnoticed")
    assert not verify(bytes(buf))
