"""The persistent disk tier: one LMDB environment per cache directory.

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

Layout
    ``path/`` holds LMDB's ``data.mdb`` and ``lock.mdb`` and a 128-byte
    ``stats.i64`` counters file. Inside the environment there are three named
    databases: ``data`` (key -> value bytes), ``meta`` (key -> a fixed 48-byte
    record: size, cost, ctime, atime, hits, seq) and ``info`` (format version
    and the running totals: bytes, items, next seq, generation). Every change
    to data, meta and the totals happens in one write transaction, so the budget
    ``bytes <= capacity`` holds at every commit. The store never deletes files.

Damage
    A ``data.mdb`` shorter than its last page (an interrupted copy) is refused
    at open: reading past its end would kill the process with SIGBUS. Totals
    that are missing or impossible (negative, another count than the meta db's,
    more bytes than the data pages hold) are recounted by the next write and
    refused by reads; a damaged meta record is never trusted (its entry counts
    by its value's length, ``verify`` reports it, ``delete`` removes it).

Map size
    LMDB reserves address space up front (``map_size``); the file grows as
    needed up to it, so it also bounds disk usage. The default is
    ``2 * capacity + 64 MiB``: copy-on-write keeps the old pages of the last
    transactions until no reader needs them, every value larger than a page
    occupies whole pages (up to 4 KiB lost per value), and the freelist can be
    too fragmented for a long value, which then goes to the end of the file.
    Twice the payload covers that with room to spare; the 64 MiB covers the
    B-tree pages of small caches. A put that still hits the limit (or a full
    disk) fails cleanly: the transaction aborts, ``put`` returns False, it is
    counted as refused and logged once.

Eviction cost
    Building :class:`~mmcache.policies.Residents` means reading every meta
    record: O(n). The store keeps an in-process snapshot of the meta columns,
    updated in place by its own writes and tagged with the environment's
    ``generation`` counter. When another process has written meanwhile, the
    snapshot is still used for up to one second: victims chosen from it are
    checked against the committed meta (same key, same ``seq``) before they are
    deleted, so a stale snapshot can only pick a less ideal victim, never break
    the budget. Policies that order all residents (lru, fifo, lfu) also evict a
    small batch at a time (at least 1/256 of the capacity) so their sort is paid
    once per batch, not once per put; ``value`` and ``keep`` decide per entry.

What LRU means on disk
    Recording a read's time and count needs a write. Reads are therefore
    buffered in-process and written with this process's next write transaction
    (a put, delete or expire), when 4096 distinct keys are pending, by
    :meth:`DiskStore.flush` and on :meth:`DiskStore.close`. Within one process
    eviction order is exact (pending reads are applied before victims are
    chosen); reads by other processes count once they have flushed. Only the
    policies that look at reads (lru, lfu and custom ones) pay for this;
    ``value``, ``keep`` and ``fifo`` do not record reads, and ``info().atime``
    then stays the admission time.

Statistics
    hits, misses, puts, admitted, refused, evictions, expired and corrupt are
    cumulative over every process and run that used the directory: they live in
    ``stats.i64`` (eight int64 counters) and each update takes an ``flock`` for
    about a microsecond; bytes and items come from the transactional totals.
    Take differences between two :meth:`DiskStore.stats` calls for per-epoch
    rates, or call :meth:`DiskStore.reset_stats`. Where the file cannot be
    written (a read-only cache root) the counters are per-process.

Processes, fork and pickling
    Several processes may open the same directory. LMDB forbids using an
    environment across ``fork()`` and py-lmdb refuses to open the same files
    twice in one process, so a forked child can neither keep the parent's
    handle nor open a second one while it exists. The store therefore closes
    its environment just before any ``os.fork()`` (after the operations in
    flight on other threads finish) and reopens it in the parent right after;
    the child opens its own on first use. A fork from inside a ``view()`` block
    cannot close it: the child then refuses to use the store (CacheError) and
    the parent is unaffected. Pickling keeps only the configuration; unpickling
    (spawn workers) opens the directory again. Objects of one process that open
    the same directory share one environment.

    When another process with a larger ``map_size`` grew the file beyond this
    process's map, the next transaction waits for this process's others to end
    and adopts the file's size (LMDB's ``MDB_MAP_RESIZED``); inside a ``view()``
    block that cannot happen and the call raises CacheError.

Durability and speed
    Each commit is fsynced once (``sync=True, metasync=False``): a power cut
    can lose the last transaction but never corrupts the B-tree. With 150 KB
    values on a local disk one ``put`` (one commit) runs at about 3,000/s;
    :meth:`DiskStore.put_many` groups about 1 MiB per commit for about twice
    that. :meth:`DiskStore.get_many` copies as fast as numpy copies the same
    bytes; :meth:`DiskStore.view_many` lends zero-copy buffers to collate a
    batch with a single copy.

Thread and process safety
    Every method is thread-safe and process-safe, except that the buffers lent
    by :meth:`DiskStore.view` and :meth:`DiskStore.view_many` are valid only
    inside their ``with`` block.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import math
import mmap
import os
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import lmdb
import numpy as np
import numpy.typing as npt

from mmcache.errors import CacheError
from mmcache.policies import (
    FIFOPolicy,
    IntArray,
    KeepPolicy,
    LRUPolicy,
    Policy,
    Residents,
    ValuePolicy,
    get_policy,
)
from mmcache.stats import TierStats
from mmcache.stores.base import EntryInfo, Store, check_key, dir_mode
from mmcache.units import MiB, format_size, parse_size

__all__ = ["DISK_FORMAT_VERSION", "DiskStore"]

logger = logging.getLogger(__name__)

#: (major, minor) of the on-disk layout. A different major refuses to open.
DISK_FORMAT_VERSION = (1, 0)

_FORMAT = struct.Struct("<8sHH")
_MAGIC = b"MMCDISK\x00"
# size, cost, ctime, atime, hits, seq: one fixed record per entry.
_META = struct.Struct("<qdddqq")
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
# bytes, items, next seq, generation (bumped by every committed change to meta).
_TOTALS = struct.Struct("<qqqq")
_K_FORMAT = b"format"
_K_TOTALS = b"totals"
_DB_NAMES = (b"data", b"meta", b"info")

#: Headroom of the default map size over the payload budget (see module docstring).
MAP_OVERHEAD = 64 * MiB
#: Reader slots (64 bytes each in lock.mdb): several per worker and rank.
_MAX_READERS = 1024
#: Size LMDB gives lock.mdb: a 192-byte header holding the first of the 64-byte reader
#: slots (mdb_env_setup_locks: ``(max_readers - 1) * 64 + 192``; measured: 8192 B for
#: LMDB's default of 126 readers, 65664 B for 1024).
_LOCK_FILE_SIZE = 128 + 64 * _MAX_READERS
#: errno values of a full file system or quota: "no space" at open (CacheError).
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_FALLOC_FL_KEEP_SIZE = 1
#: Distinct keys whose reads are buffered before a write transaction records them.
_ACCESS_FLUSH_MAX = 4096
#: Seconds a snapshot of the meta columns may lag behind other processes' writes.
_SNAPSHOT_MAX_AGE = 1.0
#: Fraction of the capacity that lru/fifo/lfu evict at least, per eviction.
_EVICT_BATCH_FRACTION = 1 / 256
#: Payload bytes per write transaction of put_many (see its docstring).
_PUT_MANY_TXN_BYTES = 1 * MiB
#: Seconds fork() waits for operations of other threads to finish.
_FORK_WAIT = 10.0
_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})

_STATS_FILE = "stats.i64"
_STATS_MAGIC = 0x6D6D63_73746174_01  # "mmc" "stat" v1
# Slot 0 of the counters file holds the magic number; these are the other slots.
(_HITS, _MISSES, _PUTS, _ADMITTED, _REFUSED, _EVICTIONS, _EXPIRED, _CORRUPT) = range(1, 9)
_STATS_SIZE = 16 * 8


# --------------------------------------------------------------------------- counters


class _Counters:
    """Node-wide event counters in a small file, updated under ``flock``.

    Thread-safe (an in-process lock orders threads, ``flock`` orders processes).
    After fork the child must open its own (``flock`` locks belong to the open
    file description, which parent and child would share).
    """

    def __init__(self, directory: str, *, mode: int, create: bool) -> None:
        self._lock = threading.Lock()
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._local = [0] * 9
        path = os.path.join(directory, _STATS_FILE)
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(path, flags, mode)
        except OSError as exc:
            logger.debug("stats file %s not writable (%s): counting per process", path, exc)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size < _STATS_SIZE:
                    os.ftruncate(fd, _STATS_SIZE)
                magic = struct.unpack("<q", os.pread(fd, 8, 0))[0]
                if magic == 0:  # new, or its creator found the disk full: (re)initialise
                    os.pwrite(fd, struct.pack("<q", _STATS_MAGIC), 0)
                    magic = _STATS_MAGIC
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            if magic != _STATS_MAGIC:
                logger.warning("%s is not an mmcache stats file: counting per process", path)
                os.close(fd)
                return
            self._map = mmap.mmap(fd, _STATS_SIZE)
            self._fd = fd
        except OSError as exc:
            os.close(fd)
            logger.warning("cannot use stats file %s (%s): counting per process", path, exc)

    def add(self, *pairs: tuple[int, int]) -> None:
        """Add ``n`` to counter ``index`` for each ``(index, n)``."""
        with self._lock:
            m = self._map
            if m is None:
                for index, n in pairs:
                    self._local[index] += n
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                for index, n in pairs:
                    if n:
                        off = index * 8
                        struct.pack_into("<q", m, off, struct.unpack_from("<q", m, off)[0] + n)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read(self) -> list[int]:
        with self._lock:
            m = self._map
            if m is None:
                return list(self._local)
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            try:
                return list(struct.unpack_from("<9q", m, 0))
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def reset(self) -> None:
        with self._lock:
            m = self._map
            if m is None:
                self._local = [0] * 9
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                struct.pack_into("<8q", m, 8, *([0] * 8))
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self._lock:
            self._release()

    def forget(self) -> None:
        """Drop this (forked) child's copy without the lock, which another thread may
        have held at fork time and which nobody will release here."""
        self._release()

    def _release(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# --------------------------------------------------------------------------- environment


class _Gate:
    """Counts the operations in flight on one environment.

    ``quiesce`` blocks new operations and waits for those of other threads, so
    the environment can be closed before ``fork()`` without pulling a memory map
    from under a reader. Used as ``with gate:`` around every LMDB access.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._closed = False
        self._local = threading.local()

    def __enter__(self) -> None:
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._active += 1
        self._local.n = getattr(self._local, "n", 0) + 1

    def __exit__(self, *exc: object) -> None:
        self._local.n -= 1
        with self._cond:
            self._active -= 1
            if self._active == 0:
                self._cond.notify_all()

    def quiesce(self, timeout: float) -> bool:
        """Block new operations; wait for other threads'. True if none remain at all."""
        mine = getattr(self._local, "n", 0)
        with self._cond:
            self._closed = True
            drained = self._cond.wait_for(lambda: self._active <= mine, timeout)
        return drained and mine == 0

    def release(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()


class _EnvHandle:
    """One LMDB environment of this process, shared by every DiskStore on its directory."""

    def __init__(
        self, path: str, ident: tuple[int, int], *, readonly: bool, map_size: int, mode: int
    ) -> None:
        self.path = path
        self.ident = ident
        self.readonly = readonly
        self.map_size = map_size
        self.mode = mode
        self.refs = 0
        self.pid = os.getpid()
        self.gate = _Gate()
        self.lock = threading.Lock()  # opening the environment
        self.resize_lock = threading.Lock()  # adopt_map_size
        self.env: lmdb.Environment | None = None
        self.data: Any = None
        self.meta: Any = None
        self.info: Any = None
        self.lockless = False
        self.fork_broken = False
        self._reopen_after_fork = False
        self._open()

    def _open(self) -> None:
        if not self.lockless:
            self._reserve_files()
        try:
            env = lmdb.open(
                self.path,
                map_size=self.map_size,
                subdir=True,
                readonly=self.readonly,
                # One fsync per commit keeps the B-tree intact across a power cut;
                # skipping the meta-page fsync can only lose the last transaction.
                sync=True,
                metasync=False,
                mode=self.mode,
                create=not self.readonly,
                max_dbs=len(_DB_NAMES),
                max_readers=_MAX_READERS,
                max_spare_txns=1,
                lock=not self.lockless,
            )
        except lmdb.Error as exc:
            if self.readonly and not self.lockless and _is_permission_error(exc):
                # A read-only medium: the reader table cannot be written. Nobody can
                # write there either, so reading without locks is safe.
                logger.info("opening %s without locks (read-only medium)", self.path)
                self.lockless = True
                self._open()
                return
            raise CacheError(f"cannot open the disk cache at {self.path}: {exc}") from exc
        try:
            self._check_complete(env)
            if not self.lockless:
                stale = env.reader_check()
                if stale:
                    logger.info("cleared %d reader slots of dead processes in %s", stale, self.path)
            self._open_dbs(env)
        except BaseException as exc:
            env.close()
            if isinstance(exc, lmdb.Error):  # e.g. the first commit finds the disk full
                raise CacheError(f"cannot open the disk cache at {self.path}: {exc}") from exc
            raise
        self.env = env
        self.pid = os.getpid()

    def _check_complete(self, env: lmdb.Environment) -> None:
        """Refuse a ``data.mdb`` that ends before its last page (an interrupted copy).

        LMDB maps the file and trusts its meta page, which names the last page in
        use: reading a page past the end of a truncated file kills the process
        with SIGBUS (no error to catch), in every reader and in ``verify`` alike.
        A committed transaction has written all its pages before its meta page,
        so a complete file always reaches the end of that page. Checked before
        any page beyond the two meta pages is read.
        """
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        path = os.path.join(self.path, "data.mdb")
        size = os.stat(path).st_size
        if size < need:
            raise CacheError(
                f"{path} is truncated: {size} bytes, but its last page ends at byte {need} "
                "(an interrupted copy or restore?); copy the complete file again, or delete "
                f"{self.path} to start an empty cache"
            )

    def _reserve_files(self) -> None:
        """Allocate the disk blocks LMDB writes at open, so a full disk is a CacheError.

        LMDB sizes ``lock.mdb`` with ``ftruncate`` (a sparse file) and writes its
        header and reader slots through a shared mapping: on a full file system
        the first touch of an unallocated page kills the process with SIGBUS
        (there is no error to fall back on). ``posix_fallocate`` turns that into
        ``ENOSPC`` before LMDB runs. A lock file already in use is only filled
        in, never grown: its size fixes the reader table of the processes using
        it. Allocating never changes bytes, so it is safe while others use it
        (on file systems without ``fallocate``, glibc probes and writes one zero
        byte per block, the last byte of a 64-byte slot: padding, always zero).

        ``data.mdb`` is written with ``pwrite`` (ENOSPC is an error there), but
        a new one whose two meta pages were only half written is refused by
        LMDB forever after ("MDB_INVALID: File is not an LMDB file"). Those two
        pages are reserved without changing the file's size (a zero-filled
        ``data.mdb`` is just as invalid): ``fallocate(FALLOC_FL_KEEP_SIZE)``.

        A read-only open creates and reserves lock.mdb as LMDB would (LMDB
        creates it too where the directory is writable) but not data.mdb.
        Called before ``lmdb.open``, while this process holds no LMDB lock on
        the files (closing a descriptor of lock.mdb would drop them). Raises
        CacheError when the file system has no room; other errors are left to
        ``lmdb.open`` to report in its own words.
        """
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            fd = os.open(os.path.join(self.path, "lock.mdb"), flags, self.mode)
            try:
                os.posix_fallocate(fd, 0, os.fstat(fd).st_size or _LOCK_FILE_SIZE)
            finally:
                os.close(fd)
            if not self.readonly:  # a read-only open never creates data.mdb
                fd = os.open(os.path.join(self.path, "data.mdb"), flags, self.mode)
                try:
                    if os.fstat(fd).st_size < 2 * mmap.PAGESIZE:
                        _allocate_keep_size(fd, 2 * mmap.PAGESIZE)
                finally:
                    os.close(fd)
        except OSError as exc:
            if exc.errno in _NO_SPACE_ERRNOS:
                raise CacheError(
                    f"no space left on the file system of the disk cache at {self.path}"
                    f" ({exc.strerror}): free some space, or pass disk=None"
                ) from exc
            logger.debug("cannot preallocate the LMDB files in %s: %s", self.path, exc)

    def _open_dbs(self, env: lmdb.Environment) -> None:
        with env.begin() as txn:
            names = set(txn.cursor().iternext(values=False))
        if not names <= set(_DB_NAMES):
            raise CacheError(
                f"{self.path} holds an LMDB database that mmcache did not create "
                f"(databases {sorted(names)!r}); choose another directory"
            )
        if self.readonly and names != set(_DB_NAMES):
            raise CacheError(f"{self.path} holds no mmcache disk cache to open read-only")
        create = not self.readonly
        self.data = env.open_db(b"data", create=create)
        self.meta = env.open_db(b"meta", create=create)
        self.info = env.open_db(b"info", create=create)
        with env.begin(write=not self.readonly) as txn:
            raw = txn.get(_K_FORMAT, db=self.info)
            if raw is None:
                if self.readonly or txn.stat(self.data)["entries"]:
                    raise CacheError(f"{self.path}: the disk cache has no format record")
                txn.put(_K_FORMAT, _FORMAT.pack(_MAGIC, *DISK_FORMAT_VERSION), db=self.info)
                txn.put(_K_TOTALS, _TOTALS.pack(0, 0, 0, 0), db=self.info)
                return
            magic, major, minor = _FORMAT.unpack(raw) if len(raw) == _FORMAT.size else (b"", 0, 0)
            if magic != _MAGIC:
                raise CacheError(f"{self.path}: not an mmcache disk cache (bad format record)")
            if major != DISK_FORMAT_VERSION[0]:
                raise CacheError(
                    f"{self.path} was written in disk format {major}.{minor}; this mmcache "
                    f"reads format {DISK_FORMAT_VERSION[0]}.x. Use a matching mmcache version "
                    "or delete the directory to start an empty cache."
                )

    def require(self) -> lmdb.Environment:
        """The open environment (reopened lazily in a forked child). Call inside the gate."""
        env = self.env
        if env is not None:
            return env
        if self.fork_broken:
            raise CacheError(
                f"the disk cache at {self.path} was in use by the forking thread (inside a "
                "view() block?) when this process forked, so this child cannot open it; "
                "fork outside view() blocks"
            )
        with self.lock:
            if self.env is None:
                self._open()
            env = self.env
        if env is None:  # pragma: no cover - _open sets it or raises
            raise CacheError(f"cannot open the disk cache at {self.path}")
        return env

    def adopt_map_size(self) -> bool:
        """Map the file another process grew beyond our map (LMDB's MDB_MAP_RESIZED).

        Needs every transaction of this process closed: waits for other
        threads' and fails (False) if the calling thread still has one open.
        """
        with self.resize_lock:
            if not self.gate.quiesce(_FORK_WAIT):
                self.gate.release()
                return False
            try:
                if self.env is not None:
                    self.env.set_mapsize(0)  # 0: adopt the size recorded in the file
                    logger.info("%s: map size grown to the file's", self.path)
            finally:
                self.gate.release()
            return True

    def close(self) -> None:
        if self.pid != os.getpid() or self.env is None:
            # A forked child never closes an environment it inherited: mdb_env_close
            # would clear the parent's reader slots (they carry the parent's pid).
            self.env = None
            return
        if not self.gate.quiesce(_FORK_WAIT):
            self.gate.release()
            logger.warning("closing %s while it is in use; leaving it open", self.path)
            return
        try:
            self.env.close()
        finally:
            self.env = None
            self.gate.release()

    # fork hooks (called with the registry lock held)

    def before_fork(self) -> None:
        self._reopen_after_fork = False
        if self.env is None or self.pid != os.getpid():
            return
        if self.gate.quiesce(_FORK_WAIT):
            self.env.close()
            self.env = None
            self._reopen_after_fork = True
        else:
            logger.warning(
                "fork() while %s is in use by the forking thread: the child cannot use it",
                self.path,
            )

    def after_fork_parent(self) -> None:
        try:
            if self._reopen_after_fork:
                self._open()
        except Exception:
            logger.exception("cannot reopen %s after fork; will retry on next use", self.path)
            self.env = None
        finally:
            self.gate.release()

    def after_fork_child(self) -> None:
        self.gate = _Gate()
        self.lock = threading.Lock()
        self.resize_lock = threading.Lock()
        if self.env is not None:
            # Still open: the parent's handle, which fork could not close. Never
            # touch it here (see close()), and py-lmdb refuses a second one.
            self.fork_broken = True
        self.env = None
        self.pid = os.getpid()


_REGISTRY: dict[tuple[int, int], _EnvHandle] = {}
# Reentrant: a store's finalizer (garbage collection) may run while this thread
# holds it, e.g. inside _before_fork.
_REGISTRY_LOCK = threading.RLock()


def _acquire_handle(path: str, *, readonly: bool, map_size: int, mode: int) -> _EnvHandle:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CacheError(f"cannot open the disk cache at {path}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"the disk cache path {path} is not a directory")
    ident = (st.st_dev, st.st_ino)
    with _REGISTRY_LOCK:
        handle = _REGISTRY.get(ident)
        if handle is None:
            handle = _EnvHandle(path, ident, readonly=readonly, map_size=map_size, mode=mode)
            _REGISTRY[ident] = handle
        elif handle.readonly and not readonly:
            raise CacheError(
                f"{path} is already open read-only in this process; close that store first"
            )
        handle.refs += 1
        return handle


def _release_handle(handle: _EnvHandle) -> None:
    with _REGISTRY_LOCK:
        handle.refs -= 1
        if handle.refs > 0:
            return
        if _REGISTRY.get(handle.ident) is handle:
            del _REGISTRY[handle.ident]
    handle.close()


def _before_fork() -> None:
    _REGISTRY_LOCK.acquire()
    for handle in list(_REGISTRY.values()):
        try:
            handle.before_fork()
        except Exception:
            logger.exception("preparing %s for fork failed", handle.path)


def _after_fork_parent() -> None:
    try:
        for handle in list(_REGISTRY.values()):
            handle.after_fork_parent()
    finally:
        _REGISTRY_LOCK.release()


def _after_fork_child() -> None:
    # The forking thread took the lock in _before_fork; it is this thread now.
    try:
        for handle in list(_REGISTRY.values()):
            handle.after_fork_child()
    finally:
        _REGISTRY_LOCK.release()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child
)


# --------------------------------------------------------------------------- helpers


_MetaRecord = tuple[int, float, float, float, int, int]


def _parse_meta(raw: bytes | memoryview | None) -> _MetaRecord | None:
    """The fields of a meta record, or None when it is absent or damaged.

    Damaged: not 48 bytes, or a field no put writes (a negative size, hits or
    seq; a negative or non-finite cost). Such a record is never trusted: its
    entry counts by the length of its value and ``verify`` reports it.
    """
    if raw is None or len(raw) != _META.size:
        return None
    record = cast(_MetaRecord, _META.unpack(raw))
    size, cost, _ctime, _atime, hits, seq = record
    if min(size, hits, seq) < 0 or not (math.isfinite(cost) and cost >= 0):
        return None
    return record


def _entry_size(txn: lmdb.Transaction[Any], h: _EnvHandle, key: bytes, raw: bytes) -> int:
    """Bytes the totals count for an entry: its meta size, or its value's length if
    the record is damaged (the size the put recorded, unless the value rotted too)."""
    meta = _parse_meta(raw)
    if meta is not None:
        return meta[0]
    value = txn.get(key, db=h.data)
    return 0 if value is None else len(value)


class _DamagedTotals(CacheError):
    """The totals record is missing or impossible; a write transaction recounts it."""


@dataclass
class _Totals:
    bytes: int
    items: int
    next_seq: int
    gen: int

    @classmethod
    def read(cls, txn: lmdb.Transaction[Any], h: _EnvHandle) -> _Totals:
        """The totals, checked against what the transaction sees.

        The budget rests on them, so a record that is missing, negative, counts
        other than the meta db's entries, or more bytes than the data db's pages
        can hold is refused (``_DamagedTotals``) rather than believed; both checks
        are O(1) (LMDB keeps the counts in the database record).
        """
        raw = txn.get(_K_TOTALS, db=h.info)
        if raw is None or len(raw) != _TOTALS.size:
            why = "missing" if raw is None else f"{len(raw)} bytes long, not {_TOTALS.size}"
        else:
            tot = cls(*_TOTALS.unpack(raw))
            items = txn.stat(h.meta)["entries"]
            data = txn.stat(h.data)
            room = (data["leaf_pages"] + data["overflow_pages"]) * data["psize"]
            if min(tot.bytes, tot.items, tot.next_seq, tot.gen) >= 0 and (
                tot.items == items and tot.bytes <= room
            ):
                return tot
            why = (
                f"impossible (bytes={tot.bytes}, items={tot.items}, next_seq={tot.next_seq}, "
                f"gen={tot.gen}; the cache holds {items} entries in {room} bytes of pages)"
            )
        raise _DamagedTotals(
            f"the totals record of the disk cache at {h.path} is {why}: run "
            "`mmcache verify --repair` on its cache root (any write through mmcache recounts it)"
        )

    @classmethod
    def recount(cls, txn: lmdb.Transaction[Any], h: _EnvHandle) -> _Totals:
        """Totals counted from the meta db (one O(n) scan of 48-byte records), written.

        For a damaged record (see :meth:`read`); ``rebuild_totals`` is the full
        repair that also removes inconsistent entries.
        """
        raw = txn.get(_K_TOTALS, db=h.info)
        old = _TOTALS.unpack(raw) if raw is not None and len(raw) == _TOTALS.size else None
        total = items = 0
        next_seq = max(old[2], 0) if old is not None else 0
        for key, rec in txn.cursor(db=h.meta):
            total += _entry_size(txn, h, bytes(key), bytes(rec))
            items += 1
            meta = _parse_meta(rec)
            if meta is not None:
                next_seq = max(next_seq, meta[5] + 1)
        tot = cls(total, items, next_seq, max(old[3], 0) + 1 if old is not None else 0)
        tot.write(txn, h.info)
        return tot

    def write(self, txn: lmdb.Transaction[Any], db: Any) -> None:
        txn.put(_K_TOTALS, _TOTALS.pack(self.bytes, self.items, self.next_seq, self.gen), db=db)


class _Snapshot:
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
    def build(cls, txn: lmdb.Transaction[Any], meta_db: Any, gen: int) -> _Snapshot:
        keys: list[bytes] = []
        records: list[bytes] = []
        for key, raw in txn.cursor(db=meta_db):
            if len(raw) == _META.size:  # a damaged record is verify()'s business
                keys.append(bytes(key))
                records.append(bytes(raw))
        cols = np.frombuffer(b"".join(records), dtype=_META_DTYPE)
        # The checks of _parse_meta, vectorised: policies must never see a damaged row.
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

    def upsert(self, key: bytes, record: tuple[int, float, float, float, int, int]) -> None:
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


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    """libc's 64-bit ``fallocate(2)`` (Linux), or None where it cannot be found."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        func = getattr(libc, "fallocate64", None)
        if func is None:
            if ctypes.sizeof(ctypes.c_long) != 8:
                return None  # a 32-bit off_t: the offsets below would be misread
            func = libc.fallocate
    except (OSError, AttributeError, TypeError):  # no libc to load, or no fallocate in it
        return None
    func.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    func.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], func)


_FALLOCATE = _load_fallocate()


def _allocate_keep_size(fd: int, length: int) -> None:
    """Allocate the blocks of ``[0, length)`` without changing the file's size.

    Raises OSError (ENOSPC) when the file system is full; a no-op where the
    call or the flag is not supported (the file system then behaves as before).
    """
    if _FALLOCATE is None:
        return
    if _FALLOCATE(fd, _FALLOC_FL_KEEP_SIZE, 0, length) != 0:
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        raise OSError(err, os.strerror(err))


def _is_permission_error(exc: BaseException) -> bool:
    code = getattr(exc, "code", None) or getattr(exc, "errno", None)
    text = str(exc).lower()
    return code in (errno.EACCES, errno.EROFS, errno.EPERM) or "permission" in text


def _is_space_error(exc: BaseException | None) -> bool:
    """Map full, disk full or a failed write: the put is refused, not fatal."""
    if isinstance(exc, (lmdb.MapFullError, lmdb.DiskError)):
        return True
    if isinstance(exc, lmdb.Error):
        return exc.code in _SPACE_ERRNOS
    return isinstance(exc, OSError) and exc.errno in _SPACE_ERRNOS


def _as_buffer(value: bytes | memoryview) -> memoryview:
    if isinstance(value, str):
        raise TypeError("store values are bytes-like, got str")
    view = memoryview(value)
    if not view.contiguous:
        raise ValueError("store values must be contiguous buffers")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


def _check_cost(cost: float) -> float:
    cost = float(cost)
    if not math.isfinite(cost) or cost < 0:
        raise ValueError(f"cost must be a finite number of seconds >= 0, got {cost!r}")
    return cost


class _Txn:
    """``with _Txn(handle) as txn``: an LMDB transaction inside the handle's gate.

    Commits when the block succeeds and aborts when it raises. LMDB errors
    become :class:`CacheError` (the LMDB error is the ``__cause__``), so callers
    catch one exception type, an ``OSError``.
    """

    __slots__ = ("_gate", "_handle", "_txn", "_write")

    def __init__(self, handle: _EnvHandle, *, write: bool = False) -> None:
        self._handle = handle
        self._gate = handle.gate  # the one entered, even if a fork replaces handle.gate
        self._write = write
        self._txn: lmdb.Transaction[Any] | None = None

    def __enter__(self) -> lmdb.Transaction[Any]:
        resized = False
        while True:
            self._gate.__enter__()
            try:
                self._txn = self._handle.require().begin(write=self._write)
                return self._txn
            except lmdb.MapResizedError as exc:
                self._gate.__exit__()
                if resized or not self._handle.adopt_map_size():
                    raise _cache_error(self._handle.path, exc) from exc
                resized = True
            except BaseException as exc:
                self._gate.__exit__()
                if isinstance(exc, lmdb.Error):
                    raise _cache_error(self._handle.path, exc) from exc
                raise

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        txn, self._txn = self._txn, None
        try:
            if txn is not None:
                if exc is None:
                    txn.commit()
                else:
                    txn.abort()
        except lmdb.Error as err:
            if exc is None:
                raise _cache_error(self._handle.path, err) from err
        finally:
            self._gate.__exit__()
        if isinstance(exc, lmdb.Error):
            raise _cache_error(self._handle.path, exc) from exc


def _cache_error(path: str, exc: BaseException) -> CacheError:
    return CacheError(f"the disk cache at {path} failed: {exc}")


# --------------------------------------------------------------------------- the store


class DiskStore(Store):
    """Persistent byte store in an LMDB environment at ``path``, with a hard byte budget.

    ``capacity`` is the budget for payload bytes (an int or e.g. ``"50GiB"``),
    ``policy`` the admission/eviction policy (name or instance), ``clock`` the
    clock of access times: wall time by default, because entries outlive
    processes and reboots. ``map_size`` bounds the file (default
    ``2 * capacity + 64 MiB``, see the module docstring); ``mode`` the
    permissions of the files it creates (the directory gets the matching
    ``x`` bits: 0600 -> 0700). ``readonly=True`` opens an existing cache
    without changing it: ``put`` returns False, ``delete`` and ``expire`` raise.

    Every method is thread-safe and process-safe (see the module docstring for
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
        self._capacity = parse_size(capacity)
        self._policy = get_policy(policy)
        self._readonly = bool(readonly)
        self._clock = clock
        self._map_size_arg = map_size
        self._mode = int(mode)
        if map_size is not None and (isinstance(map_size, bool) or map_size <= 0):
            raise CacheError(f"map_size must be a positive number of bytes, got {map_size!r}")
        self._map_size = map_size if map_size is not None else 2 * self._capacity + MAP_OVERHEAD
        # Orderings over all residents are sorted once per batch, not once per put.
        batch = not isinstance(self._policy, (ValuePolicy, KeepPolicy))
        self._batch_bytes = int(self._capacity * _EVICT_BATCH_FRACTION) if batch else 0
        # Only policies that look at reads pay for recording them.
        self._track = not self._readonly and not isinstance(
            self._policy, (ValuePolicy, KeepPolicy, FIFOPolicy)
        )
        self._mu = threading.Lock()
        self._pending: dict[bytes, list[float]] = {}
        self._snap: _Snapshot | None = None
        self._logged: set[str] = set()
        self._closed = False
        existed = os.path.isdir(self._path)
        if not self._readonly:
            try:
                os.makedirs(self._path, mode=dir_mode(self._mode), exist_ok=True)
                if not existed:  # makedirs' mode is masked by the umask; the user asked
                    os.chmod(self._path, dir_mode(self._mode))
            except OSError as exc:
                raise CacheError(f"cannot create the disk cache at {self._path}: {exc}") from exc
        handle = _acquire_handle(
            self._path, readonly=self._readonly, map_size=self._map_size, mode=self._mode
        )
        self._handle: _EnvHandle | None = handle
        created = not self._readonly and not existed
        # A store dropped without close() still releases the environment.
        self._finalizer = weakref.finalize(self, _release_handle, handle)
        self._pid = os.getpid()
        self._counters = _Counters(self._path, mode=self._mode, create=not self._readonly)
        if created:
            # LMDB and os.open create files with mode & ~umask; give them the mode asked for.
            for name in ("data.mdb", "lock.mdb", _STATS_FILE):
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(self._path, name), self._mode)
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

    def _env(self) -> _EnvHandle:
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
        self._mu = threading.Lock()
        self._pending = {}
        self._counters.forget()
        self._counters = _Counters(self._path, mode=self._mode, create=not self._readonly)
        self._pid = os.getpid()

    def _log_once(self, tag: str, level: int, msg: str, *args: object) -> None:
        if tag not in self._logged:
            self._logged.add(tag)
            logger.log(level, msg, *args)

    def _count_reads(self, keys: Sequence[bytes], found: Sequence[bool]) -> None:
        hits = sum(found)
        self._counters.add((_HITS, hits), (_MISSES, len(found) - hits))
        if not (hits and self._track):
            return
        now = self._clock()
        with self._mu:
            pending = self._pending
            for key, ok in zip(keys, found, strict=True):
                if not ok:
                    continue
                rec = pending.get(key)
                if rec is None:
                    pending[key] = [now, 1.0]
                else:
                    rec[0] = now
                    rec[1] += 1.0
            full = len(pending) >= _ACCESS_FLUSH_MAX
        if full:
            self.flush()

    def _totals_txn(self, txn: lmdb.Transaction[Any], h: _EnvHandle) -> _Totals:
        """The totals in a write transaction: a damaged record is recounted, not refused.

        Recounting there is safe (writers are serialised) and keeps the budget
        exact; the read-only paths (``nbytes``, ``stats``) raise instead.
        """
        try:
            return _Totals.read(txn, h)
        except _DamagedTotals as exc:
            logger.warning("%s; recounting it from the entries", exc)
            self._snap = None
            return _Totals.recount(txn, h)

    def _bump(self, tot: _Totals) -> None:
        """Count one committed change to meta; keep an in-sync snapshot in sync."""
        snap = self._snap
        in_sync = snap is not None and snap.gen == tot.gen
        tot.gen += 1
        if in_sync and snap is not None:
            snap.gen = tot.gen

    def _flush_reads_txn(self, txn: lmdb.Transaction[Any], h: _EnvHandle, tot: _Totals) -> None:
        with self._mu:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        snap = self._snap
        for key, (atime, hits) in pending.items():
            meta = _parse_meta(txn.get(key, db=h.meta))
            if meta is None:  # gone, or damaged: verify's business
                continue
            size, cost, ctime, old_atime, old_hits, seq = meta
            new_atime = max(old_atime, atime)
            record = _META.pack(size, cost, ctime, new_atime, old_hits + int(hits), seq)
            txn.put(key, record, db=h.meta)
            if snap is not None:
                snap.touch(key, new_atime, int(hits))
        self._bump(tot)

    # ------------------------------------------------------------------ reads

    def get(self, key: bytes) -> bytes | None:
        """Return a copy of the value, or None. Counts a hit or a miss. Thread/process-safe."""
        check_key(key)
        h = self._env()
        with _Txn(h) as txn:
            value: bytes | None = txn.get(key, db=h.data)
        self._count_reads((key,), (value is not None,))
        return value

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Copies of several values (None where absent), read in one transaction.

        Counts one hit or miss per key. Thread/process-safe.
        """
        for key in keys:
            check_key(key)
        h = self._env()
        with _Txn(h) as txn:
            data = h.data
            values: list[bytes | None] = [txn.get(key, db=data) for key in keys]
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
            with h.gate:
                try:
                    env = h.require()
                    with env.begin(buffers=True) as txn:
                        value = txn.get(key, db=h.data)
                        found = value is not None
                        yield value
                except lmdb.Error as exc:
                    raise _cache_error(self._path, exc) from exc
        finally:
            if found is not None:
                self._count_reads((key,), (found,))

    @contextlib.contextmanager
    def view_many(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        """Zero-copy buffers of several values (None where absent), in one read transaction.

        For collating a batch straight into its destination with one copy: the
        buffers are valid only inside the ``with`` block. Counts one hit or miss
        per key. Thread/process-safe.
        """
        for key in keys:
            check_key(key)
        h = self._env()
        found: list[bool] | None = None
        try:
            with h.gate:
                try:
                    with h.require().begin(buffers=True) as txn:
                        data = h.data
                        values = [txn.get(key, db=data) for key in keys]
                        found = [v is not None for v in values]
                        yield values
                except lmdb.Error as exc:
                    raise _cache_error(self._path, exc) from exc
        finally:
            if found is not None:
                self._count_reads(keys, found)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is present (no hit or miss counted). Thread/process-safe."""
        check_key(key)
        h = self._env()
        with _Txn(h) as txn:
            return txn.get(key, db=h.meta) is not None

    def info(self, key: bytes) -> EntryInfo | None:
        """Metadata of ``key``, including reads not yet written. Thread/process-safe."""
        check_key(key)
        h = self._env()
        with _Txn(h) as txn:
            raw: bytes | None = txn.get(key, db=h.meta)
        if raw is None:
            return None
        meta = _parse_meta(raw)
        if meta is None:
            raise CacheError(
                f"the meta record of entry {key.hex()} in the disk cache at {self._path} is "
                f"damaged ({len(raw)} bytes): run `mmcache verify --repair` to remove the entry"
            )
        size, cost, ctime, atime, hits, _seq = meta
        with self._mu:
            rec = self._pending.get(key)
            if rec is not None:
                atime = max(atime, rec[0])
                hits += int(rec[1])
        return EntryInfo(size=size, cost=cost, ctime=ctime, atime=atime, hits=hits)

    def keys(self) -> Iterator[bytes]:
        """The keys present, read in one transaction. Thread/process-safe."""
        h = self._env()
        with _Txn(h) as txn:
            keys: list[bytes] = list(txn.cursor(db=h.meta).iternext(values=False))
        return iter(keys)

    def _totals(self) -> _Totals:
        h = self._env()
        with _Txn(h) as txn:
            return _Totals.read(txn, h)

    def nbytes(self) -> int:
        """Payload bytes held now, by all processes. Thread/process-safe."""
        return self._totals().bytes

    def __len__(self) -> int:
        return self._totals().items

    def capacity(self) -> int:
        """The hard byte budget of this store."""
        return self._capacity

    def stats(self) -> TierStats:
        """Counters of every process and run that used this directory (see module docstring)."""
        tot = self._totals()
        c = self._counters.read()
        return TierStats(
            hits=c[_HITS],
            misses=c[_MISSES],
            puts=c[_PUTS],
            admitted=c[_ADMITTED],
            refused=c[_REFUSED],
            evictions=c[_EVICTIONS],
            expired=c[_EXPIRED],
            corrupt=c[_CORRUPT],
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

        Fewer commits (fsyncs) than one ``put`` each: about twice the rate for
        150 KB values on a disk. Larger transactions are slower again (LMDB
        buffers every dirty page until the commit), hence the 1 MiB groups; each
        entry is atomic, the batch is not. Returns what ``put`` would return for
        each entry, in order. Thread/process-safe.
        """
        items = [(check_key(k), _as_buffer(v), _check_cost(c), float(t)) for k, v, c, t in entries]
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
            self._counters.add((_PUTS, len(items)), (_REFUSED, len(items)))
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
            with _Txn(h, write=True) as txn:
                results = [
                    self._put_txn(txn, h, key=k, buf=b, cost=c, ctime=t) for k, b, c, t in items
                ]
        except CacheError as exc:
            self._snap = None
            if not _is_space_error(exc.__cause__):
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
            self._counters.add((_PUTS, 1), (_REFUSED, 1))
            return [False]
        except BaseException:
            self._snap = None
            raise
        admitted = sum(ok for ok, _evicted in results)
        self._counters.add(
            (_PUTS, len(results)),
            (_ADMITTED, admitted),
            (_REFUSED, len(results) - admitted),
            (_EVICTIONS, sum(evicted for _ok, evicted in results)),
        )
        return [ok for ok, _evicted in results]

    def _put_txn(
        self,
        txn: lmdb.Transaction[Any],
        h: _EnvHandle,
        *,
        key: bytes,
        buf: memoryview,
        cost: float,
        ctime: float,
    ) -> tuple[bool, int]:
        tot = self._totals_txn(txn, h)
        gen0 = tot.gen
        self._flush_reads_txn(txn, h, tot)
        size = buf.nbytes
        old = txn.get(key, db=h.meta)
        used = tot.bytes - (_entry_size(txn, h, key, old) if old is not None else 0)
        victims: list[bytes] | None = []
        if size > self._capacity:
            victims = None
        elif size > self._capacity - used:
            need = size - (self._capacity - used)
            victims = self._choose_victims(txn, h, tot, key=key, size=size, cost=cost, need=need)
        if victims is None:
            # Refused: an older value of the key is stale now, so it goes too.
            if old is not None:
                self._delete_entry(txn, h, tot, key, old)
                self._bump(tot)
            if tot.gen != gen0:
                tot.write(txn, h.info)
            return False, 0
        for victim in victims:
            raw = txn.get(victim, db=h.meta)
            if raw is not None:
                self._delete_entry(txn, h, tot, victim, raw)
        if old is not None:
            self._delete_entry(txn, h, tot, key, old)
        record = (size, cost, ctime, self._clock(), 0, tot.next_seq)
        txn.put(key, buf, db=h.data)
        txn.put(key, _META.pack(*record), db=h.meta)
        if self._snap is not None:
            self._snap.upsert(key, record)
        tot.next_seq += 1
        tot.bytes += size
        tot.items += 1
        self._bump(tot)
        tot.write(txn, h.info)
        return True, len(victims)

    def _delete_entry(
        self, txn: lmdb.Transaction[Any], h: _EnvHandle, tot: _Totals, key: bytes, raw: bytes
    ) -> None:
        tot.bytes -= _entry_size(txn, h, key, raw)
        txn.delete(key, db=h.data)
        txn.delete(key, db=h.meta)
        tot.items -= 1
        if self._snap is not None:
            self._snap.remove(key)

    def _choose_victims(
        self,
        txn: lmdb.Transaction[Any],
        h: _EnvHandle,
        tot: _Totals,
        *,
        key: bytes,
        size: int,
        cost: float,
        need: int,
    ) -> list[bytes] | None:
        """Ask the policy for victims freeing ``need`` bytes, checked against committed meta."""
        for attempt in range(2):
            snap = self._snap
            if snap is None or (
                snap.gen != tot.gen and (attempt > 0 or snap.age() > _SNAPSHOT_MAX_AGE)
            ):
                snap = self._snap = _Snapshot.build(txn, h.meta, tot.gen)
            residents, rows = snap.residents(exclude=key)
            picked: IntArray | None = None
            if self._batch_bytes > need:
                picked = self._policy.select_victims(
                    residents, size=size, cost=cost, need=self._batch_bytes
                )
            if picked is None:
                picked = self._policy.select_victims(residents, size=size, cost=cost, need=need)
            if picked is None:
                return None
            picked = np.unique(np.asarray(picked, dtype=np.int64))
            if picked.size and (picked[0] < 0 or picked[-1] >= len(residents)):
                raise CacheError(f"policy {self._policy!r} returned rows out of range")
            victims: list[bytes] = []
            freed = 0
            valid = True
            for i in picked.tolist():
                row = int(rows[i])
                victim = snap.keys[row]
                meta = _parse_meta(txn.get(victim, db=h.meta)) if victim is not None else None
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
                self._log_once(
                    "policy",
                    logging.ERROR,
                    "policy %r freed %d of the %d bytes needed; refusing",
                    self._policy,
                    freed,
                    need,
                )
                return None
            self._snap = None  # stale: rebuild it and ask again
        return None

    def _trim_to_capacity(self) -> None:
        """Evict down to the budget when the directory holds more (a smaller capacity)."""

        def op(txn: lmdb.Transaction[Any], h: _EnvHandle, tot: _Totals) -> int:
            excess = tot.bytes - self._capacity
            if excess <= 0:
                return 0
            snap = self._snap = _Snapshot.build(txn, h.meta, tot.gen)
            residents, rows = snap.residents(exclude=None)
            picked = self._policy.select_victims(residents, size=0, cost=0.0, need=excess)
            if picked is None:  # value/keep never evict for nothing: fall back to LRU order
                picked = LRUPolicy().select_victims(residents, size=0, cost=0.0, need=excess)
            if picked is None:
                return 0
            evicted = 0
            for i in np.unique(np.asarray(picked, dtype=np.int64)).tolist():
                victim = snap.keys[int(rows[i])]
                raw = txn.get(victim, db=h.meta) if victim is not None else None
                if victim is not None and raw is not None:
                    self._delete_entry(txn, h, tot, victim, raw)
                    evicted += 1
            self._bump(tot)
            return evicted

        with contextlib.suppress(_DamagedTotals):  # else the write below recounts them
            if self._totals().bytes <= self._capacity:
                return
        evicted = self._write(op)
        if evicted:
            logger.info(
                "%s: evicted %d entries to fit the capacity of %s",
                self._path,
                evicted,
                format_size(self._capacity),
            )
            self._counters.add((_EVICTIONS, evicted))

    def _write(self, op: Callable[[lmdb.Transaction[Any], _EnvHandle, _Totals], int]) -> int:
        """Run ``op`` in a write transaction that also records pending reads."""
        if self._readonly:
            raise CacheError(f"{self} is read-only")
        h = self._env()
        try:
            with _Txn(h, write=True) as txn:
                tot = self._totals_txn(txn, h)
                gen0 = tot.gen
                self._flush_reads_txn(txn, h, tot)
                result = op(txn, h, tot)
                if tot.gen != gen0:
                    tot.write(txn, h.info)
                return result
        except BaseException:
            self._snap = None
            raise

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` (also a value whose meta record is damaged or missing); return
        whether it was present. Thread/process-safe.

        Raises CacheError on a read-only store.
        """
        check_key(key)

        def op(txn: lmdb.Transaction[Any], h: _EnvHandle, tot: _Totals) -> int:
            raw = txn.get(key, db=h.meta)
            if raw is None:  # a value without its meta record (verify reports it) or nothing
                return int(txn.delete(key, db=h.data))
            self._delete_entry(txn, h, tot, key, raw)
            self._bump(tot)
            return 1

        with self._mu:
            self._pending.pop(key, None)
        return bool(self._write(op))

    def discard(self, key: bytes, *, why: Literal["corrupt", "expired"]) -> bool:
        """Delete ``key`` and count it as ``corrupt`` or ``expired``."""
        removed = self.delete(key)
        if removed:
            self._counters.add((_CORRUPT if why == "corrupt" else _EXPIRED, 1))
        return removed

    def discard_corrupt(self, key: bytes) -> bool:
        """Delete an entry found corrupt (e.g. by the codec's checksum) and count it."""
        removed = self.delete(key)
        if removed:
            self._counters.add((_CORRUPT, 1))
        return removed

    def expire(self, before: float) -> int:
        """Remove entries whose ``ctime < before``; return how many. Scans the meta db.

        Thread/process-safe; raises CacheError on a read-only store.
        """
        before = float(before)

        def op(txn: lmdb.Transaction[Any], h: _EnvHandle, tot: _Totals) -> int:
            old: list[tuple[bytes, bytes]] = []
            for key, raw in txn.cursor(db=h.meta):
                meta = _parse_meta(raw)
                if meta is not None and meta[2] < before:
                    old.append((bytes(key), bytes(raw)))
            for key, raw in old:
                self._delete_entry(txn, h, tot, key, raw)
            if old:
                self._bump(tot)
            return len(old)

        removed = self._write(op)
        if removed:
            self._counters.add((_EXPIRED, removed))
        return removed

    def flush(self) -> None:
        """Write the buffered read times and counts (lru, lfu) now. Thread/process-safe."""
        if self._readonly or self._closed:
            return
        with self._mu:
            if not self._pending:
                return
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
        bad: list[bytes] = []
        h = self._env()
        with h.gate:
            try:
                with h.require().begin(buffers=True) as txn:
                    for raw_key, value in txn.cursor(db=h.data):
                        key = bytes(raw_key)
                        meta = _parse_meta(txn.get(key, db=h.meta))
                        if meta is None or meta[0] != len(value):
                            bad.append(key)
                            continue
                        try:
                            ok = bool(check(bytes(value)))
                        except Exception:
                            ok = False
                        if not ok:
                            bad.append(key)
                    for raw_key in txn.cursor(db=h.meta).iternext(values=False):
                        if txn.get(raw_key, db=h.data) is None:
                            bad.append(bytes(raw_key))
            except lmdb.Error as exc:
                raise _cache_error(self._path, exc) from exc
        if bad:
            self._counters.add((_CORRUPT, len(bad)))
        return bad

    def rebuild_totals(self) -> tuple[int, int]:
        """Recompute the totals from the data and meta dbs; return ``(bytes, items)``.

        Entries whose meta record is missing or disagrees with the value's size
        are removed: they cannot be trusted. For repair after page corruption
        (LMDB does not checksum its pages). Thread/process-safe.
        """

        def op(txn: lmdb.Transaction[Any], h: _EnvHandle, tot: _Totals) -> int:
            sizes = {bytes(k): len(v) for k, v in txn.cursor(db=h.data)}
            metas = {bytes(k): bytes(v) for k, v in txn.cursor(db=h.meta)}
            total = items = orphans = 0
            next_seq = tot.next_seq
            for key, raw in metas.items():
                meta = _parse_meta(raw)
                if meta is not None and sizes.get(key) == meta[0]:
                    total += sizes[key]
                    items += 1
                    next_seq = max(next_seq, meta[5] + 1)
                else:
                    txn.delete(key, db=h.meta)
                    txn.delete(key, db=h.data)
                    orphans += 1
            for key in sizes.keys() - metas.keys():
                txn.delete(key, db=h.data)
                orphans += 1
            if orphans:
                logger.warning("%s: removed %d inconsistent entries", self._path, orphans)
            tot.bytes, tot.items, tot.next_seq = total, items, next_seq
            tot.gen += 1
            self._snap = None
            return 0

        self._write(op)
        tot = self._totals()
        return tot.bytes, tot.items

    def compact_copy(self, dest: str | os.PathLike[str]) -> None:
        """Write a compacted copy of the environment into the new directory ``dest``.

        LMDB files never shrink; swap the copy in while no process uses the cache.
        """
        target = os.fspath(dest)
        os.makedirs(target, mode=dir_mode(self._mode), exist_ok=True)
        if os.path.exists(os.path.join(target, "data.mdb")):
            raise CacheError(f"{target} already holds an LMDB environment")
        h = self._env()
        with h.gate:
            try:
                h.require().copy(target, compact=True)
            except lmdb.Error as exc:
                raise _cache_error(self._path, exc) from exc

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
