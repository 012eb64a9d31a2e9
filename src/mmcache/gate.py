"""A counter shared with worker processes that holds work back until it is opened.

The loader's workers may be handed the first batches of the next epoch while
the current one ends (so they need no round trip when it starts), but they
must not ``stat`` the image files for it before the training loop really
begins that epoch: whatever the user's code does between two epochs (rewrite
an image, say) has to be seen. Each such task carries a gate number; the
worker waits until the training process has opened the gate that far.

A gate is one shared 64-bit integer that only the training process writes
(monotonically), with a multiprocessing condition (POSIX semaphores) that
wakes the waiting workers when it moves: no polling, whatever the training
loop does between epochs. A waiting worker also checks once a second that
its parent is alive.

Thread/process safety: :meth:`open_to` and :meth:`open_all` from the training
process (one writer); :meth:`wait` from any worker.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

__all__ = ["Gate"]

_PARENT_CHECK_S = 1.0
#: open_all's step: beyond any gate number handed out before it.
_ALL = 1 << 32


class Gate:
    """A shared, monotonically opened counter (see the module docstring).

    Args:
        context: the multiprocessing context (or its name) the workers are
            started with; ``None`` for the default.
    """

    def __init__(self, context: Any = None) -> None:
        if isinstance(context, str):
            context = multiprocessing.get_context(context)
        ctx = context if context is not None else multiprocessing.get_context()
        self._value = ctx.RawValue("q", 0)
        self._moved = ctx.Condition()

    @property
    def value(self) -> int:
        """How far the gate is open: tasks with a gate number up to this may run."""
        return int(self._value.value)

    def open_to(self, number: int) -> None:
        """Let tasks with gate numbers up to ``number`` run (never closes it again)."""
        if number > self._value.value:
            with self._moved:
                self._value.value = number
                self._moved.notify_all()

    def open_all(self) -> int:
        """Let every task handed out so far run (a stream is abandoned); the new value."""
        with self._moved:
            self._value.value = self._value.value + _ALL
            self._moved.notify_all()
        return int(self._value.value)

    def wait(self, number: int) -> None:
        """Block until the gate is open to ``number`` (or the parent process is gone)."""
        if self._value.value >= number:
            return
        parent = os.getppid()
        with self._moved:
            while self._value.value < number:
                self._moved.wait(_PARENT_CHECK_S)
                if os.getppid() != parent:
                    return  # orphaned: torch's worker loop notices and exits next
