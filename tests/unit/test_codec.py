"""Unit tests of mmcache.codec: round trips, zero copy, layout, and every corruption."""

from __future__ import annotations

import ast
import contextlib
import doctest
import pickle
import re
import struct
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest
import xxhash

from mmcache import codec
from mmcache.codec import (
    ALIGN,
    HEADER_SIZE,
    decode,
    encode,
    encode_into,
    encoded_size,
    layout_signature,
    read_header,
    verify,
)
from mmcache.errors import ConfigError, CorruptEntryError

ALL_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
]

# Encoding of {"a": uint8 [1, 2], "m": bool [[True, False]]}, ctime 1700000000.5,
# cost 0.25, as written by format version 1. If this test fails, the byte format
# changed: bump codec.VERSION and keys.FORMAT_VERSION, then update the bytes.
GOLDEN_V1 = bytes.fromhex(
    "4d4d43310100000021d923d15b4237d5c20000000000000000002040fc54d941"
    "000000000000d03f020000004200000001000201020000000000000080000000"
    "0000000002000000000000006101000102010000000000000002000000000000"
    "00c00000000000000002000000000000006d0000000000000000000000000000"
    "0102000000000000000000000000000000000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000000"
    "0100"
)


def reseal(buf: bytes | bytearray) -> bytes:
    """Recompute the checksum so that only the structural checks can catch a change."""
    data = bytearray(buf)
    hasher = xxhash.xxh3_64(bytes(data[:8]))
    hasher.update(bytes(data[16:]))
    data[8:16] = struct.pack("<Q", hasher.intdigest())
    return bytes(data)


def typical_sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "image": rng.integers(0, 256, size=(3, 224, 224), dtype=np.uint8),
        "input_ids": rng.integers(0, 50_000, size=32, dtype=np.int32),
        "attention_mask": np.ones(32, dtype=np.int32),
    }


def assert_same(original: dict[str, np.ndarray], decoded: dict[str, np.ndarray]) -> None:
    assert list(decoded) == list(original)
    for name, arr in original.items():
        out = decoded[name]
        assert out.shape == arr.shape, name
        assert out.dtype == arr.dtype.newbyteorder("<"), name
        assert out.tobytes() == np.ascontiguousarray(arr).astype(out.dtype).tobytes(), name


# ---------------------------------------------------------------- round trips


def test_round_trip_typical_sample() -> None:
    sample = typical_sample()
    buf = encode(sample, ctime=1_700_000_000.25, cost=0.007)
    assert isinstance(buf, bytes)
    assert len(buf) == encoded_size(sample)
    assert_same(sample, decode(buf))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype(dtype: type) -> None:
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 2, size=(2, 3, 5)).astype(dtype)
    if np.dtype(dtype).kind == "f":
        arr.flat[0] = np.nan
        arr.flat[1] = -np.inf
    out = decode(encode({"x": arr}))["x"]
    assert out.dtype == np.dtype(dtype)
    assert out.tobytes() == arr.tobytes()


def test_round_trip_empty_and_zero_dim_arrays() -> None:
    sample = {
        "empty": np.zeros((0,), np.float32),
        "empty2d": np.zeros((4, 0), np.int64),
        "scalar": np.array(7, dtype=np.int16),
        "after": np.arange(3, dtype=np.uint8),
    }
    out = decode(encode(sample))
    assert_same(sample, out)
    assert out["scalar"].shape == ()
    assert int(out["scalar"]) == 7
    assert decode(encode({})) == {}


def test_round_trip_unicode_and_empty_names() -> None:
    sample = {
        "图像": np.arange(4, dtype=np.uint8),
        "émoji🙂": np.ones(2, np.float16),
        "": np.zeros(1),
    }
    assert_same(sample, decode(encode(sample)))


def test_non_contiguous_and_big_endian_arrays_are_converted() -> None:
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    sample = {
        "strided": base[:, ::2],
        "fortran": np.asfortranarray(base),
        "big_endian": np.arange(5, dtype=">i4"),
        "big_float": np.linspace(0, 1, 7).astype(">f8"),
    }
    out = decode(encode(sample))
    for name, arr in sample.items():
        np.testing.assert_array_equal(out[name], arr)
        assert out[name].dtype.byteorder in ("<", "=", "|")
        assert out[name].flags.c_contiguous


