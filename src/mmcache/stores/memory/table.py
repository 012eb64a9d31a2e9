"""The entries of a memory store: the entry rows and the hash index over their keys.

:class:`EntryTable` works on the arrays of one generation of the index segment
(``index.py``) and the meta segment's header, which the caller maps and locks (shared
to look up, exclusive to change anything); it touches the file only to allocate the
pages of rows before their first use (:meth:`EntryTable.reserve_rows`, see
``layout.py``). The functions on the hash table alone (:func:`lookup_many`,
:func:`rebuild_table`) take the arrays as arguments, so they are easy to test alone.

The hash table is open addressing with linear probing over ``int32`` cells:
``0`` is a free cell, ``-1`` a tombstone (a deleted cell that probes must walk
past), and ``v > 0`` points to entry ``v - 1``. Zero meaning "free" lets a new
table be a zero-filled (sparse, untouched) tmpfs file. Keys are 128-bit
digests stored as two ``uint64`` words per entry; the home cell is a
multiplicative hash of both words, so keys that are not uniform (small
integers, sequential ids) still spread.

Processes are identified by ``(pid, start time)``: a WRITING row records its
writer's, and a reservation whose writer died is reclaimed
(:meth:`EntryTable.reclaim_dead_writers`).
"""

from __future__ import annotations

import functools
import logging
import os
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from mmcache.errors import CacheError
from mmcache.policies import Residents
from mmcache.stores.base import KEY_SIZE, EntryInfo, Keys, check_key
from mmcache.stores.memory.index import ENTRY_COLUMNS, Index
from mmcache.stores.memory.layout import (
    H_CREATED_AT,
    H_ENTRY_HINT,
    H_ENTRY_HW,
    H_ITEMS,
    H_NBYTES,
    H_ROWS_RESERVED,
    H_SEQ,
    H_TOMBSTONES,
    H_USED_CELLS,
    H_WRITING,
    ROW_RESERVE_STEP,
    EntryState,
    Meta,
)
from mmcache.stores.memory.shm import own_start_time, pid_alive
from mmcache.stores.memory.slabs import Slabs

__all__ = [
    "CELL_FREE",
    "CELL_TOMBSTONE",
    "IN_FLIGHT",
    "EntryTable",
    "home_cell",
    "home_cells",
    "keys_array",
    "lookup_many",
    "rebuild_table",
    "split_key",
]

log = logging.getLogger(__name__)

CELL_FREE = 0
CELL_TOMBSTONE = -1
#: ``EntryState.READY`` as a plain int: an enum member read costs two Python calls
#: (``EnumType.__getattr__``), on every batch lookup of the warm path.
_READY = int(EntryState.READY)

_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: Fibonacci hashing
_MASK64 = (1 << 64) - 1
_MIX_U64 = np.uint64(_MIX)
_KEY = struct.Struct("<QQ")
ENTRY_NAMES = tuple(name for name, _, _ in ENTRY_COLUMNS)

#: Reservations this process is copying into right now: (store id, entry, seq). Shared by
#: every MemoryStore object of the process, so one object never reclaims another's.
IN_FLIGHT: set[tuple[tuple[str, int], int, int]] = set()


def home_cell(k0: int, k1: int, shift: int) -> int:
    """Home cell of one key (two 64-bit words) in a table of ``2**(64-shift)`` cells."""
    return (((k0 ^ k1) * _MIX) & _MASK64) >> shift


def home_cells(keys: npt.NDArray[np.uint64], shift: int) -> npt.NDArray[np.int64]:
    """Vectorised :func:`home_cell` over ``keys`` of shape ``[n, 2]``."""
    mixed = (keys[:, 0] ^ keys[:, 1]) * _MIX_U64  # uint64 arithmetic wraps, as intended
    cells: npt.NDArray[np.int64] = (mixed >> np.uint64(shift)).astype(np.int64)
    return cells


