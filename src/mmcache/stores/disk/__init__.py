"""The persistent disk tier: one LMDB environment per cache directory (:class:`DiskStore`).

Why LMDB
    The disk tier must survive crashes (a write is published atomically or not
    at all), keep a hard byte budget, serve many reader processes (every
    DataLoader worker and rank of a node) and read large values without extra
    copies. LMDB does all of that in a mature, small C library: copy-on-write
    B-trees with MVCC give atomic multi-key transactions and a database that
    always opens after ``kill -9`` or a power cut (committed transactions are
    kept, the one in flight vanishes); readers never block writers and run in
    parallel across processes; values are read straight from the memory map
    (:meth:`DiskStore.view` is zero-copy, :meth:`DiskStore.get` copies once).

Rejected alternatives
    * SQLite BLOBs (python-diskcache's index): a read copies the value through
      SQLite's page cache and then again into Python, and its write path (WAL,
      journal) is slower for 100 KB values; large values end up as separate
      files anyway.
    * One file per entry: an inode and three syscalls per entry, directory churn
      under eviction, and no atomic way to keep a byte total: a crash between
      writing a file and updating the total leaves them disagreeing.
    * A home-made append-only file: would have to re-implement crash recovery,
      free-space reuse and multi-process locking, which LMDB already has.

Map size
    LMDB reserves address space up front (``map_size``); the file grows as
    needed up to it, so it also bounds disk usage. The default is
    ``2 * capacity + 64 MiB``: copy-on-write keeps the old pages of the last
    transactions until no reader needs them, every value larger than a page
    occupies whole pages (up to 4 KiB lost per value), and the freelist can be
    too fragmented for a long value, which then goes to the end of the file.
    A put that still hits the limit (or a full disk) fails cleanly: the
    transaction aborts, ``put`` returns False, it is counted as refused and
    logged once. The file never shrinks: :meth:`DiskStore.compact`.

The package, by what each module owns: :mod:`.env` the LMDB environment
(per-process handles, fork, transactions), :mod:`.reserve` the disk blocks of
its files, :mod:`.counters` the node-wide stats file, :mod:`.snapshot` the
totals and meta records and the victims chosen from them, :mod:`.writes` what a
write transaction changes (and the buffered reads it records),
:mod:`.maintenance` verify, repair and compaction, :mod:`.gather` the batch
gathers of the training process (zero-copy, verified) and their read-ahead,
:mod:`.formed` a tier whose values are stored in a compact form, :mod:`.packs` the
small entries of a write transaction stored together in one LMDB value (~1.0x
their size on disk instead of ~2x). The store never deletes
files (:meth:`DiskStore.compact` renames a copy over ``data.mdb``). Every
method is thread-safe and process-safe, except that the buffer lent by
:meth:`DiskStore.view` is valid only inside its ``with`` block.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import lmdb

from mmcache.checks import check_int
from mmcache.errors import CacheError, ConfigError
from mmcache.policies import FIFOPolicy, KeepPolicy, Policy, ValuePolicy, get_policy
from mmcache.rootfiles import make_dir
from mmcache.stats import TierStats
from mmcache.stores.base import EntryInfo, Store, check_key, dir_mode
from mmcache.stores.disk.counters import Counter, CounterFile
from mmcache.stores.disk.env import (
    DISK_FORMAT_VERSION,
    MAP_OVERHEAD,
    EnvHandle,
    Txn,
    acquire_handle,
    cache_error,
    is_failed_write,
    release_handle,
)
from mmcache.stores.disk.gather import DiskGather
from mmcache.stores.disk.maintenance import (
    CompactReport,
    SalvageReport,
    compact_copy,
    compact_in_place,
    rebuild_totals_txn,
    salvage_in_place,
    tree_problem,
    verify_entries,
)
from mmcache.stores.disk.packs import read_value
from mmcache.stores.disk.snapshot import DamagedTotals, Evictor, Totals, parse_meta
from mmcache.stores.disk.writes import EntryWriter, PendingReads, WriteOp, as_buffer, check_cost
from mmcache.units import MAX_SIZE, MiB, format_size, parse_size

__all__ = ["DISK_FORMAT_VERSION", "CompactReport", "DiskStore"]

_R = TypeVar("_R")

logger = logging.getLogger(__name__)

#: Payload bytes per write transaction of put_many (see its docstring).
_PUT_MANY_TXN_BYTES = 1 * MiB


class DiskStore(DiskGather, Store):
    """Persistent byte store in an LMDB environment at ``path``, with a hard byte budget.

    ``capacity`` is the budget for payload bytes (an int or e.g. ``"50GiB"``),
    ``policy`` the admission/eviction policy (name or instance), ``clock`` the
    clock of access times: wall time by default, because entries outlive
    processes and reboots. ``map_size`` bounds the file (default
    ``2 * capacity + 64 MiB``, see the module docstring); ``mode`` the
    permissions of the files it creates (the directory gets the matching
    ``x`` bits: 0600 -> 0700). ``readonly=True`` opens an existing cache
    without changing it: ``put`` returns False, ``delete`` and ``expire`` raise.

    Every method is thread-safe and process-safe (see :mod:`.env` for
    fork). Failures of the storage raise :class:`~mmcache.errors.CacheError`,
    except a full map or disk, which makes ``put`` return False.

    >>> import tempfile
    >>> with DiskStore(tempfile.mkdtemp(), capacity="1MiB", policy="lru") as store:
    ...     store.put(bytes(16), b"hello")
    ...     store.get(bytes(16))
    True
    b'hello'
    """

    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int | str,
        policy: str | Policy = "value",
        readonly: bool = False,
        clock: Callable[[], float] = time.time,
        map_size: int | None = None,
        mode: int = 0o600,
    ) -> None:
        self._path = os.path.abspath(os.fspath(path))
        self._capacity = parse_size(capacity, name="capacity")
        self._policy = get_policy(policy)
        self._readonly = bool(readonly)
        self._clock = clock
        self._map_size_arg = map_size
        self._mode = int(mode)
        if map_size is not None:
            try:
                check_int("map_size (bytes)", map_size, minimum=1)
            except ConfigError as exc:  # a CacheError, as it always was
                raise CacheError(str(exc)) from exc
        # Bounded by MAX_SIZE: a larger map is an OverflowError in LMDB's binding, a
        # bound it never reaches is a clear "Cannot allocate memory" CacheError at open.
        self._map_size = (
            map_size if map_size is not None else min(2 * self._capacity + MAP_OVERHEAD, MAX_SIZE)
        )
        # Only policies that look at reads pay for recording them.
        self._track = not self._readonly and not isinstance(
            self._policy, (ValuePolicy, KeepPolicy, FIFOPolicy)
        )
        self._pending = PendingReads()
        self._evict = Evictor(self._policy, self._capacity)
        self._writer = EntryWriter(
            capacity=self._capacity, clock=clock, evict=self._evict, pending=self._pending
        )
        self._logged: set[str] = set()
        self._closed = False
        if not self._readonly:
            try:  # the exact mode, keeping a shared root's setgid bit (G15), never a link
                make_dir(self._path, dir_mode(self._mode))
            except OSError as exc:
                raise CacheError(f"cannot create the disk cache at {self._path}: {exc}") from exc
        handle = acquire_handle(
            self._path, readonly=self._readonly, map_size=self._map_size, mode=self._mode
        )
        self._handle: EnvHandle | None = handle
        # A store dropped without close() still releases the environment.
        self._finalizer = weakref.finalize(self, release_handle, handle)
        self._pid = os.getpid()
        self._counters = CounterFile(self._path, mode=self._mode, create=not self._readonly)
        # data.mdb, lock.mdb and stats.i64 got their mode where they were created
        # (reserve_files, CounterFile: rootfiles.open_file, never through a link).
        try:
            if not self._readonly:
                self._trim_to_capacity()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing

    def __repr__(self) -> str:
        return (
            f"DiskStore({self._path!r}, capacity={self._capacity}, "
            f"policy={self._policy.name!r}, readonly={self._readonly})"
        )

    def __getstate__(self) -> dict[str, Any]:
        """Configuration only: unpickling opens the directory again (spawn workers)."""
        return {
            "path": self._path,
            "capacity": self._capacity,
            "policy": self._policy,
            "readonly": self._readonly,
            "clock": self._clock,
            "map_size": self._map_size_arg,
            "mode": self._mode,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    @property
    def path(self) -> str:
        """The cache directory."""
        return self._path

    @property
    def map_size(self) -> int:
        """The LMDB map size this store asked for (bytes; bounds the file size)."""
        return self._map_size

    @property
    def policy(self) -> Policy:
        """The admission/eviction policy."""
        return self._policy

    def _env(self) -> EnvHandle:
        if self._pid != os.getpid():
            self._after_fork()
        handle = self._handle
        if handle is None or self._closed:
            raise CacheError(f"the disk store at {self._path} is closed")
        return handle

    def _after_fork(self) -> None:
        # The parent's pending reads are the parent's to record; the inherited
        # stats descriptor would share the parent's flock. Another parent thread
        # may have held either lock at fork time: replace, never acquire them.
        self._pending.forget()
        self._counters.forget()
        self._counters = CounterFile(self._path, mode=self._mode, create=not self._readonly)
        self._pid = os.getpid()

    def _log_once(self, tag: str, level: int, msg: str, *args: object) -> None:
        if tag not in self._logged:
            self._logged.add(tag)
            logger.log(level, msg, *args)

    def _count_reads(self, keys: Sequence[bytes], found: Sequence[bool]) -> None:
        hits = sum(found)
        self._counters.add((Counter.HITS, hits), (Counter.MISSES, len(found) - hits))
        if not (hits and self._track):
            return
        if self._pending.record(keys, found, self._clock()):
            self.flush()

    # ------------------------------------------------------------------ reads

    def get(self, key: bytes) -> bytes | None:
        """Return a copy of the value, or None. Counts a hit or a miss. Thread/process-safe."""
        check_key(key)
        h = self._env()
        with Txn(h, buffers=True) as txn:
            buf = read_value(txn, h, key)
            value = None if buf is None else bytes(buf)
        self._count_reads((key,), (value is not None,))
        return value

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Copies of several values (None where absent), read in one transaction.

        Counts one hit or miss per key. Thread/process-safe.
        """
        for key in keys:
            check_key(key)
        h = self._env()
        values: list[bytes | None] = []
        with Txn(h, buffers=True) as txn:
            seen: dict[int, Any] = {}
            for key in keys:
                buf = read_value(txn, h, key, seen)
                values.append(None if buf is None else bytes(buf))
        self._count_reads(keys, [v is not None for v in values])
        return values

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        """Lend a zero-copy read-only buffer into the memory map (None if absent).

        Valid only inside the ``with`` block, which holds a read transaction (a
        long block keeps old pages from being reused, and delays a ``fork()``
        of another thread). Counts a hit or a miss. Thread/process-safe.
        """
        check_key(key)
        h = self._env()
        found: bool | None = None
        try:
            with h.in_flight:
                try:
                    env = h.require()
                    with env.begin(buffers=True) as txn:
                        value = read_value(txn, h, key)
                        found = value is not None
                        yield value
                except lmdb.Error as exc:
                    raise cache_error(self._path, exc) from exc
        finally:
            if found is not None:
                self._count_reads((key,), (found,))

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is present (no hit or miss counted). Thread/process-safe."""
        check_key(key)
        h = self._env()
        with Txn(h) as txn:
            return txn.get(key, db=h.meta) is not None

    def info(self, key: bytes) -> EntryInfo | None:
        """Metadata of ``key``, including reads not yet written. Thread/process-safe."""
        check_key(key)
        h = self._env()
        with Txn(h) as txn:
            raw: bytes | None = txn.get(key, db=h.meta)
        if raw is None:
            return None
        meta = parse_meta(raw)
        if meta is None:
            raise CacheError(
                f"the meta record of entry {key.hex()} in the disk cache at {self._path} is "
                f"damaged ({len(raw)} bytes): run `mmcache verify --repair` to remove the entry"
            )
        size, cost, ctime, atime, hits, _seq = meta
        atime, hits = self._pending.merged(key, atime, hits)
        return EntryInfo(size=size, cost=cost, ctime=ctime, atime=atime, hits=hits)

    def keys(self) -> Iterator[bytes]:
        """The keys present, read in one transaction. Thread/process-safe."""
        h = self._env()
        with Txn(h) as txn:
            keys: list[bytes] = list(txn.cursor(db=h.meta).iternext(values=False))
        return iter(keys)

    def _totals(self) -> Totals:
        h = self._env()
        with Txn(h) as txn:
            return Totals.read(txn, h)

    def nbytes(self) -> int:
        """Payload bytes held now, by all processes. Thread/process-safe."""
        return self._totals().bytes

    def __len__(self) -> int:
        return self._totals().items

    def capacity(self) -> int:
        """The hard byte budget of this store."""
        return self._capacity

    def stats(self) -> TierStats:
        """Counters of every process and run that used this directory (see :mod:`.counters`)."""
        tot = self._totals()
        return TierStats(
            **self._counters.counts(),
            bytes=tot.bytes,
            budget=self._capacity,
            items=tot.items,
        )

    def reset_stats(self) -> None:
        """Zero the event counters (hits ... corrupt) for every process of the node."""
        self._env()
        self._counters.reset()

    # ------------------------------------------------------------------ writes

    def put(
        self, key: bytes, value: bytes | memoryview, *, cost: float = 0.0, ctime: float = 0.0
    ) -> bool:
        """Store ``value`` if the policy admits it; its victims go in the same transaction.

        Returns False (counted as refused) when the policy refuses, the value is
        larger than the capacity, the store is read-only, or the map or the disk
        is full. A refused put also removes an older value of ``key``, which is
        never served again. Thread/process-safe.
        """
        return self.put_many([(key, value, cost, ctime)])[0]

    def put_many(
        self, entries: Iterable[tuple[bytes, bytes | memoryview, float, float]]
    ) -> list[bool]:
        """``put`` each ``(key, value, cost, ctime)``, about 1 MiB per write transaction.

        Fewer commits (fsyncs) than one ``put`` each. Larger transactions are
        slower again (LMDB buffers every dirty page until the commit), hence the
        1 MiB groups; each entry is atomic, the batch is not. Returns what ``put`` would return for
        each entry, in order. Thread/process-safe.
        """
        items = [(check_key(k), as_buffer(v), check_cost(c), float(t)) for k, v, c, t in entries]
        results: list[bool] = []
        start = 0
        while start < len(items):
            stop, nbytes = start + 1, items[start][1].nbytes
            while stop < len(items) and nbytes + items[stop][1].nbytes <= _PUT_MANY_TXN_BYTES:
                nbytes += items[stop][1].nbytes
                stop += 1
            results += self._put_group(items[start:stop])
            start = stop
        return results

    def _put_group(self, items: list[tuple[bytes, memoryview, float, float]]) -> list[bool]:
        """Put ``items`` in one write transaction (one at a time if the map or disk fills)."""
        h = self._env()
        if self._readonly:
            self._log_once("readonly", logging.INFO, "%s is read-only: puts are refused", self)
            self._counters.add((Counter.PUTS, len(items)), (Counter.REFUSED, len(items)))
            return [False] * len(items)
        for _key, buf, _cost, _ctime in items:
            if buf.nbytes > self._capacity:
                self._log_once(
                    "oversize",
                    logging.WARNING,
                    "an entry of %s is larger than the disk budget of %s: refused (logged once)",
                    format_size(buf.nbytes),
                    format_size(self._capacity),
                )
        try:
            results = self._writer.put_group(h, items)
        except CacheError as exc:
            if not is_failed_write(exc.__cause__):
                raise
            if len(items) > 1:  # keep as many as fit
                return [self._put_group([item])[0] for item in items]
            self._log_once(
                "space",
                logging.WARNING,
                "the disk cache %s is full (%s): puts are refused until space is freed "
                "(map_size=%s; logged once)",
                self._path,
                exc.__cause__,
                format_size(self._map_size),
            )
            self._counters.add((Counter.PUTS, 1), (Counter.REFUSED, 1))
            return [False]
        admitted = sum(ok for ok, _evicted in results)
        self._counters.add(
            (Counter.PUTS, len(results)),
            (Counter.ADMITTED, admitted),
            (Counter.REFUSED, len(results) - admitted),
            (Counter.EVICTIONS, sum(evicted for _ok, evicted in results)),
        )
        return [ok for ok, _evicted in results]

    def _trim_to_capacity(self) -> None:
        """Evict down to the budget when the directory holds more (a smaller capacity)."""
        with contextlib.suppress(DamagedTotals):  # else the write below recounts them
            if self._totals().bytes <= self._capacity:
                return
        evicted = self._write(self._writer.trim)
        if evicted:
            logger.info(
                "%s: evicted %d entries to fit the capacity of %s",
                self._path,
                evicted,
                format_size(self._capacity),
            )
            self._counters.add((Counter.EVICTIONS, evicted))

    def _write(self, op: WriteOp) -> int:
        """Run ``op`` in a write transaction that also records pending reads."""
        if self._readonly:
            raise CacheError(f"{self} is read-only")
        return self._writer.run(self._env(), op)

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` (also a value whose meta record is damaged or missing); return
        whether it was present. Thread/process-safe.

        Raises CacheError on a read-only store.
        """
        check_key(key)
        self._pending.drop(key)
        return bool(self._write(lambda txn, h, tot: self._writer.remove(txn, h, tot, key)))

    def discard(self, key: bytes, *, why: Literal["corrupt", "expired"]) -> bool:
        """Delete ``key`` and count it as ``corrupt`` or ``expired``."""
        removed = self.delete(key)
        if removed:
            self._counters.add((Counter.CORRUPT if why == "corrupt" else Counter.EXPIRED, 1))
        return removed

    def expire(self, before: float) -> int:
        """Remove entries whose ``ctime < before``; return how many. Scans the meta db.

        Thread/process-safe; raises CacheError on a read-only store.
        """
        before = float(before)
        removed = self._write(lambda txn, h, tot: self._writer.expire(txn, h, tot, before))
        if removed:
            self._counters.add((Counter.EXPIRED, removed))
        return removed

    def flush(self) -> None:
        """Write the buffered read times and counts (lru, lfu) now. Thread/process-safe."""
        if self._readonly or self._closed:
            return
        if self._pending:
            self._write(lambda txn, h, tot: 0)

    # ------------------------------------------------------------------ maintenance

    def verify(self, check: Callable[[bytes], bool]) -> list[bytes]:
        """Keys whose value fails ``check`` or disagrees with its meta record.

        ``check`` receives each value (the Cache passes the codec's checksum
        verifier); an exception counts as a failure. LMDB does not checksum its
        pages, so this is how silent corruption is found. Bad entries are
        counted as ``corrupt`` but not deleted: the caller decides. Reads in one
        transaction; thread/process-safe.
        """
        bad = verify_entries(self._env(), check)
        if bad:
            self._counters.add((Counter.CORRUPT, len(bad)))
        return bad

    def rebuild_totals(self) -> tuple[int, int]:
        """Recompute the totals from the data and meta dbs; return ``(bytes, items)``.

        Entries whose meta record is missing or disagrees with the value's size
        are removed: they cannot be trusted. For repair after page corruption
        (LMDB does not checksum its pages). Thread/process-safe.
        """

        def op(txn: lmdb.Transaction[Any], h: EnvHandle, tot: Totals) -> int:
            rebuild_totals_txn(txn, h, tot)
            self._evict.invalidate()
            return 0

        self._write(op)
        tot = self._totals()
        return tot.bytes, tot.items

    def compact_copy(self, dest: str | os.PathLike[str]) -> None:
        """Write a compacted copy of the environment into the new directory ``dest``.

        LMDB files never shrink; :meth:`compact` swaps such a copy in place.
        """
        compact_copy(self._env(), dest, mode=self._mode)

    def compact(self) -> CompactReport:
        """Replace the file by a compacted copy; only while no other process has it open.

        LMDB files never shrink (freed pages are reused, the file keeps its
        largest size): this gives the free pages back to the file system
        (``mmcache gc --compact``). Raises CacheError, with the cache unchanged,
        while another process or another store of this process has the
        directory open (see :func:`.maintenance.compact_in_place`). The store
        stays open; other threads must not use it meanwhile.
        """
        if self._readonly:
            raise CacheError(f"{self} is read-only")
        self.flush()
        return self._replace_file("compact", compact_in_place)

    def tree_problem(self) -> str | None:
        """Why the B-tree cannot be walked (a damaged page), or None. Reads the keys
        only; thread/process-safe (see :func:`.maintenance.tree_problem`)."""
        return tree_problem(self._env())

    def salvage(self) -> SalvageReport:
        """Replace a damaged file by a fresh one of the entries still readable; only
        while no other process has it open (as :meth:`compact`, whose swap it uses).
        The store stays open; other threads must not use it meanwhile."""
        if self._readonly:
            raise CacheError(f"{self} is read-only")
        return self._replace_file("repair", salvage_in_place)

    def _replace_file(self, what: str, replace: Callable[..., _R]) -> _R:
        """Run ``replace(path, mode=, map_size=)`` (a swap of ``data.mdb``, see
        :mod:`.maintenance`) with this store's environment released, then reopen it."""
        handle = self._env()
        self._handle = None
        self._finalizer()  # this store stops using the environment; the last user closes it
        try:
            if handle.env is not None:
                raise CacheError(
                    f"cannot {what} the disk cache at {self._path}: it is still in use in "
                    "this process (another store on it, or a view() block); close that first"
                )
            return replace(self._path, mode=self._mode, map_size=self._map_size)
        finally:
            self._evict.invalidate()
            self._handle = acquire_handle(
                self._path, readonly=False, map_size=self._map_size, mode=self._mode
            )
            self._finalizer = weakref.finalize(self, release_handle, self._handle)

    def close(self) -> None:
        """Write pending reads and release the environment. Idempotent; the data persists."""
        if self._closed:
            return
        try:
            if self._pid == os.getpid() and self._pending and not self._readonly:
                try:
                    self.flush()
                except Exception as exc:
                    logger.warning("could not record pending reads of %s: %s", self._path, exc)
        finally:
            self._closed = True
            self._handle = None
            self._counters.close()
            self._finalizer()
