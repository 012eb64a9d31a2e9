"""The index of a memory store (entry rows and hash table) in its own segment, and how it grows.

Why a segment of its own: many tiny samples (tokens only, pooled features) need far
more entries than a budget guessed at 4 KiB per entry gives, and the number is only
known once entries arrive. So the index starts small (``default_index_capacity``) and
*grows*: a new, larger index segment ``mmcache-<name>-iNNN`` (``NNN`` its generation)
replaces the old one while bytes of the budget are still free (:func:`grow_target`).

Protocol (all under the store's exclusive lock, see ``session.py``):

1. the new generation's file is created (a stale one of that number, left by a
   process that died in step 1 or 2, is removed first), its hash table and the rows
   in use are reserved (``posix_fallocate``: ``ENOSPC`` means no grow, never SIGBUS);
2. the rows ``[0, high water)`` are copied at the same row numbers (a writer copying
   its payload without the lock finds its row again) and the hash table is built;
3. the meta header's ``H_INDEX_GEN`` is set: the one-word commit point;
4. the old file is unlinked.

Every process checks ``H_INDEX_GEN`` each time it takes the lock (shared or
exclusive) and maps the new generation before it looks anything up. No reader can
ever read a freed table: an index is only read under the store lock, a grow needs the
lock exclusively, so no section that read the old generation is still running when it
is replaced; and a mapping stays valid after its file was unlinked until the process
drops it (this process drops the old one by reference, so even a stale reference
held by mistake reads the old, consistent bytes, never freed memory).

A crash: before step 3 the old generation is the store's and is intact (nothing of it
was changed); after step 3 the new one is complete. Either way the holder's pid is
left in the header, so the next holder repairs (derives counts and the hash table
from the rows again) and removes every index file but the current one
(:func:`remove_stale`); ``reclaim_orphans`` and ``unlink`` remove every generation.

The index segment starts with a small header of its own (magic, generation, entries,
table shift), so a mapping describes itself and cannot be mistaken for another
generation's.
"""

from __future__ import annotations

import contextlib
import glob
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmcache.errors import CacheError
from mmcache.stores.memory.access import Access, UntrustedFileError
from mmcache.stores.memory.layout import MAX_INDEX_CAPACITY
from mmcache.stores.memory.shm import SHM_PREFIX, Segment, map_arrays, place_arrays

__all__ = [
    "ENTRY_COLUMNS",
    "GROW_HEADROOM",
    "INDEX_MAGIC",
    "ROW_BYTES",
    "Index",
    "IndexLayout",
    "grow_target",
    "index_path",
    "index_paths",
    "index_problem",
    "remove_stale",
    "table_shift",
]

INDEX_MAGIC = int.from_bytes(b"MMCINDX1", "little")
INDEX_HEADER_WORDS = 8
I_MAGIC, I_GEN, I_ENTRIES, I_SHIFT = range(4)
#: The most entries an index segment may declare (a header declaring more is damaged,
#: never a huge mapping): as many as its ``int32`` hash cells can point at.
MAX_INDEX_ENTRIES = MAX_INDEX_CAPACITY
#: A grow sizes the index for the budget at the mean entry size seen, plus this
#: fraction (entry sizes vary), and at least doubles it (so a store grows
#: O(log n) times, each a copy of the rows in use).
GROW_HEADROOM = 0.25

#: The arrays of the index segment with one row per entry (between the header and "table"):
#: ``ROW_BYTES`` (83 B) a row, plus 2-4 hash cells of 4 B. Each column is as narrow as what
#: it holds allows (layout version 4; 93 B before): ``cls`` < 1000 classes (the ``-dNNN``
#: file names), ``slot`` < a class's slots <= ``MAX_INDEX_ENTRIES`` < 2**31, ``pid`` <=
#: Linux's ``PID_MAX_LIMIT`` (2**22). ``hits`` and ``seq`` stay 64-bit (they only grow),
#: and the times and costs stay ``f8`` (the policies compare them).
ENTRY_COLUMNS = (
    ("state", "u1", ()),
    ("key", "u8", (2,)),
    ("size", "i8", ()),
    ("cls", "i2", ()),
    ("slot", "i4", ()),
    ("cost", "f8", ()),
    ("ctime", "f8", ()),
    ("atime", "f8", ()),
    ("hits", "i8", ()),
    ("seq", "i8", ()),
    ("pid", "i4", ()),
    ("pstart", "i8", ()),
)
#: Bytes of one entry row over every column (the hash cells not included).
ROW_BYTES = sum(np.dtype(dtype).itemsize * int(np.prod(shape)) for _, dtype, shape in ENTRY_COLUMNS)


def index_path(directory: str, name: str, gen: int) -> str:
    """The file of generation ``gen`` of the store ``name``'s index."""
    return os.path.join(directory, f"{SHM_PREFIX}{name}-i{gen:03d}")


def index_paths(directory: str, name: str) -> list[str]:
    """Every index file of the store ``name`` present now (all generations)."""
    pattern = glob.escape(os.path.join(directory, f"{SHM_PREFIX}{name}-i")) + "[0-9][0-9][0-9]"
    return sorted(glob.glob(pattern))


def remove_stale(directory: str, name: str, gen: int, removed: list[str]) -> None:
    """Unlink every index file of ``name`` but generation ``gen``'s. Caller holds EX."""
    keep = index_path(directory, name, gen)
    for path in index_paths(directory, name):
        if path != keep:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(path)


def table_shift(entries: int) -> int:
    """The hash table's shift for ``entries``: ``2**(64 - shift)`` cells, at least 2 each."""
    cells = 1 << max(2 * entries - 1, 1).bit_length()  # next power of two >= 2 * entries
    return 64 - (cells.bit_length() - 1)


