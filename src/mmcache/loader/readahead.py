"""Read-ahead of a guessed epoch's next batches on a few daemon threads of the training process.

In a guessed (warm) epoch the training process plans the batches itself, so it also
has the cache read the entries of the batches to come (``WorkerPlanner.ahead``:
promotion into free memory, then the disk tier's ``prefetch``, whose LMDB reads
bring each entry's pages into the page cache with the GIL released).
:class:`ReadAhead` takes that off the training loop: the loop only queues the
keys (in the epoch's order); :data:`THREADS` threads take them :data:`CHUNK`
keys at a time, so that many entries are read from the device at once (one
thread reads one entry after the other: measured at ~0.27 of ``dd``'s
bandwidth with the page cache dropped; four threads, ~0.5). The queue is
bounded: when the threads lag, the oldest requests are dropped (a hint only).

On pages already resident the reads do nothing useful, and the threads still
cost the training loop: each read releases and retakes the GIL, and a loop
made to hand the GIL over at each of them ran a disk-only warm epoch at 0.64 of
its speed without read-ahead (measured, 15,944 against 24,830 samples/s, 3,000
samples of 151 KB). So the threads count the major page faults their calls
cause (``getrusage(RUSAGE_THREAD)``, Linux): after :data:`CALM_CHUNKS` chunks in
a row without one (and without the call reporting work done, e.g. entries
promoted), only one chunk in :data:`PROBE_EVERY` submissions is read, as a
probe; a probe that faults (the pages went: dropped, evicted, another epoch
of a larger set) brings every chunk back at once.

The loader keeps one :class:`ReadAhead` across its epochs (its plan streams
:meth:`~ReadAhead.cancel` it when they end, and the loader closes it), so its
threads start once, not at each epoch.

Thread/fork safety: the threads start on first use in each process (a forked
child never inherits them); every method may be called from any thread.
"""

from __future__ import annotations

import collections
import logging
import os
import resource
import threading
from collections.abc import Callable

import numpy as np

__all__ = [
    "CALM_CHUNKS",
    "CHUNK",
    "PROBE_EVERY",
    "THREADS",
    "WAKE_CHUNKS",
    "Calm",
    "ReadAhead",
    "thread_major_faults",
]

logger = logging.getLogger(__name__)

#: Threads reading ahead (entries read from the device at once).
THREADS = 4
#: Keys a thread takes at a time.
CHUNK = 16
#: Chunks queued at most (the oldest beyond it are dropped).
_MAX_PENDING = 64
#: Chunks in a row without a major page fault (or work reported) before probing only.
CALM_CHUNKS = 32
#: While calm, one chunk of every this many submitted key arrays is read (a probe).
PROBE_EVERY = 8
#: Chunks read whole after :meth:`ReadAhead.wake` (an epoch's start) while calm.
WAKE_CHUNKS = 8

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)


def thread_major_faults() -> int | None:
    """This thread's major page faults so far (pages read from the device), or None
    where the system cannot tell (no ``RUSAGE_THREAD``: never calm, always read)."""
    if _RUSAGE_THREAD is None:
        return None
    return int(resource.getrusage(_RUSAGE_THREAD).ru_majflt)


class Calm:
    """How many read-ahead chunks in a row were calm (no fault, no work): kept by the
    loader across epochs, whose streams each have their own :class:`ReadAhead`.
    Updated under that read-ahead's lock (one is active at a time)."""

    def __init__(self) -> None:
        self.chunks = 0