def lookup_many(
    table: npt.NDArray[np.int32],
    entry_keys: npt.NDArray[np.uint64],
    keys: npt.NDArray[np.uint64],
    shift: int,
) -> npt.NDArray[np.int64]:
    """Entry number of each of ``keys`` (``[n, 2]`` uint64), or -1 where absent.

    All keys probe in lock step: the first round is a handful of numpy
    operations over the whole batch and, with the load kept at or below 3/4
    (tombstones included), ends the search of almost every key (a match or a
    free cell); the few that must walk on do so in further rounds over just
    themselves. Caller holds the store lock (shared is enough).
    """
    n = keys.shape[0]
    if n == 0:
        return np.full(0, -1, dtype=np.int64)
    mask = table.shape[0] - 1
    k0 = entry_keys[:, 0]
    k1 = entry_keys[:, 1]
    q0 = keys[:, 0]
    q1 = keys[:, 1]
    pos = home_cells(keys, shift)
    cell = table[pos]
    entry = np.maximum(cell - 1, 0)
    match = (cell > 0) & (k0[entry] == q0) & (k1[entry] == q1)
    out = np.where(match, entry, -1).astype(np.int64)
    active = np.flatnonzero(~match & (cell != CELL_FREE))
    for _ in range(mask):
        if active.shape[0] == 0:
            break
        pos = (pos[active] + 1) & mask if pos.shape[0] == n else (pos + 1) & mask
        cell = table[pos]
        entry = np.maximum(cell - 1, 0)
        match = (cell > 0) & (k0[entry] == q0[active]) & (k1[entry] == q1[active])
        out[active[match]] = entry[match]
        go_on = ~match & (cell != CELL_FREE)
        active = active[go_on]
        pos = pos[go_on]
    return out


def rebuild_table(
    table: npt.NDArray[np.int32],
    entry_keys: npt.NDArray[np.uint64],
    entries: npt.NDArray[np.int64],
    shift: int,
) -> None:
    """Clear ``table`` and insert ``entries`` (entry numbers; keys must be distinct).

    Vectorised: in each round every pending entry tries its current cell; of
    those that find it free, one per cell wins and the others move on one
    cell. So an entry only moves past occupied cells, which is the linear
    probing invariant lookups rely on. Caller holds the store lock exclusively.
    """
    table[:] = CELL_FREE
    if entries.shape[0] == 0:
        return
    mask = table.shape[0] - 1
    pending = entries.astype(np.int64)
    pos = home_cells(entry_keys[pending], shift)
    while pending.shape[0]:
        free = table[pos] == CELL_FREE
        cand_pos = pos[free]
        _, first = np.unique(cand_pos, return_index=True)
        winners = np.flatnonzero(free)[first]
        table[pos[winners]] = (pending[winners] + 1).astype(np.int32)
        keep = np.ones(pending.shape[0], dtype=bool)
        keep[winners] = False
        pending = pending[keep]
        pos = (pos[keep] + 1) & mask


def keys_array(keys: Keys) -> npt.NDArray[np.uint64]:
    """``keys`` (16-byte ``bytes`` each, or ``uint8 [n, 16]``) as ``uint64 [n, 2]``."""
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


def split_key(key: bytes) -> tuple[int, int]:
    """The two 64-bit words of a 16-byte key."""
    k0, k1 = _KEY.unpack(key)
    return int(k0), int(k1)


#: Above :data:`EXACT_BELOW` published entries a policy decides on a random sample of
#: about this many residents (:meth:`EntryTable.residents`): O(sample) per decision, not
#: O(entries).
POLICY_SAMPLE = 1 << 10
#: Up to this many published entries a policy sees every one (its exact order: ~1-4 ms
#: of CPU a decision at the most); above it, a sample.
EXACT_BELOW = 1 << 16


@functools.cache
def _sampler() -> np.random.Generator:
    """The sample's random rows (not a secret, nor a decision that must repeat: the victims
    are validated under the lock whoever proposed them). Made on first use: importing the
    store must not import ``numpy.random`` (the stat prefetcher imports it before it forks)."""
    return np.random.default_rng()


