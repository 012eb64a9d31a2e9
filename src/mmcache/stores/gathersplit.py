"""Copy and check a batch's entries on two threads at once, when that is faster here.

A warm epoch's batch is made on one thread (the loader builds one batch ahead, and a
training loop that only waits for batches takes the next one itself), and most of
its time is the copy of each entry out of ``/dev/shm`` and the hash of the copy.
Both release the GIL (numpy's copy; ``xxhash``'s ``update`` above 64 KiB), so the
entries of one batch can be split between the calling thread and one helper thread
and run on two cores. Whether that pays depends on the machine at the moment: with
a free core a batch takes ~0.6 of the time; with every core busy (other jobs on the
node) the two halves take turns on one core, and the hand-offs of the GIL between
the threads cost more than they save.

So :class:`SplitRows` measures: it keeps the mean time per entry of both ways (one
thread, two) and runs each batch the faster way, trying the other every few batches
(:data:`EXPLORE`) so that a change of load is seen. The rows and bytes served are the
same either way (each entry is copied and checked on its own, into its own row): only
the time differs.

Thread/process safety: :meth:`SplitRows.run` from any thread (two assembling threads
at once: one of them splits, the other runs whole while the helper is taken). One
:data:`SPLIT_ROWS` per process, its times a property of the machine: a forked child
gets a fresh lock and starts its own helper thread on first use (the parent's is not
in the child).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

__all__ = ["EXPLORE", "MIN_SPLIT", "SPLIT_ROWS", "SplitRows"]

#: Batches with fewer entries (of large ranges) than this run on one thread.
MIN_SPLIT = 8
#: Every this many batches, the way that is slower lately is tried once.
EXPLORE = 8
#: Weight of the latest batch in the mean time per entry of its way.
_WEIGHT = 0.25

Rows = Callable[[Sequence[int], Callable[[int], None]], npt.NDArray[np.bool_]]


class SplitRows:
    """Runs ``check(rows, before)`` (``codec.checksums_match_rows`` with its piece
    layout bound) on one thread or split over two, whichever is faster lately (see the
    module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._busy = False  # the helper runs a half now (of another thread's batch)
        self._per_entry: dict[bool, float | None] = {False: None, True: None}
        self._batches = 0

    def after_fork(self) -> None:
        """In a fork child: a fresh lock (another thread may have held the parent's)
        and no helper (the parent's thread is not here)."""
        self._lock = threading.Lock()
        self._pool = None
        self._busy = False

    def _choose(self) -> bool:
        """Whether to split the next batch (under ``self._lock``)."""
        self._batches += 1
        one, two = self._per_entry[False], self._per_entry[True]
        if one is None or two is None:  # each way once first
            return one is not None
        faster = two < one
        return faster != (self._batches % EXPLORE == 0)

    def _helper(self) -> ThreadPoolExecutor:
        """This process's helper thread, started on first use (under ``self._lock``)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mmcache-gather")
        return self._pool

    def run(
        self, check: Rows, rows: Sequence[int], before: Callable[[int], None]
    ) -> npt.NDArray[np.bool_]:
        """``check(rows, before)``, the second half of the rows on the helper thread
        when that is the faster way now; the same result either way."""
        n = len(rows)
        if n < MIN_SPLIT:
            return check(rows, before)
        with self._lock:
            split = self._choose() and not self._busy
            if split:
                pool = self._helper()
                self._busy = True
        start = time.perf_counter()
        try:
            if split:
                half = n // 2

                def later(j: int) -> None:
                    before(j + half)

                second = pool.submit(check, rows[half:], later)
                try:
                    first = check(rows[:half], before)
                finally:
                    rest = second.result()  # waited for even when the first half failed
                ok = np.concatenate([first, rest])
            else:
                ok = check(rows, before)
        finally:
            if split:
                with self._lock:
                    self._busy = False
        per_entry = (time.perf_counter() - start) / n
        with self._lock:
            last = self._per_entry[split]
            self._per_entry[split] = (
                per_entry if last is None else last + _WEIGHT * (per_entry - last)
            )
        return ok


#: The process's one splitter (what the memory tier's checked gathers use).
SPLIT_ROWS = SplitRows()
os.register_at_fork(after_in_child=SPLIT_ROWS.after_fork)
