"""Samples to bytes and back: a versioned header, a dtype/shape table, raw buffers.

A *sample* is a mapping of field names to numpy arrays (``"image"`` uint8
``[3, 224, 224]``, ``"input_ids"`` int32 ``[32]``...). :func:`encode` turns it
into one byte string; :func:`decode` turns that back into read-only numpy arrays
that are **zero-copy views** of the buffer, so a hit in a shared-memory tier
costs no copy at all.

A cache entry is untrusted input (another process, an older version, a full
disk or a bit flip may have written it). The format therefore holds only plain
numbers and raw array bytes: no pickle, no marshal, no eval, and every
inconsistency raises :class:`~mmcache.errors.CorruptEntryError` and nothing
else, whatever the bytes. Pickle was rejected on purpose: unpickling runs code
chosen by whoever wrote the bytes, and it copies every array.

Dtypes come from a fixed whitelist, stored as one-byte codes: bool, uint8, int8,
uint16, int16, uint32, int32, uint64, int64, float16, float32, float64 and
bfloat16. Numpy has no bfloat16, so a bfloat16 field is *stored* as its uint16
bit pattern under its own code: pass the names of such uint16 fields in
``encode(..., bfloat16={"feats"})`` (from torch: ``t.view(torch.uint16).numpy()``;
``ml_dtypes.bfloat16`` arrays: ``a.view(np.uint16)``). Decoding returns the
uint16 view; :attr:`Field.logical_dtype` says ``"bfloat16"`` and
``torch.from_numpy(a).view(torch.bfloat16)`` recovers the tensor without a copy.
Bool bytes are stored as they are (a bool array holding bytes other than 0/1
round-trips bit for bit).

The byte layout (header, field table, aligned buffers, dtype codes) is defined
in :mod:`mmcache.codec.layout`, which also says where each fixed header field
lies for code that reads header bytes of many entries at once (the loader's
byte-range gather). Encoding or decoding a sample costs microseconds, well under
1% of a miss (milliseconds to decode and resize its JPEG).

Thread and process safety: every function here is pure (no shared state except
a bounded, thread-safe memo of parsed field tables), so all are safe from
any thread and any process. Decoded arrays keep the buffer they view alive;
a store that lends shared memory must keep the segment mapped while they live.

>>> import numpy as np
>>> sample = {"image": np.zeros((3, 4, 4), np.uint8), "ids": np.arange(5, dtype=np.int32)}
>>> buf = encode(sample, cost=0.007)
>>> out = decode(buf)
>>> out["ids"].tolist(), out["image"].shape, out["image"].flags.writeable
([0, 1, 2, 3, 4], (3, 4, 4), False)
>>> read_header(buf).cost
0.007
>>> [f.offset % ALIGN for f in read_header(buf).fields]
[0, 0]
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.codec.layout import (
    ALIGN,
    BFLOAT16_CODE,
    DTYPE_CODES,
    HEADER,
    HEADER_SIZE,
    HEADER_STRUCT,
    KIND_TO_CODE,
    LAYOUT_PREFIX,
    MAGIC,
    MAX_FIELDS,
    MAX_NAME_BYTES,
    MAX_NDIM,
    SUPPORTED_DTYPES,
    VERSION,
    Field,
    Header,
    HeaderField,
    layout_signature,
)
from mmcache.errors import ConfigError, CorruptEntryError

__all__ = [
    "ALIGN",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_FIELDS",
    "MAX_NAME_BYTES",
    "MAX_NDIM",
    "SUPPORTED_DTYPES",
    "VERSION",
    "DecodedSample",
    "Field",
    "Header",
    "HeaderField",
    "Sample",
    "checksum_matches",
    "checksum_matches_copied",
    "checksums_match_rows",
    "decode",
    "encode",
    "encode_into",
    "encoded_size",
    "layout_signature",
    "read_header",
    "verify",
]

#: What the pipeline produces and the cache stores: field name -> array.
Sample: TypeAlias = Mapping[str, npt.NDArray[Any]]
#: What :func:`decode` returns: read-only zero-copy views, in stored field order.
DecodedSample: TypeAlias = dict[str, npt.NDArray[Any]]

_CHECKSUM_START, _CHECKSUM_END = HEADER["checksum"].offset, HEADER["checksum"].stop
_ENTRY_HEAD = struct.Struct("<HBB")  # name_len, dtype code, ndim
# shape (ndim x uint64), offset, nbytes; one precompiled Struct per ndim.
_ENTRY_TAIL = tuple(struct.Struct(f"<{n}QQQ") for n in range(MAX_NDIM + 1))
# numpy refuses arrays whose element count (zeros aside) overflows intp.
_MAX_EXTENT = np.iinfo(np.intp).max
_ZEROS = memoryview(bytes(ALIGN))

# ---------------------------------------------------------------------------
# encoding


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything about an encoding except ctime/cost: computed once, written once."""

    table: bytes
    nfields: int
    # (offset, flat uint8 view of the C-contiguous little-endian array)
    buffers: tuple[tuple[int, npt.NDArray[np.uint8]], ...]
    length: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _normalise(name: str, value: object, as_bfloat16: bool) -> tuple[int, npt.NDArray[Any]]:
    """Return (dtype code, C-contiguous little-endian array) or raise TypeError."""
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"field {name!r}: expected a numpy array, got {type(value).__name__}; "
            "convert it with np.asarray (torch: tensor.numpy())"
        )
    arr: npt.NDArray[Any] = value
    dt = arr.dtype
    # Structured, string, object, datetime and complex dtypes have kinds (or
    # sizes) absent from the table, so one dict lookup settles the common case.
    found = KIND_TO_CODE.get((dt.kind, dt.itemsize))
    if as_bfloat16:
        if dt.kind != "u" or dt.itemsize != 2:
            raise TypeError(
                f"field {name!r}: bfloat16 fields must hold the uint16 bit pattern, got {dt}; "
                "from torch: tensor.view(torch.uint16).numpy()"
            )
        code = BFLOAT16_CODE
    elif found is not None:
        code = found
    else:
        raise TypeError(
            f"field {name!r}: dtype {dt} is not supported (object, string, complex, "
            f"structured and datetime arrays are refused); supported: {SUPPORTED_DTYPES}; "
            f"for bfloat16 pass the uint16 bits and bfloat16={{{name!r}}}"
        )
    storage = DTYPE_CODES[code][0]
    if arr.dtype != storage:  # byte order differs: convert
        arr = arr.astype(storage)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    return code, arr