def test_bfloat16_via_torch_round_trips_without_loss() -> None:
    torch = pytest.importorskip("torch")
    feats = torch.randn(5, 8).to(torch.bfloat16)
    bits = feats.view(torch.uint16).numpy()
    buf = encode({"feats": bits, "ids": np.arange(3, dtype=np.int32)}, bfloat16={"feats"})
    header = read_header(buf)
    assert header.field("feats").logical_dtype == "bfloat16"
    assert header.field("feats").dtype == np.dtype(np.uint16)
    assert header.field("ids").logical_dtype == "int32"
    out = decode(buf)["feats"]
    assert out.dtype == np.uint16
    back = torch.from_numpy(out.copy()).view(torch.bfloat16)
    assert torch.equal(back, feats)
    # The logical dtype is part of the layout: same bits as plain uint16 differ.
    assert layout_signature(
        read_header(encode({"feats": bits, "ids": np.arange(3, dtype=np.int32)}))
    ) != (layout_signature(header))


def test_bfloat16_names_are_validated() -> None:
    with pytest.raises(ConfigError, match="lacks"):
        encode({"a": np.zeros(2, np.uint16)}, bfloat16={"b"})
    with pytest.raises(TypeError, match="uint16"):
        encode({"a": np.zeros(2, np.float32)}, bfloat16={"a"})


def test_golden_bytes_are_stable() -> None:
    sample = {"a": np.array([1, 2], np.uint8), "m": np.array([[True, False]])}
    assert encode(sample, ctime=1700000000.5, cost=0.25) == GOLDEN_V1
    out = decode(GOLDEN_V1)
    assert out["a"].tolist() == [1, 2]
    assert out["m"].tolist() == [[True, False]]


# ---------------------------------------------------------------- zero copy, header


def test_decode_is_zero_copy_and_read_only() -> None:
    buf = bytearray(encode(typical_sample()))
    out = decode(buf)
    whole = np.frombuffer(buf, dtype=np.uint8)
    for arr in out.values():
        assert np.shares_memory(arr, whole)
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr.flags.writeable = True
    with pytest.raises(ValueError):
        out["image"][0, 0, 0] = 1
    # A view, not a copy: a change of the buffer shows through.
    off = read_header(buf).field("input_ids").offset
    buf[off : off + 4] = struct.pack("<i", -5)
    assert out["input_ids"][0] == -5


