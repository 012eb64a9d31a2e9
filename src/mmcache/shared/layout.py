"""What a shared tier holds, byte for byte: pack names and the index of one pack.

A share (a folder on a shared file system, or a prefix of an object store) holds::

    packs/<pack>.pack   entries one after another, each the codec's bytes with its checksum
    index/<pack>.idx    the pack's index: which key lies where, written once, whole

A pack is immutable: a writer fills it in a spool file of its own, uploads it under a
name nobody else uses (:func:`new_pack_name`: the wall clock in ns and 64 random bits),
then commits its index. Readers list ``index/`` only, so a pack becomes visible when its
index does, and an index is written whole (a rename on a file system, one PUT on an
object store): a writer killed at any moment leaves at most a pack without an index,
which nobody reads and ``mmcache gc --shared`` removes.

The index of a pack is fixed-dtype arrays, never a Python object per entry (a share
holds 10^7-10^8 entries; :mod:`mmcache.shared.index` keeps them merged as arrays too)::

    header  <8sIIQQdd  magic, version, 0, count, pack bytes, created (wall), newest ctime
    keys    uint8  [count, 16]
    offset  uint64 [count]   where each entry starts in the pack
    size    uint32 [count]   its length (at most MAX_ENTRY)
    ctime   float64[count]   its creation time (the codec header's; TTL and gc use it)
    cost    float32[count]   the CPU seconds it took to produce (the admission policy's)
    xxh3_64 of everything above

Everything is checked before it is used (:func:`decode_index`): the length of the file
against the count, the checksum, each entry inside the pack and at most
:data:`MAX_ENTRY` bytes long, so a damaged or hostile index never makes a reader
allocate or fetch more than it says, and a damaged index is skipped whole (its pack
read by nobody). Nothing is unpickled; the entries themselves carry the codec's
checksum, checked on every read.

Pure functions; thread-safe.
"""

from __future__ import annotations

import re
import secrets
import struct
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.errors import CorruptEntryError
from mmcache.keys import KEY_SIZE

__all__ = [
    "INDEX_DIR",
    "MAX_ENTRY",
    "MAX_INDEX_BYTES",
    "MAX_INDEX_ENTRIES",
    "MAX_PACK",
    "PACK_DIR",
    "ROW_BYTES",
    "IndexArrays",
    "decode_index",
    "encode_index",
    "index_bytes",
    "index_name",
    "new_pack_name",
    "pack_name",
    "pack_of",
    "pack_time",
]

INDEX_DIR = "index"
PACK_DIR = "packs"
_INDEX_SUFFIX = ".idx"
_PACK_SUFFIX = ".pack"
#: A pack's name: the wall clock in ns (hex, so names sort by age) and 64 random bits.
_NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{16}")

_MAGIC = b"MMSHIDX1"
_VERSION = 1
_HEADER = struct.Struct("<8sIIQQdd")
_TRAILER = struct.Struct("<Q")
#: Bytes per entry in an index file: key, offset, size, ctime, cost.
ROW_BYTES = KEY_SIZE + 8 + 4 + 8 + 4
#: The largest entry a share holds (a bigger one is refused at publish: not shared).
MAX_ENTRY = 1 << 30
#: The largest pack an index may describe (a hostile index cannot make a reader fetch more).
MAX_PACK = 1 << 40
#: The most entries one index may list (at 1 KiB an entry, a 4 GiB pack).
MAX_INDEX_ENTRIES = 1 << 22


def new_pack_name(clock_ns: int | None = None) -> str:
    """A pack name nobody else will use: wall clock ns and 64 random bits, in hex."""
    ns = time.time_ns() if clock_ns is None else clock_ns
    return f"{ns & (2**64 - 1):016x}-{secrets.token_hex(8)}"


def index_name(pack: str) -> str:
    """``index/<pack>.idx``, relative to the share."""
    return f"{INDEX_DIR}/{pack}{_INDEX_SUFFIX}"


def pack_name(pack: str) -> str:
    """``packs/<pack>.pack``, relative to the share."""
    return f"{PACK_DIR}/{pack}{_PACK_SUFFIX}"


def pack_of(filename: str, *, suffix: str = _INDEX_SUFFIX) -> str | None:
    """The pack named by an index (or, with ``suffix=".pack"``, pack) file's base name;
    None for anything else in the folder (a temporary file, a stranger's file)."""
    base = filename.rsplit("/", 1)[-1]
    if not base.endswith(suffix):
        return None
    stem = base[: -len(suffix)]
    return stem if _NAME.fullmatch(stem) else None


def pack_time(pack: str) -> float:
    """The wall-clock time a pack's name was made, in seconds since the epoch."""
    return int(pack.partition("-")[0], 16) / 1e9