def _plan(sample: Sample, bfloat16: Collection[str]) -> _Plan:
    if not isinstance(sample, Mapping):
        raise TypeError(f"a sample is a mapping of names to arrays, got {type(sample).__name__}")
    if len(sample) > MAX_FIELDS:
        raise ConfigError(f"a sample has at most {MAX_FIELDS} fields, got {len(sample)}")
    bf_names = frozenset(bfloat16)
    unknown = bf_names - set(sample.keys())
    if unknown:
        raise ConfigError(
            f"bfloat16 names fields the sample lacks: {sorted(unknown)}; "
            f"fields: {sorted(map(str, sample.keys()))}"
        )
    prepared: list[tuple[bytes, int, npt.NDArray[Any]]] = []
    table_size = 0
    for name, value in sample.items():
        if not isinstance(name, str):
            raise TypeError(f"field names must be str, got {name!r}")
        try:
            name_b = name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"field name {name!r} is not valid UTF-8 text: {exc}") from None
        if len(name_b) > MAX_NAME_BYTES:
            raise ConfigError(
                f"field name {name[:40]!r}... is {len(name_b)} bytes in UTF-8; "
                f"at most {MAX_NAME_BYTES}"
            )
        code, arr = _normalise(name, value, name in bf_names)
        if arr.ndim > MAX_NDIM:
            raise ConfigError(f"field {name!r} has {arr.ndim} dimensions; at most {MAX_NDIM}")
        prepared.append((name_b, code, arr))
        table_size += _ENTRY_HEAD.size + _ENTRY_TAIL[arr.ndim].size + len(name_b)

    parts: list[bytes] = []
    buffers: list[tuple[int, npt.NDArray[np.uint8]]] = []
    cursor = HEADER_SIZE + table_size
    for name_b, code, arr in prepared:
        offset = _align(cursor)
        parts.append(_ENTRY_HEAD.pack(len(name_b), code, arr.ndim))
        parts.append(_ENTRY_TAIL[arr.ndim].pack(*arr.shape, offset, arr.nbytes))
        parts.append(name_b)
        # reshape(-1) of a C-contiguous array is a view; so is the uint8 view of it.
        buffers.append((offset, arr.reshape(-1).view(np.uint8)))
        cursor = offset + arr.nbytes
    return _Plan(b"".join(parts), len(prepared), tuple(buffers), cursor)