def test_offsets_are_aligned_and_packed() -> None:
    sample = {
        "a": np.arange(3, dtype=np.uint8),
        "b": np.zeros((0,), np.float64),
        "c": np.arange(7, dtype=np.float16),
        "d": np.array(1.5),
    }
    buf = encode(sample)
    header = read_header(buf)
    for f in header.fields:
        assert f.offset % ALIGN == 0
        assert f.offset >= HEADER_SIZE
    # In order, no overlap, and the entry ends after the last buffer.
    ends = [f.offset + f.nbytes for f in header.fields]
    assert all(end <= nxt.offset for end, nxt in zip(ends, header.fields[1:], strict=False))
    assert header.length == ends[-1] == len(buf)
    # np.frombuffer on a 64-aligned base yields 64-aligned views.
    raw = np.zeros(len(buf) + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    raw[start : start + len(buf)] = np.frombuffer(buf, np.uint8)
    for arr in decode(memoryview(raw)[start : start + len(buf)]).values():
        assert arr.ctypes.data % ALIGN == 0


def test_header_fields() -> None:
    sample = typical_sample()
    buf = encode(sample, ctime=1_700_000_123.5, cost=0.0123)
    header = read_header(buf)
    assert header.version == codec.VERSION
    assert header.ctime == 1_700_000_123.5
    assert header.cost == 0.0123
    assert header.length == len(buf)
    assert [f.name for f in header.fields] == list(sample)
    image = header.field("image")
    assert (image.dtype, image.shape, image.nbytes) == (np.dtype(np.uint8), (3, 224, 224), 150528)
    with pytest.raises(KeyError, match="nope"):
        header.field("nope")


def test_layout_signature() -> None:
    rng = np.random.default_rng(2)
    one = read_header(encode(typical_sample(), ctime=1.0, cost=2.0))
    other_values = {
        k: rng.permutation(v.reshape(-1)).reshape(v.shape) for k, v in typical_sample().items()
    }
    two = read_header(encode(other_values, ctime=99.0, cost=0.5))
    assert layout_signature(one) == layout_signature(two)
    assert [f.offset for f in one.fields] == [f.offset for f in two.fields]

    def sig(sample: dict[str, np.ndarray]) -> bytes:
        return layout_signature(read_header(encode(sample)))

    base = {"image": np.zeros((3, 8, 8), np.uint8), "ids": np.zeros(4, np.int32)}
    assert sig(base) == sig({"image": np.ones((3, 8, 8), np.uint8), "ids": np.ones(4, np.int32)})
    assert sig(base) != sig({"image": np.zeros((3, 8, 9), np.uint8), "ids": np.zeros(4, np.int32)})
    assert sig(base) != sig({"image": np.zeros((3, 8, 8), np.int8), "ids": np.zeros(4, np.int32)})
    assert sig(base) != sig(
        {"picture": np.zeros((3, 8, 8), np.uint8), "ids": np.zeros(4, np.int32)}
    )
    assert sig(base) != sig({"ids": np.zeros(4, np.int32), "image": np.zeros((3, 8, 8), np.uint8)})


def test_encode_into_writes_the_same_bytes_in_place() -> None:
    sample = typical_sample()
    expected = encode(sample, ctime=5.0, cost=0.5)
    arena = bytearray(b"\xee" * (len(expected) + 300))
    n = encode_into(sample, memoryview(arena)[100:], ctime=5.0, cost=0.5)
    assert n == len(expected)
    assert bytes(arena[100 : 100 + n]) == expected
    assert arena[:100] == b"\xee" * 100
    assert arena[100 + n :] == b"\xee" * 200  # bytes past the entry untouched
    assert_same(sample, decode(memoryview(arena)[100 : 100 + n]))


def test_encode_into_refuses_short_or_read_only_buffers() -> None:
    sample = typical_sample()
    short = bytearray(encoded_size(sample) - 1)
    with pytest.raises(ValueError, match="needs"):
        encode_into(sample, short)
    assert short == bytearray(len(short))  # nothing written
    with pytest.raises(ValueError, match="writable"):
        encode_into(sample, memoryview(bytes(encoded_size(sample))))


def test_encode_into_shared_memory_and_decode_zero_copy() -> None:
    sample = typical_sample()
    shm = shared_memory.SharedMemory(create=True, size=encoded_size(sample))
    try:
        n = encode_into(sample, shm.buf)
        out = decode(shm.buf[:n])
        assert np.shares_memory(out["image"], np.frombuffer(shm.buf, np.uint8))
        assert_same(sample, out)
        del out  # the views must go before the segment can be closed
    finally:
        shm.close()
        shm.unlink()


# ---------------------------------------------------------------- refusals at encode


@pytest.mark.parametrize(
    "value",
    [
        np.array([{"a": 1}, None], dtype=object),
        np.array(["a", "bc"]),
        np.array([b"ab"]),
        np.array([1 + 2j]),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        np.zeros(2, dtype=[("x", "<i4")]),
        [1, 2, 3],
        b"raw bytes",
    ],
    ids=["object", "str", "bytes", "complex", "datetime", "structured", "list", "bytes-obj"],
)
def test_encode_refuses_unsupported_values(value: object) -> None:
    with pytest.raises(TypeError, match="field 'x'"):
        encode({"x": value})  # type: ignore[dict-item]


def test_encode_refuses_bad_names_counts_and_times() -> None:
    one = np.zeros(1, np.uint8)
    with pytest.raises(TypeError, match="names must be str"):
        encode({1: one})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="UTF-8"):
        encode({"bad\udcff": one})
    with pytest.raises(ConfigError, match="bytes in UTF-8"):
        encode({"n" * 1025: one})
    with pytest.raises(ConfigError, match="at most 256 fields"):
        encode({str(i): one for i in range(257)})
    with pytest.raises(ConfigError, match="dimensions"):
        encode({"x": np.zeros((1,) * 9, np.uint8)})
    with pytest.raises(TypeError, match="mapping"):
        encode([("x", one)])  # type: ignore[arg-type]
    for bad in ({"ctime": float("nan")}, {"cost": -1.0}, {"cost": float("inf")}):
        with pytest.raises(ConfigError):
            encode({"x": one}, **bad)
    # The limits themselves are accepted.
    assert len(decode(encode({str(i): one for i in range(256)}))) == 256
    assert decode(encode({"x": np.zeros((1,) * 8, np.uint8)}))["x"].ndim == 8


# ---------------------------------------------------------------- corruption

# One field "a", uint8 [4]: the table starts at 48 with name_len (48), code (50),
# ndim (51), shape[0] (52), offset (60), nbytes (68), name (76); data at 128.
ONE = encode({"a": np.arange(4, dtype=np.uint8)}, ctime=3.0, cost=1.0)
TWO = encode({"a": np.arange(4, dtype=np.uint8), "b": np.arange(3, dtype=np.int32)})


