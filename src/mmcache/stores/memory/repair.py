"""Crash repair and the consistency check of a memory store: pure functions over its arrays.

The entry table is the truth; every other shared structure is derived from it: the
byte and item counts and hints in the header, the hash table, the slot bitmaps and
the size-class counts. A process that dies inside the exclusive lock leaves its pid
in the header (see ``session.py``); whoever next takes the lock calls
:func:`rebuild`, which derives all of it again from the entry table. :func:`check`
verifies the same invariants without changing anything.

Both take the arrays (an :class:`~mmcache.stores.memory.table.EntryTable` and the
:class:`~mmcache.stores.memory.slabs.Slabs`) and the byte budget, never the store:
the lock session calls repair through a callback (:func:`repair_locked`, which also
counts and logs what was dropped), so nothing here takes a lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mmcache.stores.memory.layout import (
    C_CREATED,
    C_HINT,
    C_MARKED,
    C_SLOTS,
    C_USED,
    H_ENTRY_HINT,
    H_ENTRY_HW,
    H_ITEMS,
    H_NBYTES,
    H_SEQ,
    H_TOMBSTONES,
    H_USED_CELLS,
    H_WRITING,
    Count,
    EntryState,
)
from mmcache.stores.memory.slabs import Damaged, Slabs
from mmcache.stores.memory.table import EntryTable, lookup_many, rebuild_table

if TYPE_CHECKING:  # the session calls repair_locked back; it never imports this module
    from mmcache.stores.memory.session import Session

__all__ = ["Repaired", "check", "rebuild", "repair_locked"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Repaired:
    """What :func:`rebuild` dropped: ``corrupt`` entries, ``reclaimed`` half-written ones
    of dead writers, and why a data segment could not be mapped (``damaged``), if one
    could not."""

    corrupt: int
    reclaimed: int
    damaged: str | None


def rebuild(table: EntryTable, slabs: Slabs, *, capacity: int) -> Repaired:
    """Rebuild every derived structure from the entry table. Caller holds EX.

    Entries that are inconsistent (unknown state, size and class that do
    not match, a slot out of range or claimed twice, a duplicate key) are
    dropped and counted as ``corrupt``; half-written entries of dead
    writers are dropped and counted as ``reclaimed``. Never serves a byte
    it cannot vouch for.
    """
    h = table.header
    classes = slabs.classes
    state = table.state[: table.rows_reserved()]  # no later row was ever written
    unknown = state > EntryState.READY
    corrupt = int(unknown.sum())
    state[unknown] = EntryState.EMPTY
    live = np.flatnonzero(state != EntryState.EMPTY)
    size = table.size[live]
    cls = table.cls[live].astype(np.int64)
    slot = table.slot[live]
    n_classes = classes.shape[0]
    ok = (size >= 0) & (size <= capacity) & (cls >= 0) & (cls < n_classes)
    safe_cls = np.where(ok, cls, 0)
    expected = np.searchsorted(slabs.sizes, np.maximum(size, 0), side="left")
    ok &= expected == cls
    marked = np.minimum(classes[safe_cls, C_MARKED], classes[safe_cls, C_SLOTS])
    ok &= (slot >= 0) & (slot < marked)  # a slot beyond them was never allocated
    ok &= classes[safe_cls, C_CREATED] != 0
    # A class whose data segment cannot be mapped (truncated, removed) holds nothing.
    damaged: dict[int, str] = {}
    for c in slabs.created():
        try:
            slabs.get(c)
        except Damaged as exc:
            damaged[c] = str(exc)
    ok &= ~np.isin(safe_cls, list(damaged))
    corrupt += int((~ok).sum())
    # A slot claimed by two entries holds at most one of them: trust neither.
    slot_id = safe_cls * (1 << 40) + np.where(ok, slot, 0)
    _, inverse, counts = np.unique(slot_id, return_inverse=True, return_counts=True)
    shared_slot = ok & (counts[inverse] > 1)
    corrupt += int(shared_slot.sum())
    ok &= ~shared_slot
    # Duplicate keys: keep the most recent admission.
    keys = table.key[live]
    order = np.lexsort((-table.seq[live], keys[:, 1], keys[:, 0]))
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
        if not table.writer_alive(int(live[i]), cache):
            ok[i] = False
            reclaimed += 1
    state[live[~ok]] = EntryState.EMPTY
    live = live[ok]
    kept_state = state[live]
    h[H_NBYTES] = int(table.size[live].sum())
    h[H_ITEMS] = int((kept_state == EntryState.READY).sum())
    h[H_WRITING] = int((kept_state == EntryState.WRITING).sum())
    h[H_ENTRY_HW] = int(live[-1]) + 1 if live.shape[0] else 0
    h[H_ENTRY_HINT] = 0
    if live.shape[0]:
        h[H_SEQ] = max(int(h[H_SEQ]), int(table.seq[live].max()) + 1)
    rebuild_table(table.cells, table.key, live, table.shift)
    h[H_USED_CELLS] = live.shape[0]
    h[H_TOMBSTONES] = 0
    live_cls = table.cls[live]
    for c in slabs.created():
        if c in damaged:
            continue
        slab = slabs.get(c)
        # Zeroed in place, not punched: its pages must stay allocated (a full
        # /dev/shm would kill the next process touching a punched one).
        slab.bitmap[: slabs.marked(c)] = 0
        slots = table.slot[live[live_cls == c]]
        slab.bitmap[slots] = 1
        classes[c, C_USED] = slots.shape[0]
        classes[c, C_HINT] = 0
    return Repaired(corrupt, reclaimed, next(iter(damaged.values()), None))


def repair_locked(session: Session, reason: str) -> None:
    """The session's repair callback: :func:`rebuild`, then count what it dropped. EX held.

    A plain function, not a method of the store: the session keeps it, and must not
    keep the store alive (see :class:`~mmcache.stores.memory.session.Session`).
    """
    log.warning("memory store %s: repairing shared state (%s)", session.name, reason)
    done = rebuild(session.table, session.slabs, capacity=session.capacity)
    if done.damaged is not None:
        session.fail(done.damaged)
    session.count(Count.REPAIRS)
    if done.corrupt:
        session.count(Count.CORRUPT, done.corrupt)
    if done.reclaimed:
        session.count(Count.RECLAIMED, done.reclaimed)


def check(table: EntryTable, slabs: Slabs, *, capacity: int) -> list[str]:
    """The shared invariants that do not hold (empty: consistent). Caller holds the lock.

    Checks the byte and item counts against the entry table, the budget,
    that every entry is reachable through the hash table, and that the slot
    bitmaps match the entries.
    """
    problems: list[str] = []
    h = table.header
    state = table.state[: table.rows_reserved()]  # no later row was ever written
    live = np.flatnonzero(state != EntryState.EMPTY)
    if live.shape[0] and int(live[-1]) >= int(h[H_ENTRY_HW]):
        problems.append(f"entry {int(live[-1])} beyond the high-water mark")
    if bool((state > EntryState.READY).any()):
        problems.append("entries in an unknown state")
    held = int(table.size[live].sum())
    counts = {
        "bytes": (int(h[H_NBYTES]), held),
        "items": (int(h[H_ITEMS]), int((state[live] == EntryState.READY).sum())),
        "writing": (int(h[H_WRITING]), int((state[live] == EntryState.WRITING).sum())),
        "index cells": (int(h[H_USED_CELLS]), int((table.cells > 0).sum())),
        "tombstones": (int(h[H_TOMBSTONES]), int((table.cells < 0).sum())),
    }
    for what, (header, actual) in counts.items():
        if header != actual:
            problems.append(f"{what}: header says {header}, entries say {actual}")
    if held > capacity:
        problems.append(f"budget exceeded: {held} B held > {capacity} B")
    found = lookup_many(table.cells, table.key, table.key[live], table.shift)
    if not np.array_equal(found, live):
        problems.append(f"{int((found != live).sum())} entries unreachable by key")
    cls = table.cls[live].astype(np.int64)
    expected = np.searchsorted(slabs.sizes, table.size[live], side="left")
    if not np.array_equal(cls, expected):
        problems.append("entries in the wrong size class")
    for c in slabs.created():
        slab = slabs.get(c)
        slots = table.slot[live[cls == c]]
        used = int(slabs.classes[c, C_USED])
        if slots.shape[0] and int(slots.max()) >= slabs.marked(c):
            problems.append(f"class {c}: entries in slots beyond the bitmap's reserved pages")
            continue
        marked = int(np.count_nonzero(slab.bitmap[: slabs.marked(c)]))
        if not used == marked == slots.shape[0] == np.unique(slots).shape[0]:
            problems.append(f"class {c}: {used} used, {marked} marked, {slots.shape[0]} entries")
        elif slots.shape[0] and not bool(slab.bitmap[slots].all()):
            problems.append(f"class {c}: entries in slots marked free")
    return problems
