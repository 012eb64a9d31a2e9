"""Guessed epochs: an epoch that begins warm is served from the keys learnt, not planned.

When an epoch begins warm (the last batches planned had no misses, or the
first tier's budget holds every sample and this rank knows every key), the
workers are not asked to plan it. The training process *guesses* each
batch's plan from the keys and file stamps it learnt (:class:`LearntKeys`),
gathers the batch at once, and serves it once every file of it is known
unchanged this epoch: a low-priority
:class:`~mmcache.loader.warm_epoch.prefetch.StatPrefetcher` process
``stat``-s the epoch's files in order and publishes the results on a
:class:`~mmcache.loader.warm_epoch.board.FileCheckBoard`; files it has not
reached are ``stat``-ed here. A batch whose guess fails (a file changed, an
entry went, a key never learnt on this rank) is planned and produced here,
and the rest of the epoch is planned as usual.

An epoch whose keys this process does not know (its first, over a cache an
earlier run filled) is planned in the training process until its first miss
(persistent workers are started then, not before): the prefetcher is asked
for the epoch's keys too (:meth:`WarmEpochs.begin` with ``local``), made from
the stamps it takes after the epoch began, as a worker makes them, and a batch
whose keys it has published (:meth:`WarmEpochs.published`) is only looked up,
not keyed, here.

Guessing runs for ``StampKind.FILE`` sources (a ``stat`` re-checks a key) and
``StampKind.FIXED`` ones (a guessed batch is checked against the source's own keys,
which change when a revalidated shard or object changed), with workers
(``num_workers=0`` starts no process) and a cache.

The sub-package also holds the other machinery that keeps epoch starts
cheap: :mod:`~mmcache.loader.warm_epoch.gate` (persistent workers may hold
the next epoch's tasks, run only once the training loop begins it) and
:mod:`~mmcache.loader.warm_epoch.assembler` (batches assembled one ahead on a
thread kept from epoch to epoch).

Thread safety: :class:`WarmEpochs` is driven by the training process's plan
fetch and its assembling threads; a row of :class:`LearntKeys` read while
another thread writes it at most makes a guess fail.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from mmcache.cache import Cache
from mmcache.loader.shmroom import ShmRoom
from mmcache.loader.tasks import STAMP_WORDS, BatchPlan
from mmcache.loader.warm_epoch.board import FileCheckBoard
from mmcache.loader.warm_epoch.prefetch import StatPrefetcher
from mmcache.sources.base import SampleSource, StampKind
from mmcache.sources.capabilities import index_count
from mmcache.sources.chassis import BaseSource, lazy_zeros
from mmcache.sources.keytable import KeyTable
from mmcache.stores.gathering import reader_capacity

__all__ = ["LearntKeys", "WarmEpochs"]

#: Guessed epochs remembered (with their check rounds).
_KEEP_GUESSED = 4
#: A start past every epoch's last batch: a request that stops the prefetcher's round.
_NOTHING = 1 << 62
#: Where a learnt key is (LearntKeys): nowhere yet, in the node's key table, in this process.
_NOT_LEARNT, _IN_TABLE, _HERE = 0, 1, 2
#: Most samples whose keys the prefetcher publishes: the board then takes 48 bytes more
#: per sample of shared memory (``/dev/shm``), 48 MiB here; beyond, a new process's first
#: epoch is keyed in the training process (over a source with a key table, a ``stat`` and a
#: table look-up per sample: no key is hashed again, ~11 us a sample at 5x10^4).
_KEYED_MAX = 1 << 20


class LearntKeys:
    """Which samples' cache keys were learnt from plans, and the keys themselves: a guessed
    plan is made of them, never trusted on its own.

    With the node's key table (:mod:`~mmcache.sources.keytable`: the source's
    ``key_table``) a learnt key is read from there: the workers that planned the
    batch wrote its row, so this process holds one byte per sample (which were learnt,
    and where). A key the table does not hold (its file changed too recently to be
    remembered there, or the source has no table) is kept here, 49 bytes per such sample,
    in pages made only as they are written. Rows are written whole by the thread that
    fetches plans; a table row that does not verify when read makes the guess fail.
    """

    def __init__(self, n: int, table: KeyTable | None = None) -> None:
        self._n = n
        self._table = table
        self._where: np.ndarray | None = None  # uint8 [n]: _NOT_LEARNT, _IN_TABLE, _HERE
        self._rows: np.ndarray | None = None  # uint8 [n, 48]: key, then the int64 stamp

    def learn(self, plan: BatchPlan, *, fixed: bool = False) -> None:
        """Remember the plan's keys (and file stamps; ``fixed``: a ``StampKind.FIXED``
        source, whose plans carry none and whose guesses are checked by key)."""
        if plan.stamps is None and not fixed:
            return  # keys of file contents (StampKind.CONTENT): nothing a stat can verify
        if self._where is None:
            self._where = lazy_zeros((self._n,), np.uint8)
        here = np.ones(len(plan.indices), dtype=bool)
        if self._table is not None and plan.stamps is not None:
            keys, found = self._table.lookup(plan.indices, plan.stamps)
            here = ~(found & (keys == plan.keys).all(axis=1))
        self._where[plan.indices] = np.where(here, _HERE, _IN_TABLE)
        if not here.any():
            return
        if self._rows is None:
            self._rows = lazy_zeros((self._n, 16 + 8 * STAMP_WORDS), np.uint8)
        mine = plan.indices[here]
        self._rows[mine, :16] = plan.keys[here]
        if plan.stamps is not None:
            stamps = np.ascontiguousarray(plan.stamps[here])
            self._rows[mine, 16:] = stamps.view(np.uint8)

    def count(self) -> int:
        """Samples whose key is known."""
        return int(np.count_nonzero(self._where)) if self._where is not None else 0

    def guess(self, indices: np.ndarray, round_: int) -> BatchPlan | None:
        """A plan of ``indices`` from their learnt keys; None if one is unknown (or its row
        of the key table no longer verifies)."""
        if self._where is None:
            return None
        where = self._where[indices]
        if not where.all():
            return None
        keys = np.empty((len(indices), 16), dtype=np.uint8)
        stamps = np.empty((len(indices), STAMP_WORDS), dtype=np.int64)
        shared = where == _IN_TABLE
        if shared.any():
            if self._table is None:  # pragma: no cover - _IN_TABLE is written with one
                return None
            got, held, ok = self._table.rows(indices[shared])
            if not ok.all():
                return None
            keys[shared], stamps[shared] = got, held
        if not shared.all():
            if self._rows is None:  # pragma: no cover - _HERE is written with the rows
                return None
            rows = self._rows[indices[~shared]]
            keys[~shared], stamps[~shared] = rows[:, :16], rows[:, 16:].view(np.int64)
        hit = np.ones(len(indices), dtype=bool)
        return BatchPlan(indices, keys, hit, [], stamps, guessed=True, round=round_)


class WarmEpochs:
    """Which epochs are guessed, and what a guess is made of and checked with.

    Args:
        source: the samples (its ``stamps`` re-check a guess).
        order: ``batches(epoch)``, for the prefetcher: lock-free (its process may be
            forked while another thread of the training process holds a lock).
        cache: the cache (None: nothing is guessed).
        num_workers: with none, nothing is guessed (no process is started).
        num_samples: this rank's samples per epoch (all their keys must be known).
        entry_bytes: the size of one cache entry, once the loader knows it.
        context: the multiprocessing context of the workers.
        shm: the loader's room in ``/dev/shm``: without room for the prefetcher's
            lock and semaphore, epochs are not guessed (the workers plan them).
    """

    def __init__(
        self,
        source: SampleSource,
        order: Any,
        *,
        cache: Cache | None,
        num_workers: int,
        num_samples: int,
        entry_bytes: Callable[[], int | None],
        context: Any = None,
        shm: ShmRoom | None = None,
    ) -> None:
        self._source = source
        self._cache = cache
        self._n = index_count(source)  # (a mixture: its distinct samples, not one epoch)
        self._num_samples = num_samples
        self._entry_bytes = entry_bytes
        # The table of a FILE source (its stamp rows are the plans' STAMP_WORDS wide); a
        # FIXED source's rows are of another width, and the first width a process asks
        # for is the table it keeps: asking it here would cost its own keying the table.
        table = None
        if isinstance(source, BaseSource) and source.stamp_kind is StampKind.FILE:
            table = source.key_table(STAMP_WORDS)
        self.learnt = LearntKeys(self._n, table)  # keys the plans brought (guesses)
        #: Guessed epochs (the last few) and their check rounds.
        self.guessed: dict[int, int] = {}
        self._rounds = 0  # check rounds handed out
        #: Epochs whose keys the prefetcher publishes, and their rounds.
        self._keyed: dict[int, int] = {}
        self._board: FileCheckBoard | None = None
        self._prefetcher: StatPrefetcher | None = None
        # A FIXED source (shard members, rows) has nothing to stat: a guess is checked
        # against the source's own keys (memoised; re-keyed when a shard changed).
        self._fixed = num_workers > 0 and cache is not None and source.stamp_kind is StampKind.FIXED
        self._key_lock = threading.Lock()  # key_rows is not thread-safe; verified() is
        if num_workers > 0 and cache is not None and source.stamp_kind is StampKind.FILE:
            self._prefetcher = self._new_prefetcher(order, context, shm or ShmRoom())
        if self._prefetcher is not None:
            # Started now (a fork: milliseconds, plus a copy of each page the training
            # process writes afterwards): not in the first epoch's time, and before any
            # batch buffer exists (started later, those pages are copied each epoch).
            self._prefetcher.start()

    def _new_prefetcher(self, order: Any, context: Any, shm: ShmRoom) -> StatPrefetcher | None:
        """The stat prefetcher and its board, or None without room in /dev/shm for them."""
        if shm.full:
            return None
        words = STAMP_WORDS if self._n <= _KEYED_MAX else 0
        try:
            self._board = FileCheckBoard(self._n, context, key_stamps=words)
            return StatPrefetcher(self._board, self._source, order, context)
        except OSError as exc:  # its lock and semaphore: ENOSPC in a full /dev/shm
            self._board = None
            shm.report("stat prefetcher", exc, "no epoch is guessed (the workers plan each)")
            return None

    def should_guess(self, warm: bool, *, beginning: bool = False) -> bool:
        """Whether the next epoch is to be guessed: with a prefetcher, when ``warm`` (the
        last batch planned had no misses), or when the first tier's budget holds every
        sample (after a cold epoch: its last batches had misses, but all are in now).

        ``beginning``: asked as the epoch begins, when the keys of all this rank's
        samples must be known too (the workers' stream asks earlier, while the last
        plans of the epoch before are still coming).
        """
        if self._prefetcher is None and not self._fixed:
            return False
        if warm:
            return True
        entry = self._entry_bytes()
        reader = self._cache.reader if self._cache is not None else None
        if entry is None or self._cache is None or reader is None:
            return False
        if reader_capacity(reader) < entry * self._n:
            return False
        return not beginning or self.learnt.count() >= self._num_samples

    def begin(
        self, epoch: int, start: int, *, warm: bool, streams: bool, local: bool = False
    ) -> None:
        """The training loop begins ``epoch`` at batch ``start``: guess it if it begins
        warm and the workers hold no plans of it (``streams``); else, when it is planned
        here until its first miss (``local``), have the prefetcher publish its keys."""
        self.guessed.pop(epoch, None)
        self._keyed.clear()
        if self.should_guess(warm, beginning=True) and not streams:
            self._rounds += 1
            self.guessed[epoch] = self._rounds
            while len(self.guessed) > _KEEP_GUESSED:
                del self.guessed[next(iter(self.guessed))]
            if self._prefetcher is not None:
                self._prefetcher.request(self._rounds, epoch, start)
        elif local and (prefetcher := self._keying_prefetcher()) is not None:
            self._rounds += 1
            self._keyed[epoch] = self._rounds
            prefetcher.request(self._rounds, epoch, start, keys=True)

    def _keying_prefetcher(self) -> StatPrefetcher | None:
        """The prefetcher when it may publish keys, else None. Only the process forked as
        the loader was made, before its threads, keys samples: one forked later may hold a
        copy of a lock another thread held then (the source's identity ledger's), and
        would key nothing (the training process would key every batch itself)."""
        board, prefetcher = self._board, self._prefetcher
        if board is None or not board.carries_keys or prefetcher is None:
            return None
        return prefetcher if prefetcher.starts == 1 else None

    def published(self, epoch: int, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The keys and stamps of a batch of ``epoch`` the prefetcher has published this
        epoch, or None (not asked for, not there yet)."""
        round_ = self._keyed.get(epoch)
        if round_ is None or self._board is None:
            return None
        return self._board.published(indices, round_)

    def stop_publishing(self, epoch: int) -> None:
        """``epoch`` is planned by the workers from here on: the prefetcher stops keying it."""
        if self._keyed.pop(epoch, None) is not None and self._prefetcher is not None:
            self._rounds += 1
            self._prefetcher.request(self._rounds, epoch, _NOTHING)

    def is_guessed(self, epoch: int) -> bool:
        return epoch in self.guessed

    def guess(self, epoch: int, indices: np.ndarray) -> BatchPlan | None:
        """The guessed plan of a batch of ``epoch``, or None: the epoch is not guessed,
        or a sample's key was never learnt here (another rank had it before), and the
        rest of the epoch is planned as in one not guessed."""
        round_ = self.guessed.get(epoch)
        if round_ is None:
            return None
        plan = self.learnt.guess(indices, round_)
        if plan is None:
            self.stop_guessing(epoch)
        return plan

    def known_keys(self, indices: np.ndarray) -> np.ndarray | None:
        """The learnt keys (``uint8 [n, 16]``) of ``indices``, or None if one is unknown."""
        plan = self.learnt.guess(indices, 0)
        return None if plan is None else plan.keys

    def stop_guessing(self, epoch: int) -> None:
        """A guess of ``epoch`` failed: its other batches are planned as usual."""
        self.guessed.pop(epoch, None)

    def learn(self, plan: BatchPlan) -> None:
        """Remember the keys of a plan that was not a guess (only where an epoch can be
        guessed: otherwise they are never read, and they take 49 bytes per sample)."""
        if self._prefetcher is None and not self._fixed:
            return
        self.learnt.learn(plan, fixed=self._fixed)

    def verified(self, guess: BatchPlan) -> bool:
        """Whether every file of a guessed plan is unchanged this epoch. Thread-safe.

        The board says so for the files the prefetcher has ``stat``-ed already in
        this round; the others are ``stat``-ed here.
        """
        if self._fixed:
            with self._key_lock:
                return bool(np.array_equal(self._source.key_rows(guess.indices), guess.keys))
        board = self._board
        if board is None or guess.stamps is None:  # pragma: no cover - guess() needs both
            return False
        ok = board.verified(guess.indices, guess.stamps, guess.round)
        if ok.all():
            return True
        late = np.flatnonzero(~ok)
        return np.array_equal(self._source.stamps(guess.indices[late]), guess.stamps[late])

    def restart_prefetcher(self) -> None:
        """Start the prefetcher again if it was closed (with the workers)."""
        if self._prefetcher is not None and self._prefetcher.pid is None:
            self._prefetcher.start()

    def close(self) -> None:
        """Stop the prefetcher. Idempotent."""
        if self._prefetcher is not None:
            self._prefetcher.close()
