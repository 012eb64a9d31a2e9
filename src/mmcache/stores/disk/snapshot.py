"""What eviction reads: the totals record, the meta records, and victims chosen from them.

Records
    Every entry has a fixed 48-byte meta record (size, cost, ctime, atime,
    hits, seq) in the ``meta`` db; the ``info`` db holds the running totals
    (bytes, items, next seq, generation). Every change to data, meta and the
    totals happens in one write transaction, so the budget
    ``bytes <= capacity`` holds at every commit.

Damage
    Totals that are missing or impossible (negative, another count than the
    meta db's, more bytes than the data pages hold) are recounted by the next
    write and refused by reads (:class:`DamagedTotals`); a damaged meta record
    is never trusted (its entry counts by its value's length, ``verify``
    reports it, ``delete`` removes it).

Eviction cost
    Building :class:`~mmcache.policies.Residents` means reading every meta
    record: O(n). The :class:`Evictor` keeps an in-process snapshot of the meta
    columns, updated in place by this process's writes and tagged with the
    environment's ``generation`` counter. When another process has written
    meanwhile, the snapshot is still used for up to one second: victims chosen
    from it are checked against the committed meta (same key, same ``seq``)
    before they are deleted, so a stale snapshot can only pick a less ideal
    victim, never break the budget. Policies that order all residents (lru,
    fifo, lfu) also evict a small batch at a time (at least 1/256 of the
    capacity) so their sort is paid once per batch, not once per put;
    ``value`` and ``keep`` decide per entry.
"""

from __future__ import annotations

import logging
import math
import struct
import time
from dataclasses import dataclass
from typing import Any, cast

import lmdb
import numpy as np
import numpy.typing as npt

from mmcache.errors import CacheError
from mmcache.policies import (
    IntArray,
    KeepPolicy,
    LRUPolicy,
    Policy,
    Residents,
    ValuePolicy,
    validate_victims,
)
from mmcache.stores.disk.env import TOTALS_KEY, TOTALS_RECORD, EnvHandle
from mmcache.stores.disk.packs import read_value

__all__ = [
    "META_RECORD",
    "DamagedTotals",
    "Evictor",
    "MetaRecord",
    "MetaSnapshot",
    "Totals",
    "entry_size",
    "parse_meta",
]

logger = logging.getLogger(__name__)

# size, cost, ctime, atime, hits, seq: one fixed record per entry.
META_RECORD = struct.Struct("<qdddqq")
_META_DTYPE = np.dtype(
    [
        ("size", "<i8"),
        ("cost", "<f8"),
        ("ctime", "<f8"),
        ("atime", "<f8"),
        ("hits", "<i8"),
        ("seq", "<i8"),
    ]
)
#: Seconds a snapshot of the meta columns may lag behind other processes' writes.
_SNAPSHOT_MAX_AGE = 1.0
#: Fraction of the capacity that lru/fifo/lfu evict at least, per eviction.
_EVICT_BATCH_FRACTION = 1 / 256

#: The fields of a meta record, as :func:`parse_meta` returns them.
MetaRecord = tuple[int, float, float, float, int, int]


def parse_meta(raw: bytes | memoryview | None) -> MetaRecord | None:
    """The fields of a meta record, or None when it is absent or damaged.

    Damaged: not 48 bytes, or a field no put writes (a negative size, hits or
    seq; a negative or non-finite cost). Such a record is never trusted: its
    entry counts by the length of its value and ``verify`` reports it.
    """
    if raw is None or len(raw) != META_RECORD.size:
        return None
    record = cast(MetaRecord, META_RECORD.unpack(raw))
    size, cost, _ctime, _atime, hits, seq = record
    if min(size, hits, seq) < 0 or not (math.isfinite(cost) and cost >= 0):
        return None
    return record


def entry_size(txn: lmdb.Transaction[Any], h: EnvHandle, key: bytes, raw: bytes) -> int:
    """Bytes the totals count for an entry: its meta size, or its value's length if
    the record is damaged (the size the put recorded, unless the value rotted too)."""
    meta = parse_meta(raw)
    if meta is not None:
        return meta[0]
    value = read_value(txn, h, key)
    return 0 if value is None else len(value)