def _check_times(ctime: float, cost: float) -> None:
    if not math.isfinite(ctime):
        raise ConfigError(f"ctime must be a finite number of seconds, got {ctime!r}")
    if not (math.isfinite(cost) and cost >= 0.0):
        raise ConfigError(f"cost must be a finite number of seconds >= 0, got {cost!r}")


def _pieces(plan: _Plan, ctime: float, cost: float) -> tuple[bytes, list[memoryview]]:
    """Return the header (checksum filled in) and the pieces that follow it, in order.

    The checksum is computed from the source buffers while they are hot, so
    both :func:`encode` and :func:`encode_into` read each array once to hash
    it and once to copy it, and never re-read the destination.
    """
    head = HEADER_STRUCT.pack(
        MAGIC, VERSION, 0, 0, plan.length, ctime, cost, plan.nfields, len(plan.table)
    )
    pieces: list[memoryview] = [memoryview(plan.table)]
    cursor = HEADER_SIZE + len(plan.table)
    for offset, flat in plan.buffers:
        if offset > cursor:
            pieces.append(_ZEROS[: offset - cursor])
        pieces.append(flat.data)
        cursor = offset + flat.nbytes
    hasher = xxhash.xxh3_64(head[:_CHECKSUM_START])
    hasher.update(head[_CHECKSUM_END:])
    for piece in pieces:
        hasher.update(piece)
    checksum = struct.pack("<Q", hasher.intdigest())
    return head[:_CHECKSUM_START] + checksum + head[_CHECKSUM_END:], pieces


def encoded_size(sample: Sample, *, bfloat16: Collection[str] = ()) -> int:
    """Return the number of bytes :func:`encode` would produce (no copy of the data)."""
    return _plan(sample, bfloat16).length


def encode(
    sample: Sample,
    *,
    ctime: float = 0.0,
    cost: float = 0.0,
    bfloat16: Collection[str] = (),
) -> bytes:
    """Encode ``sample`` into a new ``bytes`` object (each array copied exactly once).

    ``ctime`` is the wall-clock creation time (seconds since the epoch) and
    ``cost`` the seconds it took to produce the sample; both are stored in the
    header for TTL and admission decisions. ``bfloat16`` names uint16 fields that
    hold bfloat16 bit patterns (see the module docstring).

    Non-contiguous or big-endian arrays are converted (one extra copy of those
    arrays). Raises ``TypeError`` for non-arrays and unsupported dtypes (object,
    strings, complex...), :class:`~mmcache.errors.ConfigError` for invalid
    names, too many fields or dimensions, or a non-finite ``ctime``/``cost``.
    """
    _check_times(ctime, cost)
    plan = _plan(sample, bfloat16)
    head, pieces = _pieces(plan, ctime, cost)
    # bytes.join sizes the result once and copies each piece once: one copy per
    # array, and the result is immutable bytes (a bytearray would need another
    # copy to become bytes).
    return b"".join([head, *pieces])


def encode_into(
    sample: Sample,
    out: memoryview | bytearray,
    *,
    ctime: float = 0.0,
    cost: float = 0.0,
    bfloat16: Collection[str] = (),
) -> int:
    """Encode ``sample`` into the start of the writable buffer ``out``; return its length.

    Lets a store encode straight into shared memory or a memory-mapped file with
    one copy of each array. The bytes written equal ``encode(sample, ...)``;
    bytes of ``out`` past the returned length are left untouched. Raises
    ``ValueError`` if ``out`` is read-only or shorter than :func:`encoded_size`
    (nothing is written then), otherwise as :func:`encode`.
    """
    _check_times(ctime, cost)
    plan = _plan(sample, bfloat16)
    view = memoryview(out)
    if view.readonly:
        raise ValueError("encode_into needs a writable buffer, got a read-only one")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if len(view) < plan.length:
        raise ValueError(f"encode_into needs {plan.length} bytes, the buffer has {len(view)}")
    head, pieces = _pieces(plan, ctime, cost)
    view[:HEADER_SIZE] = head
    pos = HEADER_SIZE
    for piece in pieces:
        n = len(piece)
        view[pos : pos + n] = piece  # a memcpy: every piece is a flat uint8 buffer
        pos += n
    return plan.length


