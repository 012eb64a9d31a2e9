"""Where a memory store's data lives: its files, its header words, the arrays of its meta
segment, and the states of entries and of whole stores.

Files (all ``0600`` in this user's directory ``/dev/shm/mmcache-u<uid>/``, mode
``0700``, or ``0660`` in a group's ``/dev/shm/mmcache-g<gid>/``, ``0770``; named
``mmcache-<name>...``; every file and the directory are checked for owner and mode
before use, see ``access.py``):

``mmcache-<name>.lock``
    Empty file. ``flock`` on it is the node-wide readers-writer lock; the kernel
    drops it when a holder dies, so a crash can never leave the store locked.
``mmcache-<name>-meta``
    Fixed-dtype numpy arrays (:class:`Layout`): a header (configuration, state, byte
    and item counts, the pid of the exclusive-lock holder, the index generation), the
    table of attached processes with one row of statistics counters each, and the
    size-class table.
``mmcache-<name>-iNNN``
    The index, generation ``NNN`` (``index.py``): the entry table (per entry:
    :class:`EntryState`, key, size, slot, cost, ctime, atime, hits, seq, writer pid)
    and the hash table (see ``table.py``). It grows (a new generation) when it is
    full while bytes of the budget are free.
``mmcache-<name>-dNNN``
    One per size class in use: a slot-usage bitmap, then the *slab* (see ``slabs.py``).

The RAM a store really uses is the slots of held entries (payload plus the
size-class rounding) plus metadata: 4 B per hash cell (2 to 4 cells per index entry,
touched at random so all of them count), 83 B per entry row ever used
(``index.ROW_BYTES``), about 150 KiB of fixed tables, 1 B per slot of each size class
in use (a class has a slot for each entry of its smallest size the budget could hold,
at most the index's maximum entries). None of it is counted in the budget, which is
the payloads' (``nbytes() <= capacity()``, the store contract): a budget of tiny
entries takes up to about twice its size (64 B entries: 64 B of slot, 91-99 B of index).

A full ``/dev/shm``: touching a page of a tmpfs file through a mapping (even
reading it) allocates it, and fails with SIGBUS when the tmpfs is full. So
nothing is touched through a mapping before it was allocated with
``posix_fallocate``, which fails with ``ENOSPC`` instead (see
:class:`~mmcache.stores.memory.shm.Segment`): the fixed tables when the store is
created, the hash table when an index generation is created (``CacheError`` or no
grow if they do not fit), a size class's
bitmap and the entry rows in steps as the slots and entries
in use grow (``EntryTable.reserve_rows``; a refused put, with one warning, if they do
not fit). Payloads are written with ``pwrite`` (``ENOSPC`` too: a refused put).
Reserving when a row is first used, rather than the whole meta segment at creation,
keeps the RAM cost proportional to the entries used: the rows are nearly all of the
meta segment.
"""

from __future__ import annotations

import contextlib
import glob
import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from mmcache.errors import CacheError
from mmcache.stores.memory import shm
from mmcache.stores.memory.access import Access
from mmcache.stores.memory.shm import (
    SHM_PREFIX,
    Segment,
    check_store_name,
    map_arrays,
    place_arrays,
    proc_start_time,
)

__all__ = [
    "DEFAULT_INDEX_DIVISOR",
    "HEADER_WORDS",
    "MAGIC",
    "MAX_INDEX_CAPACITY",
    "MAX_PROCS",
    "MIN_INDEX_CAPACITY",
    "OWNER_PATH_MAX",
    "ROW_OVERFLOW",
    "ROW_RESERVE_STEP",
    "ROW_RETIRED",
    "VERSION",
    "Count",
    "EntryState",
    "Layout",
    "Meta",
    "Owner",
    "StoreState",
    "data_path",
    "data_paths",
    "default_index_capacity",
    "default_max_entries",
    "initialise_meta",
    "lock_path",
    "meta_path",
    "read_header",
    "remove_file",
    "store_dir",
    "store_exists",
]