@dataclass(frozen=True)
class IndexArrays:
    """One pack's index (see the module docstring), its arrays read-only."""

    keys: npt.NDArray[np.uint8]  # [n, 16]
    offset: npt.NDArray[np.uint64]
    size: npt.NDArray[np.uint32]
    ctime: npt.NDArray[np.float64]
    cost: npt.NDArray[np.float32]
    pack_bytes: int
    created: float

    def __len__(self) -> int:
        return len(self.offset)

    @property
    def newest(self) -> float:
        """The creation time of its newest entry (0.0 for an empty pack)."""
        return float(self.ctime.max()) if len(self) else 0.0

    @property
    def nbytes(self) -> int:
        """The bytes of its entries."""
        return int(self.size.sum(dtype=np.uint64))


def encode_index(arrays: IndexArrays) -> bytes:
    """The index file of ``arrays`` (see the module docstring)."""
    n = len(arrays)
    head = _HEADER.pack(_MAGIC, _VERSION, 0, n, arrays.pack_bytes, arrays.created, arrays.newest)
    body = b"".join(
        (
            head,
            np.ascontiguousarray(arrays.keys, dtype=np.uint8).tobytes(),
            np.ascontiguousarray(arrays.offset, dtype="<u8").tobytes(),
            np.ascontiguousarray(arrays.size, dtype="<u4").tobytes(),
            np.ascontiguousarray(arrays.ctime, dtype="<f8").tobytes(),
            np.ascontiguousarray(arrays.cost, dtype="<f4").tobytes(),
        )
    )
    return body + _TRAILER.pack(xxhash.xxh3_64_intdigest(body))


def index_bytes(count: int) -> int:
    """The length of the index file of ``count`` entries."""
    return _HEADER.size + count * ROW_BYTES + _TRAILER.size


#: The longest index file a reader fetches (the bound it checks a listing's size against).
MAX_INDEX_BYTES = index_bytes(MAX_INDEX_ENTRIES)


def decode_index(data: bytes, *, name: str) -> IndexArrays:
    """The arrays of the index file ``data`` (named ``name`` in errors), every field
    checked; raises :class:`~mmcache.errors.CorruptEntryError` naming what is wrong."""
    if len(data) < _HEADER.size + _TRAILER.size:
        raise CorruptEntryError(f"shared index {name}: {len(data)} bytes, shorter than a header")
    magic, version, _, count, pack_bytes, created, _newest = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise CorruptEntryError(
            f"shared index {name}: not an mmcache index of version {_VERSION} "
            f"(magic {magic!r}, version {version})"
        )
    if count > MAX_INDEX_ENTRIES or len(data) != index_bytes(count):
        raise CorruptEntryError(
            f"shared index {name}: {len(data)} bytes for {count} entries "
            f"(expected {index_bytes(min(count, MAX_INDEX_ENTRIES))}, at most "
            f"{MAX_INDEX_ENTRIES} entries)"
        )
    (stored,) = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    if xxhash.xxh3_64_intdigest(memoryview(data)[: len(data) - _TRAILER.size]) != stored:
        raise CorruptEntryError(f"shared index {name}: checksum mismatch")
    if pack_bytes > MAX_PACK:
        raise CorruptEntryError(f"shared index {name}: a pack of {pack_bytes} bytes (> {MAX_PACK})")
    at = _HEADER.size
    keys = np.frombuffer(data, np.uint8, count * KEY_SIZE, at).reshape(count, KEY_SIZE)
    at += count * KEY_SIZE
    offset = np.frombuffer(data, "<u8", count, at)
    at += count * 8
    size = np.frombuffer(data, "<u4", count, at)
    at += count * 4
    ctime = np.frombuffer(data, "<f8", count, at)
    at += count * 8
    cost = np.frombuffer(data, "<f4", count, at)
    if count and (
        int(size.max()) > MAX_ENTRY
        or bool((offset > pack_bytes).any())
        or bool((offset + size.astype(np.uint64) > pack_bytes).any())
        or not bool(np.isfinite(ctime).all())
        or not bool(np.isfinite(cost).all())
    ):
        raise CorruptEntryError(
            f"shared index {name}: an entry lies outside its pack of {pack_bytes} bytes, is "
            f"over {MAX_ENTRY} bytes, or has a time or cost that is not a number"
        )
    return IndexArrays(
        keys=keys,
        offset=offset.astype(np.uint64),
        size=size.astype(np.uint32),
        ctime=ctime.astype(np.float64),
        cost=cost.astype(np.float32),
        pack_bytes=int(pack_bytes),
        created=float(created),
    )
