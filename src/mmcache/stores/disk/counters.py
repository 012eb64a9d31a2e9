"""Node-wide event counters of a disk cache directory: a small file updated under ``flock``.

hits, misses, puts, admitted, refused, evictions, expired and corrupt are
cumulative over every process and run that used the directory: they live in
``stats.i64`` (eight int64 counters after a magic number) and each update
takes an ``flock`` for about a microsecond; bytes and items come from the
transactional totals instead (:class:`.snapshot.Totals`). Take differences
between two ``DiskStore.stats()`` calls for per-epoch rates, or call
``DiskStore.reset_stats()``. Where the file cannot be written (a read-only
cache root) the counters are per-process.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import threading
from enum import IntEnum

from mmcache.rootfiles import open_file

__all__ = ["STATS_FILE", "Counter", "CounterFile"]

logger = logging.getLogger(__name__)

STATS_FILE = "stats.i64"
_STATS_MAGIC = 0x6D6D63_73746174_01  # "mmc" "stat" v1
_STATS_SIZE = 16 * 8


class Counter(IntEnum):
    """The counters, by their slot in the file (slot 0 holds the magic number).

    Named as the fields of :class:`~mmcache.stats.TierStats` (lower case).
    """

    HITS = 1
    MISSES = 2
    PUTS = 3
    ADMITTED = 4
    REFUSED = 5
    EVICTIONS = 6
    EXPIRED = 7
    CORRUPT = 8


class CounterFile:
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
        path = os.path.join(directory, STATS_FILE)
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:  # never through a link planted in a shared root; a new file gets ``mode``
            fd, _ = open_file(path, flags, mode)
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

    def add(self, *pairs: tuple[Counter, int]) -> None:
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

    def counts(self) -> dict[str, int]:
        """Every counter by its :class:`~mmcache.stats.TierStats` field name."""
        values = self.read()
        return {c.name.lower(): values[c] for c in Counter}

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