#: Default initial index capacity: one entry per 4 KiB of budget, clamped to
#: [MIN_INDEX_CAPACITY, MAX_INDEX_CAPACITY].
DEFAULT_INDEX_DIVISOR = 4096
MIN_INDEX_CAPACITY = 1024
#: The most entries an index may hold: its hash cells are ``int32`` holding row + 1, so
#: 2**31 - 1 rows (2.1 billion) is what they can point at. The index's bytes grow with
#: the entries it holds (``index.py``: 91-99 B per entry), not with this bound, so a
#: budget decides how large it really grows. (Until version 4 it was 2**24: at most
#: 16.8 M entries, 16.8% of a 10**8-sample set, whatever the RAM.)
MAX_INDEX_CAPACITY = (1 << 31) - 1
#: Default most entries the index grows to: one per 64 B of budget (the smallest slot;
#: smaller entries waste most of theirs), clamped as above.
MAX_INDEX_DIVISOR = 64
#: Attached-process rows (each with its own counters); more processes share one row.
MAX_PROCS = 1024
#: Bytes reserved for the owner path in the header.
OWNER_PATH_MAX = 4096
#: Entry rows are reserved (``posix_fallocate``) in steps of at least this many rows, and
#: at least an eighth of those reserved so far: a few pages at first (a tiny /dev/shm holds
#: a few entries), about 70 steps of 12 calls each up to 2**18 rows.
ROW_RESERVE_STEP = 64

MAGIC = int.from_bytes(b"MMCACHE1", "little")
# 2: every page touched through a mapping is reserved first (the hash table and the slot
# bitmaps whole, entry rows up to H_ROWS_RESERVED). A version-1 store has sparse tables
# that would raise SIGBUS on a full /dev/shm; it is re-created.
# 3: the index lives in its own segment, in generations (``index.py``); older stores are
# re-created.
# 4: the index may hold up to MAX_INDEX_CAPACITY = 2**31 - 1 entries (was 2**24), and its
# rows are 83 B, not 93 (narrower ``cls``, ``slot`` and ``pid`` columns, ``index.py``). A
# version-3 process would misread such rows, refuse such an index as damaged, or grow one
# it then cannot open; each version re-creates the other's stores instead (never reads them).
VERSION = 4


