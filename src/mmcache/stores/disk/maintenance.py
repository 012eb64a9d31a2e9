"""Maintenance of a disk cache directory: verify, rebuild the totals, compact.

None of these is on a training path: each reads or rewrites the whole
environment, and :func:`compact_in_place` needs the directory to itself.
LMDB does not checksum its pages, so :func:`verify_entries` (with the codec's
checksum) is how silent corruption is found, and :func:`rebuild_totals_txn`
the repair after it. LMDB files never shrink (freed pages are reused, the file
keeps its largest size), so a copy without the free pages is how the disk
tier gives space back after a large eviction (``mmcache gc --compact``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import lmdb

from mmcache.errors import CacheError
from mmcache.rootfiles import make_dir, open_file
from mmcache.stores.base import dir_mode
from mmcache.stores.disk.env import (
    DB_NAMES,
    EnvHandle,
    cache_error,
    no_handle_here,
    open_env,
    write_info,
)
from mmcache.stores.disk.packs import PACK_MAX_ENTRY, Packer, read_value, recount_packs
from mmcache.stores.disk.reserve import reserve_lock_file
from mmcache.stores.disk.snapshot import Totals, parse_meta

__all__ = [
    "CompactReport",
    "DamagedTreeError",
    "SalvageReport",
    "compact_copy",
    "compact_in_place",
    "rebuild_totals_txn",
    "salvage_in_place",
    "tree_problem",
    "verify_entries",
]

logger = logging.getLogger(__name__)


#: What LMDB raises on a page that is not what the B-tree says (it checksums none):
#: random bytes, zeroed bounds, a page of another file.
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadValsizeError, lmdb.InvalidError)


class DamagedTreeError(CacheError):
    """Pages of the disk tier's B-tree cannot be read: not one bad entry, but a part
    of the file. :func:`salvage_in_place` (``mmcache verify --repair``) copies what is
    still readable into a fresh file."""


def _damaged(path: str, exc: BaseException) -> DamagedTreeError:
    return DamagedTreeError(
        f"the disk tier's B-tree in {os.path.join(path, 'data.mdb')} is damaged ({exc}); "
        f"`mmcache verify --repair --cache {os.path.dirname(path)}` copies the readable "
        f"entries into a fresh file (or delete {path} to start the tier empty)"
    )


def tree_problem(h: EnvHandle) -> str | None:
    """Why the B-tree of the data or meta db cannot be walked, or None when it can.

    Walks the keys only (leaf pages, not the values' overflow pages): what
    ``mmcache stats`` runs to say a tier is damaged. Read-only, process-safe.
    """
    with h.in_flight:
        try:
            with h.require().begin() as txn:
                for db in (h.data, h.meta, h.slots, h.packs):
                    for _ in txn.cursor(db=db).iternext(values=False):
                        pass
        except _DAMAGE as exc:
            return str(_damaged(h.path, exc))
        except lmdb.Error as exc:
            raise cache_error(h.path, exc) from exc
    return None


def verify_entries(h: EnvHandle, check: Callable[[bytes], bool]) -> list[bytes]:
    """Keys whose value fails ``check`` (or raises) or disagrees with its meta record.

    Also the keys of meta records without a value. Reads in one transaction
    and changes nothing: no hit, miss or access time is recorded.
    """
    bad: list[bytes] = []
    with h.in_flight:
        try:
            with h.require().begin(buffers=True) as txn:
                seen: dict[int, Any] = {}
                for db in (h.data, h.slots):  # entries stored alone, then packed ones
                    for raw_key in txn.cursor(db=db).iternext(values=False):
                        key = bytes(raw_key)
                        value = read_value(txn, h, key, seen)
                        meta = parse_meta(txn.get(key, db=h.meta))
                        if value is None or meta is None or meta[0] != len(value):
                            bad.append(key)
                            continue
                        try:
                            ok = bool(check(bytes(value)))
                        except Exception:
                            ok = False
                        if not ok:
                            bad.append(key)
                for raw_key in txn.cursor(db=h.meta).iternext(values=False):
                    if read_value(txn, h, bytes(raw_key), seen) is None:
                        bad.append(bytes(raw_key))
        except _DAMAGE as exc:
            raise _damaged(h.path, exc) from exc
        except lmdb.Error as exc:
            raise cache_error(h.path, exc) from exc
    return list(dict.fromkeys(bad))


def rebuild_totals_txn(txn: lmdb.Transaction[Any], h: EnvHandle, tot: Totals) -> int:
    """Recount ``tot`` from the data, slot and meta dbs in the write ``txn``; return the
    number of entries removed.

    Entries whose meta record is missing, damaged or disagrees with the value's
    size are removed: they cannot be trusted. The caller writes ``tot`` and
    drops its snapshot of the meta columns.
    """
    sizes = {bytes(k): len(v) for k, v in txn.cursor(db=h.data)}
    seen: dict[int, Any] = {}
    for raw_key in list(txn.cursor(db=h.slots).iternext(values=False)):
        key = bytes(raw_key)
        value = read_value(txn, h, key, seen)  # None: a slot outside its pack, or no pack
        if key in sizes or value is None:
            txn.delete(key, db=h.slots)  # stored twice, or unreadable: not trusted
        else:
            sizes[key] = len(value)
    metas = {bytes(k): bytes(v) for k, v in txn.cursor(db=h.meta)}
    total = items = orphans = 0
    next_seq = tot.next_seq
    for key, raw in metas.items():
        meta = parse_meta(raw)
        if meta is not None and sizes.get(key) == meta[0]:
            total += sizes[key]
            items += 1
            next_seq = max(next_seq, meta[5] + 1)
        else:
            txn.delete(key, db=h.meta)
            txn.delete(key, db=h.data)
            txn.delete(key, db=h.slots)
            orphans += 1
    for key in sizes.keys() - metas.keys():
        txn.delete(key, db=h.data)
        txn.delete(key, db=h.slots)
        orphans += 1
    recount_packs(txn, h)
    if orphans:
        logger.warning("%s: removed %d inconsistent entries", h.path, orphans)
    tot.bytes, tot.items, tot.next_seq = total, items, next_seq
    tot.gen += 1
    return orphans


def compact_copy(h: EnvHandle, dest: str | os.PathLike[str], *, mode: int) -> None:
    """Write a compacted copy of the open environment into the new directory ``dest``.

    Never overwrites an environment (CacheError if ``dest`` holds a data.mdb).
    """
    target = os.fspath(dest)
    make_dir(target, dir_mode(mode))  # exact mode, a shared root's setgid kept
    if os.path.exists(os.path.join(target, "data.mdb")):
        raise CacheError(f"{target} already holds an LMDB environment")
    with h.in_flight:
        try:
            h.require().copy(target, compact=True)
        except lmdb.Error as exc:
            raise cache_error(h.path, exc) from exc


@dataclass(frozen=True)
class CompactReport:
    """What :func:`compact_in_place` did: the size of ``data.mdb`` before and after."""

    path: str
    before: int
    after: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _compacted(env: lmdb.Environment, dest: str) -> None:
    env.copy(dest, compact=True)


def compact_in_place(
    path: str,
    *,
    mode: int,
    map_size: int,
    write: Callable[[lmdb.Environment, str], None] = _compacted,
) -> CompactReport:
    """Replace ``path/data.mdb`` by a compacted copy, while no process has it open.

    Raises CacheError, leaving the cache as it was, when a process (this one
    included) has the environment open or the copy does not fit on the disk.

    Nobody else has it open: every process with the environment open holds a
    shared ``fcntl`` lock on byte 0 of ``lock.mdb`` (how LMDB finds its first
    opener), so an exclusive lock on it, taken without waiting, proves it.
    Held until the end, that lock also makes a process that opens the
    directory meanwhile wait in its open. The copy is read with an environment
    that takes no locks (MDB_NOLOCK; nobody else can write), written and
    fsynced in a ``.compact-*`` folder inside ``path`` and renamed over
    ``data.mdb``: a crash leaves the old file or the new one, both complete.

    ``lock.mdb`` keeps the last transaction id of the file it was made for; a
    process that waited at its open (not the first opener, so it does not
    rebuild it) would read the new file by the old id, which can name its
    empty meta page, and then write over the cache. So the lock file is
    emptied just before the rename (a waiting open then fails: an error,
    never the old state, even if this process dies here) and rebuilt for the
    new file before the lock is released (:func:`_reset_lock_file`).

    ``write(env, dest)`` writes the new environment into the folder ``dest``
    (a compacted copy; :func:`salvage_in_place` passes its salvage).
    """
    with no_handle_here(path):
        try:
            fd, _ = open_file(os.path.join(path, "lock.mdb"), os.O_RDWR, 0)  # no link
        except OSError as exc:
            raise CacheError(f"cannot compact the disk cache at {path}: {exc}") from exc
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise CacheError(f"cannot compact the disk cache at {path}: {exc}") from exc
                raise CacheError(
                    f"cannot compact the disk cache at {path}: another process has it open "
                    "(a training job, its DataLoader workers, or another mmcache command); "
                    "compacting replaces its file, so stop them and run it again"
                ) from exc
            try:
                return _swap_compacted(path, fd, mode=mode, map_size=map_size, write=write)
            finally:
                _reset_lock_file(path, fd, mode=mode, map_size=map_size)
        finally:
            os.close(fd)


def _swap_compacted(
    path: str,
    lock_fd: int,
    *,
    mode: int,
    map_size: int,
    write: Callable[[lmdb.Environment, str], None],
) -> CompactReport:
    """Copy, fsync, empty the lock file, rename. The caller holds the exclusive lock."""
    data = os.path.join(path, "data.mdb")
    old = os.stat(data)
    for stale in glob.glob(os.path.join(glob.escape(path), ".compact-*")):
        shutil.rmtree(stale, ignore_errors=True)  # of a compaction that crashed
    tmp = tempfile.mkdtemp(prefix=".compact-", dir=path)
    try:
        try:
            # open_env refuses a truncated file (it would SIGBUS the copy).
            env = open_env(path, map_size=map_size, readonly=True, mode=mode, lock=False)
            try:
                write(env, tmp)
            finally:
                env.close()
            new = os.path.join(tmp, "data.mdb")
            fd = os.open(new, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
                os.fchmod(fd, mode)
                if os.fstat(fd).st_gid != old.st_gid:  # a group-shared cache stays shared
                    os.fchown(fd, -1, old.st_gid)
            finally:
                os.close(fd)
        except (lmdb.Error, OSError) as exc:
            raise CacheError(
                f"cannot write a compacted copy of the disk cache at {path} ({exc}); the "
                "cache is unchanged (the copy needs about as much free space as it holds)"
            ) from exc
        os.ftruncate(lock_fd, 0)
        os.replace(new, data)
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CompactReport(path=path, before=old.st_size, after=os.stat(data).st_size)


def _reset_lock_file(path: str, fd: int, *, mode: int, map_size: int) -> None:
    """Make ``lock.mdb`` describe the current ``data.mdb`` before the lock ``fd`` goes.

    Opening the environment here makes this process the first opener (its
    lock does not conflict with our own), which rebuilds the lock file from
    the data file; closing it drops this process's locks on the file, ours
    included. The file's blocks are allocated first (LMDB writes it through a
    mapping: see :mod:`.reserve`). If either fails, the lock file is left
    empty, which any later open rebuilds and a waiting one refuses.
    """
    try:
        reserve_lock_file(fd)
        env = open_env(path, map_size=map_size, readonly=False, mode=mode, lock=True)
    except (OSError, lmdb.Error) as exc:
        logger.warning("%s: cannot rebuild lock.mdb after compacting (%s); emptied it", path, exc)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        return
    env.close()


@dataclass(frozen=True)
class SalvageReport:
    """What :func:`salvage_in_place` kept: entries copied, entries lost (listed in a
    readable part of the tree but unreadable, or inconsistent), and the file sizes."""

    path: str
    kept: int
    lost: int
    before: int
    after: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _readable_keys(env: lmdb.Environment, db: Any) -> set[bytes]:
    """The keys of ``db`` a cursor reaches from either end before a damaged page
    (each walk in its own transaction: an LMDB error invalidates the one it hit)."""
    keys: set[bytes] = set()
    with contextlib.suppress(lmdb.Error), env.begin() as txn:
        for key in txn.cursor(db=db).iternext(values=False):
            keys.add(bytes(key))
    with contextlib.suppress(lmdb.Error), env.begin() as txn:
        cursor = txn.cursor(db=db)
        found = cursor.last()
        while found:
            keys.add(bytes(cursor.key()))
            found = cursor.prev()
    return keys


@dataclass
class _Dbs:
    """The named databases of an environment that is not an :class:`EnvHandle`'s (a
    salvage's source and its fresh copy): what :mod:`.packs` reads and writes."""

    data: Any
    meta: Any
    info: Any
    slots: Any
    packs: Any
    packlive: Any

    @classmethod
    def open(cls, env: lmdb.Environment, *, create: bool) -> _Dbs:
        return cls(*(env.open_db(name, create=create) for name in DB_NAMES))


