"""The byte layout of a cache entry: the fixed header, the field table, the dtype codes.

What :mod:`mmcache.codec` writes and reads, defined once. Code that reads
header bytes of many entries at once without parsing each (the loader's
byte-range gather copies the header and field table of a whole batch under one
lock and compares them in one numpy step) takes the offsets from
:data:`HEADER` and :attr:`Header.table_end`, so a format change cannot
silently break it.

Format (version 1, little-endian everywhere)::

    offset size  field
    0      4     magic        b"MMC1"
    4      2     version      uint16, 1
    6      2     flags        uint16, reserved: must be 0
    8      8     checksum     uint64, xxh3_64 of bytes [0, 8) + [16, length)
    16     8     length       uint64, total bytes of the entry
    24     8     ctime        float64, wall-clock creation time (s since the epoch)
    32     8     cost         float64, seconds it took to produce the sample (>= 0)
    40     4     nfields      uint32, <= 256
    44     4     table_size   uint32, bytes of the field table that follows
    48     ...   field table: per field, in order
                   uint16 name_len, uint8 dtype code, uint8 ndim (<= 8),
                   ndim x uint64 shape, uint64 offset, uint64 nbytes,
                   name_len bytes of UTF-8 name (<= 1024 bytes)
    ...    ...   the raw C-order buffers, each starting at the next multiple of 64
                 (relative to the start of the entry); zero padding between them;
                 the entry ends right after the last buffer.

The checksum covers every byte of the entry except its own 8 bytes, so a flip
of any single byte is detected by ``verify=True`` (a flip inside the checksum
field makes it disagree with the rest). The layout is *canonical*: a field's
offset must be exactly the next 64-byte boundary after the previous field (or
the table), so offsets can neither overlap nor leave gaps, and two samples with
the same names, dtypes and shapes have byte-identical field tables (see
:func:`layout_signature`). Without the checksum (``verify=False``) all of this
structure is still checked; only bit flips inside array data go unnoticed.

Thread and process safety: constants and frozen dataclasses only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "ALIGN",
    "BFLOAT16",
    "BFLOAT16_CODE",
    "DTYPE_CODES",
    "HEADER",
    "HEADER_SIZE",
    "HEADER_STRUCT",
    "KIND_TO_CODE",
    "LAYOUT_PREFIX",
    "MAGIC",
    "MAX_FIELDS",
    "MAX_NAME_BYTES",
    "MAX_NDIM",
    "SUPPORTED_DTYPES",
    "VERSION",
    "Field",
    "Header",
    "HeaderField",
    "layout_signature",
]

MAGIC = b"MMC1"
#: Format version written in every header; decode refuses any other.
VERSION = 1
#: Every array buffer starts at a multiple of this (cache line; AVX-512 width).
ALIGN = 64
MAX_FIELDS = 256
MAX_NDIM = 8
MAX_NAME_BYTES = 1024


class HeaderField(NamedTuple):
    """One fixed header field: bytes ``[offset, stop)`` holding one value of numpy ``dtype``.

    ``per_entry``: the value differs between entries of one layout (checksum,
    ctime, cost); every other header byte is the same for all of them.
    """

    offset: int
    stop: int
    dtype: str
    per_entry: bool


#: The fixed header, field by field in byte order (the format table above).
HEADER: dict[str, HeaderField] = {
    "magic": HeaderField(0, 4, "|S4", False),
    "version": HeaderField(4, 6, "<u2", False),
    "flags": HeaderField(6, 8, "<u2", False),
    "checksum": HeaderField(8, 16, "<u8", True),
    "length": HeaderField(16, 24, "<u8", False),
    "ctime": HeaderField(24, 32, "<f8", True),
    "cost": HeaderField(32, 40, "<f8", True),
    "nfields": HeaderField(40, 44, "<u4", False),
    "table_size": HeaderField(44, 48, "<u4", False),
}
#: The same fields as one struct (packed and unpacked whole by the codec).
HEADER_STRUCT = struct.Struct("<4sHHQQddII")
HEADER_SIZE = HEADER_STRUCT.size  # 48
#: A layout key (:func:`layout_signature`) is the version and field count, then the table.
LAYOUT_PREFIX = struct.Struct("<HI")

BFLOAT16 = "bfloat16"
BFLOAT16_CODE = 13
#: code -> (storage dtype, logical dtype name). Codes are part of the format:
#: never renumber, only append (and bump VERSION if old readers must refuse).
DTYPE_CODES: dict[int, tuple[np.dtype[Any], str]] = {
    1: (np.dtype("|b1"), "bool"),
    2: (np.dtype("|u1"), "uint8"),
    3: (np.dtype("|i1"), "int8"),
    4: (np.dtype("<u2"), "uint16"),
    5: (np.dtype("<i2"), "int16"),
    6: (np.dtype("<u4"), "uint32"),
    7: (np.dtype("<i4"), "int32"),
    8: (np.dtype("<u8"), "uint64"),
    9: (np.dtype("<i8"), "int64"),
    10: (np.dtype("<f2"), "float16"),
    11: (np.dtype("<f4"), "float32"),
    12: (np.dtype("<f8"), "float64"),
    BFLOAT16_CODE: (np.dtype("<u2"), BFLOAT16),
}
#: (kind, itemsize) -> code, for encoding plain numpy dtypes.
KIND_TO_CODE = {
    (dt.kind, dt.itemsize): code for code, (dt, name) in DTYPE_CODES.items() if name != BFLOAT16
}
#: Logical dtype names the codec accepts.
SUPPORTED_DTYPES: tuple[str, ...] = tuple(name for _, name in DTYPE_CODES.values())


@dataclass(frozen=True, slots=True)
class Field:
    """One array of an entry: where it lies in the buffer and how to view it.

    ``dtype`` is the numpy storage dtype of the view :func:`~mmcache.codec.decode`
    returns; ``logical_dtype`` is the dtype it stands for (equal to ``dtype.name``
    except for ``"bfloat16"``, stored as uint16). ``offset`` is relative to the
    start of the entry and a multiple of :data:`ALIGN`.
    """

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    logical_dtype: str


@dataclass(frozen=True, slots=True)
class Header:
    """The parsed header of an entry (see the module docstring for the format).

    ``layout_key`` identifies the field names, dtypes, shapes and offsets: equal
    for every entry of the same layout, so a loader can gather one field of many
    entries at the same offset. ``checksum`` is as stored, not verified.
    """

    version: int
    flags: int
    ctime: float
    cost: float
    length: int
    checksum: int
    fields: tuple[Field, ...]
    layout_key: bytes

    @property
    def table_end(self) -> int:
        """Where the field table ends: bytes ``[0, table_end)`` are the fixed header and
        the table, equal in every entry of this layout but for the per-entry fields."""
        return HEADER_SIZE + len(self.layout_key) - LAYOUT_PREFIX.size

    def field(self, name: str) -> Field:
        """Return the field called ``name``; ``KeyError`` if there is none."""
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no field {name!r} in entry; fields: {[f.name for f in self.fields]}")


def layout_signature(header: Header) -> bytes:
    """Bytes identifying an entry's layout (names, dtypes, shapes, offsets).

    Identical for all samples with the same field names, dtypes and shapes in
    the same order, whatever their values, ctime or cost; different otherwise.
    It is the format version followed by the raw field table, so it is exact
    (no hash collisions) and costs nothing to compute. Use it as a dict key.
    """
    return header.layout_key
