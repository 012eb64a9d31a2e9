"""What a source keeps of one read for the rows it was told come next (:class:`Foresight`).

Some sources read many samples at once: a Parquet row group is read and decoded whole
for any one of its rows. Under a shuffled order over more data than a process may keep,
an LRU of whole groups thrashes: each group is evicted long before its next row comes,
so a cold epoch reads a group for almost every sample. But the loader knows the order
(:mod:`mmcache.sampler`): told the rows this process reads next
(:meth:`Foresight.foresee`), a source keeps, from each group it reads, only the rows of
that group still to come, and evicts by next use (Belady's rule: the row needed last goes
first) instead of by last use. Rows are smaller than the groups they come from, and a kept
row is one that will be read, so a group is read again only when the budget cannot hold
its rows until their turn: about ``rows' bytes / budget`` times an epoch (the rows this
process produces), not once a sample.

Positions count the rows foreseen, from 0 (the first row of the batch being produced);
:meth:`Foresight.reached` moves the present on (kept rows whose turn went by unread, e.g.
another process produced them, are dropped then). A row foreseen twice (a mixture's
repeats) is kept for its next turn only. A hint, never a promise: a row not foreseen or
not kept is read as before, and what is kept is checked by its source (its file's stamp)
before use.

Thread/process safety: none of its own; the source calls it under its reader lock. Kept
per process: a pickled or forked source starts a new one (the source's ``__getstate__``).
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Foresight"]


class Foresight:
    """The rows one process reads next, in order, and the values kept for them, within
    ``budget`` bytes (see the module docstring).

    >>> f = Foresight(budget=100)
    >>> f.foresee(np.array([7, 3, 8, 4]))
    >>> f.wanted(2, 9)  # rows of [2, 9) still to come, and their next turn
    (array([3, 4, 7, 8]), array([1, 3, 0, 2]))
    >>> f.keep(4, 3, "row 4", 10), f.take(4), f.take(4)
    (True, 'row 4', None)
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        #: Bytes of the values kept now.
        self.nbytes = 0
        self._now = 0
        # The foreseen rows sorted by (row, position), and those positions: a group's rows
        # still to come are one searchsorted away.
        self._rows = np.zeros(0, dtype=np.int64)
        self._at = np.zeros(0, dtype=np.int64)
        # row -> (position, value, nbytes); two heaps over it with lazy deletion: the
        # farthest turn first (what to evict) and the nearest (what went by unread).
        self._kept: dict[int, tuple[int, Any, int]] = {}
        self._far: list[tuple[int, int]] = []
        self._near: list[tuple[int, int]] = []

    @property
    def active(self) -> bool:
        """Whether some rows are foreseen (a source without them reads as before)."""
        return self._rows.size > 0

    def foresee(self, rows: npt.NDArray[np.int64]) -> None:
        """The rows this process reads next, in order (position 0 first); replaces what was
        foreseen. Kept rows that come again keep their value at their new turn."""
        rows = np.asarray(rows, dtype=np.int64)
        order = np.argsort(rows, kind="stable")  # stable: a row's turns stay in order
        self._rows, self._at = rows[order], order.astype(np.int64)
        self._now = 0
        old, self._kept, self.nbytes = self._kept, {}, 0
        self._far, self._near = [], []
        if old:
            again = np.fromiter(old, dtype=np.int64, count=len(old))
            at = self._next(again)
            for row, turn in zip(again.tolist(), at.tolist(), strict=True):
                if turn >= 0:
                    _, value, nbytes = old[row]
                    self._put(row, turn, value, nbytes)

    def clear(self) -> None:
        """Foresee nothing and keep nothing (the order is unknown from here)."""
        self.foresee(np.zeros(0, dtype=np.int64))

    def reached(self, position: int) -> None:
        """The rows before ``position`` have had their turn: drop what was kept for them."""
        self._now = max(self._now, position)
        near = self._near
        while near and near[0][0] < self._now:
            turn, row = heapq.heappop(near)
            held = self._kept.get(row)
            if held is not None and held[0] == turn:
                self._drop(row)

    def _next(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Each of ``rows``' first turn from now (-1: none), for a few kept rows."""
        out = np.full(rows.shape[0], -1, dtype=np.int64)
        lo = np.searchsorted(self._rows, rows, side="left")
        hi = np.searchsorted(self._rows, rows, side="right")
        for j, (a, b) in enumerate(zip(lo.tolist(), hi.tolist(), strict=True)):
            turns = self._at[a:b]
            later = turns[turns >= self._now]
            if later.size:
                out[j] = int(later.min())
        return out

    def wanted(self, lo: int, hi: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The foreseen rows in ``[lo, hi)`` whose turn is still to come, each once, and
        their next turn (a read of that range brings them: keep them for then)."""
        a, b = np.searchsorted(self._rows, [lo, hi], side="left").tolist()
        rows, at = self._rows[a:b], self._at[a:b]
        later = at >= self._now
        rows, at = rows[later], at[later]
        if rows.size == 0:
            return rows, at
        # Sorted by row, each row's turns ascending: its first entry is its next turn.
        first = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        return rows[first], at[first]

    def keep(self, row: int, position: int, value: Any, nbytes: int) -> bool:
        """Keep ``value`` for ``row``'s turn at ``position``, evicting the kept rows whose
        turn is farther while over budget; False (nothing kept) when every kept row comes
        sooner and there is no room."""
        if row in self._kept:
            self._drop(row)
        while self.nbytes + nbytes > self.budget:
            far = self._farthest()
            if far is None or far[0] <= position:
                return False
            self._drop(far[1])
        self._put(row, position, value, nbytes)
        return True

    def take(self, row: int) -> Any:
        """The value kept for ``row`` (no longer kept), or None."""
        held = self._kept.get(row)
        if held is None:
            return None
        self._drop(row)
        return held[1]

    def __len__(self) -> int:
        return len(self._kept)

    def _put(self, row: int, turn: int, value: Any, nbytes: int) -> None:
        self._kept[row] = (turn, value, nbytes)
        self.nbytes += nbytes
        stale = max(len(self._far), len(self._near)) > 2 * len(self._kept) + 1024
        if stale:  # mostly rows taken or dropped since: rebuilt from the rows kept
            self._far = [(-t, r) for r, (t, _, _) in self._kept.items()]
            self._near = [(t, r) for r, (t, _, _) in self._kept.items()]
            heapq.heapify(self._far)
            heapq.heapify(self._near)
        else:
            heapq.heappush(self._far, (-turn, row))
            heapq.heappush(self._near, (turn, row))

    def _drop(self, row: int) -> None:
        self.nbytes -= self._kept.pop(row)[2]

    def _farthest(self) -> tuple[int, int] | None:
        """``(turn, row)`` of the kept row whose turn is farthest (stale entries dropped)."""
        far = self._far
        while far:
            turn, row = -far[0][0], far[0][1]
            held = self._kept.get(row)
            if held is not None and held[0] == turn:
                return turn, row
            heapq.heappop(far)
        return None
