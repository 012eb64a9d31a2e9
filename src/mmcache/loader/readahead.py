"""Read-ahead of a guessed epoch's next batches on one daemon thread of the training process.

In a guessed (warm) epoch the training process plans the batches itself, so it also
asks for the cache pages of the batches to come (``prefetch`` of the disk tier:
``mincore`` then ``MADV_WILLNEED``; it looks at :data:`READ_AHEAD_PROBE` entries of
a batch first and stops there when their pages are resident, so a warm page cache
costs a few system calls a batch). :class:`ReadAhead` takes that off the training loop: the loop only
queues the keys (in the epoch's order); the thread makes the calls. The queue is
bounded: when the thread lags, the oldest requests are dropped (a hint only).

In a guessed epoch the same thread also promotes the next batches' entries into free
memory (``WorkerPlanner.ahead``: what the workers do while planning an epoch).

Thread/fork safety: the thread starts on first use in each process (a forked
child never inherits it); every method may be called from any thread.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable

import numpy as np

__all__ = ["READ_AHEAD_PROBE", "ReadAhead"]

logger = logging.getLogger(__name__)

_MAX_PENDING = 16

#: Entries of a batch whose pages the read-ahead looks at first; when all of theirs
#: are resident, the batch's others are taken to be too (``DiskGather.prefetch``).
READ_AHEAD_PROBE = 4


class ReadAhead:
    """Calls ``fn(keys)`` for each submitted key array, in order, on a daemon thread."""

    def __init__(self, fn: Callable[[np.ndarray], object]) -> None:
        self._fn = fn
        self._pending: collections.deque[np.ndarray] = collections.deque(maxlen=_MAX_PENDING)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = -1

    def submit(self, keys: np.ndarray) -> None:
        """Queue ``keys`` (``uint8 [n, 16]``) for read-ahead; never blocks."""
        with self._cond:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run, name="mmcache-readahead", daemon=True
                )
                self._thread.start()
            self._pending.append(keys)
            self._cond.notify()

    def close(self) -> None:
        """Stop the thread (what is queued is dropped); a later submit starts a new one."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._pending.clear()
            self._cond.notify_all()
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(5)

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._pending and self._thread is me:
                    self._cond.wait()
                if self._thread is not me:
                    return
                keys = self._pending.popleft()
            try:
                self._fn(keys)
            except Exception as exc:  # a hint only: never stops training
                logger.debug("read-ahead failed: %s", exc)
