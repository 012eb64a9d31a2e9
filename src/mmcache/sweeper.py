"""A low-priority process that ``stat``-s an epoch's image files for the stamp board.

In a warm epoch the training process already knows every sample's cache key;
what it must still learn, each epoch and after the epoch began, is that no
image file changed. :class:`Sweeper` runs one helper process that does those
``stat`` calls in the epoch's order, ahead of the training loop, and
publishes each result on a :class:`~mmcache.board.StampBoard` in shared
memory (see there). The training process ``stat``-s itself any file the
sweeper has not reached yet, so the sweeper only ever saves work.

The process runs at the lowest CPU priority (nice 19, and ``SCHED_IDLE``
where allowed): it uses a core only when nothing else wants it. At normal
priority, the sweeper waking at the start of each epoch preempted the
training loop for a scheduler time slice (1-4 ms) on a 2-core machine. It
is started on the first request, never uses torch, ignores SIGINT (the
training process decides), and exits when asked, when its parent is gone
(checked every second), or with the parent (a daemon process).

Thread/process safety: :meth:`Sweeper.request` and :meth:`Sweeper.close`
from the training process (one thread at a time).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mmcache.board import StampBoard

__all__ = ["Sweeper"]

_PARENT_CHECK_S = 1.0


class _Stats(Protocol):
    def stat_stamps(self, indices: np.ndarray) -> np.ndarray: ...


class _Batches(Protocol):
    def batches(self, epoch: int) -> list[np.ndarray]: ...


@dataclass(frozen=True)
class _Channel:
    """What the training process and the sweeper share to talk (multiprocessing objects)."""

    request: Any  # RawArray q[4]: round, epoch, first batch, stop
    lock: Any  # guards request[0:3]
    posted: Any  # a semaphore: one post per request


class Sweeper:
    """One low-priority process publishing ``stat`` results of epochs on ``board``.

    Args:
        board: where the results go.
        dataset: has ``stat_stamps(indices)`` (a :class:`~mmcache.MultimodalDataset`).
        order: has ``batches(epoch)``: the epoch's batches, in order.
        context: the multiprocessing context (or its name) to start it with.
    """

    def __init__(self, board: StampBoard, dataset: _Stats, order: _Batches, context: Any = None):
        if isinstance(context, str):
            context = multiprocessing.get_context(context)
        self._ctx = context if context is not None else multiprocessing.get_context()
        self._board = board
        self._dataset = dataset
        self._order = order
        self._channel = _Channel(
            self._ctx.RawArray("q", 4), self._ctx.Lock(), self._ctx.Semaphore(0)
        )
        self._process: Any = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the process now if it is not running (a fork or spawn: milliseconds,
        better spent before the first request than in it)."""
        if self._process is None or not self._process.is_alive():
            ch = self._channel
            ch.request[3] = 0
            self._process = self._ctx.Process(
                target=_run,
                args=(self._board, self._dataset, self._order, ch, os.getpid()),
                name="mmcache-sweeper",
                daemon=True,
            )
            self._process.start()

    def request(self, round_: int, epoch: int, start: int = 0) -> None:
        """Sweep ``epoch`` from batch ``start`` on, as round ``round_`` (replaces any
        sweep in progress). Never blocks once started (:meth:`start`)."""
        ch = self._channel
        with ch.lock:
            ch.request[0], ch.request[1], ch.request[2] = round_, epoch, start
        self.start()
        ch.posted.release()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the process (killed if it does not stop within ``timeout``). Idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        self._channel.request[3] = 1
        self._channel.posted.release()
        process.join(timeout)
        if process.is_alive():  # pragma: no cover - it checks the flag between batches
            process.kill()
            process.join(timeout)


def _run(board: StampBoard, dataset: _Stats, order: _Batches, ch: _Channel, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(19)
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    request, lock, posted = ch.request, ch.lock, ch.posted
    while True:
        if not posted.acquire(timeout=_PARENT_CHECK_S):
            if os.getppid() != parent:
                return
            continue
        if request[3]:
            return
        with lock:
            round_, epoch, start = int(request[0]), int(request[1]), int(request[2])
        for indices in order.batches(epoch)[start:]:
            if request[3] or int(request[0]) != round_:
                break  # stopped, or a newer sweep was asked for
            board.publish(indices, dataset.stat_stamps(indices), round_)