class DamagedTotals(CacheError):
    """The totals record is missing or impossible; a write transaction recounts it."""


@dataclass
class Totals:
    """The totals record of the info db: payload bytes, entries, the next entry's
    ``seq`` and the generation (bumped by every committed change to meta)."""

    bytes: int
    items: int
    next_seq: int
    gen: int

    @classmethod
    def read(cls, txn: lmdb.Transaction[Any], h: EnvHandle, *, pending: int = 0) -> Totals:
        """The totals, checked against what the transaction sees.

        The budget rests on them, so a record that is missing, negative, counts
        other than the meta db's entries, or more bytes than the data and pack dbs' pages
        can hold is refused (``DamagedTotals``) rather than believed; both checks
        are O(1) (LMDB keeps the counts in the database record).
        """
        raw = txn.get(TOTALS_KEY, db=h.info)
        if raw is None or len(raw) != TOTALS_RECORD.size:
            why = "missing" if raw is None else f"{len(raw)} bytes long, not {TOTALS_RECORD.size}"
        else:
            tot = cls(*TOTALS_RECORD.unpack(raw))
            items = txn.stat(h.meta)["entries"]
            room = 0
            for db in (h.data, h.packs):  # packed entries: in the packs' pages
                st = txn.stat(db)
                room += (st["leaf_pages"] + st["overflow_pages"]) * st["psize"]
            if min(tot.bytes, tot.items, tot.next_seq, tot.gen) >= 0 and (
                tot.items == items and tot.bytes <= room + pending
            ):
                return tot
            why = (
                f"impossible (bytes={tot.bytes}, items={tot.items}, next_seq={tot.next_seq}, "
                f"gen={tot.gen}; the cache holds {items} entries in {room} bytes of pages)"
            )
        raise DamagedTotals(
            f"the totals record of the disk cache at {h.path} is {why}: run "
            "`mmcache verify --repair` on its cache root (any write through mmcache recounts it)"
        )

    @classmethod
    def recount(cls, txn: lmdb.Transaction[Any], h: EnvHandle) -> Totals:
        """Totals counted from the meta db (one O(n) scan of 48-byte records), written.

        For a damaged record (see :meth:`read`); ``rebuild_totals`` is the full
        repair that also removes inconsistent entries.
        """
        raw = txn.get(TOTALS_KEY, db=h.info)
        old = (
            TOTALS_RECORD.unpack(raw)
            if raw is not None and len(raw) == TOTALS_RECORD.size
            else None
        )
        total = items = 0
        next_seq = max(old[2], 0) if old is not None else 0
        for key, rec in txn.cursor(db=h.meta):
            total += entry_size(txn, h, bytes(key), bytes(rec))
            items += 1
            meta = parse_meta(rec)
            if meta is not None:
                next_seq = max(next_seq, meta[5] + 1)
        tot = cls(total, items, next_seq, max(old[3], 0) + 1 if old is not None else 0)
        tot.write(txn, h.info)
        return tot

    def write(self, txn: lmdb.Transaction[Any], db: Any) -> None:
        txn.put(
            TOTALS_KEY, TOTALS_RECORD.pack(self.bytes, self.items, self.next_seq, self.gen), db=db
        )


