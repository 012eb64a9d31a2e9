"""The node-shared memory tier: one copy of the cache per node, in ``/dev/shm``.

Every process of the node that opens a :class:`MemoryStore` with the same
``name`` (fork or spawn DataLoader workers, the ranks of ``torchrun``,
unrelated processes) sees the same entries, and reads them at memory speed:
:meth:`MemoryStore.gather` copies a whole batch of samples into a
preallocated array with one ``memcpy`` per sample, :meth:`MemoryStore.view`
lends a zero-copy buffer.

Layout (all files ``0600`` in this user's directory ``/dev/shm/mmcache-u<uid>/``, mode
``0700``, or ``0660`` in a group's ``/dev/shm/mmcache-g<gid>/``, ``0770``; named
``mmcache-<name>...``; every file and the directory are checked for owner and mode
before use, see ``_access.py``):

``mmcache-<name>.lock``
    Empty file. ``flock`` on it is the node-wide readers-writer lock; the kernel
    drops it when a holder dies, so a crash can never leave the store locked.
``mmcache-<name>-meta``
    Fixed-dtype numpy arrays: a header (configuration, state, byte and item
    counts, the pid of the exclusive-lock holder), the table of attached
    processes with one row of statistics counters each, the size-class table,
    the entry table (per entry: :class:`EntryState`, key, size, slot, cost,
    ctime, atime, hits, seq, writer pid) and the hash table (open addressing
    over 128-bit keys, see ``_index.py``).
``mmcache-<name>-dNNN``
    One per size class in use: a slot-usage bitmap, then the *slab*, a 2-D
    ``uint8`` array ``[n_slots, slot_size]``. After the crop every image
    sample has one size, so the common case is one slab and a batch is
    gathered from one array. Classes: multiples of 64 B up to 4 KiB, then 16
    classes per power of two (waste < 1/16 of the entry). The slab is sized
    virtually for the whole budget; tmpfs allocates pages only when written,
    and the pages of freed slots are returned (``MADV_REMOVE``).

Budget: :meth:`nbytes` counts the payload of held entries (published ones and
reservations being written) and ``nbytes() <= capacity()`` holds at every
moment in every process. The RAM really used is the slots of held entries
(payload plus the class rounding above) plus metadata: 4 B per hash cell
(2 cells per index entry, touched at random so all of them count), about 100 B
per entry row ever used, about 150 KiB of fixed tables, 1 B per slot of each
size class in use (its bitmap); small classes (< 4 KiB) return a page only
when all slots on it are free (slots are reused lowest first, which keeps them
packed).

A full ``/dev/shm``: touching a page of a tmpfs file through a mapping (even
reading it) allocates it, and fails with SIGBUS when the tmpfs is full. So
nothing is touched through a mapping before it was allocated with
``posix_fallocate``, which fails with ``ENOSPC`` instead (see
:class:`~mmcache.stores._shm.Segment`): the fixed tables and the hash table
when the store is created (``CacheError`` if they do not fit), a size class's
bitmap when the class is created and the entry rows in steps as the entries
in use grow (a refused put, with one warning, if they do not fit). Payloads
are written with ``pwrite`` (``ENOSPC`` too: a refused put). Reserving when a
row is first used, rather than the whole meta segment at creation, keeps the
RAM cost proportional to the entries used: the rows are 90 % of the meta
segment (24 of 27 MiB for a 1 GiB store).

Locking protocol (readers ``LOCK_SH``, writers ``LOCK_EX``):

* ``put``: reserve under ``LOCK_EX`` (choose a slot, evict via the policy,
  entry -> ``WRITING`` with the writer's pid), write the payload with
  ``pwrite`` *without* the lock, publish under ``LOCK_EX`` (-> ``READY``).
  Payloads up to 64 KiB are written inside one exclusive section instead (two
  lock round trips cost more than the copy). The policy decision for a full store is prepared under
  ``LOCK_SH`` (residents snapshot) and the policy runs with no lock held, so
  refusals, the common case of a full cache, never block readers; the victims
  are re-validated under ``LOCK_EX``.
* A ``WRITING`` entry is invisible to readers; if its writer died it is
  reclaimed (at open, when a reservation finds no room, and in :meth:`gc`).
* The exclusive holder writes its pid into the header and clears it on
  release; whoever next finds it set knows the previous holder died inside a
  critical section and rebuilds all derived state (byte and item counts, hash
  table, slot bitmaps) from the entry table before going on.
* ``get``/``get_many``/``gather``/``view`` run under ``LOCK_SH``; they update
  ``atime``/``hits`` in place (concurrent readers may lose an increment of an
  entry's ``hits``; it is a policy hint).

Data-path waits are bounded (``DATA_LOCK_TIMEOUT``): a process stopped inside a
section (SIGSTOP, Ctrl-Z) costs others one bounded wait and one warning naming it,
then reads are misses and puts refused until it lets go. A data segment that is
missing or truncated (a same-user ``: > file`` cannot be stopped, and kills a process
that has it mapped with SIGBUS when it touches the lost pages) makes the tier fail:
reads miss and puts are refused in the processes that find it; the next opener
re-creates the store when nobody is attached (or ``CacheError``), and
:func:`reclaim_orphans` removes it.

Nothing half-written is ever served: an entry becomes ``READY`` only after its
whole payload was copied by a process that then took the lock again.

Reads copy straight from the mapping. The first read of a page by a process
maps it (a minor fault per 64 KiB with the kernel's fault-around), so the
first pass of a process over new entries runs at roughly half the speed of
later ones; shared-memory huge pages would remove that but depend on the
host's tmpfs settings.

Clock: ``atime`` must be comparable between processes; the default
:func:`time.monotonic` is ``CLOCK_MONOTONIC``, one clock for the whole machine
on Linux. An injected clock must be shared the same way.

Processes are identified by ``(pid, start time)``, so every user of a store
must share one pid namespace; opening a store created in another one (another
container sharing ``/dev/shm``) raises ``CacheError``.
"""

from __future__ import annotations

import atexit
import contextlib
import fnmatch
import glob
import logging
import os
import struct
import sys
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from mmcache.errors import CacheError, ConfigError
from mmcache.policies import KeepPolicy, Policy, Residents, get_policy
from mmcache.stats import TierStats
from mmcache.stores.memory.access import Access, UntrustedFileError
from mmcache.stores.memory.table import (
    CELL_FREE,
    CELL_TOMBSTONE,
    home_cell,
    lookup_many,
    rebuild_table,
    slot_sizes_upto,
)
from mmcache.stores.memory.shm import (
    EXCLUSIVE,
    PAGE_SIZE,
    SHARED,
    SHM_DIR,
    SHM_PREFIX,
    LockTimeout,
    NodeLock,
    Segment,
    check_store_name,
    is_no_space,
    pid_alive,
    proc_start_time,
)
from mmcache.stores.base import KEY_SIZE, EntryInfo, Keys, Store, check_key

__all__ = [
    "DEFAULT_INDEX_DIVISOR",
    "INLINE_COPY_MAX",
    "MAX_INDEX_CAPACITY",
    "MIN_INDEX_CAPACITY",
    "EntryState",
    "MemoryStore",
    "StoreState",
    "default_index_capacity",
    "reclaim_orphans",
    "store_dir",
    "store_exists",
    "unlink_store",
]

log = logging.getLogger(__name__)

#: Default index capacity: one entry per 4 KiB of budget, clamped to [1024, 2**24].
DEFAULT_INDEX_DIVISOR = 4096
MIN_INDEX_CAPACITY = 1024
MAX_INDEX_CAPACITY = 1 << 24
#: Payloads up to this size are copied inside the reservation's exclusive section.
INLINE_COPY_MAX = 64 * 1024
#: How long opening a store waits for a live holder of the lock (seconds).
OPEN_TIMEOUT = 30.0
#: How long a read or a put waits for the lock (seconds) before it gives up: a miss or a
#: refused put, with one warning naming the holder. A live holder keeps the lock for
#: micro- to milliseconds; only a stopped (SIGSTOP, Ctrl-Z) or stuck one holds it longer.
#: After a wait ran out, data-path calls do not wait at all for as long again.
DATA_LOCK_TIMEOUT = 10.0
#: Attached-process rows (each with its own counters); more processes share one row.
MAX_PROCS = 1024
#: Bytes reserved for the owner path in the header.
OWNER_PATH_MAX = 4096

_MAGIC = int.from_bytes(b"MMCACHE1", "little")
# 2: every page touched through a mapping is reserved first (the hash table and the slot
# bitmaps whole, entry rows up to _H_ROWS_RESERVED). A version-1 store has sparse tables
# that would raise SIGBUS on a full /dev/shm; it is re-created.
_VERSION = 2
#: Entry rows are reserved (``posix_fallocate``) in steps of at least this many rows, and
#: at least an eighth of those reserved so far: a few pages at first (a tiny /dev/shm holds
#: a few entries), about 70 steps of 12 calls each up to 2**18 rows.
ROW_RESERVE_STEP = 64
_KEY = struct.Struct("<QQ")


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


class _Count(IntEnum):
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


_N_COUNTERS = 16
_ROW_RETIRED = MAX_PROCS  # counters of detached and dead processes are folded here
_ROW_OVERFLOW = MAX_PROCS + 1  # shared (racy) row when the process table is full

# Header words (int64).
(
    _H_MAGIC,
    _H_VERSION,
    _H_STATE,
    _H_CREATOR_PID,
    _H_CREATOR_START,
    _H_CAPACITY,
    _H_ENTRIES,
    _H_TABLE_SHIFT,
    _H_CLASSES,
    _H_PROCS,
    _H_FLAGS,
    _H_META_SIZE,
    _H_HOLDER_PID,
    _H_NBYTES,
    _H_ITEMS,
    _H_WRITING,
    _H_USED_CELLS,
    _H_TOMBSTONES,
    _H_SEQ,
    _H_ENTRY_HINT,
    _H_ENTRY_HW,
    _H_OWNER_LEN,
    _H_CREATED_AT,
    _H_PID_NAMESPACE,
    _H_ROWS_RESERVED,  # entry rows [0, n) have their pages allocated in every column
) = range(25)
_HEADER_WORDS = 64
_FLAG_TEMPORARY = 1

# Columns of the size-class table.
_C_CREATED, _C_SLOTS, _C_USED, _C_HINT = range(4)


def _path(directory: str, name: str, suffix: str) -> str:
    return os.path.join(directory, f"{SHM_PREFIX}{name}{suffix}")


def _lock_path(directory: str, name: str) -> str:
    return _path(directory, name, ".lock")


def _meta_path(directory: str, name: str) -> str:
    return _path(directory, name, "-meta")


def _data_path(directory: str, name: str, cls: int) -> str:
    return _path(directory, name, f"-d{cls:03d}")


def _data_paths(directory: str, name: str) -> list[str]:
    pattern = glob.escape(os.path.join(directory, f"{SHM_PREFIX}{name}-d")) + "[0-9][0-9][0-9]"
    return sorted(glob.glob(pattern))


class _Damaged(CacheError):
    """A data segment of this store is missing, truncated or not ours: the tier failed."""


def _data_problem(store: MemoryStore | _Where, classes: npt.NDArray[np.int64]) -> str | None:
    """Why the data segment of a created size class cannot be used, or None.

    Missing or shorter than its class needs (truncated by another program: reading
    past the end of a mapping is SIGBUS, so this is checked before any is mapped).
    Raises :class:`UntrustedFileError` for a segment another user could control.
    """
    sizes = slot_sizes_upto(int(store._capacity)).tolist()
    for c in np.flatnonzero(classes[:, _C_CREATED]).tolist():
        path = _data_path(store._dir, store.shm_name, c)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return f"data segment {path} is missing"
        store._access.check(st, path)
        want = _Slab.file_size(int(classes[c, _C_SLOTS]), sizes[c])
        if st.st_size < want:
            return f"data segment {path} has {st.st_size} bytes, expected {want} (truncated)"
    return None


@dataclass(frozen=True)
class _Where:
    """Where a store's files are, for the node-wide scans that do not attach to it."""

    shm_name: str
    _dir: str
    _access: Access
    _capacity: int