# ---------------------------------------------------------------------------
# decoding


def _corrupt(reason: str) -> NoReturn:
    raise CorruptEntryError(f"corrupt cache entry: {reason}")


def _byte_view(buf: bytes | bytearray | memoryview) -> memoryview:
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(
            f"expected a bytes-like object (bytes, bytearray, memoryview), got {type(buf).__name__}"
        ) from None
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise TypeError("expected a contiguous buffer")
        view = view.cast("B")
    return view


def _parse_table(table: bytes, nfields: int) -> tuple[tuple[Field, ...], int]:
    """Parse and validate a field table; return the fields and the end of the last buffer.

    Depends only on its arguments, so it is memoised (see ``_parse_table_cached``).
    """
    fields: list[Field] = []
    names: set[str] = set()
    size = len(table)
    pos = 0
    cursor = HEADER_SIZE + size
    for i in range(nfields):
        if pos + _ENTRY_HEAD.size > size:
            _corrupt(f"field table ends inside field {i} of {nfields}")
        name_len, code, ndim = _ENTRY_HEAD.unpack_from(table, pos)
        pos += _ENTRY_HEAD.size
        if ndim > MAX_NDIM:
            _corrupt(f"field {i} has ndim {ndim}, at most {MAX_NDIM}")
        if code not in DTYPE_CODES:
            _corrupt(f"field {i} has unknown dtype code {code}")
        if name_len > MAX_NAME_BYTES:
            _corrupt(f"field {i} has a {name_len}-byte name, at most {MAX_NAME_BYTES}")
        tail = _ENTRY_TAIL[ndim]
        if pos + tail.size + name_len > size:
            _corrupt(f"field {i} runs past the end of the field table")
        *shape, offset, nbytes = tail.unpack_from(table, pos)
        pos += tail.size
        try:
            name = table[pos : pos + name_len].decode("utf-8")
        except UnicodeDecodeError:
            _corrupt(f"field {i} name is not valid UTF-8")
        pos += name_len
        if name in names:
            _corrupt(f"duplicate field name {name!r}")
        names.add(name)
        storage, logical = DTYPE_CODES[code]
        if math.prod(max(d, 1) for d in shape) * storage.itemsize > _MAX_EXTENT:
            _corrupt(f"field {name!r} has an impossible shape {tuple(shape)}")
        expected = math.prod(shape) * storage.itemsize
        if nbytes != expected:
            _corrupt(
                f"field {name!r} has nbytes {nbytes}, but shape {tuple(shape)} of "
                f"{logical} needs {expected}"
            )
        if offset != _align(cursor):
            _corrupt(
                f"field {name!r} is at offset {offset}, expected {_align(cursor)} "
                f"(buffers are packed in order at {ALIGN}-byte boundaries)"
            )
        cursor = offset + nbytes
        fields.append(Field(name, storage, tuple(shape), offset, nbytes, logical))
    if pos != size:
        _corrupt(f"field table has {size - pos} bytes after its {nfields} fields")
    return tuple(fields), cursor


# Entries of one layout (the common case: every image of a run has the same
# shape) parse their table once. functools.lru_cache is thread-safe; errors are
# not cached (a corrupt table is parsed each time, which is fine). Only small
# tables are cached, so the cache stays under ~1 MiB whatever the entries hold.
_CACHED_TABLE_MAX = 4096
_parse_table_cached = functools.lru_cache(maxsize=256)(_parse_table)


