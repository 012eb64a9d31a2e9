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
    EnvHandle,
    cache_error,
    check_complete,
    no_handle_here,
    open_env,
)
from mmcache.stores.disk.reserve import reserve_lock_file
from mmcache.stores.disk.snapshot import Totals, parse_meta

__all__ = [
    "CompactReport",
    "compact_copy",
    "compact_in_place",
    "rebuild_totals_txn",
    "verify_entries",
]

logger = logging.getLogger(__name__)


def verify_entries(h: EnvHandle, check: Callable[[bytes], bool]) -> list[bytes]:
    """Keys whose value fails ``check`` (or raises) or disagrees with its meta record.

    Also the keys of meta records without a value. Reads in one transaction
    and changes nothing: no hit, miss or access time is recorded.
    """
    bad: list[bytes] = []
    with h.in_flight:
        try:
            with h.require().begin(buffers=True) as txn:
                for raw_key, value in txn.cursor(db=h.data):
                    key = bytes(raw_key)
                    meta = parse_meta(txn.get(key, db=h.meta))
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
            raise cache_error(h.path, exc) from exc
    return bad


def rebuild_totals_txn(txn: lmdb.Transaction[Any], h: EnvHandle, tot: Totals) -> int:
    """Recount ``tot`` from the data and meta dbs in the write ``txn``; return the
    number of entries removed.

    Entries whose meta record is missing, damaged or disagrees with the value's
    size are removed: they cannot be trusted. The caller writes ``tot`` and
    drops its snapshot of the meta columns.
    """
    sizes = {bytes(k): len(v) for k, v in txn.cursor(db=h.data)}
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
            orphans += 1
    for key in sizes.keys() - metas.keys():
        txn.delete(key, db=h.data)
        orphans += 1
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


def compact_in_place(path: str, *, mode: int, map_size: int) -> CompactReport:
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
                return _swap_compacted(path, fd, mode=mode, map_size=map_size)
            finally:
                _reset_lock_file(path, fd, mode=mode, map_size=map_size)
        finally:
            os.close(fd)


def _swap_compacted(path: str, lock_fd: int, *, mode: int, map_size: int) -> CompactReport:
    """Copy, fsync, empty the lock file, rename. The caller holds the exclusive lock."""
    data = os.path.join(path, "data.mdb")
    old = os.stat(data)
    for stale in glob.glob(os.path.join(glob.escape(path), ".compact-*")):
        shutil.rmtree(stale, ignore_errors=True)  # of a compaction that crashed
    tmp = tempfile.mkdtemp(prefix=".compact-", dir=path)
    try:
        try:
            env = open_env(path, map_size=map_size, readonly=True, mode=mode, lock=False)
            try:
                check_complete(env, path)  # a truncated file would SIGBUS the copy
                env.copy(tmp, compact=True)
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