def patch(buf: bytes, offset: int, fmt: str, *values: object) -> bytes:
    data = bytearray(buf)
    struct.pack_into(fmt, data, offset, *values)
    return reseal(data)


def test_layout_of_the_corruption_fixture() -> None:
    (field,) = read_header(ONE).fields
    assert (field.offset, len(ONE)) == (128, 132)
    assert ONE[76:77] == b"a"


CORRUPTIONS = {
    "bad magic": (patch(ONE, 0, "4s", b"PK\x03\x04"), "magic"),
    "unknown version": (patch(ONE, 4, "<H", 2), "version"),
    "unknown flags": (patch(ONE, 6, "<H", 1), "flags"),
    "length field too small": (patch(ONE, 16, "<Q", 131), "header says"),
    "length field huge": (patch(ONE, 16, "<Q", 2**64 - 1), "header says"),
    "too many fields": (patch(ONE, 40, "<I", 257), "fields, at most"),
    "nfields beyond the table": (patch(ONE, 40, "<I", 2), "ends inside field"),
    "fewer fields than the table": (patch(ONE, 40, "<I", 0), "after its 0 fields"),
    "table past the end": (patch(ONE, 44, "<I", 1000), "runs past the end"),
    "nan cost": (patch(ONE, 32, "<d", float("nan")), "cost"),
    "negative cost": (patch(ONE, 32, "<d", -1.0), "cost"),
    "infinite ctime": (patch(ONE, 24, "<d", float("inf")), "ctime"),
    "unknown dtype code": (patch(ONE, 50, "<B", 200), "unknown dtype code"),
    "dtype code zero": (patch(ONE, 50, "<B", 0), "unknown dtype code"),
    "absurd ndim": (patch(ONE, 51, "<B", 9), "ndim 9"),
    "name too long": (patch(ONE, 48, "<H", 60000), "name"),
    "name past the table": (patch(ONE, 48, "<H", 5), "runs past the end of the field table"),
    "name not utf-8": (patch(ONE, 76, "<B", 0xFF), "UTF-8"),
    "nbytes does not match shape": (patch(ONE, 68, "<Q", 5), "nbytes 5"),
    "shape does not match nbytes": (patch(ONE, 52, "<Q", 3), "needs 3"),
    "offset out of bounds": (patch(ONE, 60, "<Q", 2**40), "offset"),
    "offset misaligned": (patch(ONE, 60, "<Q", 127), "offset 127"),
    "offset inside the table": (patch(ONE, 60, "<Q", 0), "offset 0"),
    "huge zero-size shape": (patch(patch(ONE, 52, "<Q", 0), 68, "<Q", 0), "buffers end"),
    "overlapping fields": (patch(TWO, 48 + 29 + 12, "<Q", 128), "offset 128"),
    "duplicate names": (reseal(TWO[:105] + b"a" + TWO[106:]), "duplicate field name 'a'"),
    "truncated": (ONE[:-1], "header says"),
    "truncated header": (ONE[:47], "truncated"),
    "empty": (b"", "truncated"),
    "padded": (ONE + b"\0", "header says"),
    "checksum mismatch": (ONE[:-1] + b"\x99", "checksum"),
}


def test_corruption_fixture_offsets_are_right() -> None:
    # The duplicate-name case edits the second name; make sure it is where we think.
    assert TWO[105:106] == b"b"
    assert struct.unpack_from("<Q", TWO, 48 + 29 + 12)[0] == read_header(TWO).fields[1].offset


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_every_corruption_raises_corrupt_entry_error(name: str) -> None:
    buf, reason = CORRUPTIONS[name]
    with pytest.raises(CorruptEntryError, match=reason):
        decode(buf)
    assert not verify(buf)
    if name != "checksum mismatch":
        # Structure is checked even without the checksum.
        with pytest.raises(CorruptEntryError, match=reason):
            decode(buf, verify=False)
        with pytest.raises(CorruptEntryError):
            read_header(buf)


def test_huge_shape_of_an_empty_array_is_refused() -> None:
    # shape (2**62, 2**62, 0): zero bytes, but numpy could never build the view.
    sample = encode({"a": np.zeros((1, 1, 0), np.uint8)})
    table = 48
    bad = patch(patch(sample, table + 4, "<Q", 2**62), table + 12, "<Q", 2**62)
    with pytest.raises(CorruptEntryError, match="impossible shape"):
        decode(bad, verify=False)


