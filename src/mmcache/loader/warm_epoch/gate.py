"""``EpochGate``: a counter shared with worker processes that holds next-epoch tasks back.

The loader's workers may be handed the first batches of the next epoch while
the current one ends (so they need no round trip when it starts), but they
must not ``stat`` the image files for it before the training loop really
begins that epoch: whatever the user's code does between two epochs (rewrite
an image, say) has to be seen. Each such task carries a gate number; the
worker waits until the training process has opened the gate that far.

A gate is one shared 64-bit integer that only the training process writes
(monotonically). Each worker sleeps on a POSIX semaphore of its own, which
the opener posts when the gate moves while that worker sleeps: no polling,
whatever the training loop does between epochs, and opening never blocks (a
``multiprocessing.Condition`` would: its ``notify_all`` waits until every
sleeper has woken up, milliseconds at the start of each epoch on a busy
machine; and one semaphore shared by all sleepers would let a worker
woken too early take the wake-up meant for another). A waiting worker also
checks once a second that its parent is alive.

Thread/process safety: :meth:`open_to` and :meth:`open_all` from the training
process (one writer); :meth:`wait` from any worker.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import torch

from mmcache.loader.shmroom import ShmRoom

__all__ = ["EpochGate", "epoch_gate"]

_PARENT_CHECK_S = 1.0
#: open_all's step: beyond any gate number handed out before it.
_ALL = 1 << 32


class EpochGate:
    """A shared, monotonically opened counter (see the module docstring).

    Args:
        context: the multiprocessing context (or its name) the workers are
            started with; ``None`` for the default.
        slots: how many processes may wait at once (each on a slot of its own:
            a loader worker's id).
    """

    def __init__(self, context: Any = None, slots: int = 1) -> None:
        if isinstance(context, str):
            context = multiprocessing.get_context(context)
        ctx = context if context is not None else multiprocessing.get_context()
        self._value = ctx.RawValue("q", 0)
        self._asleep = ctx.RawArray("b", max(slots, 1))  # slot k sleeps on _wake[k]
        self._lock = ctx.Lock()
        self._wake = [ctx.Semaphore(0) for _ in range(max(slots, 1))]

    @property
    def value(self) -> int:
        """How far the gate is open: tasks with a gate number up to this may run."""
        return int(self._value.value)

    def open_to(self, number: int) -> None:
        """Let tasks with gate numbers up to ``number`` run (never closes it again)."""
        if number > self._value.value:
            self._move(number)

    def open_all(self) -> int:
        """Let every task handed out so far run (a stream is abandoned); the new value."""
        return self._move(self._value.value + _ALL)

    def _move(self, number: int) -> int:
        with self._lock:
            self._value.value = max(number, self._value.value)
            for k, wake in enumerate(self._wake):
                if self._asleep[k]:
                    self._asleep[k] = 0
                    wake.release()  # a post never blocks
            return int(self._value.value)

    def wait(self, number: int, slot: int | None = None) -> None:
        """Block until the gate is open to ``number`` (or the parent process is gone).

        ``slot``: this process's (default: the torch worker id, else 0); two
        processes must not wait on one slot at once.
        """
        if self._value.value >= number:
            return
        if slot is None:
            info = torch.utils.data.get_worker_info()
            slot = info.id if info is not None else 0
        slot %= len(self._wake)
        wake = self._wake[slot]
        parent = os.getppid()
        while True:
            with self._lock:
                if self._value.value >= number:
                    return
                self._asleep[slot] = 1
            if not wake.acquire(timeout=_PARENT_CHECK_S):
                with self._lock:
                    if self._asleep[slot]:
                        self._asleep[slot] = 0  # not woken
                    else:
                        wake.acquire()  # posted (under the lock) just after the timeout
                if os.getppid() != parent:
                    return  # orphaned: torch's worker loop notices and exits next


def epoch_gate(context: Any, slots: int, shm: ShmRoom) -> EpochGate | None:
    """An :class:`EpochGate`, or None when ``/dev/shm`` has no room for its semaphores
    (reported to ``shm``, the loader's room: its workers are then not persistent)."""
    if shm.full:
        return None
    try:
        return EpochGate(context, slots)
    except OSError as exc:  # sem_open: ENOSPC in a full /dev/shm
        shm.report("epoch gate", exc, "the workers are not persistent")
        return None
