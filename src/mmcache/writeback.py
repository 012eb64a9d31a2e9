"""Write-behind: admit produced samples to the cache without making anyone wait.

A DataLoader worker that decoded a miss hands the encoded sample to a
:class:`WriteBehind` and returns the sample to the training process at once.
The entry goes into the node-shared memory tier right away (a fast copy), and
a background thread of that worker process writes the queued entries to the
disk tier, grouping them (one LMDB commit, so one ``fsync``, per
about 1 MiB instead of per sample: a commit costs about half a JPEG decode
here). A cache is allowed to lose a few pending writes: the entries are
simply produced again next time. Nothing half-written is ever visible: each
entry is committed whole or not at all by the tiers.

Process lifetime: the queue is flushed when the worker process exits normally
(a ``multiprocessing`` finalizer, which runs before a worker's ``os._exit``,
unlike ``atexit``) and when :func:`flush_all` is called; a killed process
loses its queue, which the cache tolerates by design.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from multiprocessing import util

from mmcache.cache import Cache

__all__ = ["WriteBehind", "flush_all", "write_behind"]

logger = logging.getLogger(__name__)

#: Entries waiting to be written, per process: bounds the memory they hold
#: (64 x 150 KB samples = ~10 MiB); a full queue makes the producer write itself.
MAX_PENDING = 64
#: Write at most this many bytes per group (one disk-tier commit per group).
GROUP_BYTES = 1 << 20


class WriteBehind:
    """A background writer for one :class:`Cache` in one process. Thread-safe."""

    def __init__(self, cache: Cache, *, max_pending: int = MAX_PENDING) -> None:
        self.cache = cache
        self._queue: queue.Queue[tuple[bytes, bytes, float] | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name="mmcache-write-behind", daemon=True)
        self._pid = os.getpid()
        self._closed = False
        self._thread.start()

    def submit(self, key: bytes, raw: bytes, cost: float, tag: str | None = None) -> bool:
        """Admit an encoded entry: to the memory tier now, to the disk tier in the background.

        The memory-tier put is quick (a copy into shared memory, ~0.1 ms for 150 KB)
        and makes the entry visible to every process at once, so the next epoch's
        planner finds it; the disk commit (an fsync) is what is deferred. When
        the queue is full the disk write happens here, which bounds the memory
        pending entries hold. Returns whether the memory tier admitted the entry.
        """
        if tag is not None:
            self.cache.tag(tag, [key])
        memory = self.cache.memory
        in_memory = False
        if memory is not None:
            try:
                in_memory = memory.put(key, raw, cost=cost, ctime=_ctime(raw))
            except OSError as exc:
                logger.warning("put to memory tier failed: %s", exc)
        if self.cache.disk is None:
            return in_memory
        if self._closed:
            self.cache.put_many([(key, raw, cost)], memory=False)
            return in_memory
        try:
            self._queue.put_nowait((key, raw, cost))
        except queue.Full:
            self.cache.put_many([(key, raw, cost)], memory=False)
        return in_memory

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            group = [item]
            size = len(item[1])
            stop = False
            while size < GROUP_BYTES:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                group.append(nxt)
                size += len(nxt[1])
            try:
                self.cache.put_many(group, memory=False)
            except Exception:  # a cache write must never kill the worker
                logger.exception("write-behind: %d cache puts failed", len(group))
            if stop:
                return

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


def _ctime(raw: bytes) -> float:
    from mmcache.codec import read_header

    return read_header(raw).ctime


_WRITERS: dict[int, WriteBehind] = {}
_LOCK = threading.RLock()  # re-entrant: a GC finalizer may flush mid-call


def write_behind(cache: Cache) -> Callable[..., bool]:
    """The submit function of this process's writer for ``cache`` (created on first use)."""
    with _LOCK:
        writer = _WRITERS.get(id(cache))
        fresh = writer is None or writer.cache is not cache or writer._pid != os.getpid()
        if fresh:
            writer = WriteBehind(cache)
            _WRITERS[id(cache)] = writer
    if writer is None:  # pragma: no cover - set above
        raise RuntimeError("write-behind writer missing")
    if fresh:
        # Outside the lock: creating the finalizer can run the garbage collector,
        # whose finalizers may call flush_all() (which takes the lock).
        # It runs at a normal exit of this process, DataLoader workers included.
        util.Finalize(writer, writer.flush, exitpriority=10)
    return writer.submit


def flush_all() -> None:
    """Flush every writer of this process (the loader calls it at the end of an epoch)."""
    with _LOCK:
        writers = list(_WRITERS.values())
        _WRITERS.clear()
    for w in writers:
        w.flush()