class ReadAhead:
    """Calls ``fn(chunk)`` for each :data:`CHUNK` keys of each submitted key array,
    in order, on ``threads`` daemon threads (chunks run concurrently); only probes
    while the calls fault no page in (see the module docstring).

    ``ordered(chunk)``, if given, runs before ``fn(chunk)`` one chunk at a time in
    submission order (the loader promotes entries into free memory there: in the
    epoch's order, so the budget holds the entries used first), while ``fn``
    calls run concurrently. Either may return a number: non-zero means it did
    work worth doing again (the loader's ``ordered`` returns the entries it
    promoted), which keeps every chunk read. ``faults`` counts the calling
    thread's major page faults (tests pass a fake).
    """

    def __init__(
        self,
        fn: Callable[[np.ndarray], object],
        *,
        threads: int = THREADS,
        chunk: int = CHUNK,
        faults: Callable[[], int | None] = thread_major_faults,
        calm: Calm | None = None,
        ordered: Callable[[np.ndarray], object] | None = None,
    ) -> None:
        if threads < 1 or chunk < 1:
            raise ValueError(f"threads and chunk must be >= 1, got {threads}, {chunk}")
        self._fn = fn
        self._ordered = ordered
        self._turns = threading.Condition()  # the ordered calls' turn (apart from _cond)
        self._taken = 0  # chunks taken from the queue (each one's turn number)
        self._turn = 0  # the turn whose ordered call may run now
        self._faults = faults
        self._calm = calm if calm is not None else Calm()  # chunks in a row without work
        self._submitted = 0
        self._wake_left = 0  # chunks still read whole while calm, after wake()
        #: Chunks read and chunks skipped while calm (for tests and stats).
        self.chunks_read = 0
        self.chunks_skipped = 0
        self._threads_wanted = threads
        self._chunk = chunk
        self._pending: collections.deque[np.ndarray] = collections.deque(maxlen=_MAX_PENDING)
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._generation = 0  # bumped by close(): older threads exit
        self._pid = -1

    def submit(self, keys: np.ndarray) -> None:
        """Queue ``keys`` (``uint8 [n, 16]``) for read-ahead; never blocks."""
        with self._cond:
            if self._pid != os.getpid() or not any(t.is_alive() for t in self._threads):
                self._start()
            chunks = [keys[i : i + self._chunk] for i in range(0, len(keys), self._chunk)]
            self._submitted += 1
            if self._calm.chunks >= CALM_CHUNKS:  # pages resident: a probe now and then
                probe = self._submitted % PROBE_EVERY == 0
                keep = max(self._wake_left, 1 if probe else 0)
                self._wake_left = max(self._wake_left - len(chunks), 0)
                self.chunks_skipped += max(len(chunks) - keep, 0)
                chunks = chunks[:keep]
            if chunks:  # (waking the threads for nothing costs the loop the GIL)
                self._pending.extend(chunks)
                self._cond.notify(len(chunks))

    def wake(self) -> None:
        """Read the next :data:`WAKE_CHUNKS` chunks whole even while calm (an epoch
        starts: the pages of its first batches may have gone since the last one); a
        fault among them brings every chunk back."""
        with self._cond:
            self._wake_left = WAKE_CHUNKS

    def _start(self) -> None:
        self._pid = os.getpid()
        self._generation += 1
        gen = self._generation
        with self._turns:
            self._taken = self._turn = 0
        self._threads = [
            threading.Thread(
                target=self._run, args=(gen,), name=f"mmcache-readahead-{i}", daemon=True
            )
            for i in range(self._threads_wanted)
        ]
        for t in self._threads:
            t.start()

    def cancel(self) -> None:
        """Drop what is queued and keep the threads, for the next submissions (the
        loader's plan stream ends with each epoch of non-persistent workers; starting
        and joining four threads for each epoch cost the training loop 1-18 ms of a
        150-280 ms epoch of 600 samples, measured on the busy 2-core machine)."""
        with self._cond:
            self._pending.clear()

    def close(self) -> None:
        """Stop the threads (what is queued is dropped); a later submit starts new ones."""
        with self._cond:
            threads, self._threads = self._threads, []
            self._generation += 1
            self._pending.clear()
            self._cond.notify_all()
        with self._turns:
            self._turns.notify_all()
        me = threading.current_thread()
        for t in threads:
            if t.is_alive() and t is not me and self._pid == os.getpid():
                t.join(5)

    def _my_turn(self, turn: int, gen: int) -> bool:
        """Wait until ``turn`` may run its ordered call; False if the threads stop."""
        with self._turns:
            while self._turn != turn and self._generation == gen:
                self._turns.wait(1.0)
            return self._generation == gen

    def _run(self, gen: int) -> None:
        while True:
            with self._cond:
                while not self._pending and self._generation == gen:
                    self._cond.wait()
                if self._generation != gen:
                    return
                keys = self._pending.popleft()
                with self._turns:
                    turn, self._taken = self._taken, self._taken + 1
            before = self._faults()
            worked: object = 0
            try:
                if self._ordered is not None and self._my_turn(turn, gen):
                    try:
                        worked = self._ordered(keys)
                    finally:
                        with self._turns:
                            if self._generation == gen:  # (a new start counts anew)
                                self._turn += 1
                            self._turns.notify_all()
                worked = self._fn(keys) or worked
            except Exception as exc:  # a hint only: never stops training
                logger.debug("read-ahead failed: %s", exc)
            after = self._faults()
            calm = before is not None and after == before and not worked
            with self._cond:
                self.chunks_read += 1
                self._calm.chunks = self._calm.chunks + 1 if calm else 0
