"""The write path of a memory store: admission (the policy's victims), reservation, copy, publish.

A ``put`` reserves under ``LOCK_EX`` (choose a slot, evict via the policy, entry ->
``WRITING`` with the writer's pid), writes the payload with ``pwrite`` *without*
the lock, and publishes under ``LOCK_EX`` (-> ``READY``). Payloads up to
``INLINE_COPY_MAX`` are written inside one exclusive section instead (two lock
round trips cost more than the copy). Nothing half-written is ever served: an
entry becomes ``READY`` only after its whole payload was copied by a process that
then took the lock again. A ``WRITING`` entry is invisible to readers; if its
writer died it is reclaimed (at open, when a reservation finds no room, and in
``gc``).

When the store is full, the policy's decision is prepared under ``LOCK_SH`` (a
snapshot of the residents) and the policy runs with no lock held, so refusals, the
common case of a full cache, never block readers: the result is a
:class:`Proposal` of victims, re-validated under ``LOCK_EX`` (their ``seq`` must not
have changed). After ``PROPOSAL_ATTEMPTS`` stale proposals the policy decides under
the exclusive lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from mmcache.policies import KeepPolicy, Policy, Residents, validate_victims
from mmcache.stores.base import is_no_space
from mmcache.stores.memory import shm
from mmcache.stores.memory.layout import MAX_INDEX_CAPACITY, Count, EntryState
from mmcache.stores.memory.session import Session
from mmcache.stores.memory.shm import LockTimeout
from mmcache.stores.memory.slabs import Damaged, Slab
from mmcache.stores.memory.table import IN_FLIGHT, split_key

__all__ = ["INLINE_COPY_MAX", "PROPOSAL_ATTEMPTS", "Proposal", "Writer", "as_flat_bytes"]

log = logging.getLogger(__name__)

#: Payloads up to this size are copied inside the reservation's exclusive section.
INLINE_COPY_MAX = 64 * 1024
#: Optimistic victim proposals before the policy decides under the exclusive lock.
PROPOSAL_ATTEMPTS = 3


def as_flat_bytes(value: bytes | memoryview) -> memoryview:
    """A flat byte view of any buffer (copied only if it is not contiguous)."""
    mv = memoryview(value)
    if not mv.c_contiguous:
        return memoryview(mv.tobytes())
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


@dataclass(frozen=True)
class Proposal:
    """Victims the policy chose from a snapshot: entry rows and their ``seq`` then."""

    entries: npt.NDArray[np.int64]
    seqs: npt.NDArray[np.int64]


@dataclass(frozen=True)
class _Reserved:
    """A WRITING entry of this process: its row, ``seq``, slot, and the store's id."""

    entry: int
    seq: int
    slab: Slab
    slot: int
    store_id: tuple[str, int]


class _Outcome(IntEnum):
    REFUSED = 0  # the policy (or a full index) said no
    BUSY = 1  # another live process is writing the same key right now
    NEED_VICTIMS = 2  # full: ask the policy (outside the exclusive lock) and retry
    NO_SPACE = 3  # /dev/shm has no room for the metadata the entry needs


