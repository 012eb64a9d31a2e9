"""Freshness of loose files: how a source learns that its files did not change, and when.

A loose file's stamp is its ``stat`` (:func:`mmcache.keys.stat_fields`), and the loader
re-checks a cached batch by taking its files' stamps again (each epoch, in the stat
prefetcher or the training process; in the workers for a planned batch). That costs one
``stat`` per file per check: ~3 us locally, but ~0.5 ms on NFS or Lustre, where 10^6 files
take 500 s per epoch one after another. Two things bring it down:

- **Stats in parallel** (:class:`StatTaker`): ``os.stat`` releases the GIL while the file
  system answers, so a batch's stats run on a pool of :data:`STAT_THREADS` threads when
  they are slow, and an epoch costs about ``latency x N / threads``. When they are fast
  (a local disk: the GIL, not the file system, is then the bound, and handing work to
  threads costs more than the stats) they run in the calling thread. Which one is decided
  from the stats themselves: the first few of a batch are timed, and a batch run on the
  pool times its threads; no probe of the file system's kind (a mount type does not say
  whether its attributes are cached).
- **Fewer checks** (:class:`FileChecks`), an explicit opt-in: ``recheck=`` seconds (a file
  found unchanged less than that long ago is not ``stat``-ed again; its stamp from then is
  served) or ``freshness="run"`` (each file is ``stat``-ed once per process, for data that
  is read-only while the job runs). The default, ``freshness="epoch"`` with
  ``recheck=0``, checks every file at every check, as always: a file rewritten in place is
  caught at the next epoch.

Per-folder evidence never vouches for a file, it only shortens ``recheck``'s window. A
folder's mtime and ctime change when an entry is added, removed or renamed in it (``rsync``
and "write a temporary file, then rename it" replace a file that way, with a new inode), but
not when a file inside is rewritten in place (``open(..., "wb")``, ``cp`` over it, an image
editor saving over it): an unchanged folder proves only that no name in it was added,
removed or replaced. So under ``recheck`` each folder of the files asked for is ``stat``-ed
at most every :data:`FOLDER_RECHECK_S` seconds, and when it changed, its files checked
before the change are due at once: a replaced file is seen within seconds, a rewritten one
when the window ends, as without it. Used the other way (an unchanged folder taken as proof
that its files are unchanged) it would serve a rewritten file stale for ever, and it could
save nothing but the ``stat`` of files already missing: rejected. ``"run"`` checks no folder
(its promise is that nothing changes).

Thread/process safety: :meth:`FileChecks.stamps` and :meth:`StatTaker.stat_rows` may be
called from several threads of a process (the training process's assembling threads); a
process forked from one holding them starts with nothing remembered and its own pool.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from mmcache import keys
from mmcache.errors import ConfigError

__all__ = [
    "FOLDER_RECHECK_S",
    "STAT_THREADS",
    "FileChecks",
    "Freshness",
    "StatTaker",
    "check_freshness",
    "stat_rows",
]

#: How often a loose file is ``stat``-ed: ``"epoch"`` at every check (each epoch; with
#: ``recheck``, at most once per window), ``"run"`` once per process.
Freshness = Literal["epoch", "run"]
#: Threads that ``stat`` at once when stats are slow: a network file system answers
#: many requests at once (NFS's RPC slots, Lustre's metadata servers), and each waiting
#: thread costs only its stack.
STAT_THREADS = 32
#: Stats whose fastest took longer than this (seconds) are a file system's round trips,
#: worth a thread each; a local one (page cache) takes 2-20 us, which threads only slow
#: down (the GIL).
SLOW_STAT_S = 100e-6
#: Under ``recheck``, the most seconds between two ``stat``s of one folder (``recheck`` if
#: shorter): how late a file replaced by a rename is seen. One ``stat`` per folder of 10^4
#: files per 10 s costs nothing beside theirs.
FOLDER_RECHECK_S = 10.0
#: Stats timed in the calling thread before the rest of a batch goes to the pool.
_PROBE = 4
#: Fewest stats one thread of the pool takes (handing out work costs ~10 us).
_PER_THREAD = 4
#: A stamp row with no file behind it (no path, missing, unreadable): ``-2`` everywhere.
_NONE = (-2,) * len(keys.STAT_FIELDS)

_I64 = npt.NDArray[np.int64]


def check_freshness(freshness: object, recheck: object) -> tuple[Freshness, float]:
    """``(freshness, recheck)`` if they are valid together, else ConfigError naming the
    value: ``freshness`` is ``"epoch"`` or ``"run"``, ``recheck`` seconds >= 0 (finite),
    and only with ``"epoch"`` (``"run"`` checks once: no window to set)."""
    if freshness not in ("epoch", "run"):
        raise ConfigError(
            f"freshness must be 'epoch' (check files every epoch) or 'run' (once per run, "
            f"for read-only data), got {freshness!r}"
        )
    if isinstance(recheck, bool) or not isinstance(recheck, int | float):
        raise ConfigError(f"recheck must be seconds (a number >= 0), got {recheck!r}")
    if not (math.isfinite(recheck) and recheck >= 0):
        raise ConfigError(
            f"recheck must be finite seconds >= 0, got {recheck!r} (for never again in "
            "this run, use freshness='run')"
        )
    if freshness == "run" and recheck:
        raise ConfigError(
            f"recheck={recheck!r} is for freshness='epoch'; freshness='run' checks each "
            "file once per run (drop one of them)"
        )
    return ("run" if freshness == "run" else "epoch"), float(recheck)


def _stat_run(paths: Sequence[bytes | None]) -> list[tuple[int, ...]]:
    """The stamp of each path, one after another (``-2`` where there is none). ``os.stat``
    is looked up at each call (a test's or benchmark's wrapper is seen)."""
    stat, fields = os.stat, keys.stat_fields
    rows: list[tuple[int, ...]] = []
    for path in paths:
        if path is None:
            rows.append(_NONE)
            continue
        try:
            rows.append(fields(stat(path)))
        except (OSError, ValueError):  # missing, unreadable, or a NUL in the path
            rows.append(_NONE)
    return rows


def _timed_run(paths: Sequence[bytes | None]) -> tuple[list[tuple[int, ...]], float]:
    """:func:`_stat_run`, and the fewest seconds one ``stat`` took (``inf`` for none): a
    preempted thread makes some stats look slow, never all of them, so the fastest says
    what the file system costs. (Timing each stat costs ~0.2 us: only the probes and the
    pool's parts are timed.)"""
    clock = time.perf_counter
    rows: list[tuple[int, ...]] = []
    fastest = math.inf
    for path in paths:
        t0 = clock()
        rows += _stat_run((path,))
        if path is not None:
            fastest = min(fastest, clock() - t0)
    return rows, fastest


class StatTaker:
    """Stamps of many files, on a thread pool when the file system is slow to answer.

    One per process (:func:`stat_rows`'s); the pool is made on the first slow batch and
    made again in a forked child (a pool's threads do not survive a fork).

    Args:
        threads: the pool's size (:data:`STAT_THREADS`).
        slow_s: the seconds the fastest ``stat`` of a probe takes above which the pool is
            used (:data:`SLOW_STAT_S`).
    """

    def __init__(self, *, threads: int = STAT_THREADS, slow_s: float = SLOW_STAT_S) -> None:
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.slow_s = slow_s
        self._slow = False  # the last batch's verdict (a guess, corrected by each batch)
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def stat_rows(self, paths: Sequence[bytes | None]) -> list[tuple[int, ...]]:
        """:func:`mmcache.keys.stat_fields` of each path, in order (``-2`` x 4 where none).

        Unless the last batch was slow, the first :data:`_PROBE` stats run here; if the
        fastest of them took over ``slow_s``, the rest of the batch runs on the pool (and
        the next batch starts there), else here. A batch on the pool is judged by its
        fastest ``stat``: once that is fast, the next batch starts here again."""
        n = len(paths)
        rows: list[tuple[int, ...]] = []
        at = 0
        if not self._slow:
            at = min(n, _PROBE)
            rows, fastest = _timed_run(paths[:at])
            if fastest <= self.slow_s or fastest == math.inf:  # inf: no path among them
                return rows + _stat_run(paths[at:])
            self._slow = True
        if at < n:
            rows += self._parallel(paths[at:])
        return rows

    def _parallel(self, paths: Sequence[bytes | None]) -> list[tuple[int, ...]]:
        """The stamps of ``paths`` in contiguous parts, one per thread (each ``stat`` waits
        on the file system alone); judges the speed from the fastest ``stat`` of all."""
        n = len(paths)
        parts = max(1, min(self.threads, n // _PER_THREAD))
        step = -(-n // parts)
        chunks = [paths[a : a + step] for a in range(0, n, step)]
        rows: list[tuple[int, ...]] = []
        fastest = math.inf
        for got, took in self._executor().map(_timed_run, chunks):
            rows += got
            fastest = min(fastest, took)
        self._slow = fastest > self.slow_s  # inf (no path among them): still slow
        return rows

    def _executor(self) -> ThreadPoolExecutor:
        if self._pid != os.getpid():
            # A forked child: its copy of the parent's pool has no threads, and its copy of
            # the lock may have been held by another thread at the fork. New ones (the old
            # pool is left alone, never shut down from here).
            self._lock, self._pool, self._pid = threading.Lock(), None, os.getpid()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mmcache-stat")
            return self._pool


#: This process's taker (made at import: no lock a fork could copy held; its pool is made
#: on the first slow batch, again in a forked child).
_TAKER = StatTaker()


def stat_rows(paths: Sequence[bytes | None]) -> _I64:
    """``int64 [n, 4]`` stamps of ``paths`` (:meth:`StatTaker.stat_rows`; one pool per
    process, shared by its sources)."""
    # Rows gathered in a list and made one array: a numpy row assignment per file cost
    # about as much as its stat (the training process stats what the stat prefetcher has
    # not reached itself).
    rows = _TAKER.stat_rows(paths)
    return np.array(rows, dtype=np.int64).reshape(len(rows), len(_NONE))


class FileChecks:
    """Which files are due a ``stat``, and the stamps of those that are not (one process).

    With ``freshness="epoch"`` and ``recheck=0`` (the default) every file is due at every
    call and nothing is remembered. Otherwise each row's stamp is remembered with the time
    its ``stat`` began (``clock``), and a row is due again when that is ``recheck`` seconds
    old (``"epoch"``) or never (``"run"``). 40 bytes per sample of the source (its time and
    stamp row), allocated at the first call in each process. Under ``recheck``, a row whose
    folder changed since the row was checked is due at once too (see the module docstring:
    a file replaced by a rename; the folders are ``stat``-ed at most every
    :data:`FOLDER_RECHECK_S` seconds, each remembered by its path).

    What is served from memory is what the file was at its last ``stat``: a file rewritten
    in place meanwhile is caught when its row is next due (at most ``recheck`` seconds
    later), or never in this process (``"run"``). Missing files are remembered as missing.

    Args:
        n: the source's samples.
        freshness, recheck: see :func:`check_freshness`.
        clock: seconds, monotonic (``time.monotonic``; a test's fake).

    Thread-safe; a process forked from this one starts with nothing remembered (its copy
    may have been taken in the middle of another thread's update).
    """

    def __init__(
        self,
        n: int,
        *,
        freshness: Freshness = "epoch",
        recheck: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.freshness, self.recheck = check_freshness(freshness, recheck)
        self.n = n
        self.clock = clock
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._when: npt.NDArray[np.float64] | None = None  # NaN: never checked here
        self._rows: _I64 | None = None
        self._now = -math.inf  # the last call's time
        #: folder -> [its stamp at the last check, when that began, when it was seen changed]
        self._folders: dict[bytes, list[Any]] = {}

    @property
    def remembers(self) -> bool:
        """Whether anything is remembered (``recheck`` or ``"run"``): otherwise every row
        is due at every call."""
        return self.freshness == "run" or self.recheck > 0

    def stamps(
        self,
        rows: _I64,
        take: Callable[[_I64], _I64],
        paths: Callable[[_I64], Sequence[bytes | None]] | None = None,
    ) -> _I64:
        """The stamps of ``rows`` (sample indices, checked): ``take(due)`` for the rows due
        a ``stat``, the remembered stamps of the others. ``paths(rows)``: each row's one
        file (None: none, or several), whose folder's evidence shortens ``recheck``."""
        if not self.remembers:
            return take(rows)
        if self._pid != os.getpid():
            # A forked child: its copy of the arrays may be torn (taken in the middle of
            # another thread's update) and of the lock held. It starts afresh.
            self._lock, self._when, self._rows = threading.Lock(), None, None
            self._folders, self._pid = {}, os.getpid()
        with self._lock:
            # Each call's time is later than the last one's, even on a coarse or fake clock:
            # a folder seen changed by a later call is never taken for one seen before it.
            now = self._now = max(self.clock(), math.nextafter(self._now, math.inf))
        changed = None
        if paths is not None and self.freshness == "epoch":
            # Before any of the rows is stat-ed: a folder is first seen no later than the
            # first check of a file in it, so a change it shows is after that check.
            changed = self._folder_changes(paths(rows), now)
        with self._lock:
            when, memo = self._arrays_locked()
            if self.freshness == "run":
                due = np.isnan(when[rows])
            else:  # NaN compares False: never checked is due
                due = ~(now - when[rows] < self.recheck)
                if changed is not None:  # changed after the row's last check
                    due |= changed > when[rows]
            out = memo[rows]
        if due.any():
            fresh_rows = rows[due]
            fresh = take(fresh_rows)
            out[due] = fresh
            with self._lock:
                when, memo = self._arrays_locked()
                memo[fresh_rows] = fresh
                when[fresh_rows] = now  # when the stat began: the window counts from there
        return out

    def _folder_changes(self, paths: Sequence[bytes | None], now: float) -> npt.NDArray[np.float64]:
        """When each path's folder was last seen changed (``-inf``: not since first seen,
        or no path), after a ``stat`` of each folder last checked
        ``min(recheck, FOLDER_RECHECK_S)`` or more seconds ago (on the pool if slow; the
        lock is not held meanwhile)."""
        folders = [None if p is None else os.path.dirname(p) for p in paths]
        window = min(self.recheck, FOLDER_RECHECK_S)
        with self._lock:
            seen = self._folders
            due = sorted(
                {f for f in folders if f is not None and not now - seen.get(f, _NEVER)[1] < window}
            )
        if due:
            got = stat_rows(due).tolist()
            with self._lock:
                for folder, row in zip(due, got, strict=True):
                    stamp, old = tuple(row), self._folders.get(folder)
                    if old is None:
                        self._folders[folder] = [stamp, now, -math.inf]
                    elif old[0] != stamp:
                        old[:] = [stamp, now, now]
                    else:
                        old[1] = now
        with self._lock:
            seen = self._folders
            return np.array(
                [-math.inf if f is None else seen.get(f, _NEVER)[2] for f in folders],
                dtype=np.float64,
            )

    def _arrays_locked(self) -> tuple[npt.NDArray[np.float64], _I64]:
        if self._when is None or self._rows is None:
            self._when = np.full(self.n, np.nan)
            self._rows = np.zeros((self.n, len(_NONE)), dtype=np.int64)
        return self._when, self._rows


#: A folder never checked: its last check infinitely old, never seen changed.
_NEVER: list[Any] = [None, -math.inf, -math.inf]