def store_dir(group: int | None = None) -> str:
    """The directory holding this user's stores (or group ``group``'s): see ``_access.py``."""
    return Access(0o600 if group is None else 0o660, group).directory(SHM_DIR)


def _remove(path: str, removed: list[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        removed.append(path)


def _page_round(n: int) -> int:
    return -(-n // PAGE_SIZE) * PAGE_SIZE


def default_index_capacity(capacity: int) -> int:
    """Entries the index holds by default for a byte ``capacity``."""
    return min(max(capacity // DEFAULT_INDEX_DIVISOR, MIN_INDEX_CAPACITY), MAX_INDEX_CAPACITY)


# --------------------------------------------------------------------------- meta layout


@dataclass(frozen=True)
class _Layout:
    """Where each array of the meta segment lives. A pure function of its four sizes."""

    entries: int
    table_shift: int
    classes: int
    procs: int
    fields: tuple[tuple[str, int, str, tuple[int, ...]], ...]
    size: int

    @classmethod
    def build(cls, *, entries: int, table_shift: int, classes: int, procs: int) -> _Layout:
        cells = 1 << (64 - table_shift)
        spec: list[tuple[str, str, tuple[int, ...]]] = [
            ("header", "i8", (_HEADER_WORDS,)),
            ("owner", "u1", (OWNER_PATH_MAX,)),
            ("procs", "i8", (procs, 2)),
            ("counters", "i8", (procs + 2, _N_COUNTERS)),
            ("classes", "i8", (classes, 4)),
            ("state", "u1", (entries,)),
            ("key", "u8", (entries, 2)),
            ("size", "i8", (entries,)),
            ("cls", "i4", (entries,)),
            ("slot", "i8", (entries,)),
            ("cost", "f8", (entries,)),
            ("ctime", "f8", (entries,)),
            ("atime", "f8", (entries,)),
            ("hits", "i8", (entries,)),
            ("seq", "i8", (entries,)),
            ("pid", "i8", (entries,)),
            ("pstart", "i8", (entries,)),
            ("table", "i4", (cells,)),
        ]
        fields = []
        offset = 0
        for name, dtype, shape in spec:
            offset = -(-offset // 64) * 64
            fields.append((name, offset, dtype, shape))
            offset += int(np.dtype(dtype).itemsize * np.prod(shape))
        return cls(entries, table_shift, classes, procs, tuple(fields), _page_round(offset))

    def fixed_range(self) -> tuple[int, int]:
        """``(offset, length)`` of the fixed tables (header to size classes)."""
        return 0, next(offset for name, offset, _, _ in self.fields if name == "state")

    def table_range(self) -> tuple[int, int]:
        """``(offset, length)`` of the hash table (the last array)."""
        _, offset, dtype, shape = self.fields[-1]
        return offset, np.dtype(dtype).itemsize * int(np.prod(shape))

    def row_ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of entry rows ``[start, stop)`` in every entry column."""
        out = []
        for name, offset, dtype, shape in self.fields:
            if name in _ENTRY_COLUMNS:
                row = np.dtype(dtype).itemsize * int(np.prod(shape[1:]))
                out.append((offset + start * row, (stop - start) * row))
        return out

    def arrays(self, buf: Any) -> dict[str, np.ndarray[Any, Any]]:
        out = {}
        for name, offset, dtype, shape in self.fields:
            count = int(np.prod(shape))
            out[name] = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape)
        return out


#: The arrays of the meta segment with one row per entry (between "classes" and "table").
_ENTRY_COLUMNS = frozenset(
    (
        "state", "key", "size", "cls", "slot", "cost", "ctime", "atime", "hits", "seq", "pid",
        "pstart",
    )
)  # fmt: skip


def _table_shift(entries: int) -> int:
    cells = 1 << max(2 * entries - 1, 1).bit_length()  # next power of two >= 2 * entries
    return 64 - (cells.bit_length() - 1)


class _Slab:
    """This process's mapping of one size class: the slot bitmap and the 2-D slab."""

    __slots__ = ("base", "bitmap", "rows", "seg", "slot_size")

    def __init__(self, seg: Segment, n_slots: int, slot_size: int) -> None:
        self.seg = seg
        self.slot_size = slot_size
        self.base = _page_round(n_slots)
        self.bitmap: npt.NDArray[np.uint8] = np.frombuffer(seg.buf, np.uint8, count=n_slots)
        self.rows: npt.NDArray[np.uint8] = np.frombuffer(
            seg.buf, np.uint8, count=n_slots * slot_size, offset=self.base
        ).reshape(n_slots, slot_size)

    def write(self, slot: int, data: memoryview) -> None:
        """Copy ``data`` into ``slot`` (the caller owns the slot: WRITING)."""
        self.seg.write(self.base + slot * self.slot_size, data)

    @staticmethod
    def file_size(n_slots: int, slot_size: int) -> int:
        return _page_round(n_slots) + _page_round(n_slots * slot_size)

    def close(self) -> None:
        del self.bitmap, self.rows
        self.seg.close()


@dataclass(frozen=True)
class _Reserved:
    entry: int
    seq: int
    slab: _Slab
    slot: int


class _Outcome(IntEnum):
    REFUSED = 0  # the policy (or a full index) said no
    BUSY = 1  # another live process is writing the same key right now
    NEED_PLAN = 2  # full: ask the policy (outside the exclusive lock) and retry
    NO_SPACE = 3  # /dev/shm has no room for the metadata the entry needs


# Bumped in every fork child, so a store object notices it crossed a fork.
_FORK_GENERATION = [0]


def _bump_fork_generation() -> None:
    _FORK_GENERATION[0] += 1


os.register_at_fork(after_in_child=_bump_fork_generation)

_PLAN_ATTEMPTS = 3  # optimistic policy plans before deciding under the exclusive lock

#: Reservations this process is copying into right now: (store id, entry, seq). Shared by
#: every MemoryStore object of the process, so one object never reclaims another's.
_IN_FLIGHT: set[tuple[tuple[str, int], int, int]] = set()


#: Byte ranges up to this long are gathered in one fancy-indexing step (see _copy_rows).
_SMALL_RANGE = 4096


class MemoryStore(Store):
    """Node-shared byte store in ``/dev/shm``; see the module docstring for the design.

    Args:
        name: identifies the store on the node (files ``mmcache-<name>*`` in
            :func:`store_dir`: ``/dev/shm/mmcache-u<uid>/``, or ``mmcache-g<gid>/``
            with ``group``); every process opening the same name there shares the
            same entries.
        capacity: hard byte budget of the payloads held.
        policy: admission/eviction policy (name or instance), consulted when full.
            It is per-process configuration; give every process the same one.
        create: create the store if it does not exist (else ``CacheError``).
        temporary: remove the files when the last attached process closes.
        owner_path: the cache root this store belongs to; :func:`reclaim_orphans`
            removes unused stores whose owner path no longer exists.
        clock: source of ``atime`` (must be comparable across processes).
        index_capacity: most entries held (default: capacity / 4 KiB, in [1024, 2**24]);
            raise it for many small entries (a warning says when the index is full
            while bytes are free).
        mode: file mode of the segments (default ``0o600``: this user only).
        group: share the store with the members of this group (a gid; needs
            ``mode=0o660``): its files go to ``/dev/shm/mmcache-g<gid>/``.

    Files another user could have planted are never used: see ``_access.py``
    (``CacheError`` naming the file and its owner).

    If the store exists, its configuration (capacity, index capacity,
    temporary, owner path) wins unless no other live process is attached and
    ``capacity``/``index_capacity`` differ: then it is re-created empty.

    Every method is thread-safe and process-safe. Objects survive ``fork``
    (the child re-registers itself) and pickle by configuration (a spawned
    worker re-attaches by name).

    >>> import uuid
    >>> with MemoryStore(f"doc-{uuid.uuid4().hex}", capacity=1 << 20, temporary=True) as s:
    ...     s.put(b"k" * 16, b"hello")
    ...     s.get(b"k" * 16)
    True
    b'hello'
    """

    name = "memory"
    supports_gather = True

    def __init__(
        self,
        name: str,
        *,
        capacity: int,
        policy: str | Policy = "value",
        create: bool = True,
        temporary: bool = False,
        owner_path: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        index_capacity: int | None = None,
        mode: int = 0o600,
        group: int | None = None,
    ) -> None:
        self.shm_name = check_store_name(name)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(
                f"memory store capacity must be an int >= 1 (bytes), got {capacity!r}"
            )
        if index_capacity is not None and (
            isinstance(index_capacity, bool)
            or not isinstance(index_capacity, int)
            or not 1 <= index_capacity <= MAX_INDEX_CAPACITY
        ):
            raise ConfigError(
                f"index_capacity must be an int in [1, {MAX_INDEX_CAPACITY}],"
                f" got {index_capacity!r}"
            )
        self._access = Access(mode, group)  # validates both
        owner = None if owner_path is None else os.path.abspath(os.fspath(owner_path))
        if owner is not None and len(owner.encode()) > OWNER_PATH_MAX:
            raise ConfigError(f"owner_path is longer than {OWNER_PATH_MAX} bytes: {owner[:80]}...")
        self._policy = get_policy(policy)
        self._config: dict[str, Any] = {
            "name": name,
            "capacity": capacity,
            "policy": self._policy,
            "create": bool(create),
            "temporary": bool(temporary),
            "owner_path": owner,
            "clock": clock,
            "index_capacity": index_capacity,
            "mode": mode,
            "group": group,
        }
        self._clock = clock
        self._closed = True
        self._stuck_until = 0.0  # see _wait
        self._broken: str | None = None  # a damaged data segment: reads miss, puts refused
        self._row = -1
        self._warned: set[str] = set()
        self._slabs: dict[int, _Slab] = {}
        self._map_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._attach(
            capacity=capacity,
            entries=index_capacity or default_index_capacity(capacity),
            create=bool(create),
            temporary=bool(temporary),
            owner=owner,
        )

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        """Configuration only: mappings, descriptors and locks never cross processes."""
        state = dict(self._config)
        if not self._closed:
            # Re-attach with the store's actual sizes, so the child never re-creates it.
            state["capacity"] = self._capacity
            state["index_capacity"] = self._entries
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        status = "closed" if self._closed else f"{self.nbytes()}/{self._capacity} B"
        return f"MemoryStore({self.shm_name!r}, {status}, policy={self._policy!r})"

    # ------------------------------------------------------------------ attach / detach

    def _attach(
        self, *, capacity: int, entries: int, create: bool, temporary: bool, owner: str | None
    ) -> None:
        """Open (or create) the store and register this process. Process-safe."""
        self._dir = self._access.ensure_directory(SHM_DIR, create=create)
        for _ in range(10):
            path = _lock_path(self._dir, self.shm_name)
            lock = NodeLock(path, create=create, access=self._access)
            try:
                with lock.hold(EXCLUSIVE, timeout=OPEN_TIMEOUT):
                    if lock.unlinked():
                        continue  # removed while we waited: open the new one
                    self._lock = lock
                    self._open_locked(capacity, entries, create, temporary, owner)
                    self._pid = os.getpid()
                    self._fork_gen = _FORK_GENERATION[0]
                    self._closed = False
                    self._mark_holder()
                    try:
                        self._register_locked()
                        self._reclaim_dead_writers_locked()
                    except BaseException:
                        self._repair_locked("an error while attaching")
                        raise
                    finally:
                        self._h[_H_HOLDER_PID] = 0
                break
            except BaseException:
                if self._closed:
                    self._unmap()
                    lock.close()
                raise
            finally:
                if getattr(self, "_lock", None) is not lock:
                    lock.close()
        else:  # pragma: no cover - needs ten unlinks racing one open
            raise CacheError(f"memory store {self.shm_name!r} keeps being removed while opening")
        if self._temporary:
            atexit.register(_close_at_exit, weakref.ref(self))

    def _open_locked(
        self, capacity: int, entries: int, create: bool, temporary: bool, owner: str | None
    ) -> None:
        """Map the meta segment, creating or repairing it. Caller holds the lock exclusively."""
        meta = _meta_path(self._dir, self.shm_name)
        seg: Segment | None = None
        try:
            seg = Segment.open(meta, access=self._access)
        except FileNotFoundError:
            pass
        except CacheError as exc:
            if not create or isinstance(exc, UntrustedFileError):
                raise
            log.warning("memory store %s: meta segment truncated, re-creating it", self.shm_name)
        if seg is not None:
            header = np.frombuffer(seg.buf, np.int64, count=_HEADER_WORDS)
            problem = None
            if int(header[_H_MAGIC]) != _MAGIC or int(header[_H_META_SIZE]) != seg.size:
                problem = "it is not an mmcache store of this version or is truncated"
            elif int(header[_H_VERSION]) != _VERSION:
                problem = f"it has format version {int(header[_H_VERSION])}, not {_VERSION}"
            elif int(header[_H_STATE]) != StoreState.READY:
                problem = "its creator died while initialising it"
            elif int(header[_H_PID_NAMESPACE]) != _pid_namespace():
                seg.close()
                # Liveness checks by pid cannot work across pid namespaces: a live
                # writer of another container would look dead and lose its slot.
                raise CacheError(
                    f"memory store {self.shm_name!r} belongs to processes of another pid"
                    " namespace (another container sharing /dev/shm); give each container"
                    " its own cache root or store name"
                )
            del header
            if problem is None:
                self._bind(seg)
                damaged = _data_problem(self, self._classes)
                same = self._capacity == capacity and self._entries == entries
                if damaged is not None and (self._live_procs_locked() or not create):
                    self._unmap()
                    raise CacheError(
                        f"memory store {self.shm_name!r} cannot be used: {damaged}; it is"
                        " re-created once no process is attached (or remove it: mmcache gc)"
                    )
                if damaged is not None:
                    log.warning("memory store %s: re-creating it: %s", self.shm_name, damaged)
                elif same or not create or self._live_procs_locked():
                    # create=False only attaches (mmcache verify/stats): never re-create.
                    if not same:
                        log.warning(
                            "memory store %s exists with capacity %d B and %d entries (asked"
                            " %d B, %d): using it as it is, other processes are attached",
                            self.shm_name, self._capacity, self._entries, capacity, entries,
                        )  # fmt: skip
                    if int(self._h[_H_HOLDER_PID]) != 0:
                        self._repair_locked("a process died holding the lock")
                    return
                else:
                    log.info(
                        "memory store %s: re-creating it with capacity %d B, %d entries (was"
                        " %d B, %d); no other process is attached",
                        self.shm_name, capacity, entries, self._capacity, self._entries,
                    )  # fmt: skip
                self._unmap()
            else:
                seg.close()
                if not create:
                    raise CacheError(
                        f"memory store {self.shm_name!r} at {meta} cannot be used: {problem};"
                        " open it with create=True to re-create it"
                    )
                log.warning("memory store %s: re-creating it: %s", self.shm_name, problem)
        elif not create:
            raise CacheError(
                f"no memory store named {self.shm_name!r} ({meta} is missing): create it with"
                " create=True"
            )
        self._initialise_locked(capacity, entries, temporary, owner)

    def _initialise_locked(
        self, capacity: int, entries: int, temporary: bool, owner: str | None
    ) -> None:
        """Create a fresh, empty store. Caller holds the lock exclusively."""
        removed: list[str] = []
        for path in [*_data_paths(self._dir, self.shm_name), _meta_path(self._dir, self.shm_name)]:
            _remove(path, removed)
        sizes = slot_sizes_upto(capacity)
        layout = _Layout.build(
            entries=entries, table_shift=_table_shift(entries), classes=len(sizes), procs=MAX_PROCS
        )
        self._warn_if_shm_small(capacity)
        try:
            seg = Segment.create(
                _meta_path(self._dir, self.shm_name),
                layout.size,
                access=self._access,
                reserve=[layout.fixed_range(), layout.table_range()],
            )
        except OSError as exc:
            if not is_no_space(exc):
                raise
            # Nothing of the store is left but its lock file: remove it too (processes
            # waiting for it see it unlinked and start over), so a failed open leaves
            # nothing behind in /dev/shm.
            _remove(_lock_path(self._dir, self.shm_name), removed)
            fixed, table = layout.fixed_range()[1], layout.table_range()[1]
            raise CacheError(
                f"no space left in {SHM_DIR} for memory store {self.shm_name!r}: its tables"
                f" need {_page_round(fixed) + _page_round(table)} B ({exc.strerror}); free"
                " space there (mmcache gc removes stale stores; in Docker raise --shm-size)"
                " or pass memory=0"
            ) from exc
        arrays = layout.arrays(seg.buf)
        h = arrays["header"]
        h[_H_STATE] = StoreState.INITIALISING
        h[_H_MAGIC] = _MAGIC
        h[_H_VERSION] = _VERSION
        h[_H_META_SIZE] = layout.size
        h[_H_CREATOR_PID] = os.getpid()
        h[_H_CREATOR_START] = proc_start_time(os.getpid()) or 0
        h[_H_CAPACITY] = capacity
        h[_H_ENTRIES] = entries
        h[_H_TABLE_SHIFT] = layout.table_shift
        h[_H_CLASSES] = len(sizes)
        h[_H_PROCS] = MAX_PROCS
        h[_H_FLAGS] = _FLAG_TEMPORARY if temporary else 0
        h[_H_CREATED_AT] = time.time_ns()
        h[_H_PID_NAMESPACE] = _pid_namespace()
        if owner is not None:
            raw = owner.encode()
            arrays["owner"][: len(raw)] = np.frombuffer(raw, np.uint8)
            h[_H_OWNER_LEN] = len(raw)
        classes = arrays["classes"]
        min_payload = np.concatenate(([1], sizes[:-1] + 1))
        classes[:, _C_SLOTS] = np.minimum(entries, capacity // min_payload)
        classes[0, _C_SLOTS] = entries  # class 0 also holds empty values
        del arrays, classes, h
        self._bind(seg)
        self._h[_H_STATE] = StoreState.READY

    def _bind(self, seg: Segment) -> None:
        """Make numpy views of the meta segment (header already valid)."""
        header = np.frombuffer(seg.buf, np.int64, count=_HEADER_WORDS)
        layout = _Layout.build(
            entries=int(header[_H_ENTRIES]),
            table_shift=int(header[_H_TABLE_SHIFT]),
            classes=int(header[_H_CLASSES]),
            procs=int(header[_H_PROCS]),
        )
        del header
        if layout.size != seg.size:
            seg.close()
            raise CacheError(f"memory store {self.shm_name!r}: meta segment size mismatch")
        a = layout.arrays(seg.buf)
        self._meta = seg
        self._layout = layout
        self._h = a["header"]
        self._owner_arr = a["owner"]
        self._procs = a["procs"]
        self._counters = a["counters"]
        self._classes = a["classes"]
        self._state = a["state"]
        self._ekey = a["key"]
        self._esize = a["size"]
        self._ecls = a["cls"]
        self._eslot = a["slot"]
        self._ecost = a["cost"]
        self._ectime = a["ctime"]
        self._eatime = a["atime"]
        self._ehits = a["hits"]
        self._eseq = a["seq"]
        self._epid = a["pid"]
        self._epstart = a["pstart"]
        self._table = a["table"]
        # memoryviews give Python ints at C speed for the one-key paths.
        self._mv_table = self._table.data
        self._mv_key = self._ekey.reshape(-1).data
        self._mv_state = self._state.data
        self._capacity = int(self._h[_H_CAPACITY])
        self._store_id = (self.shm_name, int(self._h[_H_CREATED_AT]))
        self._entries = layout.entries
        self._shift = layout.table_shift
        self._mask = (1 << (64 - layout.table_shift)) - 1
        self._temporary = bool(int(self._h[_H_FLAGS]) & _FLAG_TEMPORARY)
        self._sizes = slot_sizes_upto(self._capacity)
        self._sizes_list: list[int] = self._sizes.tolist()
        if len(self._sizes_list) != layout.classes:
            raise CacheError(f"memory store {self.shm_name!r}: size-class table mismatch")

    def _unmap(self) -> None:
        """Drop every mapping of this process (views first, so the mmaps can close)."""
        with self._map_lock:
            slabs, self._slabs = self._slabs, {}
        for slab in slabs.values():
            slab.close()
        meta = getattr(self, "_meta", None)
        for attr in ("_mv_table", "_mv_key", "_mv_state"):
            mv = getattr(self, attr, None)
            if mv is not None:
                mv.release()
                delattr(self, attr)
        for attr in (
            "_h", "_owner_arr", "_procs", "_counters", "_classes", "_state", "_ekey", "_esize",
            "_ecls", "_eslot", "_ecost", "_ectime", "_eatime", "_ehits", "_eseq", "_epid",
            "_epstart", "_table", "_meta", "_layout",
        ):  # fmt: skip
            if hasattr(self, attr):
                delattr(self, attr)
        if meta is not None:
            meta.close()

    def _warn_if_shm_small(self, capacity: int) -> None:
        try:
            st = os.statvfs(SHM_DIR)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        if free < capacity:
            log.warning(
                "memory store %s: capacity %d B but only %d B free in %s; puts will be refused"
                " when it fills (in Docker, raise --shm-size)",
                self.shm_name, capacity, free, SHM_DIR,
            )  # fmt: skip

    def _register_locked(self) -> None:
        """Add this process to the attached table (pruning dead ones). Caller holds EX."""
        self._prune_procs_locked()
        procs = self._procs
        free = np.flatnonzero(procs[:, 0] == 0)
        if free.shape[0]:
            row = int(free[0])
            procs[row, 0] = os.getpid()
            procs[row, 1] = proc_start_time(os.getpid()) or 0
            self._row = row
        else:
            self._row = _ROW_OVERFLOW
            if "procs" not in self._warned:
                self._warned.add("procs")
                log.warning(
                    "memory store %s: more than %d attached processes; statistics of the"
                    " extra ones share one row and may lose increments",
                    self.shm_name, MAX_PROCS,
                )  # fmt: skip

    def _prune_procs_locked(self) -> int:
        """Detach dead processes, folding their counters into the retired row. Caller holds EX."""
        procs = self._procs
        dead = 0
        for row in np.flatnonzero(procs[:, 0] != 0).tolist():
            if not pid_alive(int(procs[row, 0]), int(procs[row, 1])):
                self._retire_row_locked(row)
                dead += 1
        return dead

    def _retire_row_locked(self, row: int) -> None:
        self._counters[_ROW_RETIRED] += self._counters[row]
        self._counters[row] = 0
        self._procs[row] = 0

    def _live_procs_locked(self) -> bool:
        """Whether any process (another object of this one included) is attached. EX held."""
        self._prune_procs_locked()
        return bool((self._procs[:, 0] != 0).any())

    def _ensure_process(self) -> None:
        """Raise if closed; after a fork, become a separate user of the store."""
        if self._closed:
            raise CacheError(f"memory store {self.shm_name!r} is closed")
        if self._fork_gen != _FORK_GENERATION[0]:
            self._pid = os.getpid()
            self._fork_gen = _FORK_GENERATION[0]
            self._row = -1  # the parent's row is not ours
            self._count_lock = threading.Lock()
            self._map_lock = threading.Lock()
            with self._exclusive():
                self._register_locked()

    def close(self) -> None:
        """Detach this process and unmap. Idempotent.

        With ``temporary=True`` the last attached process to close removes the
        files. Thread-safe; call it once no thread uses the store any more.
        """
        if self._closed:
            return
        try:
            attached = self._fork_gen == _FORK_GENERATION[0] and os.getpid() == self._pid
            if attached and not self._lock.closed:
                with contextlib.suppress(CacheError), self._exclusive(timeout=OPEN_TIMEOUT):
                    self._detach_locked()
        finally:
            self._closed = True
            self._unmap()
            self._lock.close()

    def __del__(self) -> None:
        # Dropped without close(): detach now, so the attached-process table (and the
        # lifetime of a temporary store) follows the objects really in use. Never
        # wait for the lock here: the garbage collector may run this in a thread
        # that holds it through another object (a view() block).
        # The lock may be finalized already (both were garbage in one cycle: its
        # descriptors are closed): then the row stays until this process exits, when
        # the next opener prunes it. Never raises: nobody could catch it.
        if getattr(self, "_closed", True) or sys.is_finalizing():
            return
        self._closed = True
        try:
            attached = self._fork_gen == _FORK_GENERATION[0] and os.getpid() == self._pid
            if attached and not self._lock.closed and self._lock.try_exclusive():
                try:
                    h = self._h
                    if int(h[_H_STATE]) == StoreState.READY and int(h[_H_HOLDER_PID]) == 0:
                        self._detach_locked()
                finally:
                    self._lock.release()
        except (OSError, ValueError, AttributeError) as exc:  # CacheError is an OSError
            log.debug("memory store %s: detach at garbage collection: %s", self.shm_name, exc)
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self._unmap()
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self._lock.close()

    def _detach_locked(self) -> None:
        """Leave the attached table; the last user of a temporary store removes it. EX held."""
        if 0 <= self._row < MAX_PROCS:
            self._retire_row_locked(self._row)
        self._row = -1
        if self._temporary and not self._live_procs_locked():
            self._unlink_locked()

    def unlink(self) -> list[str]:
        """Remove the store's files now (for every process) and close; return the paths removed.

        Processes still attached keep their mappings until they close, but
        every further operation of theirs raises ``CacheError``. Process-safe.
        """
        removed: list[str] = []
        if not self._closed:
            with contextlib.suppress(CacheError), self._exclusive(timeout=OPEN_TIMEOUT):
                removed = self._unlink_locked()
            self.close()
        return removed

    def _unlink_locked(self) -> list[str]:
        """Mark UNLINKED and remove every file, the lock file last. Caller holds EX."""
        self._h[_H_STATE] = StoreState.UNLINKED
        removed: list[str] = []
        for path in [
            *_data_paths(self._dir, self.shm_name),
            _meta_path(self._dir, self.shm_name),
            _lock_path(self._dir, self.shm_name),
        ]:
            _remove(path, removed)
        return removed

    # ------------------------------------------------------------------ locking

    @contextlib.contextmanager
    def _exclusive(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the node lock exclusively; repair first if the last holder died in it.

        If the body raises, derived state is rebuilt before the lock is released,
        so an interrupted critical section never leaves inconsistent counts behind.
        """
        self._ensure_process()
        with self._lock.hold(EXCLUSIVE, timeout=timeout):
            h = self._h
            if int(h[_H_STATE]) != StoreState.READY:
                raise CacheError(
                    f"memory store {self.shm_name!r} was removed by another process; reopen it"
                )
            if int(h[_H_HOLDER_PID]) != 0:
                self._repair_locked("a process died holding the lock")
            self._mark_holder()
            try:
                yield
            except BaseException:
                try:
                    self._repair_locked("an error inside a critical section")
                except BaseException:
                    log.exception("memory store %s: repair failed", self.shm_name)
                    raise  # the holder pid stays set: the next holder repairs
                h[_H_HOLDER_PID] = 0
                raise
            h[_H_HOLDER_PID] = 0

    def _mark_holder(self) -> None:
        self._h[_H_HOLDER_PID] = os.getpid()

    def _wait(self) -> float:
        """How long a data-path call waits for the lock (see ``DATA_LOCK_TIMEOUT``)."""
        if self._broken is not None:
            raise _Damaged(self._broken)
        return 0.0 if time.monotonic() < self._stuck_until else DATA_LOCK_TIMEOUT

    def _data_path_failed(self, exc: CacheError, outcome: str) -> None:
        """A read or put gave up (lock held too long, or a damaged segment): warn once."""
        if isinstance(exc, LockTimeout):
            self._stuck_until = time.monotonic() + DATA_LOCK_TIMEOUT
            holder = int(self._h[_H_HOLDER_PID]) if not self._closed else 0
            who = f"exclusive holder pid {holder}" if holder else "held shared"
            what = f"lock ({who}): {exc}"
            tag = "lock"
        else:
            if self._broken is None:
                self._broken = str(exc)
            what, tag = f"damaged: {exc}", "damaged"
        if tag not in self._warned:
            self._warned.add(tag)
            log.warning(
                "memory store %s: %s; %s (the memory tier is bypassed, training goes on)",
                self.shm_name, what, outcome,
            )  # fmt: skip

    @contextlib.contextmanager
    def _shared(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the node lock shared (readers), after any repair a dead writer left due."""
        self._ensure_process()
        for _ in range(3):
            with self._lock.hold(SHARED, timeout=timeout):
                h = self._h
                if int(h[_H_STATE]) != StoreState.READY:
                    raise CacheError(
                        f"memory store {self.shm_name!r} was removed by another process; reopen it"
                    )
                if int(h[_H_HOLDER_PID]) == 0:
                    yield
                    return
            with self._exclusive(timeout):
                pass  # repairs
        raise CacheError(f"memory store {self.shm_name!r}: shared state cannot be repaired")

    # ------------------------------------------------------------------ counters

    def _count(self, column: _Count, n: int = 1) -> None:
        with self._count_lock:
            self._counters[self._row if self._row >= 0 else _ROW_OVERFLOW, column] += n

    # ------------------------------------------------------------------ slabs

    def _slab(self, cls: int, *, create: bool = False) -> _Slab:
        """This process's mapping of size class ``cls`` (created if ``create``; needs EX)."""
        slab = self._slabs.get(cls)
        if slab is not None:
            return slab
        with self._map_lock:
            slab = self._slabs.get(cls)
            if slab is not None:
                return slab
            n_slots = int(self._classes[cls, _C_SLOTS])
            slot_size = self._sizes_list[cls]
            size = _Slab.file_size(n_slots, slot_size)
            path = _data_path(self._dir, self.shm_name, cls)
            if int(self._classes[cls, _C_CREATED]):
                try:
                    seg = Segment.open(path, size, access=self._access)
                except FileNotFoundError:
                    raise _Damaged(
                        f"memory store {self.shm_name!r}: data segment {path} is missing"
                        " (removed by hand?); remove the store (mmcache gc) and retry"
                    ) from None
                except CacheError as exc:  # truncated, or not ours
                    raise _Damaged(str(exc)) from exc
            elif create:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # left by a creator that died before flagging it
                # The bitmap is read and written through the mapping: reserve all of
                # it now (1 B per slot); payload pages are written with pwrite.
                seg = Segment.create(
                    path, size, access=self._access, reserve=[(0, _page_round(n_slots))]
                )
                self._classes[cls, _C_CREATED] = 1
            else:
                raise CacheError(f"memory store {self.shm_name!r}: size class {cls} missing")
            slab = _Slab(seg, n_slots, slot_size)
            self._slabs[cls] = slab
            return slab

    def _slab_ok(self, cls: int) -> bool:
        """Whether size class ``cls``'s data segment can be mapped (see :class:`_Damaged`)."""
        try:
            self._slab(cls)
        except _Damaged as exc:
            if self._broken is None:
                self._broken = str(exc)
            return False
        return True

    def _alloc_slot_locked(self, cls: int) -> tuple[_Slab, int]:
        slab = self._slab(cls, create=True)
        row = self._classes[cls]
        bitmap = slab.bitmap
        n = bitmap.shape[0]
        pos = int(row[_C_HINT])
        while pos < n:
            chunk = bitmap[pos : pos + 4096]
            free = np.flatnonzero(chunk == 0)
            if free.shape[0]:
                slot = pos + int(free[0])
                bitmap[slot] = 1
                row[_C_USED] += 1
                row[_C_HINT] = slot + 1
                return slab, slot
            pos += chunk.shape[0]
        raise CacheError(  # the budget arithmetic makes this unreachable; never corrupt instead
            f"memory store {self.shm_name!r}: no free slot in size class {cls}"
        )

    def _release_pages_locked(self, cls: int, slot: int) -> None:
        """Return the pages of a free slot that no held slot shares. Caller holds EX."""
        slab = self._slab(cls)
        ss = slab.slot_size
        bitmap = slab.bitmap
        if bitmap[slot]:
            return  # reused in the same critical section
        start, stop = slot * ss, (slot + 1) * ss
        if start % PAGE_SIZE:
            page = start // PAGE_SIZE * PAGE_SIZE
            below = bitmap[page // ss : slot]
            start = page if not below.any() else page + PAGE_SIZE
        if stop % PAGE_SIZE:
            page = stop // PAGE_SIZE * PAGE_SIZE
            above = bitmap[slot + 1 : min(bitmap.shape[0], -(-(page + PAGE_SIZE) // ss))]
            stop = page + PAGE_SIZE if not above.any() else page
        if stop > start:
            slab.seg.punch(slab.base + start, stop - start)

    # ------------------------------------------------------------------ index

    def _find(self, k0: int, k1: int) -> tuple[int, int]:
        """``(entry, cell)`` of a key, or ``(-1, cell to insert at)``. Caller holds the lock."""
        table = self._mv_table
        keys = self._mv_key
        mask = self._mask
        pos = home_cell(k0, k1, self._shift)
        tomb = -1
        for _ in range(mask + 1):
            v = table[pos]
            if v == CELL_FREE:
                return -1, (pos if tomb < 0 else tomb)
            if v == CELL_TOMBSTONE:
                if tomb < 0:
                    tomb = pos
            elif keys[2 * v - 2] == k0 and keys[2 * v - 1] == k1:
                return v - 1, pos
            pos = (pos + 1) & mask
        if tomb >= 0:
            return -1, tomb
        raise CacheError(f"memory store {self.shm_name!r}: hash table full")  # pragma: no cover

    def _find_ready(self, key: bytes) -> int:
        k0, k1 = _KEY.unpack(key)
        e, _ = self._find(k0, k1)
        if e >= 0 and self._mv_state[e] == EntryState.READY:
            return e
        return -1

    def _insert_locked(self, e: int, k0: int, k1: int) -> None:
        h = self._h
        if int(h[_H_USED_CELLS]) + int(h[_H_TOMBSTONES]) + 1 > (self._mask + 1) * 3 // 4:
            self._rehash_locked()
        found, pos = self._find(k0, k1)
        if found == e:
            return  # the rehash above already placed it
        if found >= 0:  # pragma: no cover - callers free the old entry first
            raise CacheError(f"memory store {self.shm_name!r}: duplicate key in the index")
        if self._mv_table[pos] == CELL_TOMBSTONE:
            h[_H_TOMBSTONES] -= 1
        self._mv_table[pos] = e + 1
        h[_H_USED_CELLS] += 1

    def _rehash_locked(self) -> None:
        hw = int(self._h[_H_ENTRY_HW])
        live = np.flatnonzero(self._state[:hw] != EntryState.EMPTY)
        rebuild_table(self._table, self._ekey, live, self._shift)
        self._h[_H_TOMBSTONES] = 0
        self._h[_H_USED_CELLS] = live.shape[0]

    def _rows_reserved(self) -> int:
        """Entry rows whose pages exist: the only ones that may be touched (see module doc)."""
        return min(max(int(self._h[_H_ROWS_RESERVED]), 0), self._entries)

    def _reserve_rows_locked(self, rows: int) -> None:
        """Allocate the pages of entry rows ``[0, rows)`` (and a step more). Caller holds EX.

        Raises ``OSError`` (``ENOSPC``) when /dev/shm has no room; the header
        records only what was really reserved.
        """
        have = self._rows_reserved()
        if rows <= have:
            return
        step = max(ROW_RESERVE_STEP, have // 8)
        want = min(self._entries, -(-max(rows, have + step) // ROW_RESERVE_STEP) * ROW_RESERVE_STEP)
        for offset, length in self._layout.row_ranges(have, want):
            self._meta.reserve(offset, length)
        self._h[_H_ROWS_RESERVED] = want

    def _reserve_pages_locked(self, cls: int) -> bool:
        """Allocate what a new entry of class ``cls`` will touch through the mappings:
        the class's bitmap and the next entry row. False if /dev/shm is full. EX held."""
        try:
            self._slab(cls, create=True)
            # _alloc_entry_locked picks the lowest free row, at most the high-water mark.
            self._reserve_rows_locked(int(self._h[_H_ENTRY_HW]) + 1)
        except OSError as exc:
            if not is_no_space(exc):
                raise
            return False
        return True

    def _alloc_entry_locked(self) -> int:
        h = self._h
        state = self._state
        pos = int(h[_H_ENTRY_HINT])
        limit = self._rows_reserved()  # the caller reserved a free row below it
        while pos < limit:
            chunk = state[pos : min(pos + 4096, limit)]
            free = np.flatnonzero(chunk == EntryState.EMPTY)
            if free.shape[0]:
                e = pos + int(free[0])
                h[_H_ENTRY_HINT] = e + 1
                if e + 1 > int(h[_H_ENTRY_HW]):
                    h[_H_ENTRY_HW] = e + 1
                return e
            pos += chunk.shape[0]
        raise CacheError(f"memory store {self.shm_name!r}: entry table full")  # pragma: no cover

    def _free_locked(self, e: int, released: list[tuple[int, int]]) -> None:
        """Remove entry ``e`` (READY or WRITING). Caller holds EX.

        Order matters for crash repair: the index cell goes first, the entry
        state next, the slot last, so every intermediate state is one the
        rebuild from the entry table handles.
        """
        h = self._h
        k0, k1 = int(self._ekey[e, 0]), int(self._ekey[e, 1])
        found, pos = self._find(k0, k1)
        if found == e:
            self._mv_table[pos] = CELL_TOMBSTONE
            h[_H_TOMBSTONES] += 1
            h[_H_USED_CELLS] -= 1
        state = self._mv_state[e]
        size = int(self._esize[e])
        self._mv_state[e] = EntryState.EMPTY
        h[_H_NBYTES] -= size
        if state == EntryState.READY:
            h[_H_ITEMS] -= 1
        else:
            h[_H_WRITING] -= 1
        cls, slot = int(self._ecls[e]), int(self._eslot[e])
        slab = self._slab(cls)
        slab.bitmap[slot] = 0
        row = self._classes[cls]
        row[_C_USED] -= 1
        row[_C_HINT] = min(int(row[_C_HINT]), slot)
        h[_H_ENTRY_HINT] = min(int(h[_H_ENTRY_HINT]), e)
        released.append((cls, slot))

    def _release_all_locked(self, released: list[tuple[int, int]]) -> None:
        for cls, slot in released:
            self._release_pages_locked(cls, slot)

    # ------------------------------------------------------------------ writers' liveness

    def _writer_alive(self, e: int, cache: dict[tuple[int, int], bool]) -> bool:
        """Whether the writer of WRITING entry ``e`` may still publish it."""
        pid, start = int(self._epid[e]), int(self._epstart[e])
        if pid == os.getpid():
            # Our own reservation is alive only while a thread is copying into it; one
            # left by an error inside a critical section is reclaimed like a dead one.
            return (self._store_id, e, int(self._eseq[e])) in _IN_FLIGHT
        alive = cache.get((pid, start))
        if alive is None:
            alive = cache[(pid, start)] = pid_alive(pid, start)
        return alive

    def _reclaim_dead_writers_locked(self) -> int:
        """Free WRITING entries whose writer died. Caller holds EX."""
        hw = int(self._h[_H_ENTRY_HW])
        writing = np.flatnonzero(self._state[:hw] == EntryState.WRITING)
        cache: dict[tuple[int, int], bool] = {}
        released: list[tuple[int, int]] = []
        for e in writing.tolist():
            if not self._writer_alive(e, cache):
                self._free_locked(e, released)
        self._release_all_locked(released)
        if released:
            self._count(_Count.RECLAIMED, len(released))
            log.info(
                "memory store %s: reclaimed %d entries left half-written by dead processes",
                self.shm_name, len(released),
            )  # fmt: skip
        return len(released)

    # ------------------------------------------------------------------ repair

    def _repair_locked(self, reason: str) -> None:
        """Rebuild every derived structure from the entry table. Caller holds EX.

        Entries that are inconsistent (unknown state, size and class that do
        not match, a slot out of range or claimed twice, a duplicate key) are
        dropped and counted as ``corrupt``; half-written entries of dead
        writers are dropped and counted as ``reclaimed``. Never serves a byte
        it cannot vouch for.
        """
        log.warning("memory store %s: repairing shared state (%s)", self.shm_name, reason)
        h = self._h
        state = self._state[: self._rows_reserved()]  # no later row was ever written
        unknown = state > EntryState.READY
        corrupt = int(unknown.sum())
        state[unknown] = EntryState.EMPTY
        live = np.flatnonzero(state != EntryState.EMPTY)
        size = self._esize[live]
        cls = self._ecls[live].astype(np.int64)
        slot = self._eslot[live]
        n_classes = self._classes.shape[0]
        ok = (size >= 0) & (size <= self._capacity) & (cls >= 0) & (cls < n_classes)
        safe_cls = np.where(ok, cls, 0)
        expected = np.searchsorted(self._sizes, np.maximum(size, 0), side="left")
        ok &= expected == cls
        ok &= (slot >= 0) & (slot < self._classes[safe_cls, _C_SLOTS])
        ok &= self._classes[safe_cls, _C_CREATED] != 0
        # A class whose data segment cannot be mapped (truncated, removed) holds nothing.
        damaged = [c for c in np.flatnonzero(self._classes[:, _C_CREATED]).tolist()
                   if not self._slab_ok(int(c))]  # fmt: skip
        ok &= ~np.isin(safe_cls, damaged)
        corrupt += int((~ok).sum())
        # A slot claimed by two entries holds at most one of them: trust neither.
        slot_id = safe_cls * (1 << 40) + np.where(ok, slot, 0)
        _, inverse, counts = np.unique(slot_id, return_inverse=True, return_counts=True)
        shared_slot = ok & (counts[inverse] > 1)
        corrupt += int(shared_slot.sum())
        ok &= ~shared_slot
        # Duplicate keys: keep the most recent admission.
        keys = self._ekey[live]
        order = np.lexsort((-self._eseq[live], keys[:, 1], keys[:, 0]))
        sk = keys[order]
        dup_sorted = np.zeros(order.shape[0], dtype=bool)
        if order.shape[0] > 1:
            dup_sorted[1:] = (sk[1:, 0] == sk[:-1, 0]) & (sk[1:, 1] == sk[:-1, 1])
        dup = np.zeros(live.shape[0], dtype=bool)
        dup[order] = dup_sorted
        corrupt += int((dup & ok).sum())
        ok &= ~dup
        # Half-written entries of dead writers.
        cache: dict[tuple[int, int], bool] = {}
        reclaimed = 0
        for i in np.flatnonzero(ok & (state[live] == EntryState.WRITING)).tolist():
            if not self._writer_alive(int(live[i]), cache):
                ok[i] = False
                reclaimed += 1
        state[live[~ok]] = EntryState.EMPTY
        live = live[ok]
        kept_state = state[live]
        h[_H_NBYTES] = int(self._esize[live].sum())
        h[_H_ITEMS] = int((kept_state == EntryState.READY).sum())
        h[_H_WRITING] = int((kept_state == EntryState.WRITING).sum())
        h[_H_ENTRY_HW] = int(live[-1]) + 1 if live.shape[0] else 0
        h[_H_ENTRY_HINT] = 0
        if live.shape[0]:
            h[_H_SEQ] = max(int(h[_H_SEQ]), int(self._eseq[live].max()) + 1)
        rebuild_table(self._table, self._ekey, live, self._shift)
        h[_H_USED_CELLS] = live.shape[0]
        h[_H_TOMBSTONES] = 0
        live_cls = self._ecls[live]
        for c in np.flatnonzero(self._classes[:, _C_CREATED]).tolist():
            if c in damaged:
                continue
            slab = self._slab(int(c))
            # Zeroed in place, not punched: its pages must stay allocated (a full
            # /dev/shm would kill the next process touching a punched one).
            slab.bitmap[:] = 0
            slots = self._eslot[live[live_cls == c]]
            slab.bitmap[slots] = 1
            self._classes[c, _C_USED] = slots.shape[0]
            self._classes[c, _C_HINT] = 0
        self._count(_Count.REPAIRS)
        if corrupt:
            self._count(_Count.CORRUPT, corrupt)
        if reclaimed:
            self._count(_Count.RECLAIMED, reclaimed)

    # ------------------------------------------------------------------ reads

    def get(self, key: bytes) -> bytes | None:
        """Return a copy of the value, or None. Counts a hit or a miss. Thread/process-safe."""
        check_key(key)
        e = -1
        try:
            with self._shared(self._wait()):
                e = self._find_ready(key)
                if e >= 0:
                    slab = self._slab(int(self._ecls[e]))
                    value = slab.rows[int(self._eslot[e]), : int(self._esize[e])].tobytes()
                    self._eatime[e] = self._clock()
                    self._ehits[e] += 1
        except (LockTimeout, _Damaged) as exc:
            self._data_path_failed(exc, "reads are misses")
            e = -1
        if e < 0:
            self._count(_Count.MISSES)
            return None
        self._count(_Count.HITS)
        return value

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        """Lend a zero-copy, read-only buffer of the value (None if absent).

        The shared lock is held for the whole ``with`` block, so writers of the
        whole node wait: keep it short, and do not write to the store inside
        it (``RuntimeError``). The buffer is released at the end of the block
        (unless something still exports it, e.g. ``np.frombuffer``; then it
        must not be used after the block). Counts a hit or a miss.
        Thread/process-safe.
        """
        check_key(key)
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self._shared(self._wait()))
                e = self._find_ready(key)
                slab = self._slab(int(self._ecls[e])) if e >= 0 else None
            except (LockTimeout, _Damaged) as exc:
                self._data_path_failed(exc, "reads are misses")
                stack.close()
                e, slab = -1, None
            if e < 0 or slab is None:
                self._count(_Count.MISSES)
                yield None
                return
            row = slab.rows[int(self._eslot[e]), : int(self._esize[e])]
            self._eatime[e] = self._clock()
            self._ehits[e] += 1
            self._count(_Count.HITS)
            base = row.data
            mv = base.toreadonly()
            try:
                yield mv
            finally:
                with contextlib.suppress(BufferError):
                    mv.release()
                    base.release()

    def _keys_array(self, keys: Keys) -> npt.NDArray[np.uint64]:
        if isinstance(keys, np.ndarray):
            if keys.dtype != np.uint8 or keys.ndim != 2 or keys.shape[1] != KEY_SIZE:
                got = f"{keys.dtype}{list(keys.shape)}"
                raise ValueError(f"keys as an array must be uint8 [n, {KEY_SIZE}], got {got}")
            return np.ascontiguousarray(keys).view(np.uint64)
        try:
            joined = b"".join(keys)
        except TypeError:
            joined = b""
        if len(joined) != KEY_SIZE * len(keys) or set(map(len, keys)) != {KEY_SIZE}:
            for k in keys:
                check_key(k)  # raises with the precise message
        return np.frombuffer(joined, dtype=np.uint64).reshape(len(keys), 2)

    def _lookup_ready(self, q: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        eids = lookup_many(self._table, self._ekey, q, self._shift)
        hit = eids >= 0
        hit[hit] = self._state[eids[hit]] == EntryState.READY
        return np.where(hit, eids, -1)

    def gather(
        self, keys: Keys, offset: int, length: int, out: npt.NDArray[np.uint8]
    ) -> npt.NDArray[np.bool_]:
        """Copy bytes ``[offset, offset+length)`` of each present entry into ``out[i]``.

        ``out`` is a preallocated ``uint8`` array of shape ``[len(keys), length]``
        (rows of absent keys are left untouched). Returns the found mask. An
        entry shorter than ``offset + length`` counts as absent. One shared
        lock for the whole batch; the index lookup is vectorised over the
        batch; counts hits and misses and updates ``atime``/``hits``.
        Thread/process-safe.
        """
        return self.gather_ranges(keys, [(offset, length, out)])

    def gather_ranges(
        self,
        keys: Keys,
        targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]],
        *,
        count: bool = True,
    ) -> npt.NDArray[np.bool_]:
        """:meth:`gather` of several byte ranges at once: ``(offset, length, out)`` each.

        Every range of every key is copied under one shared lock, so no entry
        can be replaced between two of its ranges (a batch never mixes two
        versions of a sample). A key is found when it is present and holds
        every range; only found rows are written. ``count=False`` leaves the hit
        and miss counters alone (a caller that may not serve what it read counts
        with :meth:`count_reads`). Thread/process-safe.
        """
        n = len(keys)
        end = 0
        for offset, length, out in targets:
            if offset < 0 or length < 0:
                raise ValueError(f"offset and length must be >= 0, got {offset}, {length}")
            if (
                not isinstance(out, np.ndarray)
                or out.dtype != np.uint8
                or out.shape != (n, length)
                or not out.flags.writeable
            ):
                got = f"{out.dtype}{list(out.shape)}" if isinstance(out, np.ndarray) else type(out)
                raise ValueError(
                    f"out must be a writeable uint8 array of shape [{n}, {length}], got {got}"
                )
            end = max(end, offset + length)
        found = np.zeros(n, dtype=bool)
        if n == 0:
            return found
        q = self._keys_array(keys)
        try:
            with self._shared(self._wait()):
                eids = self._lookup_ready(q)
                idx = np.flatnonzero(eids >= 0)
                e = eids[idx]
                fits = self._esize[e] >= end
                idx, e = idx[fits], e[fits]
                if idx.shape[0]:
                    for offset, length, out in targets:
                        if length:
                            self._copy_rows(out, idx, e, offset, offset + length)
                    self._eatime[e] = self._clock()
                    np.add.at(self._ehits, e, 1)  # a key twice in a batch: two hits
                found[idx] = True
        except (LockTimeout, _Damaged) as exc:
            self._data_path_failed(exc, "reads are misses")
            found[:] = False  # rows already copied are not served
            idx = np.zeros(0, np.int64)
        if count:
            hits = int(idx.shape[0])
            self.count_reads(hits=hits, misses=n - hits)
        return found

    def count_reads(self, *, hits: int = 0, misses: int = 0) -> None:
        """Add to this process's hit and miss counters (see ``gather_ranges(count=False)``)."""
        if hits:
            self._count(_Count.HITS, hits)
        if misses:
            self._count(_Count.MISSES, misses)

    def _copy_rows(
        self,
        out: npt.NDArray[np.uint8],
        idx: npt.NDArray[np.int64],
        e: npt.NDArray[np.int64],
        start: int,
        stop: int,
    ) -> None:
        """``out[idx[j]] = slab[slot(e[j]), start:stop]``, grouped by size class.

        A short range (a header and the token ids: up to ``_SMALL_RANGE`` bytes)
        is gathered with one fancy-indexing step (its temporary is small; 64
        row copies in Python cost 47 us a batch, this ~5 us). A long one (the
        image) takes one numpy row copy (a memcpy) per sample. Measured on 64 x 150 KB
        samples, this runs at 0.92-1.0x a plain contiguous copy of the same
        bytes, while the "vectorised" alternatives are slower: ``np.take`` along
        axis 0 (0.21x: it copies the whole slab when the column range is not the
        full row, and is slow even when it is) and fancy indexing
        ``slab[rows, a:b]`` (0.30x: a temporary, then a second copy).
        """
        cls = self._ecls[e]
        slots = self._eslot[e]
        if (cls == cls[0]).all():
            groups: list[tuple[int, list[int], list[int]]] = [
                (int(cls[0]), idx.tolist(), slots.tolist())
            ]
        else:
            groups = [
                (int(c), idx[cls == c].tolist(), slots[cls == c].tolist()) for c in np.unique(cls)
            ]
        small = stop - start <= _SMALL_RANGE
        for c, rows_out, rows_in in groups:
            slab = self._slab(c).rows
            if small:
                out[rows_out] = slab[rows_in, start:stop]  # one gather: no per-row Python
                continue
            for i, r in zip(rows_out, rows_in, strict=True):
                out[i] = slab[r, start:stop]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Copies of the values of ``keys`` (None where absent), under one shared lock.

        Counts hits and misses. Thread/process-safe.
        """
        n = len(keys)
        if n == 0:
            return []
        q = self._keys_array(keys)
        result: list[bytes | None] = [None] * n
        try:
            with self._shared(self._wait()):
                eids = self._lookup_ready(q)
                idx = np.flatnonzero(eids >= 0)
                e = eids[idx]
                for i, c, s, size in zip(
                    idx.tolist(),
                    self._ecls[e].tolist(),
                    self._eslot[e].tolist(),
                    self._esize[e].tolist(),
                    strict=True,
                ):
                    result[i] = self._slab(c).rows[s, :size].tobytes()
                if idx.shape[0]:
                    self._eatime[e] = self._clock()
                    np.add.at(self._ehits, e, 1)
        except (LockTimeout, _Damaged) as exc:
            self._data_path_failed(exc, "reads are misses")
            result = [None] * n
            idx = np.zeros(0, np.int64)
        hits = int(idx.shape[0])
        if hits:
            self._count(_Count.HITS, hits)
        if n - hits:
            self._count(_Count.MISSES, n - hits)
        return result

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is present (no hit/miss counted). Thread/process-safe."""
        check_key(key)
        try:
            with self._shared(self._wait()):
                return self._find_ready(key) >= 0
        except (LockTimeout, _Damaged) as exc:
            self._data_path_failed(exc, "reads are misses")
            return False

    def contains_many(self, keys: Keys) -> npt.NDArray[np.bool_]:
        """Presence of each key (no hit/miss counted), under one shared lock, vectorised.

        ``keys``: a sequence of 16-byte keys, or a ``uint8 [n, 16]`` array of them.

        The loader asks this for every batch it plans (in its workers). Thread/process-safe.
        """
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        q = self._keys_array(keys)
        try:
            with self._shared(self._wait()):
                found: npt.NDArray[np.bool_] = self._lookup_ready(q) >= 0
        except (LockTimeout, _Damaged) as exc:
            self._data_path_failed(exc, "reads are misses")
            found = np.zeros(len(keys), dtype=bool)
        return found

    def info(self, key: bytes) -> EntryInfo | None:
        """Metadata of ``key`` or None (no hit/miss counted). Thread/process-safe."""
        check_key(key)
        with self._shared():
            e = self._find_ready(key)
            if e < 0:
                return None
            return EntryInfo(
                size=int(self._esize[e]),
                cost=float(self._ecost[e]),
                ctime=float(self._ectime[e]),
                atime=float(self._eatime[e]),
                hits=int(self._ehits[e]),
            )

    def keys(self) -> Iterator[bytes]:
        """A snapshot of the keys present. Thread/process-safe."""
        with self._shared():
            hw = int(self._h[_H_ENTRY_HW])
            rows = np.flatnonzero(self._state[:hw] == EntryState.READY)
            raw = self._ekey[rows].tobytes()
        return iter([raw[i : i + KEY_SIZE] for i in range(0, len(raw), KEY_SIZE)])

    def __len__(self) -> int:
        self._ensure_process()
        return int(self._h[_H_ITEMS])

    def nbytes(self) -> int:
        """Payload bytes held now, reservations being written included. Process-safe."""
        self._ensure_process()
        return int(self._h[_H_NBYTES])

    def capacity(self) -> int:
        """The hard byte budget (the store's, which may differ from the one asked for)."""
        return self._capacity

    @property
    def policy(self) -> Policy:
        """The policy this process consults when the store is full."""
        return self._policy

    @property
    def index_capacity(self) -> int:
        """The most entries the store can hold."""
        return self._entries

    @property
    def temporary(self) -> bool:
        """Whether the files go when the last attached process closes."""
        return self._temporary

    @property
    def owner_path(self) -> str | None:
        """The cache root recorded at creation, if any."""
        self._ensure_process()
        n = int(self._h[_H_OWNER_LEN])
        return self._owner_arr[:n].tobytes().decode() if n else None

    def stats(self) -> TierStats:
        """Counters summed over every process of the node that used the store. Process-safe."""
        self._ensure_process()
        c = self._counters.sum(axis=0)
        return TierStats(
            hits=int(c[_Count.HITS]),
            misses=int(c[_Count.MISSES]),
            puts=int(c[_Count.PUTS]),
            admitted=int(c[_Count.ADMITTED]),
            refused=int(c[_Count.REFUSED]),
            evictions=int(c[_Count.EVICTIONS]),
            expired=int(c[_Count.EXPIRED]),
            corrupt=int(c[_Count.CORRUPT]),
            bytes=int(self._h[_H_NBYTES]),
            budget=self._capacity,
            items=int(self._h[_H_ITEMS]),
        )

    def segment_paths(self) -> list[str]:
        """The files of this store in ``/dev/shm`` (lock, meta, data), existing now."""
        paths = [_lock_path(self._dir, self.shm_name), _meta_path(self._dir, self.shm_name)]
        return [p for p in paths if os.path.exists(p)] + _data_paths(self._dir, self.shm_name)

    def resident_bytes(self) -> int:
        """RAM the store's files really hold now (tmpfs blocks), metadata included."""
        total = 0
        for path in self.segment_paths():
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(path).st_blocks * 512
        return total

    # ------------------------------------------------------------------ writes

    def put(
        self, key: bytes, value: bytes | memoryview, *, cost: float = 0.0, ctime: float = 0.0
    ) -> bool:
        """Store ``value`` under ``key`` if it fits or the policy makes room; return whether.

        Replacing a key is allowed; if the new value is refused, the old one is
        removed too (a new value for a key means the old one is stale). Returns
        False without storing when another live process is writing the same key
        at this moment, or when ``/dev/shm`` is full. An entry larger than the
        capacity is refused and logged once. Thread/process-safe; the payload
        is copied once.
        """
        check_key(key)
        src = _as_flat_bytes(value)
        self._ensure_process()
        self._count(_Count.PUTS)
        try:
            return self._put(key, src, cost=cost, ctime=ctime)
        except (LockTimeout, _Damaged) as exc:
            self._count(_Count.REFUSED)
            self._data_path_failed(exc, "puts are refused")
            return False

    def _put(self, key: bytes, src: memoryview, *, cost: float, ctime: float) -> bool:
        size = src.nbytes
        k0, k1 = _KEY.unpack(key)
        if size > self._capacity:
            self._count(_Count.REFUSED)
            if "oversize" not in self._warned:
                self._warned.add("oversize")
                log.warning(
                    "memory store %s: refused an entry of %d B, larger than the whole capacity"
                    " of %d B (raise the memory budget to cache such entries)",
                    self.shm_name, size, self._capacity,
                )  # fmt: skip
            self._drop_stale(k0, k1)
            return False
        res = self._reserve(k0, k1, size=size, cost=float(cost), ctime=float(ctime), src=src)
        if not isinstance(res, _Reserved):
            return res
        # Copy without the lock: readers and other writers go on meanwhile.
        try:
            res.slab.write(res.slot, src)
        except OSError as exc:
            self._abort(res)
            if not is_no_space(exc):
                raise
            self._refuse_no_space(admitted=True)
            return False
        except BaseException:
            self._abort(res)
            raise
        try:
            # If this wait runs out, the reservation is left WRITING: this process
            # reclaims it later (not in flight any more), others once it exits.
            with self._exclusive(self._wait()):
                return self._publish_locked(res)
        finally:
            _IN_FLIGHT.discard((self._store_id, res.entry, res.seq))

    def _reserve(
        self, k0: int, k1: int, *, size: int, cost: float, ctime: float, src: memoryview
    ) -> _Reserved | bool:
        """Reserve an entry (evicting as the policy says), or finish a small put outright.

        Returns a :class:`_Reserved` the caller must fill and publish (payloads
        over ``INLINE_COPY_MAX``), or the put's result.
        """
        inline = size <= INLINE_COPY_MAX
        counted = False  # whether the refused put was counted as admitted already
        plan: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None = None
        for attempt in range(_PLAN_ATTEMPTS + 1):
            with self._exclusive(self._wait()):
                res = self._reserve_locked(
                    k0=k0,
                    k1=k1,
                    size=size,
                    cost=cost,
                    ctime=ctime,
                    plan=plan,
                    decide=attempt == _PLAN_ATTEMPTS,
                )
                if isinstance(res, _Reserved):
                    if not inline:
                        _IN_FLIGHT.add((self._store_id, res.entry, res.seq))
                        return res
                    try:
                        res.slab.write(res.slot, src)
                    except OSError as exc:
                        if not is_no_space(exc):
                            raise
                        released: list[tuple[int, int]] = []
                        self._free_locked(res.entry, released)
                        self._release_all_locked(released)
                        res, counted = _Outcome.NO_SPACE, True
                    else:
                        return self._publish_locked(res)
            if res == _Outcome.NO_SPACE:
                self._refuse_no_space(admitted=counted)
                return False
            if res != _Outcome.NEED_PLAN:
                return False
            plan, had_old = self._plan(k0, k1, size, cost)
            if plan is None:
                self._count(_Count.REFUSED)
                if had_old:
                    self._drop_stale(k0, k1)
                return False
        return False  # pragma: no cover - the last attempt decides under the lock

    def _drop_stale(self, k0: int, k1: int) -> None:
        """Remove the published value of a key whose new value was refused."""
        with self._exclusive(self._wait()):
            e, _ = self._find(k0, k1)
            if e >= 0 and self._mv_state[e] == EntryState.READY:
                released: list[tuple[int, int]] = []
                self._free_locked(e, released)
                self._release_all_locked(released)

    def _warn_index_full(self, size: int) -> None:
        """Once per process: the index is full while bytes are free (many small entries).

        Why not grow the index instead: its arrays live in the meta segment, mapped
        at fixed offsets by every attached process; growing it would mean a new
        segment and a remap protocol in every process's every locked section.
        """
        if "index" in self._warned:
            return
        self._warned.add("index")
        held, cap = int(self._h[_H_NBYTES]), self._capacity
        log.warning(
            "memory store %s: its index is full (%d entries) with only %d of %d B held"
            " (entries of about %d B): the rest of the budget stays unused. Raise the index"
            " capacity: Cache(memory_entries=%d) or MemoryStore(index_capacity=...)",
            self.shm_name, self._entries, held, cap, size,
            min(max(cap // max(size, 1), self._entries * 2), MAX_INDEX_CAPACITY),
        )  # fmt: skip

    def _refuse_no_space(self, *, admitted: bool) -> None:
        """Count a put refused because /dev/shm is full (it may have been counted admitted)."""
        if admitted:
            self._count(_Count.ADMITTED, -1)
        self._count(_Count.REFUSED)
        self._warn_full()

    def _warn_full(self) -> None:
        if "enospc" not in self._warned:
            self._warned.add("enospc")
            log.warning(
                "memory store %s: %s is full; refusing puts until space is freed (in"
                " Docker, raise --shm-size or lower the memory budget)",
                self.shm_name, SHM_DIR,
            )  # fmt: skip

    def _publish_locked(self, res: _Reserved) -> bool:
        e = res.entry
        if (
            self._mv_state[e] != EntryState.WRITING
            or int(self._eseq[e]) != res.seq
            or int(self._epid[e]) != os.getpid()
        ):  # pragma: no cover - only if our reservation was wrongly reclaimed
            log.error("memory store %s: a reservation was lost before publish", self.shm_name)
            return False
        self._eatime[e] = self._clock()
        self._mv_state[e] = EntryState.READY
        self._h[_H_WRITING] -= 1
        self._h[_H_ITEMS] += 1
        return True

    def _abort(self, res: _Reserved) -> None:
        try:
            with self._exclusive(self._wait()):
                e = res.entry
                if self._mv_state[e] == EntryState.WRITING and int(self._eseq[e]) == res.seq:
                    released: list[tuple[int, int]] = []
                    self._free_locked(e, released)
                    self._release_all_locked(released)
        finally:
            _IN_FLIGHT.discard((self._store_id, res.entry, res.seq))

    def _reserve_locked(
        self,
        *,
        k0: int,
        k1: int,
        size: int,
        cost: float,
        ctime: float,
        plan: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None,
        decide: bool,
    ) -> _Reserved | _Outcome:
        """Make room (evicting ``plan`` if still valid) and reserve a WRITING entry. EX held."""
        h = self._h
        old, _ = self._find(k0, k1)
        cache: dict[tuple[int, int], bool] = {}
        if old >= 0 and self._mv_state[old] == EntryState.WRITING:
            if self._writer_alive(old, cache):
                return _Outcome.BUSY
            released0: list[tuple[int, int]] = []
            self._free_locked(old, released0)
            self._release_all_locked(released0)
            self._count(_Count.RECLAIMED)
            old = -1
        old_size = int(self._esize[old]) if old >= 0 else 0
        released: list[tuple[int, int]] = []

        def shortfall() -> tuple[int, bool]:
            need = int(h[_H_NBYTES]) + size - old_size - self._capacity
            full = old < 0 and int(h[_H_ITEMS]) + int(h[_H_WRITING]) >= self._entries
            return need, full

        need, full = shortfall()
        if (need > 0 or full) and int(h[_H_WRITING]) and self._reclaim_dead_writers_locked():
            need, full = shortfall()
        if full and need <= 0 and int(h[_H_NBYTES]) < self._capacity // 2:
            self._warn_index_full(size)
        victims: npt.NDArray[np.int64] | None = None
        if need > 0 or full:
            victims = None if plan is None else self._validate_plan_locked(plan, old, need, full)
            if victims is None:
                if not decide:
                    return _Outcome.NEED_PLAN
                # Optimistic plans kept going stale: decide under the lock this time.
                rows, residents = self._residents_locked(old)
                victims = self._ask_policy(
                    rows, residents, size=size, cost=cost, need=need, full=full
                )
                if victims is None:
                    self._count(_Count.REFUSED)
                    if old >= 0:  # the new value is refused: the old one is stale
                        self._free_locked(old, released)
                        self._release_all_locked(released)
                    return _Outcome.REFUSED
        cls = bisect_left(self._sizes_list, size)
        # Admitted: now make sure /dev/shm has the pages the entry's metadata needs,
        # before evicting anything for it (a full /dev/shm must not cost the victims).
        if not self._reserve_pages_locked(cls):
            if old >= 0:  # the new value is refused: the old one is stale
                self._free_locked(old, released)
                self._release_all_locked(released)
            return _Outcome.NO_SPACE
        if victims is not None:
            for v in victims.tolist():
                self._free_locked(v, released)
            self._count(_Count.EVICTIONS, len(victims))
        if old >= 0:
            self._free_locked(old, released)
        slab, slot = self._alloc_slot_locked(cls)
        e = self._alloc_entry_locked()
        seq = int(h[_H_SEQ])
        h[_H_SEQ] = seq + 1
        self._ekey[e, 0] = k0
        self._ekey[e, 1] = k1
        self._esize[e] = size
        self._ecls[e] = cls
        self._eslot[e] = slot
        self._ecost[e] = cost
        self._ectime[e] = ctime
        self._eatime[e] = self._clock()
        self._ehits[e] = 0
        self._eseq[e] = seq
        self._epid[e] = os.getpid()
        self._epstart[e] = _own_start_time()
        self._mv_state[e] = EntryState.WRITING
        h[_H_NBYTES] += size
        h[_H_WRITING] += 1
        self._insert_locked(e, k0, k1)
        self._release_all_locked(released)
        self._count(_Count.ADMITTED)
        return _Reserved(e, seq, slab, slot)

    def _residents_locked(self, old: int) -> tuple[npt.NDArray[np.int64], Residents]:
        """READY entries (except ``old``) as policy input. Caller holds the lock."""
        hw = int(self._h[_H_ENTRY_HW])
        rows = np.flatnonzero(self._state[:hw] == EntryState.READY)
        if old >= 0:
            rows = rows[rows != old]
        residents = Residents(
            size=self._esize[rows],
            cost=self._ecost[rows],
            atime=self._eatime[rows],
            ctime=self._ectime[rows],
            hits=self._ehits[rows],
            seq=self._eseq[rows],
        )
        return rows, residents

    def _ask_policy(
        self,
        rows: npt.NDArray[np.int64],
        residents: Residents,
        *,
        size: int,
        cost: float,
        need: int,
        full: bool,
    ) -> npt.NDArray[np.int64] | None:
        """Run the policy and check its answer: entries (not rows) to evict, or None."""
        if isinstance(self._policy, KeepPolicy) or rows.shape[0] == 0:
            return None
        chosen = self._policy.select_victims(
            residents, size=size, cost=cost, need=max(need, 1 if full else 0)
        )
        if chosen is None:
            return None
        chosen = np.asarray(chosen, dtype=np.int64).reshape(-1)
        valid = (
            chosen.shape[0] > 0
            and bool(((chosen >= 0) & (chosen < rows.shape[0])).all())
            and np.unique(chosen).shape[0] == chosen.shape[0]
            and int(residents.size[chosen].sum()) >= need
        )
        if not valid:
            if "policy" not in self._warned:
                self._warned.add("policy")
                log.warning(
                    "memory store %s: policy %r returned victims that do not free %d B;"
                    " refusing the entry",
                    self.shm_name, self._policy, need,
                )  # fmt: skip
            return None
        return rows[chosen]

    def _plan(
        self, k0: int, k1: int, size: int, cost: float
    ) -> tuple[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None, bool]:
        """Ask the policy for victims from a snapshot taken under the shared lock.

        The policy itself runs with no lock held, so a refusal costs readers
        nothing. Returns ``(entries, their seq)`` for validation, or None
        (refuse), and whether the key had a published value.
        """
        with self._shared(self._wait()):
            old = self._find(k0, k1)[0]
            if old >= 0 and self._mv_state[old] != EntryState.READY:
                old = -1
            old_size = int(self._esize[old]) if old >= 0 else 0
            need = int(self._h[_H_NBYTES]) + size - old_size - self._capacity
            full = old < 0 and int(self._h[_H_ITEMS]) + int(self._h[_H_WRITING]) >= self._entries
            if need <= 0 and not full:
                return (np.zeros(0, np.int64), np.zeros(0, np.int64)), old >= 0
            rows, residents = self._residents_locked(old)
        victims = self._ask_policy(rows, residents, size=size, cost=cost, need=need, full=full)
        if victims is None:
            return None, old >= 0
        return (victims, residents.seq[np.searchsorted(rows, victims)]), old >= 0

    def _validate_plan_locked(
        self,
        plan: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]],
        old: int,
        need: int,
        full: bool,
    ) -> npt.NDArray[np.int64] | None:
        """The planned victims if they are all still there and still free enough. EX held."""
        victims, seqs = plan
        if victims.shape[0] == 0 or bool((victims == old).any()):
            return None
        still = (self._state[victims] == EntryState.READY) & (self._eseq[victims] == seqs)
        if not still.all() or int(self._esize[victims].sum()) < need:
            return None
        return victims

    def verify(self, check: Callable[[bytes], bool]) -> list[bytes]:
        """Keys whose value fails ``check`` (the Cache passes the codec's checksum).

        Entries are trusted on reads (see the module docstring), so this is how a
        byte changed in ``/dev/shm`` is found. Each entry is copied under its own
        short shared section (writers wait for one copy, not the whole pass) and
        no hit, miss or access time is recorded. Bad entries are counted as
        ``corrupt`` but not deleted: the caller decides. Thread/process-safe.
        """
        bad: list[bytes] = []
        for key in list(self.keys()):
            with self._shared():
                e = self._find_ready(key)
                if e < 0:
                    continue
                slab = self._slab(int(self._ecls[e]))
                value = slab.rows[int(self._eslot[e]), : int(self._esize[e])].tobytes()
            if not check(value):
                bad.append(key)
        if bad:
            self._count(_Count.CORRUPT, len(bad))
        return bad

    def discard(self, key: bytes, *, why: Literal["corrupt", "expired"]) -> bool:
        """Delete ``key`` and count it as ``corrupt`` or ``expired``. Thread/process-safe."""
        removed = self.delete(key)
        if removed:
            self._count(_Count.CORRUPT if why == "corrupt" else _Count.EXPIRED)
        return removed

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present. Thread/process-safe.

        An entry still being written by a live process is not present yet.
        """
        check_key(key)
        with self._exclusive():
            e = self._find_ready(key)
            if e < 0:
                return False
            released: list[tuple[int, int]] = []
            self._free_locked(e, released)
            self._release_all_locked(released)
            return True

    def expire(self, before: float) -> int:
        """Remove entries whose ``ctime < before``; return how many. Thread/process-safe."""
        with self._exclusive():
            hw = int(self._h[_H_ENTRY_HW])
            rows = np.flatnonzero(
                (self._state[:hw] == EntryState.READY) & (self._ectime[:hw] < before)
            )
            released: list[tuple[int, int]] = []
            for e in rows.tolist():
                self._free_locked(e, released)
            self._release_all_locked(released)
        if rows.shape[0]:
            self._count(_Count.EXPIRED, int(rows.shape[0]))
        return int(rows.shape[0])

    def clear(self) -> int:
        """Remove every published entry; return how many. Thread/process-safe."""
        with self._exclusive():
            hw = int(self._h[_H_ENTRY_HW])
            rows = np.flatnonzero(self._state[:hw] == EntryState.READY)
            released: list[tuple[int, int]] = []
            for e in rows.tolist():
                self._free_locked(e, released)
            self._release_all_locked(released)
        return int(rows.shape[0])

    def check(self) -> list[str]:
        """Verify the shared invariants; return the problems found (empty: consistent).

        Checks the byte and item counts against the entry table, the budget,
        that every entry is reachable through the hash table, and that the slot
        bitmaps match the entries. For tests, ``mmcache verify`` and debugging.
        Thread/process-safe (shared lock).
        """
        problems: list[str] = []
        with self._shared():
            h = self._h
            state = self._state[: self._rows_reserved()]  # no later row was ever written
            live = np.flatnonzero(state != EntryState.EMPTY)
            if live.shape[0] and int(live[-1]) >= int(h[_H_ENTRY_HW]):
                problems.append(f"entry {int(live[-1])} beyond the high-water mark")
            if bool((state > EntryState.READY).any()):
                problems.append("entries in an unknown state")
            held = int(self._esize[live].sum())
            counts = {
                "bytes": (int(h[_H_NBYTES]), held),
                "items": (int(h[_H_ITEMS]), int((state[live] == EntryState.READY).sum())),
                "writing": (int(h[_H_WRITING]), int((state[live] == EntryState.WRITING).sum())),
                "index cells": (int(h[_H_USED_CELLS]), int((self._table > 0).sum())),
                "tombstones": (int(h[_H_TOMBSTONES]), int((self._table < 0).sum())),
            }
            for what, (header, actual) in counts.items():
                if header != actual:
                    problems.append(f"{what}: header says {header}, entries say {actual}")
            if held > self._capacity:
                problems.append(f"budget exceeded: {held} B held > {self._capacity} B")
            found = lookup_many(self._table, self._ekey, self._ekey[live], self._shift)
            if not np.array_equal(found, live):
                problems.append(f"{int((found != live).sum())} entries unreachable by key")
            cls = self._ecls[live].astype(np.int64)
            expected = np.searchsorted(self._sizes, self._esize[live], side="left")
            if not np.array_equal(cls, expected):
                problems.append("entries in the wrong size class")
            for c in np.flatnonzero(self._classes[:, _C_CREATED]).tolist():
                slab = self._slab(int(c))
                slots = self._eslot[live[cls == c]]
                used = int(self._classes[c, _C_USED])
                marked = int(np.count_nonzero(slab.bitmap))
                if not used == marked == slots.shape[0] == np.unique(slots).shape[0]:
                    problems.append(
                        f"class {c}: {used} used, {marked} marked, {slots.shape[0]} entries"
                    )
                elif slots.shape[0] and not bool(slab.bitmap[slots].all()):
                    problems.append(f"class {c}: entries in slots marked free")
        return problems

    def gc(self) -> int:
        """Reclaim what dead processes left: half-written entries, attached-process rows;
        compact the hash table. Returns the entries reclaimed. Thread/process-safe."""
        with self._exclusive():
            reclaimed = self._reclaim_dead_writers_locked()
            self._prune_procs_locked()
            if int(self._h[_H_TOMBSTONES]):
                self._rehash_locked()
        return reclaimed


def _as_flat_bytes(value: bytes | memoryview) -> memoryview:
    """A flat byte view of any buffer (copied only if it is not contiguous)."""
    mv = memoryview(value)
    if not mv.c_contiguous:
        return memoryview(mv.tobytes())
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


_OWN_START: list[int] = [-1, 0]  # (pid, start time) of this process, cached


def _pid_namespace() -> int:
    """Identity of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _own_start_time() -> int:
    pid = os.getpid()
    if _OWN_START[0] != pid:
        _OWN_START[0] = pid
        _OWN_START[1] = proc_start_time(pid) or 0
    return _OWN_START[1]


def _close_at_exit(ref: weakref.ref[MemoryStore]) -> None:
    store = ref()
    if store is not None:
        try:
            store.close()
        except Exception:  # at exit, report and go on: other stores still need closing
            log.exception("closing memory store %s at exit failed", store.shm_name)


# --------------------------------------------------------------------------- node-wide cleanup


def _store_names(directory: str, pattern: str) -> dict[str, list[str]]:
    """Store names found in ``directory`` (matching the glob ``pattern``) and their files."""
    names: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(glob.escape(directory), SHM_PREFIX + "*")):
        base = os.path.basename(path)[len(SHM_PREFIX) :]
        for suffix in (".lock", "-meta"):
            if base.endswith(suffix):
                name = base[: -len(suffix)]
                break
        else:
            if len(base) > 5 and base[-5:-3] == "-d" and base[-3:].isdigit():
                name = base[:-5]
            else:
                continue
        if fnmatch.fnmatchcase(name, pattern):
            names.setdefault(name, []).append(path)
    return names


def _scan_access(group: int | None) -> Access:
    return Access(0o600 if group is None else 0o660, group)


def _orphan_reason(directory: str, name: str, access: Access) -> str | None:
    """Why the store ``name`` should go, or None to keep it. Caller holds its lock (EX)."""
    try:
        seg = Segment.open(_meta_path(directory, name), access=access)
    except FileNotFoundError:
        return "no meta segment (creation never finished)"
    except UntrustedFileError:
        return None  # not ours to judge, nor to remove
    except CacheError:
        return "truncated meta segment"
    except OSError:
        return None  # not ours to judge (permissions)
    try:
        h = np.frombuffer(seg.buf, np.int64, count=_HEADER_WORDS)
        if int(h[_H_MAGIC]) != _MAGIC or int(h[_H_META_SIZE]) != seg.size:
            return "not a valid store (bad magic or size)"
        if int(h[_H_STATE]) != StoreState.READY:
            return "half-initialised by a dead creator"
        if int(h[_H_PID_NAMESPACE]) != _pid_namespace():
            return None  # its processes' liveness cannot be judged from here
        layout = _Layout.build(
            entries=int(h[_H_ENTRIES]),
            table_shift=int(h[_H_TABLE_SHIFT]),
            classes=int(h[_H_CLASSES]),
            procs=int(h[_H_PROCS]),
        )
        if layout.size != seg.size:
            return "not a valid store (layout size)"
        arrays = layout.arrays(seg.buf)
        procs = arrays["procs"]
        live = any(
            pid_alive(int(pid), int(start)) for pid, start in procs[procs[:, 0] != 0].tolist()
        )
        owner_len = int(h[_H_OWNER_LEN])
        owner = (
            arrays["owner"][:owner_len].tobytes().decode(errors="replace") if owner_len else None
        )
        temporary = bool(int(h[_H_FLAGS]) & _FLAG_TEMPORARY)
        reason = None
        if not live:
            where = _Where(name, directory, access, int(h[_H_CAPACITY]))
            try:
                reason = _data_problem(where, arrays["classes"])
            except UntrustedFileError:
                return None
            if reason is not None:
                pass  # a damaged store: every later open would fail on it
            elif temporary:
                reason = "temporary and no live process attached"
            elif owner is not None and not os.path.exists(owner):
                reason = f"owner path {owner} no longer exists"
        if reason is not None:
            h[_H_STATE] = StoreState.UNLINKED
        del h, arrays, procs
        return reason
    finally:
        seg.close()


def reclaim_orphans(pattern: str = "*", *, group: int | None = None) -> list[str]:
    """Remove memory stores of this user (or of ``group``) that nobody will use again;
    return the paths removed.

    A store goes when no live process is attached to it and it is temporary,
    or its ``owner_path`` (the cache root) no longer exists, or one of its data
    segments is missing or truncated, or it was left half-initialised by a
    creator that died; also leftover files of a store without a lock file.
    Stores whose lock is held right now are skipped, and so are files another
    user could control. ``pattern`` is a glob on store names (``Cache.gc``
    passes its own store's name). Process-safe.
    """
    removed: list[str] = []
    access = _scan_access(group)
    try:
        directory = access.ensure_directory(SHM_DIR, create=False)
    except UntrustedFileError:
        raise
    except CacheError:
        return removed  # no directory: no store
    for name, paths in sorted(_store_names(directory, pattern).items()):
        if not os.path.exists(_lock_path(directory, name)):
            for path in paths:
                _remove(path, removed)
            continue
        try:
            lock = NodeLock(_lock_path(directory, name), create=False, access=access)
        except CacheError:
            continue
        try:
            if not lock.try_exclusive():
                continue
            try:
                if lock.unlinked():
                    continue
                reason = _orphan_reason(directory, name, access)
                if reason is not None:
                    log.info("removing orphaned memory store %s: %s", name, reason)
                    for path in [
                        *_data_paths(directory, name),
                        _meta_path(directory, name),
                        _lock_path(directory, name),
                    ]:
                        _remove(path, removed)
            finally:
                lock.release()
        finally:
            lock.close()
    return removed


def store_exists(name: str, *, group: int | None = None) -> bool:
    """Whether some process made the store ``name`` on this node (its files exist)."""
    check_store_name(name)
    directory = store_dir(group)
    return os.path.exists(_lock_path(directory, name)) or os.path.exists(
        _meta_path(directory, name)
    )


def unlink_store(
    name: str, *, timeout: float = OPEN_TIMEOUT, group: int | None = None
) -> list[str]:
    """Remove the store ``name`` (all its files), whether or not it is in use.

    Waits for the lock (at most ``timeout`` seconds) so no critical section is
    cut in half; processes still attached get ``CacheError`` on their next
    operation. Returns the paths removed. Process-safe.
    """
    check_store_name(name)
    removed: list[str] = []
    access = _scan_access(group)
    try:
        directory = access.ensure_directory(SHM_DIR, create=False)
    except UntrustedFileError:
        raise
    except CacheError:
        return removed
    files = [*_data_paths(directory, name), _meta_path(directory, name)]
    try:
        lock = NodeLock(_lock_path(directory, name), create=False, access=access)
    except UntrustedFileError:
        raise
    except CacheError:
        for path in files:
            _remove(path, removed)
        return removed
    try:
        with lock.hold(EXCLUSIVE, timeout=timeout):
            with contextlib.suppress(FileNotFoundError, CacheError):
                seg = Segment.open(_meta_path(directory, name), access=access)
                try:
                    h = np.frombuffer(seg.buf, np.int64, count=_HEADER_WORDS)
                    if int(h[_H_MAGIC]) == _MAGIC:
                        h[_H_STATE] = StoreState.UNLINKED
                    del h
                finally:
                    seg.close()
            for path in [*_data_paths(directory, name), *files[-1:], _lock_path(directory, name)]:
                _remove(path, removed)
    finally:
        lock.close()
    return removed