class _Reader:
    """Reads one entry at a time from a damaged environment: a read that fails
    invalidates its transaction (MDB_BAD_TXN after MDB_CORRUPTED), so a new one
    is begun for the next."""

    def __init__(self, env: lmdb.Environment, dbs: _Dbs) -> None:
        self._env, self._dbs = env, dbs
        self._txn: lmdb.Transaction[Any] | None = None

    def read(self, key: bytes) -> tuple[bytes | None, bytes | None] | None:
        """``(value, meta record)`` (copies), or None when the pages of ``key`` are damaged."""
        if self._txn is None:
            self._txn = self._env.begin(buffers=True)
        try:
            value = read_value(self._txn, self._dbs, key)
            raw = self._txn.get(key, db=self._dbs.meta)
            return (
                None if value is None else bytes(value),
                None if raw is None else bytes(raw),
            )
        except lmdb.Error:
            self.close()
            return None

    def close(self) -> None:
        txn, self._txn = self._txn, None
        if txn is not None:
            with contextlib.suppress(lmdb.Error):
                txn.abort()


def _salvage_copy(
    env: lmdb.Environment, dest: str, *, mode: int, map_size: int, counts: list[int]
) -> None:
    """Write into the folder ``dest`` a fresh environment of the readable, consistent
    entries of ``env`` (value and meta record both readable, sizes agreeing), with its
    totals counted; ``counts`` gets ``[kept, lost]``.

    The keys come from both ends of the data and the meta db (a cursor stops at
    a damaged page; each entry is then read by its own lookup, which descends
    another path of the tree). Entries are written in batches of transactions,
    so memory holds the keys, never the values.
    """
    kept = lost = total = next_seq = 0
    src: _Dbs | None
    try:
        src = _Dbs.open(env, create=False)
    except lmdb.Error:
        src = None  # the main db itself is damaged (or a part is missing): an empty tier
    out = open_env(dest, map_size=map_size, readonly=False, mode=mode, lock=False)
    try:
        dst = _Dbs.open(out, create=True)
        if src is not None:
            keys = sorted(
                _readable_keys(env, src.data)
                | _readable_keys(env, src.meta)
                | _readable_keys(env, src.slots)
            )
            reader = _Reader(env, src)
            try:
                for start in range(0, len(keys), 512):
                    with out.begin(write=True) as wtxn:
                        packer = Packer(wtxn, dst)  # small entries packed again
                        for key in keys[start : start + 512]:
                            got = reader.read(key)
                            value, raw = got if got is not None else (None, None)
                            record = parse_meta(raw)
                            if (
                                value is None
                                or raw is None
                                or record is None
                                or record[0] != len(value)
                            ):
                                lost += 1
                            else:
                                if len(value) <= PACK_MAX_ENTRY:
                                    packer.add(key, value)
                                else:
                                    wtxn.put(key, value, db=dst.data)
                                wtxn.put(key, raw, db=dst.meta)
                                kept += 1
                                total += len(value)
                                next_seq = max(next_seq, record[5] + 1)
                        packer.flush()
            finally:
                reader.close()
        with out.begin(write=True) as wtxn:
            write_info(wtxn, dst.info, (total, kept, next_seq, 1))
    finally:
        out.close()
    counts[:] = [kept, lost]


def salvage_in_place(path: str, *, mode: int, map_size: int) -> SalvageReport:
    """Replace a ``data.mdb`` whose B-tree is damaged (:class:`DamagedTreeError`) by a
    fresh one holding every entry still readable; while no process has it open.

    The swap is :func:`compact_in_place`'s (the same lock, fsync and rename: a
    crash leaves the damaged file or the fresh one, both whole); only the copy
    differs (:func:`_salvage_copy`). The values are not checked here: ``verify``
    after it finds and removes those that rotted. Raises CacheError, leaving the
    file as it was, when another process has it open or the copy does not fit.
    """
    counts = [0, 0]

    def write(env: lmdb.Environment, dest: str) -> None:
        _salvage_copy(env, dest, mode=mode, map_size=map_size, counts=counts)

    done = compact_in_place(path, mode=mode, map_size=map_size, write=write)
    kept, lost = counts
    logger.warning("%s: salvaged %d entries into a fresh file, %d lost", path, kept, lost)
    return SalvageReport(path, kept, lost, done.before, done.after)