def default_index_capacity(capacity: int) -> int:
    """Entries a new index holds at first for a byte ``capacity`` (it grows from there)."""
    return min(max(capacity // DEFAULT_INDEX_DIVISOR, MIN_INDEX_CAPACITY), MAX_INDEX_CAPACITY)


def default_max_entries(capacity: int) -> int:
    """The most entries the index of a byte ``capacity`` grows to when none is given."""
    return min(max(capacity // MAX_INDEX_DIVISOR, MIN_INDEX_CAPACITY), MAX_INDEX_CAPACITY)


class EntryState(IntEnum):
    """State of one row of the entry table.

    Transitions, all under the exclusive lock:
    ``EMPTY -> WRITING`` (reserve: slot chosen, bytes counted, writer pid set);
    ``WRITING -> READY`` (publish, after the whole payload was copied);
    ``WRITING -> EMPTY`` (abort by the writer, or reclaim once the writer is dead);
    ``READY -> EMPTY`` (delete, evict, expire, replace).
    Readers only ever serve ``READY``. The "tombstone" of a deleted key lives in
    the hash table (``CELL_TOMBSTONE``), not here: entry rows never move, so a
    writer copying without the lock can always find its row again.
    """

    EMPTY = 0
    WRITING = 1
    READY = 2


class StoreState(IntEnum):
    """State of a whole store (header field).

    ``ABSENT`` (zero-filled file) ``-> INITIALISING -> READY -> UNLINKED``.
    Creation runs under the exclusive lock, so whoever else takes the lock and
    finds ``ABSENT``/``INITIALISING`` knows the creator died: it re-initialises.
    ``UNLINKED``: removed; processes still attached get ``CacheError``.
    """

    ABSENT = 0
    INITIALISING = 1
    READY = 2
    UNLINKED = 3


class Count(IntEnum):
    """Columns of the per-process statistics counters."""

    HITS = 0
    MISSES = 1
    PUTS = 2
    ADMITTED = 3
    REFUSED = 4
    EVICTIONS = 5
    EXPIRED = 6
    CORRUPT = 7
    RECLAIMED = 8
    REPAIRS = 9


N_COUNTERS = 16
ROW_RETIRED = MAX_PROCS  # counters of detached and dead processes are folded here
ROW_OVERFLOW = MAX_PROCS + 1  # shared (racy) row when the process table is full

# Header words (int64).
(
    H_MAGIC,
    H_VERSION,
    H_STATE,
    H_CREATOR_PID,
    H_CREATOR_START,
    H_CAPACITY,
    H_ENTRIES,
    H_TABLE_SHIFT,  # unused since version 3 (the index segment has its own header)
    H_CLASSES,
    H_PROCS,
    H_FLAGS,
    H_META_SIZE,
    H_HOLDER_PID,
    H_NBYTES,
    H_ITEMS,
    H_WRITING,
    H_USED_CELLS,
    H_TOMBSTONES,
    H_SEQ,
    H_ENTRY_HINT,
    H_ENTRY_HW,
    H_OWNER_LEN,
    H_CREATED_AT,
    H_PID_NAMESPACE,
    H_ROWS_RESERVED,  # entry rows [0, n) have their pages allocated in every column
    H_INDEX_GEN,  # the index generation in use (index.py); H_ENTRIES is its size
    H_MAX_ENTRIES,  # the most entries the index may grow to
    H_OWNER_ID,  # the identity of the owner root (Owner.root_id); 0: none (older stores too)
) = range(28)
HEADER_WORDS = 64
FLAG_TEMPORARY = 1

# Columns of the size-class table.
# C_MARKED: slots ``[0, n)`` have the pages of their bitmap bytes allocated (see slabs.py).
C_CREATED, C_SLOTS, C_USED, C_HINT, C_MARKED = range(5)
CLASS_COLUMNS = 5


# --------------------------------------------------------------------------- files


def _path(directory: str, name: str, suffix: str) -> str:
    return os.path.join(directory, f"{SHM_PREFIX}{name}{suffix}")


def lock_path(directory: str, name: str) -> str:
    return _path(directory, name, ".lock")


def meta_path(directory: str, name: str) -> str:
    return _path(directory, name, "-meta")


def data_path(directory: str, name: str, cls: int) -> str:
    return _path(directory, name, f"-d{cls:03d}")


def data_paths(directory: str, name: str) -> list[str]:
    pattern = glob.escape(os.path.join(directory, f"{SHM_PREFIX}{name}-d")) + "[0-9][0-9][0-9]"
    return sorted(glob.glob(pattern))


def remove_file(path: str, removed: list[str]) -> None:
    """Unlink ``path`` if it exists, appending it to ``removed``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        removed.append(path)


def store_dir(group: int | None = None) -> str:
    """The directory holding this user's stores (or group ``group``'s): see ``access.py``."""
    return Access(0o600 if group is None else 0o660, group).directory(shm.SHM_DIR)


def store_exists(name: str, *, group: int | None = None) -> bool:
    """Whether some process made the store ``name`` on this node (its files exist)."""
    check_store_name(name)
    directory = store_dir(group)
    return os.path.exists(lock_path(directory, name)) or os.path.exists(meta_path(directory, name))


# --------------------------------------------------------------------------- meta layout


@dataclass(frozen=True)
class Owner:
    """The cache root a store belongs to, recorded in its header at creation: ``path``
    and ``root_id``, the identity the root had then (its ``root-id`` file, see
    :mod:`mmcache.cacheroot`; 0: none). A store whose root is gone, or whose path now
    holds a root of another identity (removed and made again), is an orphan
    (``cleanup.py``). Header words written before identities existed read 0."""

    path: str
    root_id: int = 0


@dataclass(frozen=True)
class Layout:
    """Where each array of the meta segment lives. A pure function of its two sizes."""

    classes: int
    procs: int
    fields: tuple[tuple[str, int, str, tuple[int, ...]], ...]
    size: int

    @classmethod
    def build(cls, *, classes: int, procs: int) -> Layout:
        spec: list[tuple[str, str, tuple[int, ...]]] = [
            ("header", "i8", (HEADER_WORDS,)),
            ("owner", "u1", (OWNER_PATH_MAX,)),
            ("procs", "i8", (procs, 2)),
            ("counters", "i8", (procs + 2, N_COUNTERS)),
            ("classes", "i8", (classes, CLASS_COLUMNS)),
        ]
        fields, size = place_arrays(spec)
        return cls(classes, procs, fields, size)

    @classmethod
    def of_header(cls, header: np.ndarray[Any, Any]) -> Layout:
        """The layout a valid header describes."""
        return cls.build(classes=int(header[H_CLASSES]), procs=int(header[H_PROCS]))

    def arrays(self, buf: Any) -> dict[str, np.ndarray[Any, Any]]:
        return map_arrays(buf, self.fields)


def initialise_meta(
    seg: Segment,
    layout: Layout,
    *,
    capacity: int,
    entries: int,
    max_entries: int,
    slot_sizes: np.ndarray[Any, Any],
    temporary: bool,
    owner: Owner | None,
    created_at: int,
    pid_namespace: int,
) -> None:
    """Write the header, owner path and size-class table of a new, zero-filled meta segment.

    ``entries``: the size of the first index generation (0, created by the caller);
    ``max_entries``: the most it grows to, which is also the slot count of the size
    classes (an entry of a class always finds a slot, however large the index grew).
    Leaves the store ``INITIALISING``: the caller sets ``READY`` once it is mapped.
    """
    arrays = layout.arrays(seg.buf)
    h = arrays["header"]
    h[H_STATE] = StoreState.INITIALISING
    h[H_MAGIC] = MAGIC
    h[H_VERSION] = VERSION
    h[H_META_SIZE] = layout.size
    h[H_CREATOR_PID] = os.getpid()
    h[H_CREATOR_START] = proc_start_time(os.getpid()) or 0
    h[H_CAPACITY] = capacity
    h[H_ENTRIES] = entries
    h[H_MAX_ENTRIES] = max_entries
    h[H_INDEX_GEN] = 0
    h[H_CLASSES] = len(slot_sizes)
    h[H_PROCS] = layout.procs
    h[H_FLAGS] = FLAG_TEMPORARY if temporary else 0
    h[H_CREATED_AT] = created_at
    h[H_PID_NAMESPACE] = pid_namespace
    if owner is not None:
        raw = owner.path.encode()
        arrays["owner"][: len(raw)] = np.frombuffer(raw, np.uint8)
        h[H_OWNER_LEN] = len(raw)
        h[H_OWNER_ID] = owner.root_id
    classes = arrays["classes"]
    min_payload = np.concatenate(([1], slot_sizes[:-1] + 1))
    classes[:, C_SLOTS] = np.minimum(max_entries, capacity // min_payload)
    classes[0, C_SLOTS] = max_entries  # class 0 also holds empty values
    del arrays, classes, h


def read_header(seg: Segment) -> np.ndarray[Any, Any]:
    """A view of the header words of a mapped meta segment (before its layout is known)."""
    return np.frombuffer(seg.buf, np.int64, count=HEADER_WORDS)


class Meta:
    """One process's numpy views of a store's meta segment (see :class:`Layout`).

    The views are only valid while the segment is mapped: :meth:`close` drops them
    first, so the mapping can close. Every attribute is an array in shared memory,
    read and written under the store's lock by its owner: the header words ``H_*``
    belong to the session (state, holder, configuration, index generation) or to the
    entry table (counts, hints, reserved rows), the size-class table to the slabs, the
    process table and counters to the session.
    """

    def __init__(self, seg: Segment, name: str) -> None:
        layout = Layout.of_header(read_header(seg))
        if layout.size != seg.size:
            raise CacheError(f"memory store {name!r}: meta segment size mismatch")
        self.seg = seg
        self.layout = layout
        self.arrays = layout.arrays(seg.buf)
        self.header = self.arrays["header"]
        self.owner = self.arrays["owner"]
        self.procs = self.arrays["procs"]
        self.counters = self.arrays["counters"]
        self.classes = self.arrays["classes"]

    def owner_path(self, errors: str = "strict") -> str | None:
        """The cache root recorded at creation, if any (``errors`` as in ``bytes.decode``)."""
        n = int(self.header[H_OWNER_LEN])
        return self.owner[:n].tobytes().decode(errors=errors) if n else None

    def owner_id(self) -> int:
        """The identity of the cache root recorded at creation (0: none)."""
        return int(self.header[H_OWNER_ID])

    def close(self) -> None:
        """Drop every view, then unmap (views first, so the mmap can close)."""
        del self.arrays, self.header, self.owner, self.procs, self.counters, self.classes
        self.seg.close()
