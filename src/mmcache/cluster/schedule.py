"""What each rank sends to which peer in each window of batches: derived, never asked.

A *window* is ``window`` consecutive batches of an epoch. For window ``w`` of
epoch ``e``, rank ``p`` sends to each of its peers ``q`` (see
:class:`~mmcache.cluster.topology.Topology`) the samples that ``q`` reads in
that window, whose home is ``p``'s node, and for which ``p`` is ``q``'s partner
there; every process computes the same lists from (seed, epoch, world size,
placement), because every rank's batches are a pure function of them
(:class:`~mmcache.loader.stream.BatchOrder` for each rank). Which of those the
sender actually has (its presence bitmap of the window) travels in the
message itself, so no other collective is needed.

Thread safety: the memo is guarded by a lock (the exchange thread and the
training thread both ask).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from mmcache.cluster.topology import Topology

__all__ = ["Schedule"]

#: Epochs of every rank's batches kept (the exchange may run into the next epoch).
_MEMO_EPOCHS = 2

Batches = Callable[[int, int], list[np.ndarray]]  # (rank, epoch) -> that rank's batches


class Schedule:
    """The exchange plan of one loader: ``batches(rank, epoch)`` gives any rank's batches."""

    def __init__(
        self, topology: Topology, home: npt.NDArray[np.int32], batches: Batches, window: int
    ) -> None:
        self.topology = topology
        self.home = home
        self.window = window
        self._batches = batches
        self._memo: dict[tuple[int, int], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def batches(self, rank: int, epoch: int) -> list[np.ndarray]:
        with self._lock:
            got = self._memo.get((rank, epoch))
            if got is None:
                got = self._batches(rank, epoch)
                old = [k for k in self._memo if k[1] < epoch - _MEMO_EPOCHS + 1]
                for k in old:
                    del self._memo[k]
                self._memo[(rank, epoch)] = got
            return got

    def clear(self) -> None:
        """Forget the batches computed (a resumed epoch changes them)."""
        with self._lock:
            self._memo.clear()

    def windows(self, epoch: int) -> int:
        """Windows of ``epoch`` (of this rank's batches: every rank has as many)."""
        n = len(self.batches(self.topology.rank, epoch))
        return -(-n // self.window)

    def window_of(self, batch: int) -> int:
        return batch // self.window

    def last_batch(self, epoch: int, w: int) -> int:
        """The last batch of window ``w`` of ``epoch``."""
        n = len(self.batches(self.topology.rank, epoch))
        return min((w + 1) * self.window, n) - 1

    def reads(self, rank: int, epoch: int, w: int) -> npt.NDArray[np.int64]:
        """The sample indices ``rank`` reads in window ``w`` of ``epoch``, in order."""
        part = self.batches(rank, epoch)[w * self.window : (w + 1) * self.window]
        if not part:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(part).astype(np.int64, copy=False)

    def serve(self, epoch: int, w: int, peer: int) -> npt.NDArray[np.int64]:
        """What this rank sends ``peer`` in window ``w``: what ``peer`` reads there that
        is homed on this node and that this rank serves it (unique, in read order)."""
        topo = self.topology
        if topo.partner(peer, topo.node) != topo.rank:
            return np.zeros(0, dtype=np.int64)
        reads = self.reads(peer, epoch, w)
        mine = reads[self.home[reads] == topo.node]
        _, first = np.unique(mine, return_index=True)
        out: npt.NDArray[np.int64] = mine[np.sort(first)]
        return out

    def foreign(self, epoch: int, w: int) -> npt.NDArray[np.int64]:
        """This rank's reads in window ``w`` homed on another node (unique)."""
        reads = self.reads(self.topology.rank, epoch, w)
        return np.unique(reads[self.home[reads] != self.topology.node])

    def offer_peer(self, index: int) -> int:
        """The rank this rank sends a cold sample home to: its partner on the home node."""
        return self.topology.partner(self.topology.rank, int(self.home[index]))
