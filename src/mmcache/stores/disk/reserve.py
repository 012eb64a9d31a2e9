"""Disk blocks for the files LMDB writes through mappings, allocated before it opens them.

A separate room because it is about the file system, not LMDB's API: on a full
disk, a page LMDB touches through a shared mapping that has no block behind it
kills the process with SIGBUS, so the blocks are reserved first and a full
disk becomes a CacheError (:func:`reserve_files`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from collections.abc import Callable
from typing import cast

from mmcache.errors import CacheError
from mmcache.rootfiles import UnsafeFileError, open_file
from mmcache.stores.base import is_no_space

__all__ = ["MAX_READERS", "reserve_files", "reserve_lock_file"]

logger = logging.getLogger(__name__)

#: Reader slots (64 bytes each in lock.mdb): several per worker and rank.
MAX_READERS = 1024
#: Size LMDB gives lock.mdb: a 192-byte header holding the first of the 64-byte reader
#: slots (mdb_env_setup_locks: ``(max_readers - 1) * 64 + 192``; measured: 8192 B for
#: LMDB's default of 126 readers, 65664 B for 1024).
_LOCK_FILE_SIZE = 128 + 64 * MAX_READERS
_FALLOC_FL_KEEP_SIZE = 1


def reserve_files(path: str, *, mode: int, readonly: bool) -> None:
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
    Both files are opened through :func:`mmcache.rootfiles.open_file`: a new one
    gets ``mode`` exactly; a symbolic or hard link a member of a shared root
    planted raises UnsafeFileError (a CacheError), so LMDB never writes through it.
    Called before ``lmdb.open``, while this process holds no LMDB lock on
    the files (closing a descriptor of lock.mdb would drop them). Raises
    CacheError when the file system has no room; other errors are left to
    ``lmdb.open`` to report in its own words.
    """
    flags = os.O_RDWR | os.O_CREAT
    try:
        fd, _ = open_file(os.path.join(path, "lock.mdb"), flags, mode)
        try:
            reserve_lock_file(fd)
        finally:
            os.close(fd)
        if not readonly:  # a read-only open never creates data.mdb
            fd, _ = open_file(os.path.join(path, "data.mdb"), flags, mode)
            try:
                if os.fstat(fd).st_size < 2 * mmap.PAGESIZE:
                    _allocate_keep_size(fd, 2 * mmap.PAGESIZE)
            finally:
                os.close(fd)
    except UnsafeFileError:
        raise  # a planted link: LMDB, which opens the files by name, must not follow it
    except OSError as exc:
        if is_no_space(exc):
            raise CacheError(
                f"no space left on the file system of the disk cache at {path}"
                f" ({exc.strerror}): free some space, or pass disk=None"
            ) from exc
        logger.debug("cannot preallocate the LMDB files in %s: %s", path, exc)


def reserve_lock_file(fd: int) -> None:
    """Allocate the blocks of the open ``lock.mdb`` (LMDB's size for it if it is empty).

    Raises OSError (ENOSPC) when the file system has no room for them.
    """
    os.posix_fallocate(fd, 0, os.fstat(fd).st_size or _LOCK_FILE_SIZE)


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
