"""Write-behind: admit produced entries to a :class:`TieredStore` without making anyone wait.

A DataLoader worker that decoded a miss hands the encoded entry to the
:class:`WriteBehind` of its process and returns the sample at once. The entry
goes into the front tiers right away (the node-shared memory tier: a fast copy
that every process sees at once, so the next epoch's planner finds it), and a
background thread writes the queued entries to the deferred tiers (the disk
tier), grouping them: one commit, so one ``fsync``, per about 1 MiB instead of
per sample. It is the tiered store's own write split in two
(:meth:`TieredStore.put_front`, then :meth:`TieredStore.put_many` with
``skip_front``), not a second copy of the tier walk.

Promotions ride along: a hit of the shared tier, below the disk tier, is promoted into
the disk tier by this thread, in the same groups (:meth:`WriteBehind.promote`), not by a
commit per hit in the reading process.

Reads see this process's pending writes (:meth:`WriteBehind.pending`): a worker
asked for a sample it produced a moment ago, whose deferred commit has not
happened yet (a loaded machine, the next epoch starting at once), serves it from
the queue instead of producing it again.

A cache is allowed to lose a few pending writes: the entries are simply
produced again next time. Nothing half-written is ever visible: each entry is
committed whole or not at all by the tiers.

A flush ends with :meth:`TieredStore.commit`: what was written becomes visible to
other processes and nodes (the shared tier's open pack is committed).

Process lifetime: the queue is flushed when the process exits normally (a
``multiprocessing`` finalizer, which runs before a DataLoader worker's
``os._exit``, unlike ``atexit``) and when :func:`flush_all` is called; a killed
process loses its queue, which the cache tolerates by design.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing import util

from mmcache.codec import read_header
from mmcache.stores.base import Store
from mmcache.stores.tiered import Row, TieredStore

__all__ = [
    "GROUP_BYTES",
    "MAX_PENDING",
    "WriteBehind",
    "flush_all",
    "flush_for",
    "writer_for",
    "writer_if_any",
]

logger = logging.getLogger(__name__)

#: Entries waiting to be written, per process: bounds the memory they hold
#: (64 x 150 KB samples = ~10 MiB); a full queue makes the producer write itself.
MAX_PENDING = 64
#: Write at most this many bytes per group (one deferred-tier commit per group).
GROUP_BYTES = 1 << 20
#: A group waits up to this long for more entries: a worker producing a tiny sample per
#: millisecond then commits some dozens at once, not one each (one LMDB commit for
#: them, and the disk tier packs small entries of one commit together, 2.2x -> 1.3x of
#: their size); the entries wait in the front tier and :meth:`WriteBehind.pending`.
LINGER_S = 0.05
#: ... but no longer than this after the last entry came: a producer that pauses (an epoch's
#: end, a slow sample) has its entries committed at once, so the next epoch finds them.
LINGER_GAP_S = 0.005

#: ``tag(fingerprint, keys)``: told the fingerprint of what is submitted (Cache.tag).
TagFn = Callable[[str, list[bytes]], None]

#: A queued write: a row, where it goes (None: every deferred tier, a produced
#: entry; else the tiers a hit is promoted into, :meth:`WriteBehind.promote`) and the
#: fingerprint that produced it (its key is logged with the group, :meth:`WriteBehind._log`).
Item = tuple[Row, tuple[Store, ...] | None, str | None]


class WriteBehind:
    """A background writer for one :class:`TieredStore` in one process. Thread-safe.

    ``tag``, when given, is called with the ``tag`` of each submitted entry (the
    cache logs which pipeline fingerprint wrote which key).
    """

    def __init__(
        self, store: TieredStore, *, max_pending: int = MAX_PENDING, tag: TagFn | None = None
    ) -> None:
        self.store = store
        self._tag = tag
        self._queue: queue.Queue[Item | None] = queue.Queue(max_pending)
        # Entries queued and not yet committed, by key (the rows the queue holds: no copy).
        self._pending: dict[bytes, Row] = {}
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="mmcache-write-behind", daemon=True)
        self._pid = os.getpid()
        self._closed = False
        self._thread.start()

    def submit(self, key: bytes, raw: bytes, cost: float, tag: str | None = None) -> bool:
        """Admit a codec-encoded entry: to the front tiers now, to the deferred ones later.

        The front put is quick (a copy into shared memory, ~0.1 ms for 150 KB);
        the deferred commit is what waits. When the queue is full the deferred
        write happens here, which bounds the memory pending entries hold.
        Returns whether a front tier admitted the entry.
        """
        ctime = read_header(raw).ctime
        store = self.store
        admitted = store.put_front(key, raw, cost=cost, ctime=ctime)
        row = (key, raw, cost, ctime)
        if not store.deferred or self._closed:
            self._log([(row, tag)])
            if store.deferred:
                store.put_many([row], skip_front=True)
            return admitted
        with self._pending_lock:
            self._pending[key] = row
        try:
            self._queue.put_nowait((row, None, tag))
        except queue.Full:
            self._done([row])
            self._log([(row, tag)])
            store.put_many([row], skip_front=True)
        return admitted

    def _log(self, tagged: list[tuple[Row, str | None]]) -> None:
        """Tell ``tag`` the keys of produced rows, one call per fingerprint: the key log is
        one append per call (~14 us), so a group's keys go in one, from the writer's
        thread, before the group's deferred commit."""
        if self._tag is None:
            return
        by_tag: dict[str, list[bytes]] = {}
        for row, tag in tagged:
            if tag is not None:
                by_tag.setdefault(tag, []).append(row[0])
        for tag, keys in by_tag.items():
            self._tag(tag, keys)

    def promote(self, stores: tuple[Store, ...], row: Row) -> None:
        """Promote a hit into ``stores`` (deferred tiers above the tier that served it: the
        disk tier, for a shared hit) from the background thread, grouped like the
        writes (one commit per group, not one per hit); the faster tiers have it
        already. A full queue or a flushed writer writes it here. (The ``later`` of
        :meth:`TieredStore.lookup`.)"""
        if self._closed:
            self.store.put_into(stores, [row])
            return
        try:
            self._queue.put_nowait((row, stores, None))
        except queue.Full:
            self.store.put_into(stores, [row])

    def pending(self, key: bytes) -> bytes | None:
        """The encoded entry of ``key`` if it is queued here and not yet committed, else None."""
        with self._pending_lock:
            row = self._pending.get(key)
        return None if row is None else row[1]

    def _done(self, rows: list[Row]) -> None:
        with self._pending_lock:
            for row in rows:
                if self._pending.get(row[0]) is row:
                    del self._pending[row[0]]

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            group = [item]
            size = len(item[0][1])
            stop = False
            deadline = time.monotonic() + LINGER_S
            while size < GROUP_BYTES:
                wait = min(LINGER_GAP_S, deadline - time.monotonic())
                try:
                    nxt = self._queue.get(timeout=max(wait, 0.0))
                except queue.Empty:
                    break  # the producer paused (an epoch's end): commit what came
                if nxt is None:
                    stop = True
                    break
                group.append(nxt)
                size += len(nxt[0][1])
            self._write(group)
            if stop:
                return

    def _write(self, group: list[Item]) -> None:
        """Write one group: the produced rows to every deferred tier, the promotions to
        their tiers."""
        produced = [row for row, where, _ in group if where is None]
        promoted: dict[tuple[Store, ...], list[Row]] = {}
        for row, where, _ in group:
            if where is not None:
                promoted.setdefault(where, []).append(row)
        try:
            self._log([(row, tag) for row, where, tag in group if where is None])
            if produced:
                self.store.put_many(produced, skip_front=True)
            for stores, rows in promoted.items():
                self.store.put_into(stores, rows)
        except Exception:  # a cache write must never kill the worker
            logger.exception("write-behind: %d cache puts failed", len(group))
        finally:
            self._done(produced)

    def flush(self, timeout: float | None = 30.0) -> None:
        """Write everything queued and stop the thread (later submits write directly)."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            logger.warning(
                "write-behind: queue still full after %ss; pending puts dropped", timeout
            )
            return
        self._thread.join(timeout)
        # What was written is published too (the shared tier's open pack is committed):
        # a flush is the end of an epoch, of a worker or of a warm-up.
        self.store.commit()


# One writer per owner (a Cache) per process; the owner is kept to tell a new object
# reusing a freed id from the one the writer was made for.
_WRITERS: dict[int, tuple[object, WriteBehind]] = {}
_LOCK = threading.RLock()  # re-entrant: a GC finalizer may flush mid-call


def writer_for(owner: object, make: Callable[[], WriteBehind]) -> WriteBehind:
    """This process's writer for ``owner``, made by ``make()`` on first use (and again
    in a forked child, whose inherited writer has no thread)."""
    with _LOCK:
        held = _WRITERS.get(id(owner))
        fresh = held is None or held[0] is not owner or held[1]._pid != os.getpid()
        if held is None or fresh:
            writer = make()
            _WRITERS[id(owner)] = (owner, writer)
        else:
            writer = held[1]
    if fresh:
        # Outside the lock: creating the finalizer can run the garbage collector,
        # whose finalizers may call flush_all() (which takes the lock).
        # It runs at a normal exit of this process, DataLoader workers included.
        util.Finalize(writer, writer.flush, exitpriority=10)
    return writer


def writer_if_any(owner: object) -> WriteBehind | None:
    """This process's writer for ``owner`` if one was made (never makes one)."""
    with _LOCK:
        held = _WRITERS.get(id(owner))
    if held is None or held[0] is not owner or held[1]._pid != os.getpid():
        return None
    return held[1]


def flush_for(owner: object) -> None:
    """Flush this process's writer for ``owner``, if it made one (a later write makes a
    new one): what ``Cache.commit`` and ``Cache.close`` run first."""
    with _LOCK:
        held = _WRITERS.get(id(owner))
        if held is None or held[0] is not owner or held[1]._pid != os.getpid():
            return
        del _WRITERS[id(owner)]
    held[1].flush()


def flush_all() -> None:
    """Flush every writer of this process (the loader calls it at the end of an epoch)."""
    with _LOCK:
        writers = [w for _, w in _WRITERS.values()]
        _WRITERS.clear()
    for w in writers:
        w.flush()
