"""The LMDB environment of a disk cache directory: one handle per process, fork hooks, transactions.

Opening
    ``path/`` holds LMDB's ``data.mdb`` and ``lock.mdb``; inside the environment
    there are six named databases: ``data`` (key -> value bytes of an entry
    stored alone), ``meta`` (key -> a fixed 48-byte record, see :mod:`.snapshot`),
    ``info`` (format version and the running totals), and ``slots``, ``packs``
    and ``packlive`` (small entries stored together, see :mod:`.packs`). A
    ``data.mdb`` shorter than its last page (an interrupted copy) is refused
    at open: reading past its end would kill the process with SIGBUS. On a
    full file system the files LMDB writes at open are allocated first
    (:mod:`.reserve`), so a full disk is a CacheError, not a SIGBUS.

Processes, fork and pickling
    Several processes may open the same directory. LMDB forbids using an
    environment across ``fork()`` and py-lmdb refuses to open the same files
    twice in one process, so a forked child can neither keep the parent's
    handle nor open a second one while it exists. Objects of one process that
    open the same directory therefore share one :class:`EnvHandle` (a
    per-process registry), which closes its environment just before any
    ``os.fork()`` (after the operations in flight on other threads finish) and
    reopens it in the parent right after; the child opens its own on first use.
    A fork from inside a ``view()`` block cannot close it: the child then
    refuses to use the store (CacheError) and the parent is unaffected. A
    pickled store carries only its configuration: unpickling (spawn workers)
    opens the directory again, through this registry.

    When another process with a larger ``map_size`` grew the file beyond this
    process's map, the next transaction waits for this process's others to end
    and adopts the file's size (LMDB's ``MDB_MAP_RESIZED``); inside a ``view()``
    block that cannot happen and the call raises CacheError.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
import threading
from collections.abc import Iterator
from typing import Any

import lmdb

from mmcache.errors import CacheError
from mmcache.rootfiles import pinned_files
from mmcache.stores.base import NO_SPACE_ERRNOS
from mmcache.stores.disk.reserve import MAX_READERS, reserve_files
from mmcache.units import MiB

__all__ = [
    "DB_NAMES",
    "DISK_FORMAT_VERSION",
    "FAILED_WRITE_ERRNOS",
    "MAP_OVERHEAD",
    "TOTALS_KEY",
    "TOTALS_RECORD",
    "EnvHandle",
    "Txn",
    "acquire_handle",
    "cache_error",
    "check_complete",
    "is_failed_write",
    "no_handle_here",
    "open_env",
    "release_handle",
    "write_info",
]

logger = logging.getLogger(__name__)

#: (major, minor) of the on-disk layout. A different major refuses to open, except
#: 1: a store of format 1 (no packs, :mod:`.packs`) is one of format 2 without any
#: pack, so a writable open adds the pack databases and rewrites its format record
#: (mmcache of format 1 then refuses it: it does not know those databases).
DISK_FORMAT_VERSION = (2, 0)
_MIGRATES = {1}

_FORMAT = struct.Struct("<8sHH")
_MAGIC = b"MMCDISK\x00"
_K_FORMAT = b"format"
#: The totals record in the info db: bytes, items, next seq, generation (bumped by
#: every committed change to meta); read and written by :class:`.snapshot.Totals`.
TOTALS_RECORD = struct.Struct("<qqqq")
TOTALS_KEY = b"totals"
#: The named databases, in this order (see :mod:`.packs` for the last three).
DB_NAMES = (b"data", b"meta", b"info", b"slots", b"packs", b"packlive")
_V1_NAMES = {b"data", b"meta", b"info"}

#: Headroom of the default map size over the payload budget (see DiskStore).
MAP_OVERHEAD = 64 * MiB
#: Seconds fork() waits for operations of other threads to finish.
_FORK_WAIT = 10.0
#: errno values of a failed LMDB write that refuse the put (the store keeps working)
#: instead of raising: no space (the one set of every tier), a file size limit
#: (EFBIG), or the I/O error a full device can report for a write (EIO).
FAILED_WRITE_ERRNOS = NO_SPACE_ERRNOS | {errno.EFBIG, errno.EIO}


class _ForkQuiesce:
    """Counts the operations in flight on one environment, so that fork can stop them.

    ``quiesce`` blocks new operations and waits for those of other threads, so
    the environment can be closed before ``fork()`` (or a map resize) without
    pulling a memory map from under a reader. Used as ``with handle.in_flight:``
    around every LMDB access.
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


