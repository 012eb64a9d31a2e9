"""``Lifeline``: the loader's child processes end when the training process dies.

The loader starts processes of its own (crop processes, the stat prefetcher) and
torch starts its workers for it. When the training process is killed (``kill -9``,
the OOM killer, a scheduler's preemption) nothing tells them: a crop process blocks
in its queue's ``get`` for ever (it inherited the other queues' write ends, so no
EOF comes), and a worker's exit joins its queue's feeder thread, blocked writing
into a pipe whose read end a sibling holds. Such orphans keep their memory and
their mapped ``/dev/shm`` buffers until someone kills them by hand.

A child holds its :class:`Lifeline` as its first act (:meth:`Lifeline.hold`):

- on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the child as
  its parent dies. The signal follows the death of the parent *thread* that
  forked, not of the process; so it is only asked for when the main thread forked
  (which lives as long as the process). A worker forked by the loader's assembling
  thread would otherwise be killed when that thread ends, and torch's SIGCHLD
  handler would raise "worker killed" in the training loop;
- then, in every case, a daemon thread that checks the parent every
  :data:`CHECK_S` seconds and ends the process (``os._exit``: no exit handler may
  join a blocked feeder thread) once it is gone. It also closes the race of a
  parent that died between the fork and the ``prctl``.

"The parent is gone" is: ``os.getppid()`` changed (the child was re-parented to
init or a subreaper), or, for a child whose first parent is not the training
process (a ``forkserver`` child), the training process no longer runs (its pid and
start time, so a reused pid does not count).

A ``Lifeline`` is made in the process and thread that start the child, right
before they start it (:meth:`Lifeline.here`); it pickles (``spawn`` contexts).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from mmcache.stores.memory.shm import proc_start_time

__all__ = ["CHECK_S", "Lifeline", "WorkerStart"]

#: Seconds between two checks of the parent in a child (its death is noticed within).
CHECK_S = 0.5
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class Lifeline:
    """Who a child process belongs to: the training process's pid and start time, and
    whether the thread starting the child is the main thread (see the module)."""

    parent: int
    start: int | None
    main_thread: bool

    @classmethod
    def here(cls) -> Lifeline:
        """The lifeline of a child this thread of this process is about to start."""
        pid = os.getpid()
        return cls(pid, proc_start_time(pid), threading.current_thread() is threading.main_thread())

    def hold(self) -> None:
        """In the child: end with the parent from now on (see the module docstring).
        Returns at once; ends the process at once if the parent is already gone."""
        first = os.getppid()
        if first == self.parent and self.main_thread:
            _ask_death_signal()
        if self._gone(first):
            os._exit(0)
        threading.Thread(
            target=self._watch, args=(first,), name="mmcache-lifeline", daemon=True
        ).start()

    def _gone(self, first: int) -> bool:
        if os.getppid() != first:
            return True
        if first == self.parent:
            return False
        # Started by a go-between (a forkserver): is the training process itself alive?
        return self.start is None or proc_start_time(self.parent) != self.start

    def _watch(self, first: int) -> None:
        stop = threading.Event()  # never set: a sleep that nothing interrupts
        while not stop.wait(CHECK_S):
            if self._gone(first):
                os._exit(0)


def _ask_death_signal() -> None:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux; nothing elsewhere (the watch
    thread still ends the process)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class WorkerStart:
    """torch's ``worker_init_fn`` for the loader's workers: hold the lifeline, then run
    the user's ``worker_init_fn``.

    :meth:`renew` is called in the thread that starts the workers, right before
    (``iter`` of the torch DataLoader), so that each start carries its own
    :class:`Lifeline`; a forked worker copies it, a spawned one gets it pickled.
    """

    def __init__(self, user: Callable[[int], None] | None) -> None:
        self.user = user
        self.lifeline = Lifeline.here()

    def renew(self) -> None:
        self.lifeline = Lifeline.here()

    def __call__(self, worker_id: int) -> None:
        self.lifeline.hold()
        if self.user is not None:
            self.user(worker_id)
