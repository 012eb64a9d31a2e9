"""The processes attached to a memory store and their statistics counters (meta arrays).

Each attached process has a row: its ``(pid, start time)`` in ``procs`` (zero: a free
row) and its counters in the same row of ``counters`` (columns:
:class:`~mmcache.stores.memory.layout.Count`), so counting is a write to a row of
one's own, never shared. The counters of processes that detached or died are folded
into ``ROW_RETIRED``; when every row is taken, further processes share
``ROW_OVERFLOW`` (and may lose increments). Statistics are the sum of every row.

Why a process table at all: a temporary store is removed by its last user, a store
is re-created only when nobody is attached, and ``reclaim_orphans`` removes only
stores no live process uses; each needs to know who is attached, crashes included.
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt

from mmcache.stores.memory.layout import ROW_OVERFLOW, ROW_RETIRED
from mmcache.stores.memory.shm import pid_alive, proc_start_time

__all__ = ["ProcessTable", "any_alive"]


def any_alive(procs: npt.NDArray[np.int64]) -> bool:
    """Whether a process recorded in the ``procs`` array (``[n, 2]``) is still running."""
    return any(pid_alive(int(pid), int(start)) for pid, start in procs[procs[:, 0] != 0].tolist())


class ProcessTable:
    """The attached-process rows and counters of one store. Caller holds EX to change rows."""

    __slots__ = ("counters", "procs")

    def __init__(self, procs: npt.NDArray[np.int64], counters: npt.NDArray[np.int64]) -> None:
        self.procs = procs
        self.counters = counters

    def register(self) -> int:
        """Give this process a row (after pruning dead ones); ``ROW_OVERFLOW`` if none is free."""
        self.prune()
        free = np.flatnonzero(self.procs[:, 0] == 0)
        if not free.shape[0]:
            return ROW_OVERFLOW
        row = int(free[0])
        self.procs[row, 0] = os.getpid()
        self.procs[row, 1] = proc_start_time(os.getpid()) or 0
        return row

    def prune(self) -> int:
        """Detach dead processes, folding their counters into the retired row."""
        procs = self.procs
        dead = 0
        for row in np.flatnonzero(procs[:, 0] != 0).tolist():
            if not pid_alive(int(procs[row, 0]), int(procs[row, 1])):
                self.retire(row)
                dead += 1
        return dead

    def retire(self, row: int) -> None:
        """Free ``row``, keeping its counts in the retired row."""
        self.counters[ROW_RETIRED] += self.counters[row]
        self.counters[row] = 0
        self.procs[row] = 0

    def any_attached(self) -> bool:
        """Whether any live process (this one included) has a row."""
        self.prune()
        return bool((self.procs[:, 0] != 0).any())

    def add(self, row: int, column: int, n: int) -> None:
        """Add ``n`` to counter ``column`` of ``row`` (``ROW_OVERFLOW`` when negative)."""
        self.counters[row if row >= 0 else ROW_OVERFLOW, column] += n

    def totals(self) -> npt.NDArray[np.int64]:
        """Every counter summed over all rows (the node's statistics)."""
        totals: npt.NDArray[np.int64] = self.counters.sum(axis=0)
        return totals