class EntryTable:
    """The entry rows of one store and the hash index over their keys.

    Columns (one row per entry, arrays of the index segment ``index``): ``state``
    (:class:`~mmcache.stores.memory.layout.EntryState`), ``key`` (``uint64 [2]``),
    ``size``, ``cls`` and ``slot`` (where the payload is: ``slabs.py``), ``cost``,
    ``ctime``, ``atime``, ``hits``, ``seq`` (admission order), ``pid`` and ``pstart``
    (the writer of a WRITING row); ``cells`` is the hash table. The header words it
    keeps: bytes, items and reservations held, used and tombstone cells, the next
    ``seq``, the lowest possibly free row, the high-water mark and the rows reserved.

    Readers may read the columns under the shared lock; every change goes through a
    method, under the exclusive lock. Rows never move (a grow copies them to the same
    rows of the next generation), so a writer copying without the lock can always find
    its row again. One object serves one generation: the session makes a new one when
    the index grows (``gen``).
    """

    def __init__(self, meta: Meta, index: Index, name: str) -> None:
        a = index.arrays
        self._arrays = a
        self.name = name
        self.index = index
        self.gen = index.gen
        self.header = meta.header
        self.state: npt.NDArray[np.uint8] = a["state"]
        self.key: npt.NDArray[np.uint64] = a["key"]
        self.size: npt.NDArray[np.int64] = a["size"]
        self.cls: npt.NDArray[np.int16] = a["cls"]
        self.slot: npt.NDArray[np.int32] = a["slot"]
        self.cost: npt.NDArray[np.float64] = a["cost"]
        self.ctime: npt.NDArray[np.float64] = a["ctime"]
        self.atime: npt.NDArray[np.float64] = a["atime"]
        self.hits: npt.NDArray[np.int64] = a["hits"]
        self.seq: npt.NDArray[np.int64] = a["seq"]
        self.pid: npt.NDArray[np.int32] = a["pid"]
        self.pstart: npt.NDArray[np.int64] = a["pstart"]
        self.cells: npt.NDArray[np.int32] = a["table"]
        # memoryviews give Python ints at C speed for the one-key paths.
        self._mv_cells: Any = self.cells.data
        self._mv_key: Any = self.key.reshape(-1).data
        self._mv_state: Any = self.state.data
        self.entries = index.layout.entries
        self.shift = index.layout.table_shift
        self._mask = (1 << (64 - self.shift)) - 1
        #: Identifies the store across re-creations (for IN_FLIGHT).
        self.store_id = (name, int(self.header[H_CREATED_AT]))

    def release(self) -> None:
        """Drop the memoryviews (before the meta segment is unmapped)."""
        for mv in (self._mv_cells, self._mv_key, self._mv_state):
            mv.release()

    # ------------------------------------------------------------------ counts

    def nbytes(self) -> int:
        """Payload bytes held: published entries and reservations."""
        return int(self.header[H_NBYTES])

    def items(self) -> int:
        """Published entries."""
        return int(self.header[H_ITEMS])

    def writing(self) -> int:
        """Reservations being written."""
        return int(self.header[H_WRITING])

    def tombstones(self) -> int:
        """Deleted cells that lookups must walk past (:meth:`rehash` drops them)."""
        return int(self.header[H_TOMBSTONES])

    def high_water(self) -> int:
        """Rows ``[0, high_water)`` are the only ones that may be in use."""
        return int(self.header[H_ENTRY_HW])

    def ready_rows(self) -> npt.NDArray[np.int64]:
        """The rows of published entries, ascending."""
        return np.flatnonzero(self.state[: self.high_water()] == EntryState.READY)

    # ------------------------------------------------------------------ lookups

    def find(self, k0: int, k1: int) -> tuple[int, int]:
        """``(entry, cell)`` of a key, or ``(-1, cell to insert at)``. Caller holds the lock."""
        table = self._mv_cells
        keys = self._mv_key
        mask = self._mask
        pos = home_cell(k0, k1, self.shift)
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
        raise CacheError(f"memory store {self.name!r}: hash table full")  # pragma: no cover

    def find_ready(self, key: bytes) -> int:
        """The row of ``key``'s published entry, or -1."""
        k0, k1 = _KEY.unpack(key)
        e, _ = self.find(k0, k1)
        if e >= 0 and self._mv_state[e] == EntryState.READY:
            return e
        return -1

    def is_ready(self, e: int) -> bool:
        return bool(self._mv_state[e] == EntryState.READY)

    def is_writing(self, e: int) -> bool:
        return bool(self._mv_state[e] == EntryState.WRITING)

    def lookup_ready(self, q: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """Rows of the published entries of keys ``q`` (``uint64 [n, 2]``), -1 where absent."""
        eids = lookup_many(self.cells, self.key, q, self.shift)
        hit = eids >= 0
        hit[hit] = self.state[eids[hit]] == _READY
        return np.where(hit, eids, -1)

    def residents(self, old: int, *, need: int = 0) -> tuple[npt.NDArray[np.int64], Residents]:
        """Published entries (except ``old``) as policy input, rows ascending. Caller
        holds the lock.

        Above :data:`EXACT_BELOW` published entries, a random sample of about
        :data:`POLICY_SAMPLE` of them rather than all (as Redis approximates LRU):
        a full store decides for every newcomer, and gathering every resident cost
        0.08 s per put at 10^6 entries and 5.5 s at 2^25. The policy's victims are the
        best of the sample, not of the whole store; a sample whose bytes cannot free
        ``need`` gives way to every entry."""
        sample = POLICY_SAMPLE
        rows: npt.NDArray[np.int64] | None = None
        if self.items() > max(EXACT_BELOW, sample):
            picks = np.unique(_sampler().integers(0, self.high_water(), size=2 * sample))
            rows = picks[self.state[picks] == EntryState.READY]
            if old >= 0:
                rows = rows[rows != old]
            if rows.shape[0] == 0 or int(self.size[rows].sum()) < need:
                rows = None
        if rows is None:
            rows = self.ready_rows()
            if old >= 0:
                rows = rows[rows != old]
        residents = Residents(
            size=self.size[rows],
            cost=self.cost[rows],
            atime=self.atime[rows],
            ctime=self.ctime[rows],
            hits=self.hits[rows],
            seq=self.seq[rows],
        )
        return rows, residents

    # ------------------------------------------------------------------ reads

    def payload(self, e: int, slabs: Slabs) -> npt.NDArray[np.uint8]:
        """A view of entry ``e``'s bytes in its slot (valid while the lock is held)."""
        return slabs.get(int(self.cls[e])).rows[int(self.slot[e]), : int(self.size[e])]

    def info(self, e: int) -> EntryInfo:
        """The metadata of entry ``e``."""
        return EntryInfo(
            size=int(self.size[e]),
            cost=float(self.cost[e]),
            ctime=float(self.ctime[e]),
            atime=float(self.atime[e]),
            hits=int(self.hits[e]),
        )

    def touch(self, e: int, now: float) -> None:
        """Record a read of entry ``e`` (concurrent readers may lose a ``hits`` increment)."""
        self.atime[e] = now
        self.hits[e] += 1

    def touch_many(self, e: npt.NDArray[np.int64], now: float) -> None:
        """:meth:`touch` of every row of ``e`` (a row twice: two hits)."""
        self.atime[e] = now
        np.add.at(self.hits, e, 1)

    # ------------------------------------------------------------------ rows' pages

    def rows_reserved(self) -> int:
        """Entry rows whose pages exist: the only ones that may be touched (``layout.py``)."""
        return min(max(int(self.header[H_ROWS_RESERVED]), 0), self.entries)

    def reserve_rows(self, rows: int) -> None:
        """Allocate the pages of entry rows ``[0, rows)`` (and a step more). Caller holds EX.

        Raises ``OSError`` (``ENOSPC``) when /dev/shm has no room; the header
        records only what was really reserved.
        """
        have = self.rows_reserved()
        if rows <= have:
            return
        step = max(ROW_RESERVE_STEP, have // 8)
        want = min(self.entries, -(-max(rows, have + step) // ROW_RESERVE_STEP) * ROW_RESERVE_STEP)
        for offset, length in self.index.layout.row_ranges(have, want):
            self.index.seg.reserve(offset, length)
        self.header[H_ROWS_RESERVED] = want

    # ------------------------------------------------------------------ changes (EX held)

    def insert(self, e: int, k0: int, k1: int) -> None:
        """Point the key's cell at row ``e``, rehashing first if the table is too loaded."""
        h = self.header
        if int(h[H_USED_CELLS]) + int(h[H_TOMBSTONES]) + 1 > (self._mask + 1) * 3 // 4:
            self.rehash()
        found, pos = self.find(k0, k1)
        if found == e:
            return  # the rehash above already placed it
        if found >= 0:  # pragma: no cover - callers free the old entry first
            raise CacheError(f"memory store {self.name!r}: duplicate key in the index")
        if self._mv_cells[pos] == CELL_TOMBSTONE:
            h[H_TOMBSTONES] -= 1
        self._mv_cells[pos] = e + 1
        h[H_USED_CELLS] += 1

    def copy_to(self, index: Index) -> int:
        """Copy the rows in use into a new, larger generation ``index`` (same row numbers)
        and build its hash table; return the cells used. Changes nothing here. EX held."""
        hw = self.high_water()
        new = index.arrays
        for name in ENTRY_NAMES:
            new[name][:hw] = self._arrays[name][:hw]
        live = np.flatnonzero(new["state"][:hw] != EntryState.EMPTY)
        rebuild_table(new["table"], new["key"], live, index.layout.table_shift)
        return int(live.shape[0])

    def rehash(self) -> None:
        """Rebuild the hash table from the rows in use (drops every tombstone)."""
        live = np.flatnonzero(self.state[: self.high_water()] != EntryState.EMPTY)
        rebuild_table(self.cells, self.key, live, self.shift)
        self.header[H_TOMBSTONES] = 0
        self.header[H_USED_CELLS] = live.shape[0]

    def _alloc(self) -> int:
        h = self.header
        state = self.state
        pos = int(h[H_ENTRY_HINT])
        limit = self.rows_reserved()  # the caller reserved a free row below it
        while pos < limit:
            chunk = state[pos : min(pos + 4096, limit)]
            free = np.flatnonzero(chunk == EntryState.EMPTY)
            if free.shape[0]:
                e = pos + int(free[0])
                h[H_ENTRY_HINT] = e + 1
                if e + 1 > int(h[H_ENTRY_HW]):
                    h[H_ENTRY_HW] = e + 1
                return e
            pos += chunk.shape[0]
        raise CacheError(f"memory store {self.name!r}: entry table full")  # pragma: no cover

    def add_writing(
        self,
        k0: int,
        k1: int,
        *,
        size: int,
        cls: int,
        slot: int,
        cost: float,
        ctime: float,
        atime: float,
    ) -> tuple[int, int]:
        """Take a free row for a reservation of this process (WRITING); ``(row, seq)``.

        The caller made room (bytes and rows: :meth:`reserve_rows`) and took the slot.
        """
        h = self.header
        e = self._alloc()
        seq = int(h[H_SEQ])
        h[H_SEQ] = seq + 1
        self.key[e, 0] = k0
        self.key[e, 1] = k1
        self.size[e] = size
        self.cls[e] = cls
        self.slot[e] = slot
        self.cost[e] = cost
        self.ctime[e] = ctime
        self.atime[e] = atime
        self.hits[e] = 0
        self.seq[e] = seq
        self.pid[e] = os.getpid()
        self.pstart[e] = own_start_time()
        self._mv_state[e] = EntryState.WRITING
        h[H_NBYTES] += size
        h[H_WRITING] += 1
        self.insert(e, k0, k1)
        return e, seq

    def publish(self, e: int, seq: int, now: float) -> bool:
        """WRITING -> READY for this process's reservation ``(e, seq)``; False if it was lost."""
        if (
            self._mv_state[e] != EntryState.WRITING
            or int(self.seq[e]) != seq
            or int(self.pid[e]) != os.getpid()
        ):  # pragma: no cover - only if our reservation was wrongly reclaimed
            log.error("memory store %s: a reservation was lost before publish", self.name)
            return False
        self.atime[e] = now
        self._mv_state[e] = EntryState.READY
        self.header[H_WRITING] -= 1
        self.header[H_ITEMS] += 1
        return True

    def free(self, e: int, slabs: Slabs, released: list[tuple[int, int]]) -> None:
        """Remove entry ``e`` (READY or WRITING) and free its slot; ``released`` gets it.

        Order matters for crash repair: the index cell goes first, the entry
        state next, the slot last, so every intermediate state is one the
        rebuild from the entry table handles.
        """
        h = self.header
        k0, k1 = int(self.key[e, 0]), int(self.key[e, 1])
        found, pos = self.find(k0, k1)
        if found == e:
            self._mv_cells[pos] = CELL_TOMBSTONE
            h[H_TOMBSTONES] += 1
            h[H_USED_CELLS] -= 1
        state = self._mv_state[e]
        size = int(self.size[e])
        self._mv_state[e] = EntryState.EMPTY
        h[H_NBYTES] -= size
        if state == EntryState.READY:
            h[H_ITEMS] -= 1
        else:
            h[H_WRITING] -= 1
        cls, slot = int(self.cls[e]), int(self.slot[e])
        slabs.free(cls, slot)
        h[H_ENTRY_HINT] = min(int(h[H_ENTRY_HINT]), e)
        released.append((cls, slot))

    def remove(self, entries: Iterable[int], slabs: Slabs) -> None:
        """:meth:`free` each of ``entries``, then give back their slots' pages. EX held."""
        released: list[tuple[int, int]] = []
        for e in entries:
            self.free(e, slabs, released)
        slabs.release_all(released)

    # ------------------------------------------------------------------ writers' liveness

    def writer_alive(self, e: int, cache: dict[tuple[int, int], bool]) -> bool:
        """Whether the writer of WRITING entry ``e`` may still publish it."""
        pid, start = int(self.pid[e]), int(self.pstart[e])
        if pid == os.getpid():
            # Our own reservation is alive only while a thread is copying into it; one
            # left by an error inside a critical section is reclaimed like a dead one.
            return (self.store_id, e, int(self.seq[e])) in IN_FLIGHT
        alive = cache.get((pid, start))
        if alive is None:
            alive = cache[(pid, start)] = pid_alive(pid, start)
        return alive

    def reclaim_dead_writers(self, slabs: Slabs) -> int:
        """Free WRITING entries whose writer died; return how many. Caller holds EX."""
        writing = np.flatnonzero(self.state[: self.high_water()] == EntryState.WRITING)
        cache: dict[tuple[int, int], bool] = {}
        released: list[tuple[int, int]] = []
        for e in writing.tolist():
            if not self.writer_alive(e, cache):
                self.free(e, slabs, released)
        slabs.release_all(released)
        return len(released)