class Writer:
    """The puts of one store object, over its :class:`~mmcache.stores.memory.session.Session`.

    ``policy`` chooses victims when the store is full; ``clock`` stamps ``atime``.
    Thread-safe and process-safe (every shared change is under the store lock).
    """

    def __init__(self, session: Session, policy: Policy, clock: Callable[[], float]) -> None:
        self._session = session
        self._policy = policy
        self._clock = clock

    def put(self, key: bytes, value: bytes | memoryview, *, cost: float, ctime: float) -> bool:
        """``MemoryStore.put`` after the key was checked."""
        s = self._session
        src = as_flat_bytes(value)
        s.ensure_process()
        s.count(Count.PUTS)
        try:
            return self._put(key, src, cost=cost, ctime=ctime)
        except (LockTimeout, Damaged) as exc:
            s.count(Count.REFUSED)
            s.data_path_failed(exc, "puts are refused")
            return False

    def _put(self, key: bytes, src: memoryview, *, cost: float, ctime: float) -> bool:
        s = self._session
        size = src.nbytes
        k0, k1 = split_key(key)
        if size > s.capacity:
            s.count(Count.REFUSED)
            if s.warn_once("oversize"):
                log.warning(
                    "memory store %s: refused an entry of %d B, larger than the whole capacity"
                    " of %d B (raise the memory budget to cache such entries)",
                    s.name, size, s.capacity,
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
            with s.exclusive(s.wait()):
                return s.table.publish(res.entry, res.seq, self._clock())
        finally:
            IN_FLIGHT.discard((res.store_id, res.entry, res.seq))

    def _reserve(
        self, k0: int, k1: int, *, size: int, cost: float, ctime: float, src: memoryview
    ) -> _Reserved | bool:
        """Reserve an entry (evicting as the policy says), or finish a small put outright.

        Returns a :class:`_Reserved` the caller must fill and publish (payloads
        over ``INLINE_COPY_MAX``), or the put's result.
        """
        s = self._session
        inline = size <= INLINE_COPY_MAX
        counted = False  # whether the refused put was counted as admitted already
        proposal: Proposal | None = None
        for attempt in range(PROPOSAL_ATTEMPTS + 1):
            with s.exclusive(s.wait()):
                res = self._reserve_locked(
                    k0=k0,
                    k1=k1,
                    size=size,
                    cost=cost,
                    ctime=ctime,
                    proposal=proposal,
                    decide=attempt == PROPOSAL_ATTEMPTS,
                )
                if isinstance(res, _Reserved):
                    if not inline:
                        IN_FLIGHT.add((res.store_id, res.entry, res.seq))
                        return res
                    try:
                        res.slab.write(res.slot, src)
                    except OSError as exc:
                        if not is_no_space(exc):
                            raise
                        s.table.remove([res.entry], s.slabs)
                        res, counted = _Outcome.NO_SPACE, True
                    else:
                        return s.table.publish(res.entry, res.seq, self._clock())
            if res == _Outcome.NO_SPACE:
                self._refuse_no_space(admitted=counted)
                return False
            if res != _Outcome.NEED_VICTIMS:
                return False
            proposal, had_old = self._propose(k0, k1, size, cost)
            if proposal is None:
                s.count(Count.REFUSED)
                if had_old:
                    self._drop_stale(k0, k1)
                return False
        return False  # pragma: no cover - the last attempt decides under the lock

    def _drop_stale(self, k0: int, k1: int) -> None:
        """Remove the published value of a key whose new value was refused."""
        s = self._session
        with s.exclusive(s.wait()):
            e, _ = s.table.find(k0, k1)
            if e >= 0 and s.table.is_ready(e):
                s.table.remove([e], s.slabs)

    def _abort(self, res: _Reserved) -> None:
        s = self._session
        try:
            with s.exclusive(s.wait()):
                e = res.entry
                if s.table.is_writing(e) and int(s.table.seq[e]) == res.seq:
                    s.table.remove([e], s.slabs)
        finally:
            IN_FLIGHT.discard((res.store_id, res.entry, res.seq))

    def _warn_index_full(self, size: int) -> None:
        """Once per process: the index is full while bytes are free, and cannot grow
        (it is at its maximum, ``memory_entries``, or /dev/shm has no room)."""
        s = self._session
        if not s.warn_once("index"):
            return
        held, cap = s.table.nbytes(), s.capacity
        log.warning(
            "memory store %s: its index is full (%d entries, its maximum) with only %d of"
            " %d B held (entries of about %d B): the rest of the budget stays unused. Raise"
            " it: Cache(memory_entries=%d) or MemoryStore(index_capacity=...)",
            s.name, s.entries, held, cap, size,
            min(max(cap // max(size, 1), s.entries * 2), MAX_INDEX_CAPACITY),
        )  # fmt: skip

    def _refuse_no_space(self, *, admitted: bool) -> None:
        """Count a put refused because /dev/shm is full (it may have been counted admitted)."""
        s = self._session
        if admitted:
            s.count(Count.ADMITTED, -1)
        s.count(Count.REFUSED)
        if s.warn_once("enospc"):
            log.warning(
                "memory store %s: %s is full; refusing puts until space is freed (in"
                " Docker, raise --shm-size or lower the memory budget)",
                s.name, shm.SHM_DIR,
            )  # fmt: skip

    def _reserve_pages_locked(self, cls: int) -> bool:
        """Allocate what a new entry of class ``cls`` will touch through the mappings:
        the class's bitmap up to a free slot and the next entry row. False if /dev/shm is
        full. EX held."""
        s = self._session
        try:
            s.slabs.reserve_slot(cls)
            # The new entry takes the lowest free row, at most the high-water mark.
            s.table.reserve_rows(s.table.high_water() + 1)
        except OSError as exc:
            if not is_no_space(exc):
                raise
            return False
        return True

    def _reserve_locked(
        self,
        *,
        k0: int,
        k1: int,
        size: int,
        cost: float,
        ctime: float,
        proposal: Proposal | None,
        decide: bool,
    ) -> _Reserved | _Outcome:
        """Make room (evicting ``proposal`` if still valid) and reserve a WRITING entry. EX held."""
        s = self._session
        t, slabs = s.table, s.slabs
        old, _ = t.find(k0, k1)
        cache: dict[tuple[int, int], bool] = {}
        if old >= 0 and t.is_writing(old):
            if t.writer_alive(old, cache):
                return _Outcome.BUSY
            t.remove([old], slabs)
            s.count(Count.RECLAIMED)
            old = -1
        old_size = int(t.size[old]) if old >= 0 else 0
        released: list[tuple[int, int]] = []

        def shortfall() -> tuple[int, bool]:
            need = t.nbytes() + size - old_size - s.capacity
            full = old < 0 and t.items() + t.writing() >= s.entries
            return need, full

        need, full = shortfall()
        if (need > 0 or full) and t.writing() and s.reclaim_locked():
            need, full = shortfall()
        if full and need <= 0 and s.grow_index_locked():
            # The index was full while the bytes were not: a larger generation replaced
            # it (every row kept its number, so ``old`` is still right).
            t = s.table
            need, full = shortfall()
        if full and need <= 0 and t.nbytes() < s.capacity // 2:
            self._warn_index_full(size)
        victims: npt.NDArray[np.int64] | None = None
        if need > 0 or full:
            victims = None if proposal is None else self._still_valid(proposal, old, need)
            if victims is None:
                if not decide:
                    return _Outcome.NEED_VICTIMS
                # Optimistic proposals kept going stale: decide under the lock this time.
                if isinstance(self._policy, KeepPolicy):  # never evicts: no residents
                    rows, residents = np.zeros(0, np.int64), Residents.from_columns(size=[])
                else:
                    rows, residents = t.residents(old, need=need)
                victims = self._ask_policy(
                    rows, residents, size=size, cost=cost, need=need, full=full
                )
                if victims is None:
                    s.count(Count.REFUSED)
                    if old >= 0:  # the new value is refused: the old one is stale
                        t.free(old, slabs, released)
                        slabs.release_all(released)
                    return _Outcome.REFUSED
        cls = slabs.class_of(size)
        # Admitted: now make sure /dev/shm has the pages the entry's metadata needs,
        # before evicting anything for it (a full /dev/shm must not cost the victims).
        if not self._reserve_pages_locked(cls):
            if old >= 0:  # the new value is refused: the old one is stale
                t.free(old, slabs, released)
                slabs.release_all(released)
            return _Outcome.NO_SPACE
        if victims is not None:
            for v in victims.tolist():
                t.free(v, slabs, released)
            s.count(Count.EVICTIONS, len(victims))
        if old >= 0:
            t.free(old, slabs, released)
        slab, slot = slabs.alloc(cls)
        e, seq = t.add_writing(
            k0, k1, size=size, cls=cls, slot=slot, cost=cost, ctime=ctime, atime=self._clock()
        )
        slabs.release_all(released)
        s.count(Count.ADMITTED)
        return _Reserved(e, seq, slab, slot, t.store_id)

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
        check = validate_victims(self._policy, residents, chosen, need=need, entries=int(full))
        if check.rows is None:
            s = self._session
            if check.problem is not None and s.warn_once("policy"):
                log.warning("memory store %s: %s; refusing the entry", s.name, check.problem)
            return None
        return rows[check.rows]

    def _propose(self, k0: int, k1: int, size: int, cost: float) -> tuple[Proposal | None, bool]:
        """Ask the policy for victims from a snapshot taken under the shared lock.

        The policy itself runs with no lock held, so a refusal costs readers
        nothing. Returns the proposal to validate, or None (refuse), and whether
        the key had a published value.
        """
        s = self._session
        with s.shared(s.wait()):
            t = s.table
            old = t.find(k0, k1)[0]
            if old >= 0 and not t.is_ready(old):
                old = -1
            old_size = int(t.size[old]) if old >= 0 else 0
            need = t.nbytes() + size - old_size - s.capacity
            full = old < 0 and t.items() + t.writing() >= s.entries
            if need <= 0 and not full:
                return Proposal(np.zeros(0, np.int64), np.zeros(0, np.int64)), old >= 0
            if isinstance(self._policy, KeepPolicy):  # never evicts: refused unread
                return None, old >= 0
            rows, residents = t.residents(old, need=need)
        victims = self._ask_policy(rows, residents, size=size, cost=cost, need=need, full=full)
        if victims is None:
            return None, old >= 0
        return Proposal(victims, residents.seq[np.searchsorted(rows, victims)]), old >= 0

    def _still_valid(self, proposal: Proposal, old: int, need: int) -> npt.NDArray[np.int64] | None:
        """The proposed victims if they are all still there and still free enough. EX held."""
        t = self._session.table
        victims, seqs = proposal.entries, proposal.seqs
        if victims.shape[0] == 0 or bool((victims == old).any()):
            return None
        still = (t.state[victims] == EntryState.READY) & (t.seq[victims] == seqs)
        if not still.all() or int(t.size[victims].sum()) < need:
            return None
        return victims