class MetaSnapshot:
    """In-process copy of the meta columns, one row per entry (see "Eviction cost").

    Only touched inside write transactions, which LMDB serialises, so it needs
    no lock of its own.
    """

    def __init__(self, gen: int, keys: list[bytes], cols: npt.NDArray[Any]) -> None:
        self.gen = gen
        self.built = time.monotonic()
        self.keys: list[bytes | None] = list(keys)
        self.cols = cols
        self.live = np.ones(len(keys), dtype=bool)
        self.index = {k: i for i, k in enumerate(keys)}
        self.dead = 0

    @classmethod
    def build(cls, txn: lmdb.Transaction[Any], meta_db: Any, gen: int) -> MetaSnapshot:
        keys: list[bytes] = []
        records: list[bytes] = []
        for key, raw in txn.cursor(db=meta_db):
            if len(raw) == META_RECORD.size:  # a damaged record is verify()'s business
                keys.append(bytes(key))
                records.append(bytes(raw))
        cols = np.frombuffer(b"".join(records), dtype=_META_DTYPE)
        # The checks of parse_meta, vectorised: policies must never see a damaged row.
        good = (cols["size"] >= 0) & (cols["hits"] >= 0) & (cols["seq"] >= 0)
        good &= np.isfinite(cols["cost"]) & (cols["cost"] >= 0)
        if not good.all():
            keys = [k for k, ok in zip(keys, good.tolist(), strict=True) if ok]
        return cls(gen, keys, cols[good].copy())

    def age(self) -> float:
        return time.monotonic() - self.built

    def residents(self, exclude: bytes | None) -> tuple[Residents, IntArray]:
        live = self.live.copy()
        row = self.index.get(exclude) if exclude is not None else None
        if row is not None:
            live[row] = False
        rows = np.flatnonzero(live).astype(np.int64)
        c = self.cols[rows]
        res = Residents(
            size=np.ascontiguousarray(c["size"]),
            cost=np.ascontiguousarray(c["cost"]),
            atime=np.ascontiguousarray(c["atime"]),
            ctime=np.ascontiguousarray(c["ctime"]),
            hits=np.ascontiguousarray(c["hits"]),
            seq=np.ascontiguousarray(c["seq"]),
        )
        return res, rows

    def remove(self, key: bytes) -> None:
        row = self.index.pop(key, None)
        if row is not None:
            self.live[row] = False
            self.keys[row] = None
            self.dead += 1

    def upsert(self, key: bytes, record: MetaRecord) -> None:
        self.remove(key)
        n = len(self.keys)
        if n == self.cols.shape[0]:
            grow = max(16, n)
            self.cols = np.concatenate([self.cols, np.zeros(grow, dtype=_META_DTYPE)])
            self.live = np.concatenate([self.live, np.zeros(grow, dtype=bool)])
        self.cols[n] = record
        self.live[n] = True
        self.keys.append(key)
        self.index[key] = n
        if self.dead > max(1024, n // 2):
            self._compact()

    def touch(self, key: bytes, atime: float, hits: int) -> None:
        row = self.index.get(key)
        if row is not None:
            self.cols["atime"][row] = max(float(self.cols["atime"][row]), atime)
            self.cols["hits"][row] += hits

    def _compact(self) -> None:
        rows = np.flatnonzero(self.live)
        self.keys = [self.keys[i] for i in rows]
        self.cols = self.cols[rows].copy()
        self.live = np.ones(len(rows), dtype=bool)
        self.index = {k: i for i, k in enumerate(self.keys) if k is not None}
        self.dead = 0


class Evictor:
    """Chooses victims from a :class:`MetaSnapshot` it owns (see "Eviction cost").

    The store reports every change it commits (:meth:`added`, :meth:`removed`,
    :meth:`touched`, :meth:`bump`) so an in-sync snapshot stays in sync, and
    calls :meth:`invalidate` when a write transaction fails. Used only inside
    write transactions, which LMDB serialises, so it needs no lock of its own.
    """

    def __init__(self, policy: Policy, capacity: int) -> None:
        self._policy = policy
        # Orderings over all residents are sorted once per batch, not once per put.
        batch = not isinstance(policy, (ValuePolicy, KeepPolicy))
        self._batch_bytes = int(capacity * _EVICT_BATCH_FRACTION) if batch else 0
        self._snap: MetaSnapshot | None = None
        self._warned = False

    def invalidate(self) -> None:
        """Forget the snapshot (a failed transaction, or totals recounted)."""
        self._snap = None

    def bump(self, tot: Totals) -> None:
        """Count one committed change to meta; keep an in-sync snapshot in sync."""
        snap = self._snap
        in_sync = snap is not None and snap.gen == tot.gen
        tot.gen += 1
        if in_sync and snap is not None:
            snap.gen = tot.gen

    def added(self, key: bytes, record: MetaRecord) -> None:
        if self._snap is not None:
            self._snap.upsert(key, record)

    def removed(self, key: bytes) -> None:
        if self._snap is not None:
            self._snap.remove(key)

    def touched(self, key: bytes, atime: float, hits: int) -> None:
        if self._snap is not None:
            self._snap.touch(key, atime, hits)

    def choose(
        self,
        txn: lmdb.Transaction[Any],
        h: EnvHandle,
        tot: Totals,
        *,
        key: bytes,
        size: int,
        cost: float,
        need: int,
    ) -> list[bytes] | None:
        """Ask the policy for victims freeing ``need`` bytes, checked against committed meta.

        None: the policy refuses the newcomer ``key`` (or cannot free enough).
        """
        for attempt in range(2):
            snap = self._snap
            if snap is None or (
                snap.gen != tot.gen and (attempt > 0 or snap.age() > _SNAPSHOT_MAX_AGE)
            ):
                snap = self._snap = MetaSnapshot.build(txn, h.meta, tot.gen)
            residents, rows = snap.residents(exclude=key)
            picked: IntArray | None = None
            if self._batch_bytes > need:
                picked = self._policy.select_victims(
                    residents, size=size, cost=cost, need=self._batch_bytes
                )
            if picked is None:
                picked = self._policy.select_victims(residents, size=size, cost=cost, need=need)
            check = validate_victims(self._policy, residents, picked, need=need)
            if check.rows is None:
                if check.problem is not None and not self._warned:
                    self._warned = True
                    logger.error("%s; refusing (logged once)", check.problem)
                return None
            picked = check.rows
            victims: list[bytes] = []
            freed = 0
            valid = True
            for i in picked.tolist():
                row = int(rows[i])
                victim = snap.keys[row]
                meta = parse_meta(txn.get(victim, db=h.meta)) if victim is not None else None
                if victim is None or meta is None:
                    valid = False
                    break
                vsize, _cost, _ctime, _atime, _hits, vseq = meta
                if vseq != int(snap.cols["seq"][row]):
                    valid = False
                    break
                victims.append(victim)
                freed += vsize
            if valid and freed >= need:
                return victims
            if valid and snap.gen == tot.gen:
                if not self._warned:
                    self._warned = True
                    logger.error(
                        "policy %r freed %d of the %d bytes needed; refusing (logged once)",
                        self._policy,
                        freed,
                        need,
                    )
                return None
            self._snap = None  # stale: rebuild it and ask again
        return None

    def over_budget(
        self, txn: lmdb.Transaction[Any], h: EnvHandle, tot: Totals, *, capacity: int
    ) -> list[tuple[bytes, bytes]] | None:
        """Victims (key, meta record) that bring ``tot.bytes`` down to ``capacity``.

        For a directory that holds more than a smaller capacity allows. None
        when nothing needs to (or can) go; ``value``/``keep`` never evict for
        nothing, so they fall back to least-recently-used order here.
        """
        excess = tot.bytes - capacity
        if excess <= 0:
            return None
        snap = self._snap = MetaSnapshot.build(txn, h.meta, tot.gen)
        residents, rows = snap.residents(exclude=None)
        picked = self._policy.select_victims(residents, size=0, cost=0.0, need=excess)
        if picked is None:
            picked = LRUPolicy().select_victims(residents, size=0, cost=0.0, need=excess)
        rows_ok = validate_victims(self._policy, residents, picked, need=0).rows
        if rows_ok is None:
            return None
        victims: list[tuple[bytes, bytes]] = []
        for i in rows_ok.tolist():
            victim = snap.keys[int(rows[i])]
            raw = txn.get(victim, db=h.meta) if victim is not None else None
            if victim is not None and raw is not None:
                victims.append((victim, raw))
        return victims
