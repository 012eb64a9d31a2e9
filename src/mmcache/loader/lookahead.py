"""Each producing process tells a source that shares reads which samples it produces next.

A source whose samples share one read (a Parquet row group is read whole for any of its
rows; the :class:`~mmcache.sources.capabilities.ForeseesReads` capability) thrashes
under a shuffle over more data than a process keeps: an LRU of whole groups evicts each
group long before its next row comes. The loader knows every epoch's order in advance
(:mod:`mmcache.sampler`), and which batches a process produces: with ``W`` workers
torch hands a stream's tasks round-robin, so the worker that got batch ``j`` gets
``j + W``, ``j + 2W``, ... while tasks are one batch each (always, in a cold stretch:
see :class:`~mmcache.loader.stream.WorkerTaskSampler`); the training process producing
alone (``num_workers=0``) gets every batch. :class:`Lookahead` tells the source those
samples (:data:`HORIZON` at most) once a second batch with misses on that stride
confirms a stretch, and where it has got to at each later batch; the source keeps what a
read brings for the rows to come (:mod:`mmcache.sources.foresight`).

A hint only: a batch off the stride (grouped tasks of a warm stretch, a new epoch or
stream) makes the source foresee nothing until the next batch confirms a stretch again
(a lone batch does not pay for computing the epoch's order), and one it cannot place
(its indices are not the order's: a resumed span this process has not seen) likewise;
either way the batches are the same, only the reads differ. Nothing is done for a
source without the capability, or for a batch with no miss.

Thread/process safety: per process (a forked or spawned worker starts afresh: the state
names the process it belongs to); the planner calls it from one thread at a time per
process (workers run one task at a time; ``num_workers=0``: the loader's fetch lock).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from mmcache.sources.capabilities import ForeseesReads

__all__ = ["HORIZON", "Lookahead"]

#: Samples foreseen at once (the source's budget decides how many rows it keeps): far
#: enough that a budget of tiny rows fills, small enough that foreseeing again (a sort
#: of this many rows, ~20 ms) is rare next to producing them.
HORIZON = 1 << 18

#: ``batches(epoch)``: the epoch's batches, in order (:meth:`BatchOrder.batches`).
Batches = Callable[[int], list[np.ndarray]]


class Lookahead:
    """Foresees, for ``source``, the batches of ``batches(epoch)`` this process produces
    (see the module docstring); does nothing for a source without ``ForeseesReads``."""

    def __init__(self, source: object, batches: Batches | None) -> None:
        self._source = source if isinstance(source, ForeseesReads) else None
        self._batches = batches if self._source is not None else None  # (nothing to tell)
        # (pid, epoch, first batch, stride, end batch) foreseen, and each batch's position.
        self._span: tuple[int, int, int, int, int] | None = None
        self._starts = np.zeros(0, dtype=np.int64)
        # (pid, epoch, batch, stride) of the last batch followed: a stretch is foreseen once
        # a second batch on the stride confirms it.
        self._last: tuple[int, int, int, int] | None = None

    def follow(self, epoch: int, j: int, indices: np.ndarray) -> None:
        """Batch ``j`` of ``epoch`` (``indices``) is produced here now."""
        source, batches = self._source, self._batches
        if source is None or batches is None:
            return
        info = torch.utils.data.get_worker_info()
        stride = info.num_workers if info is not None else 1
        pid, last, span = os.getpid(), self._last, self._span
        self._last = (pid, epoch, j, stride)
        if span is not None and span[:2] == (pid, epoch) and span[3] == stride:
            first, end = span[2], span[4]
            if first <= j < end and (j - first) % stride == 0:
                source.reached(int(self._starts[(j - first) // stride]))
                return
        on_stride = last is not None and last[:2] == (pid, epoch) and last[3] == stride
        if on_stride and last is not None and j > last[2] and (j - last[2]) % stride == 0:
            self._foresee(source, batches(epoch), (epoch, j), indices, stride=stride)
            return
        # Off the stride (a new epoch or stream, grouped tasks): foresee nothing until the
        # next batch confirms a stretch; computing the epoch's order (a permutation of all
        # its samples) for each lone batch of a warm stretch would cost more than its reads.
        if span is not None:
            self._span = None
            source.foresee(np.zeros(0, dtype=np.int64))

    def _foresee(
        self,
        source: ForeseesReads,
        batches: list[np.ndarray],
        at: tuple[int, int],
        indices: np.ndarray,
        *,
        stride: int,
    ) -> None:
        """Foresee this process's batches of epoch ``at[0]`` from batch ``at[1]`` (its
        ``indices``) on: ``j``, ``j + stride``, ..., :data:`HORIZON` samples at most."""
        epoch, j = at
        if j >= len(batches) or not np.array_equal(batches[j], indices):
            self._span = None  # not the order this process knows: foresee nothing
            source.foresee(np.zeros(0, dtype=np.int64))
            return
        picked: list[np.ndarray] = []
        total, k = 0, j
        while k < len(batches) and total < HORIZON:
            picked.append(batches[k])
            total += len(batches[k])
            k += stride
        sizes = np.fromiter((len(b) for b in picked), dtype=np.int64, count=len(picked))
        self._starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._span = (os.getpid(), epoch, j, stride, k)
        source.foresee(np.concatenate(picked))