def _read_header(view: memoryview) -> Header:
    n = len(view)
    if n < HEADER_SIZE:
        _corrupt(f"truncated: {n} bytes, the header alone needs {HEADER_SIZE}")
    unpacked = HEADER_STRUCT.unpack_from(view)
    magic, version, flags, checksum, length, ctime, cost, nfields, table_size = unpacked
    if magic != MAGIC:
        _corrupt(f"bad magic {magic!r}, expected {MAGIC!r} (not an mmcache entry)")
    if version != VERSION:
        _corrupt(f"format version {version}, this mmcache reads version {VERSION}")
    if flags != 0:
        _corrupt(f"unknown flags {flags:#06x}")
    if length != n:
        _corrupt(f"header says {length} bytes, the buffer has {n} (truncated or padded)")
    if nfields > MAX_FIELDS:
        _corrupt(f"{nfields} fields, at most {MAX_FIELDS}")
    if table_size > n - HEADER_SIZE:
        _corrupt(f"field table of {table_size} bytes runs past the end ({n} bytes)")
    if not math.isfinite(ctime):
        _corrupt(f"ctime is {ctime!r}")
    if not (math.isfinite(cost) and cost >= 0.0):
        _corrupt(f"cost is {cost!r}")
    table = bytes(view[HEADER_SIZE : HEADER_SIZE + table_size])
    if len(table) <= _CACHED_TABLE_MAX:
        fields, end = _parse_table_cached(table, nfields)
    else:
        fields, end = _parse_table(table, nfields)
    if end != length:
        _corrupt(f"buffers end at byte {end}, the entry has {length} bytes")
    layout_key = LAYOUT_PREFIX.pack(version, nfields) + table
    return Header(version, flags, ctime, cost, length, checksum, fields, layout_key)


def _checksum_ok(view: memoryview, header: Header) -> bool:
    hasher = xxhash.xxh3_64(view[:_CHECKSUM_START])
    hasher.update(view[_CHECKSUM_END:])
    return bool(hasher.intdigest() == header.checksum)


_SUM_AND_LENGTH = struct.Struct("<QQ")  # the checksum [8, 16) and the length [16, 24)
_SUM_AND_LENGTH_END = _CHECKSUM_START + _SUM_AND_LENGTH.size


def checksum_matches(buf: bytes | bytearray | memoryview) -> bool:
    """Whether ``buf``'s stored length and xxh3 checksum match its bytes, without parsing
    the field table: the integrity check of a batch gather, whose caller compares the
    header and field table with the batch layout itself (the checksum covers them)."""
    view = _byte_view(buf)
    if len(view) < HEADER_SIZE:
        return False
    checksum, length = _SUM_AND_LENGTH.unpack_from(view, _CHECKSUM_START)
    if length != len(view):
        return False
    hasher = xxhash.xxh3_64(view[:_CHECKSUM_START])
    hasher.update(view[_CHECKSUM_END:])
    return bool(hasher.intdigest() == checksum)


def checksum_matches_copied(
    buf: bytes | bytearray | memoryview, copies: Sequence[tuple[int, npt.NDArray[np.uint8]]]
) -> bool:
    """:func:`checksum_matches` of ``buf``, hashing bytes ``[offset, offset + len(copy))``
    from ``copy`` for each ``(offset, copy)`` of ``copies`` (sorted by offset, apart):
    copies of those bytes the caller has just made, still in the CPU cache, so the
    checksum does not read ``buf`` a second time from memory (a batch gather copies,
    then checks). The same answer as :func:`checksum_matches` when each copy equals
    its bytes of ``buf``."""
    view = _byte_view(buf)
    n = len(view)
    if n < HEADER_SIZE:
        return False
    checksum, length = _SUM_AND_LENGTH.unpack_from(view, _CHECKSUM_START)
    if length != n:
        return False
    hasher = xxhash.xxh3_64()
    pos = 0
    for offset, copy in copies:
        if offset > pos:
            _hash_piece(hasher, view[pos:offset], pos)
        if offset >= _CHECKSUM_END:  # the usual piece (a field): no call per piece
            hasher.update(copy.data)
        else:
            _hash_piece(hasher, copy, offset)
        pos = offset + len(copy)
    if pos < n:
        _hash_piece(hasher, view[pos:], pos)
    return bool(hasher.intdigest() == checksum)


