"""Read-ahead of a guessed epoch's next batches on a few daemon threads of the training process.

In a guessed (warm) epoch the training process plans the batches itself, so it also
has the cache read the entries of the batches to come (``WorkerPlanner.ahead``:
promotion into free memory, then the disk tier's ``prefetch``, whose LMDB reads
bring each entry's pages into the page cache with the GIL released).
:class:`ReadAhead` takes that off the training loop: the loop only queues the
keys (in the epoch's order); :data:`THREADS` threads take them :data:`CHUNK`
keys at a time, so that many entries are read from the device at once (one
thread reads one entry after the other: measured at ~0.27 of ``dd``'s
bandwidth with the page cache dropped; four threads, ~0.5). On warm pages a
chunk costs about a microsecond an entry. The queue is bounded: when the
threads lag, the oldest requests are dropped (a hint only).

Thread/fork safety: the threads start on first use in each process (a forked
child never inherits them); every method may be called from any thread.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable

import numpy as np

__all__ = ["CHUNK", "THREADS", "ReadAhead"]

logger = logging.getLogger(__name__)

#: Threads reading ahead (entries read from the device at once).
THREADS = 4
#: Keys a thread takes at a time.
CHUNK = 16
#: Chunks queued at most (the oldest beyond it are dropped).
_MAX_PENDING = 64


class ReadAhead:
    """Calls ``fn(chunk)`` for each :data:`CHUNK` keys of each submitted key array,
    in order, on ``threads`` daemon threads (chunks run concurrently)."""

    def __init__(
        self, fn: Callable[[np.ndarray], object], *, threads: int = THREADS, chunk: int = CHUNK
    ) -> None:
        if threads < 1 or chunk < 1:
            raise ValueError(f"threads and chunk must be >= 1, got {threads}, {chunk}")
        self._fn = fn
        self._threads_wanted = threads
        self._chunk = chunk
        self._pending: collections.deque[np.ndarray] = collections.deque(maxlen=_MAX_PENDING)
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._generation = 0  # bumped by close(): older threads exit
        self._pid = -1

    def submit(self, keys: np.ndarray) -> None:
        """Queue ``keys`` (``uint8 [n, 16]``) for read-ahead; never blocks."""
        with self._cond:
            if self._pid != os.getpid() or not any(t.is_alive() for t in self._threads):
                self._start()
            for i in range(0, len(keys), self._chunk):
                self._pending.append(keys[i : i + self._chunk])
            self._cond.notify_all()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._generation += 1
        gen = self._generation
        self._threads = [
            threading.Thread(
                target=self._run, args=(gen,), name=f"mmcache-readahead-{i}", daemon=True
            )
            for i in range(self._threads_wanted)
        ]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Stop the threads (what is queued is dropped); a later submit starts new ones."""
        with self._cond:
            threads, self._threads = self._threads, []
            self._generation += 1
            self._pending.clear()
            self._cond.notify_all()
        me = threading.current_thread()
        for t in threads:
            if t.is_alive() and t is not me and self._pid == os.getpid():
                t.join(5)

    def _run(self, gen: int) -> None:
        while True:
            with self._cond:
                while not self._pending and self._generation == gen:
                    self._cond.wait()
                if self._generation != gen:
                    return
                keys = self._pending.popleft()
            try:
                self._fn(keys)
            except Exception as exc:  # a hint only: never stops training
                logger.debug("read-ahead failed: %s", exc)