class EnvHandle:
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
        self.in_flight = _ForkQuiesce()
        self.lock = threading.Lock()  # opening the environment
        self.resize_lock = threading.Lock()  # adopt_map_size
        self.env: lmdb.Environment | None = None
        self.data: Any = None
        self.meta: Any = None
        self.info: Any = None
        self.slots: Any = None
        self.packs: Any = None
        self.packlive: Any = None
        self.lockless = False
        self.fork_broken = False
        self._reopen_after_fork = False
        self._open()

    def _open(self) -> None:
        if not self.lockless:
            reserve_files(self.path, mode=self.mode, readonly=self.readonly)
        try:
            env = open_env(
                self.path,
                map_size=self.map_size,
                readonly=self.readonly,
                mode=self.mode,
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

    def _open_dbs(self, env: lmdb.Environment) -> None:
        with env.begin() as txn:
            names = set(txn.cursor().iternext(values=False))
        if not names <= set(DB_NAMES):
            raise CacheError(
                f"{self.path} holds an LMDB database that mmcache did not create "
                f"(databases {sorted(names)!r}); choose another directory"
            )
        if self.readonly and names != set(DB_NAMES):
            if names == _V1_NAMES:
                raise CacheError(
                    f"{self.path} holds a disk cache of format 1 (before packs); open it "
                    "writable once (any mmcache command that writes, e.g. `mmcache verify "
                    "--repair`) to upgrade it to format 2, then read-only"
                )
            raise CacheError(f"{self.path} holds no mmcache disk cache to open read-only")
        create = not self.readonly
        self.data = env.open_db(b"data", create=create)
        self.meta = env.open_db(b"meta", create=create)
        self.info = env.open_db(b"info", create=create)
        if self.readonly:  # (a read transaction's handles would end with it)
            self.slots, self.packs, self.packlive = (
                env.open_db(name, create=False) for name in DB_NAMES[3:]
            )
        with env.begin(write=not self.readonly) as txn:
            raw = txn.get(_K_FORMAT, db=self.info)
            if raw is None:
                if self.readonly or txn.stat(self.data)["entries"]:
                    raise CacheError(f"{self.path}: the disk cache has no format record")
                txn.put(_K_FORMAT, _FORMAT.pack(_MAGIC, *DISK_FORMAT_VERSION), db=self.info)
                txn.put(TOTALS_KEY, TOTALS_RECORD.pack(0, 0, 0, 0), db=self.info)
                major, minor = DISK_FORMAT_VERSION
            else:
                magic, major, minor = (
                    _FORMAT.unpack(raw) if len(raw) == _FORMAT.size else (b"", 0, 0)
                )
                if magic != _MAGIC:
                    raise CacheError(f"{self.path}: not an mmcache disk cache (bad format record)")
                if major != DISK_FORMAT_VERSION[0] and (self.readonly or major not in _MIGRATES):
                    raise CacheError(
                        f"{self.path} was written in disk format {major}.{minor}; this mmcache "
                        f"reads format {DISK_FORMAT_VERSION[0]}.x. Use a matching mmcache "
                        "version or delete the directory to start an empty cache."
                    )
            if not self.readonly:  # created in the transaction that upgrades format 1
                self.slots, self.packs, self.packlive = (
                    env.open_db(name, txn=txn) for name in DB_NAMES[3:]
                )
            if major != DISK_FORMAT_VERSION[0]:
                txn.put(_K_FORMAT, _FORMAT.pack(_MAGIC, *DISK_FORMAT_VERSION), db=self.info)
                logger.info(
                    "%s: disk format %d.%d upgraded to %d.%d",
                    self.path,
                    major,
                    minor,
                    *DISK_FORMAT_VERSION,
                )

    def require(self) -> lmdb.Environment:
        """The open environment (reopened lazily in a forked child). Call inside
        ``with self.in_flight:``."""
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
            if not self.in_flight.quiesce(_FORK_WAIT):
                self.in_flight.release()
                return False
            try:
                if self.env is not None:
                    self.env.set_mapsize(0)  # 0: adopt the size recorded in the file
                    logger.info("%s: map size grown to the file's", self.path)
            finally:
                self.in_flight.release()
            return True

    def close(self) -> None:
        if self.pid != os.getpid() or self.env is None:
            # A forked child never closes an environment it inherited: mdb_env_close
            # would clear the parent's reader slots (they carry the parent's pid).
            self.env = None
            return
        if not self.in_flight.quiesce(_FORK_WAIT):
            self.in_flight.release()
            logger.warning("closing %s while it is in use; leaving it open", self.path)
            return
        try:
            self.env.close()
        finally:
            self.env = None
            self.in_flight.release()

    # fork hooks (called with the registry lock held)

    def before_fork(self) -> None:
        self._reopen_after_fork = False
        if self.env is None or self.pid != os.getpid():
            return
        if self.in_flight.quiesce(_FORK_WAIT):
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
            self.in_flight.release()

    def after_fork_child(self) -> None:
        self.in_flight = _ForkQuiesce()
        self.lock = threading.Lock()
        self.resize_lock = threading.Lock()
        if self.env is not None:
            # Still open: the parent's handle, which fork could not close. Never
            # touch it here (see close()), and py-lmdb refuses a second one.
            self.fork_broken = True
        self.env = None
        self.pid = os.getpid()


def open_env(
    path: str, *, map_size: int, readonly: bool, mode: int, lock: bool
) -> lmdb.Environment:
    """``lmdb.open`` with the settings of every mmcache disk cache (raises lmdb.Error),
    of the files as checked here (never through a link swapped in meanwhile), and
    :func:`check_complete` (CacheError for a truncated ``data.mdb``).

    ``lock=False`` (MDB_NOLOCK) neither reads nor locks ``lock.mdb``: only for
    a read-only medium, or while nobody else can have the directory open.
    """
    # LMDB opens its files by name, following links, and truncates and writes lock.mdb
    # at open: hand it a private folder whose lock.mdb leads to exactly the file checked
    # here (rootfiles.pinned_files). data.mdb stays a name LMDB resolves itself: it opens
    # it after waiting for the lock, and compaction renames a new data.mdb in while an
    # opener waits (maintenance.compact_in_place); a data.mdb swapped for a link to
    # another file is refused by LMDB as "not an LMDB file" unless that file is one.
    names = ("lock.mdb",) if lock else ()
    with pinned_files(path, names, create=not readonly, mode=mode, by_name=("data.mdb",)) as where:
        env = _lmdb_open(where, map_size=map_size, readonly=readonly, mode=mode, lock=lock)
        try:
            check_complete(env, path, opened_at=where)
        except BaseException:
            env.close()
            raise
        return env


def _lmdb_open(
    path: str, *, map_size: int, readonly: bool, mode: int, lock: bool
) -> lmdb.Environment:
    return lmdb.open(
        path,
        map_size=map_size,
        subdir=True,
        readonly=readonly,
        # One fsync per commit keeps the B-tree intact across a power cut;
        # skipping the meta-page fsync can only lose the last transaction.
        sync=True,
        metasync=False,
        mode=mode,
        create=not readonly,
        max_dbs=len(DB_NAMES),
        max_readers=MAX_READERS,
        max_spare_txns=1,
        lock=lock,
    )


def check_complete(env: lmdb.Environment, directory: str, *, opened_at: str | None = None) -> None:
    """Refuse a ``data.mdb`` that ends before its last page (an interrupted copy).

    LMDB maps the file and trusts its meta page, which names the last page in
    use: reading a page past the end of a truncated file kills the process
    with SIGBUS (no error to catch), in every reader and in ``verify`` alike.
    A committed transaction has written all its pages before its meta page,
    so a complete file always reaches the end of that page. Checked before
    any page beyond the two meta pages is read. ``opened_at``: the folder LMDB
    was given (:func:`open_env`'s pinned one), whose ``data.mdb`` is the file it
    opened; ``directory`` names it in the message.
    """
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    path = os.path.join(directory, "data.mdb")
    size = os.stat(os.path.join(opened_at or directory, "data.mdb")).st_size
    if size < need:
        raise CacheError(
            f"{path} is truncated: {size} bytes, but its last page ends at byte {need} "
            "(an interrupted copy or restore?); copy the complete file again, or delete "
            f"{directory} to start an empty cache"
        )


_REGISTRY: dict[tuple[int, int], EnvHandle] = {}
# Reentrant: a store's finalizer (garbage collection) may run while this thread
# holds it, e.g. inside _before_fork.
_REGISTRY_LOCK = threading.RLock()


def _ident(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CacheError(f"cannot open the disk cache at {path}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"the disk cache path {path} is not a directory")
    return (st.st_dev, st.st_ino)


def acquire_handle(path: str, *, readonly: bool, map_size: int, mode: int) -> EnvHandle:
    """This process's handle on the directory ``path`` (opened on first use), one more user."""
    ident = _ident(path)
    with _REGISTRY_LOCK:
        handle = _REGISTRY.get(ident)
        if handle is None:
            handle = EnvHandle(path, ident, readonly=readonly, map_size=map_size, mode=mode)
            _REGISTRY[ident] = handle
        elif handle.readonly and not readonly:
            raise CacheError(
                f"{path} is already open read-only in this process; close that store first"
            )
        handle.refs += 1
        return handle


def release_handle(handle: EnvHandle) -> None:
    """One user fewer; the last one closes the environment (``handle.env`` is then None)."""
    with _REGISTRY_LOCK:
        handle.refs -= 1
        if handle.refs > 0:
            return
        if _REGISTRY.get(handle.ident) is handle:
            del _REGISTRY[handle.ident]
    handle.close()


@contextlib.contextmanager
def no_handle_here(path: str) -> Iterator[None]:
    """Run the block while this process has no handle on ``path`` and opens none.

    Holds the registry lock, so no store of this process opens the directory
    (and no fork starts) until the block ends. Raises CacheError when a handle
    on it is open now (another store of this process uses the directory).
    """
    ident = _ident(path)
    with _REGISTRY_LOCK:
        if ident in _REGISTRY:
            raise CacheError(
                f"the disk cache at {path} is open in this process by another store; close it first"
            )
        yield


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


def _is_permission_error(exc: BaseException) -> bool:
    code = getattr(exc, "code", None) or getattr(exc, "errno", None)
    text = str(exc).lower()
    return code in (errno.EACCES, errno.EROFS, errno.EPERM) or "permission" in text


def is_failed_write(exc: BaseException | None) -> bool:
    """Map full, disk full or a failed write (:data:`FAILED_WRITE_ERRNOS`): the put is
    refused, not fatal."""
    if isinstance(exc, (lmdb.MapFullError, lmdb.DiskError)):
        return True
    if isinstance(exc, lmdb.Error):
        return exc.code in FAILED_WRITE_ERRNOS
    return isinstance(exc, OSError) and exc.errno in FAILED_WRITE_ERRNOS


class Txn:
    """``with Txn(handle) as txn``: an LMDB transaction counted in the handle's ``in_flight``.

    Commits when the block succeeds and aborts when it raises. LMDB errors
    become :class:`CacheError` (the LMDB error is the ``__cause__``), so callers
    catch one exception type, an ``OSError``.
    """

    __slots__ = ("_buffers", "_handle", "_in_flight", "_txn", "_write")

    def __init__(self, handle: EnvHandle, *, write: bool = False, buffers: bool = False) -> None:
        self._handle = handle
        self._in_flight = handle.in_flight  # the one entered, even if a fork replaces it
        self._write = write
        self._buffers = buffers  # values as zero-copy buffers, valid inside the block
        self._txn: lmdb.Transaction[Any] | None = None

    def __enter__(self) -> lmdb.Transaction[Any]:
        resized = False
        while True:
            self._in_flight.__enter__()
            try:
                env = self._handle.require()
                if self._buffers:
                    self._txn = env.begin(write=self._write, buffers=True)
                else:
                    self._txn = env.begin(write=self._write)
                return self._txn
            except lmdb.MapResizedError as exc:
                self._in_flight.__exit__()
                if resized or not self._handle.adopt_map_size():
                    raise cache_error(self._handle.path, exc) from exc
                resized = True
            except BaseException as exc:
                self._in_flight.__exit__()
                if isinstance(exc, lmdb.Error):
                    raise cache_error(self._handle.path, exc) from exc
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
                raise cache_error(self._handle.path, err) from err
        finally:
            self._in_flight.__exit__()
        if isinstance(exc, lmdb.Error):
            raise cache_error(self._handle.path, exc) from exc


def write_info(txn: lmdb.Transaction[Any], info: Any, totals: tuple[int, int, int, int]) -> None:
    """Write the format record and ``totals`` (bytes, items, next_seq, gen) into the
    ``info`` db of a new environment (a salvaged copy, see :mod:`.maintenance`)."""
    txn.put(_K_FORMAT, _FORMAT.pack(_MAGIC, *DISK_FORMAT_VERSION), db=info)
    txn.put(TOTALS_KEY, TOTALS_RECORD.pack(*totals), db=info)


def cache_error(path: str, exc: BaseException) -> CacheError:
    """The CacheError an LMDB failure of the cache at ``path`` becomes (``raise ... from``)."""
    return CacheError(f"the disk cache at {path} failed: {exc}")