#: One large copy of :func:`checksums_match_rows`: ``(out, src, start, stop)``, entry
#: ``j``'s ``src[sources[j], start:stop]`` copied into ``out[rows[j]]`` before its hash.
RowCopy: TypeAlias = tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], int, int]
_HashPlan: TypeAlias = list[tuple[memoryview | None, npt.NDArray[np.uint8], int, int, int]]


def checksums_match_rows(
    size: int,
    pieces: Sequence[tuple[int, npt.NDArray[np.uint8]]],
    rows: Sequence[int],
    before: Callable[[int], None] | None = None,
    *,
    copies: Sequence[RowCopy] = (),
    sources: Sequence[int] = (),
) -> npt.NDArray[np.bool_]:
    """:func:`checksum_matches` of many entries of ``size`` bytes each, read from copies.

    Entry ``j``'s bytes ``[offset, offset + width)`` are row ``rows[j]`` of the
    ``uint8 [m, width]`` array of each ``(offset, array)`` of ``pieces``: sorted by offset,
    each starting where the one before stopped, from 0 to ``size``, rows contiguous.
    Just before entry ``j`` is hashed, each ``(out, src, start, stop)`` of ``copies``
    copies ``src[sources[j], start:stop]`` into ``out[rows[j]]``, then ``before(j)``
    runs, when given: a batch gather copies the entry's large pieces then, so the hash
    reads them while they are still in the CPU cache (64 images are ~10 MB: a whole
    batch copied first would be out of it). Per entry, True where its stored length is
    ``size`` and its stored checksum matches (both read from the pieces, after the
    last copy).

    The batch form of :func:`checksum_matches_copied`: what to hash is worked out once
    for the batch, so each entry costs one hasher, a slice per piece and, for
    ``copies``, a numpy row copy each (which releases the GIL), with no Python call of
    the caller's: a gather of 64 images spends ~2 us of Python per entry here beside
    the copy and the hashing, which is what the warm path pays per hit."""
    ok = np.zeros(len(rows), dtype=bool)
    pos = 0
    plan: _HashPlan = []
    views: list[memoryview] = []
    for offset, arr in pieces:
        width = arr.shape[1] if arr.ndim == 2 else -1
        if offset != pos or width < 0 or (width and arr.strides[1] != 1):
            raise ValueError("pieces must be [m, width] rows that tile the entry in order")
        pos += width
        flat = None
        if width and arr.flags.c_contiguous:  # rows sliced from one flat view: no array per row
            flat = arr.data.cast("B")
            views.append(flat)
        for lo, hi in ((offset, min(pos, _CHECKSUM_START)), (max(offset, _CHECKSUM_END), pos)):
            if lo < hi:  # the checksum's own bytes are not hashed
                plan.append((flat, arr, width, lo - offset, hi - offset))
    if pos != size:
        raise ValueError(f"pieces cover {pos} bytes of an entry of {size}")
    if copies and len(sources) != len(rows):
        raise ValueError(f"{len(sources)} sources for {len(rows)} rows to copy")
    if size < HEADER_SIZE or not len(rows):
        return ok
    try:
        if before is None and all(flat is not None for flat, *_ in plan):
            digests = _digests_flat(plan, rows, copies, sources)
        else:
            digests = _digests(plan, rows, before, copies, sources)
    finally:
        for view in views:
            view.release()
    index = np.asarray(rows, dtype=np.int64)
    parts = []  # bytes [8, 24) of each entry: its checksum, then its length
    for offset, arr in pieces:
        lo, hi = max(_CHECKSUM_START - offset, 0), min(_SUM_AND_LENGTH_END - offset, arr.shape[1])
        if lo < hi:
            parts.append(arr[index, lo:hi])
    stored = (parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)).view("<u8")
    ok[:] = (stored[:, 0] == np.asarray(digests, dtype=np.uint64)) & (stored[:, 1] == size)
    return ok


