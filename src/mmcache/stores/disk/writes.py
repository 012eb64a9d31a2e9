"""What the disk tier's write transactions write: entries, victims, totals, buffered reads.

Every change to data, meta and the totals happens in one write transaction,
so the budget ``bytes <= capacity`` holds at every commit. :class:`EntryWriter`
makes those changes inside a transaction the store opened; it keeps the
totals, the :class:`PendingReads` and the :class:`~.snapshot.Evictor`'s
snapshot consistent with what it writes.

What LRU means on disk
    Recording a read's time and count needs a write. Reads are therefore
    buffered in-process (:class:`PendingReads`) and written with this
    process's next write transaction (a put, delete or expire), when 4096
    distinct keys are pending, by ``DiskStore.flush`` and on
    ``DiskStore.close``. Within one process eviction order is exact (pending
    reads are applied before victims are chosen); reads by other processes
    count once they have flushed. Only the policies that look at reads (lru,
    lfu and custom ones) pay for this; ``value``, ``keep`` and ``fifo`` do not
    record reads, and ``info().atime`` then stays the admission time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias

import lmdb

from mmcache.stores.disk.env import EnvHandle, Txn
from mmcache.stores.disk.packs import PACK_MAX_ENTRY, Packer
from mmcache.stores.disk.snapshot import (
    META_RECORD,
    DamagedTotals,
    Evictor,
    Totals,
    entry_size,
    parse_meta,
)

__all__ = ["EntryWriter", "PendingReads", "WriteOp", "as_buffer", "check_cost"]

logger = logging.getLogger(__name__)

#: What runs inside a write transaction (:meth:`EntryWriter.run`): returns a count.
WriteOp: TypeAlias = "Callable[[lmdb.Transaction[Any], EnvHandle, Totals], int]"
#: Distinct keys whose reads are buffered before a write transaction records them.
_ACCESS_FLUSH_MAX = 4096


def as_buffer(value: bytes | memoryview) -> memoryview:
    """A put's value as a flat byte view (no copy); TypeError/ValueError otherwise."""
    if isinstance(value, str):
        raise TypeError("store values are bytes-like, got str")
    view = memoryview(value)
    if not view.contiguous:
        raise ValueError("store values must be contiguous buffers")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


def check_cost(cost: float) -> float:
    """A put's miss cost in seconds: finite and >= 0 (ValueError otherwise)."""
    cost = float(cost)
    if not math.isfinite(cost) or cost < 0:
        raise ValueError(f"cost must be a finite number of seconds >= 0, got {cost!r}")
    return cost


class PendingReads:
    """Read times and counts of this process not yet written into the meta records.

    Thread-safe. After fork the child calls :meth:`forget`: the parent's
    reads are the parent's to record, and another parent thread may have held
    the lock at fork time.
    """

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._reads: dict[bytes, list[float]] = {}  # key -> [last read time, reads]

    def record(self, keys: Sequence[bytes], found: Sequence[bool], now: float) -> bool:
        """Note a read at ``now`` of each key found; True when it is time to flush."""
        with self._mu:
            pending = self._reads
            for key, ok in zip(keys, found, strict=True):
                if not ok:
                    continue
                rec = pending.get(key)
                if rec is None:
                    pending[key] = [now, 1.0]
                else:
                    rec[0] = now
                    rec[1] += 1.0
            return len(pending) >= _ACCESS_FLUSH_MAX

    def take(self) -> dict[bytes, list[float]]:
        """Every pending read, which the caller now writes; none are left."""
        with self._mu:
            pending, self._reads = self._reads, {}
        return pending

    def drop(self, key: bytes) -> None:
        with self._mu:
            self._reads.pop(key, None)

    def merged(self, key: bytes, atime: float, hits: int) -> tuple[float, int]:
        """``(atime, hits)`` of a meta record with this process's pending reads added."""
        with self._mu:
            rec = self._reads.get(key)
            if rec is not None:
                atime = max(atime, rec[0])
                hits += int(rec[1])
        return atime, hits

    def __bool__(self) -> bool:
        with self._mu:
            return bool(self._reads)

    def forget(self) -> None:
        """Drop the parent's reads in a forked child, never taking the inherited lock."""
        self._mu = threading.Lock()
        self._reads = {}