def test_every_single_byte_flip_is_detected() -> None:
    buf = encode(
        {"a": np.arange(4, dtype=np.uint8), "f": np.linspace(0, 1, 5).astype(np.float16)},
        ctime=10.0,
        cost=0.5,
    )
    for pos in range(len(buf)):
        for xor in (0x01, 0x80, 0xFF):
            bad = bytearray(buf)
            bad[pos] ^= xor
            with pytest.raises(CorruptEntryError):
                decode(bytes(bad))
            assert not verify(bytes(bad))
            # Without the checksum: either decodes or raises the one error.
            with contextlib.suppress(CorruptEntryError):
                decode(bytes(bad), verify=False)


def test_verify_accepts_good_entries_and_rejects_other_objects() -> None:
    assert verify(ONE)
    assert verify(bytearray(TWO))
    assert not verify(b"not an entry at all")
    with pytest.raises(TypeError):
        verify(12345)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        decode("MMC1 a string")  # type: ignore[arg-type]


def test_planted_pickle_is_never_executed(tmp_path: Path) -> None:
    class Evil:
        def __init__(self, target: Path) -> None:
            self.target = target

        def __reduce__(self) -> tuple[object, ...]:
            return (Path.touch, (self.target,))

    # The payload is live: unpickling it really creates its file.
    canary = tmp_path / "canary"
    pickle.loads(pickle.dumps(Evil(canary)))
    assert canary.exists()

    target = tmp_path / "pwned"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        payload = pickle.dumps(Evil(target), protocol=protocol)
        for buf in (payload, b"MMC1" + payload, reseal(ONE[:HEADER_SIZE] + payload)):
            with pytest.raises(CorruptEntryError):
                decode(buf)
            with pytest.raises(CorruptEntryError):
                decode(buf, verify=False)
    # A pickle stored as the bytes of a field comes back as plain bytes.
    payload = pickle.dumps(Evil(target))
    out = decode(encode({"blob": np.frombuffer(payload, np.uint8)}))
    assert out["blob"].tobytes() == payload
    assert not target.exists()


def test_codec_source_has_no_pickle_marshal_or_eval() -> None:
    sources = sorted(Path(codec.__file__).parent.glob("*.py"))  # the codec package
    assert len(sources) >= 2
    trees = [ast.parse(p.read_text(encoding="utf-8")) for p in sources]
    banned_modules = {"pickle", "marshal", "shelve", "dill", "cloudpickle"}
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & banned_modules
        if isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in banned_modules
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in {"eval", "exec", "compile", "__import__"}
        if isinstance(node, ast.keyword):
            assert node.arg != "allow_pickle"


def test_docstring_examples_run() -> None:
    result = doctest.testmod(codec)
    assert result.attempted > 0
    assert result.failed == 0


def test_header_fields_say_where_each_value_lies() -> None:
    """codec.HEADER is what the loader reads header bytes by: it must match the struct
    the codec packs, and two entries of one layout differ only in its per-entry fields."""
    from mmcache.codec.layout import HEADER, HEADER_STRUCT

    codes = re.findall(r"\d*[a-zA-Z?]", HEADER_STRUCT.format.lstrip("<"))  # "4s", "H", ...
    sizes = [struct.calcsize("<" + code) for code in codes]
    offset = 0
    for f, size in zip(HEADER.values(), sizes, strict=True):
        assert (f.offset, f.stop) == (offset, offset + size)
        assert np.dtype(f.dtype).itemsize == size
        offset += size
    assert offset == HEADER_SIZE
    a = encode({"x": np.zeros((3, 5), np.uint8), "y": np.arange(4)}, ctime=1.5e9, cost=0.25)
    b = encode({"x": np.ones((3, 5), np.uint8), "y": np.arange(4) + 1}, ctime=1.7e9, cost=3.0)
    header = read_header(a)
    raw = np.frombuffer(a, dtype=np.uint8)
    got = {name: raw[f.offset : f.stop].view(f.dtype)[0] for name, f in HEADER.items()}
    assert got["magic"] == codec.MAGIC and got["version"] == codec.VERSION
    assert (got["flags"], got["checksum"], got["length"]) == (0, header.checksum, len(a))
    assert (got["ctime"], got["cost"], got["nfields"]) == (1.5e9, 0.25, 2)
    assert HEADER_SIZE + got["table_size"] == header.table_end
    end = header.table_end
    differ = np.flatnonzero(raw[:end] != np.frombuffer(b, dtype=np.uint8)[:end])
    per_entry = {i for f in HEADER.values() if f.per_entry for i in range(f.offset, f.stop)}
    assert len(differ) and set(differ.tolist()) <= per_entry
