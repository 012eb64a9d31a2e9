"""Which bytes of each cached entry a batch gather copies, and how it checks them.

A batch's hits are copied as byte ranges of their entries, the same ranges
for every entry of one layout (:attr:`mmcache.codec.Header.layout_key`):
each large field (the image) gets a range of its own, copied straight into
the batch tensor; the header, the field table and the small fields (token
ids, mask) that lie close together are merged into as few ranges as possible,
because each range costs a Python-level row copy.

Along with the fields the gather copies each entry's fixed header and field
table: an entry whose table differs from the layout (another shape under the
key: a damaged entry) or that expired is not served. Both checks read the
header by the offsets :data:`mmcache.codec.HEADER` exports, so a format change
in the codec cannot silently break them.

Thread safety: pure functions over immutable values, plus a bounded memo
(a dict written whole per layout, read by both assembling threads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mmcache import codec

__all__ = ["ByteRanges", "byte_ranges", "expired_rows", "head_matches"]

#: Fields larger than this get a range of their own (copied straight into the batch).
_LARGE_FIELD = 4096
#: Merge neighbouring ranges separated by at most this many bytes (alignment padding).
_MERGE_GAP = 256
#: Layouts remembered (one per batch shape in use: there is usually one).
_MAX_LAYOUTS = 64
_CTIME = codec.HEADER["ctime"]


@dataclass(frozen=True)
class ByteRanges:
    """How to read the entries of one layout: merged byte ranges, and what the header
    and field table (bytes ``[0, table_end)``) must say."""

    segments: tuple[tuple[int, int, tuple[str, ...]], ...]  # (start, stop, field names)
    offsets: dict[str, tuple[int, int, np.dtype[Any], tuple[int, ...]]]
    table_end: int
    expected_head: np.ndarray  # uint8 [table_end]: the bytes every entry shares
    ignore: np.ndarray  # bool [table_end]: True for the per-entry header fields


_RANGES: dict[bytes, ByteRanges] = {}


def byte_ranges(layout: codec.Header) -> ByteRanges:
    """The ranges (and checks) of ``layout``'s entries, memoised per layout."""
    ranges = _RANGES.get(layout.layout_key)
    if ranges is not None:
        return ranges
    table_end = layout.table_end
    segments: list[tuple[int, int, list[str]]] = [(0, table_end, [])]
    for f in sorted(layout.fields, key=lambda f: f.offset):
        start, stop = f.offset, f.offset + f.nbytes
        last = segments[-1]
        last_large = len(last[2]) == 1 and (last[1] - last[0]) > _LARGE_FIELD
        if f.nbytes <= _LARGE_FIELD and not last_large and start - last[1] <= _MERGE_GAP:
            segments[-1] = (last[0], stop, [*last[2], f.name])
        else:
            segments.append((start, stop, [f.name]))
    offsets = {f.name: (f.offset, f.nbytes, f.dtype, tuple(f.shape)) for f in layout.fields}
    ignore = np.zeros(table_end, dtype=bool)
    for h in codec.HEADER.values():
        if h.per_entry:
            ignore[h.offset : h.stop] = True
    ranges = ByteRanges(
        segments=tuple((a, b, tuple(names)) for a, b, names in segments),
        offsets=offsets,
        table_end=table_end,
        expected_head=_expected_head(layout, table_end),
        ignore=ignore,
    )
    if len(_RANGES) < _MAX_LAYOUTS:
        _RANGES[layout.layout_key] = ranges
    return ranges


def _expected_head(layout: codec.Header, table_end: int) -> np.ndarray:
    """The header and table bytes of an entry of ``layout`` (per-entry fields aside)."""
    ref = codec.encode(
        {f.name: np.zeros(f.shape, dtype=f.dtype) for f in layout.fields},
        bfloat16={f.name for f in layout.fields if f.logical_dtype == "bfloat16"},
    )
    return np.frombuffer(ref, dtype=np.uint8, count=table_end)


def head_matches(head: np.ndarray, ranges: ByteRanges) -> np.ndarray:
    """Per row of ``head`` (``uint8 [n, table_end]``): the header and table are the layout's."""
    return np.asarray(((head == ranges.expected_head) | ranges.ignore).all(axis=1), dtype=bool)


def expired_rows(head: np.ndarray, cutoff: float) -> np.ndarray:
    """Per row of ``head``: the entry was created before ``cutoff`` (its TTL ran out)."""
    ctime = head[:, _CTIME.offset : _CTIME.stop].copy().view(_CTIME.dtype).reshape(len(head))
    return np.asarray(ctime < cutoff, dtype=bool)