class EntryWriter:
    """Runs the disk tier's write transactions: puts, removals, expiry, trimming.

    Holds the state every write transaction must keep consistent (the
    evictor's snapshot and the pending reads) and the budget; the store gives
    it the environment handle of each call. Write transactions are serialised
    by LMDB, so it needs no lock of its own.
    """

    def __init__(
        self,
        *,
        capacity: int,
        clock: Callable[[], float],
        evict: Evictor,
        pending: PendingReads,
    ) -> None:
        self._capacity = capacity
        self._clock = clock
        self._evict = evict
        self._pending = pending
        # The packer of the write transaction in progress (LMDB runs one at a time).
        self._packer: Packer | None = None

    @contextlib.contextmanager
    def _txn(self, h: EnvHandle) -> Iterator[lmdb.Transaction[Any]]:
        """A write transaction with its :class:`~.packs.Packer`, flushed before the commit."""
        try:
            with Txn(h, write=True) as txn:
                self._packer = Packer(txn, h)
                try:
                    yield txn
                    self._packer.flush()
                finally:
                    self._packer = None
        except BaseException:
            self._evict.invalidate()
            raise

    def packer(self, txn: lmdb.Transaction[Any], h: EnvHandle) -> Packer:
        """The packer of the transaction in progress (one of its own for a transaction
        not opened here: then nothing is pending, and removals need no flush)."""
        return self._packer if self._packer is not None else Packer(txn, h)

    def run(self, h: EnvHandle, op: WriteOp) -> int:
        """Run ``op`` in a write transaction that also records pending reads; write the
        totals if ``op`` changed them."""
        with self._txn(h) as txn:
            tot, gen0 = self.begin(txn, h)
            result = op(txn, h, tot)
            if tot.gen != gen0:
                tot.write(txn, h.info)
            return result

    def put_group(
        self, h: EnvHandle, items: Sequence[tuple[bytes, memoryview, float, float]]
    ) -> list[tuple[bool, int]]:
        """:meth:`put` each ``(key, buf, cost, ctime)`` in one write transaction.

        A full map or disk raises CacheError (``is_failed_write(exc.__cause__)``)
        and nothing of the group is written.
        """
        with self._txn(h) as txn:
            put = self.put
            return [put(txn, h, key=k, buf=b, cost=c, ctime=t) for k, b, c, t in items]

    def begin(self, txn: lmdb.Transaction[Any], h: EnvHandle) -> tuple[Totals, int]:
        """The totals as read (their ``gen`` before this transaction's changes), once
        the pending reads are written.

        A damaged totals record is recounted here, not refused: recounting is
        safe (writers are serialised) and keeps the budget exact; the read-only
        paths (``nbytes``, ``stats``) raise instead.
        """
        try:
            # Entries a packer holds until the commit are counted, not yet in pages.
            tot = Totals.read(txn, h, pending=self.packer(txn, h).pending_bytes)
        except DamagedTotals as exc:
            logger.warning("%s; recounting it from the entries", exc)
            self._evict.invalidate()
            tot = Totals.recount(txn, h)
        gen0 = tot.gen
        pending = self._pending.take()
        if pending:
            for key, (atime, hits) in pending.items():
                meta = parse_meta(txn.get(key, db=h.meta))
                if meta is None:  # gone, or damaged: verify's business
                    continue
                size, cost, ctime, old_atime, old_hits, seq = meta
                new_atime = max(old_atime, atime)
                record = META_RECORD.pack(size, cost, ctime, new_atime, old_hits + int(hits), seq)
                txn.put(key, record, db=h.meta)
                self._evict.touched(key, new_atime, int(hits))
            self._evict.bump(tot)
        return tot, gen0

    def put(
        self,
        txn: lmdb.Transaction[Any],
        h: EnvHandle,
        *,
        key: bytes,
        buf: memoryview,
        cost: float,
        ctime: float,
    ) -> tuple[bool, int]:
        """Admit ``buf`` under ``key`` and evict its victims: ``(admitted, evicted)``.

        A refused put also removes an older value of ``key``, never served again.
        """
        tot, gen0 = self.begin(txn, h)
        capacity = self._capacity
        size = buf.nbytes
        old = txn.get(key, db=h.meta)
        used = tot.bytes - (entry_size(txn, h, key, old) if old is not None else 0)
        victims: list[bytes] | None = []
        if size > capacity:
            victims = None
        elif size > capacity - used:
            need = size - (capacity - used)
            victims = self._evict.choose(txn, h, tot, key=key, size=size, cost=cost, need=need)
        if victims is None:
            # Refused: an older value of the key is stale now, so it goes too.
            if old is not None:
                self.delete(txn, h, tot, key, old)
                self._evict.bump(tot)
            if tot.gen != gen0:
                tot.write(txn, h.info)
            return False, 0
        for victim in victims:
            raw = txn.get(victim, db=h.meta)
            if raw is not None:
                self.delete(txn, h, tot, victim, raw)
        packer = self.packer(txn, h)
        if old is not None:
            self.delete(txn, h, tot, key, old)
        else:  # a value without its meta record (damage) must not shadow the new one
            packer.remove(key)
        record = (size, cost, ctime, self._clock(), 0, tot.next_seq)
        if size <= PACK_MAX_ENTRY and self._packer is not None:
            packer.add(key, buf)
        else:
            txn.put(key, buf, db=h.data)
        txn.put(key, META_RECORD.pack(*record), db=h.meta)
        self._evict.added(key, record)
        tot.next_seq += 1
        tot.bytes += size
        tot.items += 1
        self._evict.bump(tot)
        tot.write(txn, h.info)
        return True, len(victims)

    def delete(
        self, txn: lmdb.Transaction[Any], h: EnvHandle, tot: Totals, key: bytes, raw: bytes
    ) -> None:
        """Remove the entry ``key`` whose meta record is ``raw``, from the totals too
        (the caller bumps the generation once for all it removed)."""
        tot.bytes -= entry_size(txn, h, key, raw)
        self.packer(txn, h).remove(key)
        txn.delete(key, db=h.meta)
        tot.items -= 1
        self._evict.removed(key)

    def remove(self, txn: lmdb.Transaction[Any], h: EnvHandle, tot: Totals, key: bytes) -> int:
        """Delete ``key``, also a value whose meta record is missing; 1 if it was there."""
        raw = txn.get(key, db=h.meta)
        if raw is None:  # a value without its meta record (verify reports it) or nothing
            return int(self.packer(txn, h).remove(key))
        self.delete(txn, h, tot, key, raw)
        self._evict.bump(tot)
        return 1

    def expire(self, txn: lmdb.Transaction[Any], h: EnvHandle, tot: Totals, before: float) -> int:
        """Delete every entry with ``ctime < before`` (a scan of the meta db); how many."""
        old: list[tuple[bytes, bytes]] = []
        for key, raw in txn.cursor(db=h.meta):
            meta = parse_meta(raw)
            if meta is not None and meta[2] < before:
                old.append((bytes(key), bytes(raw)))
        for key, raw in old:
            self.delete(txn, h, tot, key, raw)
        if old:
            self._evict.bump(tot)
        return len(old)

    def trim(self, txn: lmdb.Transaction[Any], h: EnvHandle, tot: Totals) -> int:
        """Evict down to the budget (a directory filled under a larger one); how many."""
        victims = self._evict.over_budget(txn, h, tot, capacity=self._capacity)
        if victims is None:
            return 0
        for victim, raw in victims:
            self.delete(txn, h, tot, victim, raw)
        self._evict.bump(tot)
        return len(victims)