def grow_target(*, entries: int, max_entries: int, items: int, nbytes: int, capacity: int) -> int:
    """The entries a full index of ``entries`` should grow to (``entries``: it cannot).

    Sized from the budget and the entry sizes seen: the budget at the mean size of the
    ``items`` entries holding ``nbytes``, plus ``GROW_HEADROOM``; at least twice the
    current size; at most ``max_entries``.
    """
    if entries >= max_entries:
        return entries
    mean = max(nbytes / max(items, 1), 1.0)
    want = int(capacity / mean * (1 + GROW_HEADROOM))
    return min(max(want, 2 * entries), max_entries)


@dataclass(frozen=True)
class IndexLayout:
    """Where each array of an index segment lives. A pure function of its two sizes."""

    entries: int
    table_shift: int
    fields: tuple[tuple[str, int, str, tuple[int, ...]], ...]
    size: int

    @classmethod
    def build(cls, entries: int) -> IndexLayout:
        shift = table_shift(entries)
        spec: list[tuple[str, str, tuple[int, ...]]] = [
            ("header", "i8", (INDEX_HEADER_WORDS,)),
            *((name, dtype, (entries, *shape)) for name, dtype, shape in ENTRY_COLUMNS),
            ("table", "i4", (1 << (64 - shift),)),
        ]
        fields, size = place_arrays(spec)
        return cls(entries, shift, fields, size)

    def header_range(self) -> tuple[int, int]:
        return 0, INDEX_HEADER_WORDS * 8

    def table_range(self) -> tuple[int, int]:
        """``(offset, length)`` of the hash table (the last array)."""
        _, offset, dtype, shape = self.fields[-1]
        return offset, np.dtype(dtype).itemsize * int(np.prod(shape))

    def row_ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of entry rows ``[start, stop)`` in every entry column."""
        out = []
        for _, offset, dtype, shape in self.fields[1:-1]:
            row = np.dtype(dtype).itemsize * int(np.prod(shape[1:]))
            out.append((offset + start * row, (stop - start) * row))
        return out

    def arrays(self, buf: Any) -> dict[str, np.ndarray[Any, Any]]:
        return map_arrays(buf, self.fields)


class Index:
    """One process's mapping of one generation of a store's index segment.

    ``arrays``: the header words ``I_*``, the entry columns (``ENTRY_COLUMNS``) and
    ``table`` (the hash cells), read and written under the store lock. Dropping the
    object (and every view of its arrays) unmaps it; :meth:`close` does it at once
    (only when no thread can still use it: the store's close).
    """

    def __init__(self, seg: Segment, name: str, gen: int) -> None:
        ok = seg.size >= INDEX_HEADER_WORDS * 8
        if ok:
            words = np.frombuffer(seg.buf, np.int64, count=INDEX_HEADER_WORDS)
            entries = int(words[I_ENTRIES])
            ok = int(words[I_MAGIC]) == INDEX_MAGIC and int(words[I_GEN]) == gen
            ok = ok and 0 < entries <= MAX_INDEX_ENTRIES
            del words
        layout = IndexLayout.build(entries) if ok else None
        if layout is None or layout.size != seg.size:
            seg.close()
            raise CacheError(
                f"memory store {name!r}: index segment {seg.path} is not generation {gen}"
                " of this store or is truncated; remove the store (mmcache gc) and retry"
            )
        self.seg = seg
        self.gen = gen
        self.layout = layout
        self.arrays = layout.arrays(seg.buf)

    @classmethod
    def create(
        cls, directory: str, name: str, access: Access, *, gen: int, entries: int, rows: int
    ) -> Index:
        """A new, empty generation ``gen`` of ``entries`` with rows ``[0, rows)`` reserved.

        Raises ``OSError`` (``ENOSPC``) when /dev/shm has no room (nothing is left).
        """
        path = index_path(directory, name, gen)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a process that died growing the index
        layout = IndexLayout.build(entries)
        seg = Segment.create(
            path,
            layout.size,
            access=access,
            reserve=[layout.header_range(), layout.table_range(), *layout.row_ranges(0, rows)],
        )
        words = np.frombuffer(seg.buf, np.int64, count=INDEX_HEADER_WORDS)
        words[I_ENTRIES] = entries
        words[I_SHIFT] = layout.table_shift
        words[I_GEN] = gen
        words[I_MAGIC] = INDEX_MAGIC
        del words
        return cls(seg, name, gen)

    @classmethod
    def open(cls, directory: str, name: str, access: Access, gen: int) -> Index:
        """Map generation ``gen``; ``CacheError`` if it is missing, truncated or not ours."""
        path = index_path(directory, name, gen)
        try:
            seg = Segment.open(path, access=access)
        except FileNotFoundError:
            raise CacheError(
                f"memory store {name!r}: index segment {path} is missing (removed by hand?);"
                " remove the store (mmcache gc) and retry"
            ) from None
        return cls(seg, name, gen)

    def close(self) -> None:
        """Drop the views, then unmap."""
        del self.arrays
        self.seg.close()


def index_problem(directory: str, name: str, access: Access, gen: int) -> str | None:
    """Why generation ``gen`` of the store's index cannot be used, or None.

    Checked from the file's size and header before the store maps it. Raises
    :class:`~mmcache.stores.memory.access.UntrustedFileError` for a file another
    user could control.
    """
    try:
        Index.open(directory, name, access, gen).close()
    except UntrustedFileError:
        raise
    except CacheError as exc:
        return str(exc)
    return None
