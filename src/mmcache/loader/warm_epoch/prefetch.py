"""``StatPrefetcher``: a low-priority process that ``stat``-s an epoch's files ahead of use.

In a guessed epoch the training process already knows every sample's cache
key; what it must still learn, each epoch and after the epoch began, is that
no image file changed. :class:`StatPrefetcher` runs one helper process that
does those ``stat`` calls (the source's :meth:`~mmcache.sources.base.SampleSource.stamps`,
``StampKind.FILE`` only) in the epoch's order, ahead of the training loop,
and publishes each result on a
:class:`~mmcache.loader.warm_epoch.board.FileCheckBoard` in shared memory
(see there). The training process ``stat``-s itself any file the prefetcher
has not reached yet, so the prefetcher only ever saves work. How a batch's files are
``stat``-ed is the source's (:mod:`mmcache.sources.freshness`): on a pool of threads when
the file system is slow to answer, and not again within the source's ``recheck`` window
(or run, with ``freshness="run"``); this process remembers its own checks from epoch to
epoch.

Asked for an epoch's *keys* (``request(..., keys=True)``: an epoch whose keys
the training process does not know, planned there until its first miss), it
also computes each sample's cache key from the stamps it just took
(:meth:`~mmcache.sources.base.SampleSource.key_rows`, with the source's own
memo and identity ledger in this process) and publishes key and stamps on the
board (:meth:`~mmcache.loader.warm_epoch.board.FileCheckBoard.publish_keys`):
a batch found there is not keyed in the training process.

The process runs at the lowest CPU priority (nice 19, and ``SCHED_IDLE``
where allowed): it uses a core only when nothing else wants it. At normal
priority, waking it at the start of each epoch preempted the training loop
for a scheduler time slice on a 2-core machine. It is started on the first
request, never uses torch, ignores SIGINT (the training process decides), and
exits when asked, or with the training process: as a daemon process when it exits,
and by its :class:`~mmcache.loader.lifeline.Lifeline` when it is killed.

Thread/process safety: :meth:`StatPrefetcher.request` and
:meth:`StatPrefetcher.close` from the training process (one thread at a time).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import numpy as np

from mmcache.loader.lifeline import Lifeline
from mmcache.loader.warm_epoch.board import FileCheckBoard

__all__ = ["StatPrefetcher"]


class _Stamps(Protocol):
    def stamps(self, indices: np.ndarray) -> np.ndarray: ...

    def key_rows(self, indices: np.ndarray, *, stamps: np.ndarray | None = None) -> np.ndarray: ...


class _Batches(Protocol):
    def batches(self, epoch: int) -> list[np.ndarray]: ...


class _Slot(IntEnum):
    """The words of the request array the training process and the prefetcher share."""

    ROUND = 0  # the check round of the epoch asked for (FileCheckBoard.publish's)
    EPOCH = 1
    START = 2  # the first batch to stat
    STOP = 3  # non-zero: exit
    KEYS = 4  # non-zero: publish the keys too (FileCheckBoard.publish_keys)


@dataclass(frozen=True)
class _Channel:
    """What the training process and the prefetcher share to talk (multiprocessing objects)."""

    request: Any  # RawArray q[4], indexed by _Slot
    lock: Any  # guards ROUND, EPOCH and START (written together)
    posted: Any  # a semaphore: one post per request


class StatPrefetcher:
    """One low-priority process publishing ``stat`` results of epochs on ``board``.

    Args:
        board: where the results go.
        source: has ``stamps(indices)`` (a ``StampKind.FILE`` source: file stats) and
            ``key_rows(indices, stamps=...)``.
        order: has ``batches(epoch)``: the epoch's batches, in order (holding no
            lock: the process may be forked while another thread holds one).
        context: the multiprocessing context (or its name) to start it with.
    """

    def __init__(
        self, board: FileCheckBoard, source: _Stamps, order: _Batches, context: Any = None
    ) -> None:
        if isinstance(context, str):
            context = multiprocessing.get_context(context)
        self._ctx = context if context is not None else multiprocessing.get_context()
        self._board = board
        self._source = source
        self._order = order
        self._channel = _Channel(
            self._ctx.RawArray("q", len(_Slot)), self._ctx.Lock(), self._ctx.Semaphore(0)
        )
        self._process: Any = None
        #: Processes started so far (one, unless it was closed and started again).
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the process now if it is not running (a fork or spawn: milliseconds,
        better spent before the first request than in it)."""
        if self._process is None or not self._process.is_alive():
            # The process computes each epoch's order (a shuffled one with numpy.random,
            # which numpy imports at first use: ~15 ms of CPU). Imported here, before
            # the fork, the process shares this one and its first keys are published
            # that much sooner; the training process needs it for its first epoch's
            # order anyway (it pays it here instead, once).
            import numpy.random  # noqa: F401

            ch = self._channel
            ch.request[_Slot.STOP] = 0
            self.starts += 1
            self._process = self._ctx.Process(
                target=_run,
                args=(self._board, self._source, self._order, ch, Lifeline.here()),
                name="mmcache-stat-prefetcher",
                daemon=True,
            )
            self._process.start()

    def request(self, round_: int, epoch: int, start: int = 0, *, keys: bool = False) -> None:
        """Stat ``epoch`` from batch ``start`` on, as check round ``round_`` (replaces
        any request in progress), and with ``keys`` publish the keys too. Never blocks
        once started (:meth:`start`)."""
        ch = self._channel
        with ch.lock:
            ch.request[_Slot.ROUND] = round_
            ch.request[_Slot.EPOCH] = epoch
            ch.request[_Slot.START] = start
            ch.request[_Slot.KEYS] = int(keys)
        self.start()
        ch.posted.release()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the process (killed if it does not stop within ``timeout``). Idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        self._channel.request[_Slot.STOP] = 1
        self._channel.posted.release()
        process.join(timeout)
        if process.is_alive():  # pragma: no cover - it checks the flag between batches
            process.kill()
            process.join(timeout)


def _run(
    board: FileCheckBoard, source: _Stamps, order: _Batches, ch: _Channel, lifeline: Lifeline
) -> None:
    lifeline.hold()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(19)
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    request, lock, posted = ch.request, ch.lock, ch.posted
    while True:
        posted.acquire()
        if request[_Slot.STOP]:
            return
        with lock:
            round_ = int(request[_Slot.ROUND])
            epoch, start = int(request[_Slot.EPOCH]), int(request[_Slot.START])
            keys = bool(request[_Slot.KEYS])
        for indices in order.batches(epoch)[start:]:
            if request[_Slot.STOP] or int(request[_Slot.ROUND]) != round_:
                break  # stopped, or a newer epoch was asked for
            stamps = source.stamps(indices)
            if not keys:
                board.publish(indices, stamps, round_)
                continue
            try:
                rows = source.key_rows(indices, stamps=stamps)
            except Exception:  # noqa: S112 - the training process keys it and reports it
                continue
            board.publish_keys(indices, rows, stamps, round_)