def _digests_flat(
    plan: _HashPlan, rows: Sequence[int], copies: Sequence[RowCopy], sources: Sequence[int]
) -> list[int]:
    """The xxh3 of each entry when every piece has a flat view (the gather's case): the
    loop of :func:`checksums_match_rows` with the least Python per entry (measured: a
    numpy row copy ~0.9 us, three hash slices and updates ~1.2 us)."""
    flats = [(f, w, lo, hi) for f, _, w, lo, hi in plan if f is not None]
    (flat0, width0, lo0, hi0), rest = flats[0], flats[1:]
    new = xxhash.xxh3_64
    digests = [0] * len(rows)
    one = copies[0] if len(copies) == 1 else None
    for j, r in enumerate(rows):
        if one is not None:
            one[0][r] = one[1][sources[j], one[2] : one[3]]
        else:
            for out, src, start, stop in copies:
                out[r] = src[sources[j], start:stop]
        base = r * width0
        hasher = new(flat0[base + lo0 : base + hi0])
        for flat, width, lo, hi in rest:
            base = r * width
            hasher.update(flat[base + lo : base + hi])
        digests[j] = hasher.intdigest()
    return digests


def _digests(
    plan: _HashPlan,
    rows: Sequence[int],
    before: Callable[[int], None] | None,
    copies: Sequence[RowCopy],
    sources: Sequence[int],
) -> list[int]:
    """The xxh3 of each entry, any pieces (a piece without a flat view is sliced per row)."""
    digests = []
    for j, r in enumerate(rows):
        for out, src, start, stop in copies:
            out[r] = src[sources[j], start:stop]
        if before is not None:
            before(j)
        hasher = xxhash.xxh3_64()
        for flat, arr, width, lo, hi in plan:
            if flat is not None:
                base = r * width
                hasher.update(flat[base + lo : base + hi])
            else:
                hasher.update(arr[r, lo:hi].data)
        digests.append(hasher.intdigest())
    return digests


def _hash_piece(hasher: Any, piece: Any, start: int) -> None:
    """Hash ``piece`` (bytes ``[start, start + len(piece))`` of an entry) but the
    checksum's own bytes."""
    stop = start + len(piece)
    if stop <= _CHECKSUM_START or start >= _CHECKSUM_END:
        hasher.update(piece)
        return
    if start < _CHECKSUM_START:
        hasher.update(piece[: _CHECKSUM_START - start])
    if stop > _CHECKSUM_END:
        hasher.update(piece[max(_CHECKSUM_END - start, 0) :])


def read_header(buf: bytes | bytearray | memoryview) -> Header:
    """Parse and validate the header and field table of an entry; skip the checksum.

    Cheap (no pass over the array data). Raises
    :class:`~mmcache.errors.CorruptEntryError` on any structural inconsistency
    (``buf`` must be exactly one whole entry), ``TypeError`` if ``buf`` is not a
    bytes-like object.
    """
    return _read_header(_byte_view(buf))


def verify(buf: bytes | bytearray | memoryview) -> bool:
    """Whether ``buf`` is a well-formed entry whose checksum matches (never raises
    for bad bytes; ``TypeError`` only if ``buf`` is not bytes-like)."""
    view = _byte_view(buf)
    try:
        return _checksum_ok(view, _read_header(view))
    except CorruptEntryError:
        return False


def decode(buf: bytes | bytearray | memoryview, *, verify: bool = True) -> DecodedSample:
    """Decode an entry into read-only numpy arrays that are zero-copy views of ``buf``.

    With ``verify=True`` (the default) the xxh3_64 checksum is checked (~2 us
    per 150 KB); with ``verify=False`` only the structure is, which is enough
    for bytes this process wrote itself. Any inconsistency raises
    :class:`~mmcache.errors.CorruptEntryError`, never another exception, for any
    byte string. The arrays keep ``buf`` alive and cannot be made writable;
    copy them (``np.array(a)``) to modify them.
    """
    view = _byte_view(buf)
    header = _read_header(view)
    if verify and not _checksum_ok(view, header):
        _corrupt("checksum mismatch (the entry was modified or partly written)")
    readonly = view.toreadonly()
    out: DecodedSample = {}
    try:
        for f in header.fields:
            arr = np.frombuffer(
                readonly, dtype=f.dtype, count=f.nbytes // f.dtype.itemsize, offset=f.offset
            )
            out[f.name] = arr.reshape(f.shape)
    except (ValueError, TypeError) as exc:  # pragma: no cover - the checks above prevent it
        # Last line of defence for untrusted bytes: numpy must never leak its own
        # errors to the caller, whatever slipped through the validation above.
        raise CorruptEntryError(f"corrupt cache entry: {exc}") from exc
    return out
