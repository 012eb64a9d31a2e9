"""Worker tasks: plan one batch (its keys, what the first tier holds) and produce its misses.

A *batch plan* (:class:`BatchPlan`) is the one meaning of "plan" in the
loader: a batch's dataset indices, cache keys, which rows the cache's first
tiers the training process gathers from (the :class:`~mmcache.stores.base.BatchReader`:
the node-shared memory tier, then the disk tier's map) held when planned, and a
result for every other row.

Plans are made by the worker processes of a plain ``torch.utils.data.DataLoader``
over a :class:`WorkerPlanner` (fork or spawn, persistent or not, with the
user's ``worker_init_fn``). For a ``StampKind.FILE`` source the worker
``stat``-s the files (so a changed file gets a new key every epoch), computes
the keys, asks the first tier which it holds, and for every other sample
looks in the other tiers (``cache.lookup`` promotes a hit) or produces it,
admitting the result (write-behind: nobody waits on a disk put). What comes
back (:class:`PackedPlan`) is the keys and a hit mask; a sample the worker
put in shared memory is not sent either. With ``num_workers=0`` the training
process runs the same tasks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, cast

import numpy as np
import torch

from mmcache import codec
from mmcache.cache import Cache
from mmcache.cluster.flight import FLIGHT
from mmcache.errors import SampleError
from mmcache.keys import STAT_FIELDS
from mmcache.loader.lookahead import Batches, Lookahead
from mmcache.readthrough import ReadThrough, Write, read_through
from mmcache.sources.base import SampleSource, StampKind
from mmcache.sources.capabilities import DrawsEpochs
from mmcache.stores.base import BatchReader, Promotes, ReadsAhead
from mmcache.stores.claims import Claims
from mmcache.stores.gathering import reader_stores
from mmcache.writeback import pending_write, write_behind

__all__ = [
    "STAMP_WORDS",
    "BatchPlan",
    "PackedPlan",
    "SampleOrigin",
    "TaskResult",
    "WorkerPlanner",
    "WorkerTask",
]

#: int64 words of a file's stat stamp (:func:`mmcache.keys.stat_fields`).
STAMP_WORDS = len(STAT_FIELDS)


class SampleOrigin(Enum):
    """Where a sample of a batch came from: what the epoch counters count.

    ``MEMORY_HIT``: the cache's first tier (gathered in the training process).
    ``DISK_HIT``: a lower tier, through ``cache.lookup`` (which promotes it).
    ``PRODUCED``: made by the source (a miss). ``REJECTED``: the source could
    not make it (``on_error="skip"``); not in the batch. ``WAITED``: another process
    of the node was producing it (its claim, :mod:`mmcache.stores.claims`); this one
    waited and took what it published: neither made here nor cached when asked.
    """

    MEMORY_HIT = "memory_hit"
    DISK_HIT = "disk_hit"
    PRODUCED = "produced"
    REJECTED = "rejected"
    WAITED = "waited"


@dataclass
class TaskResult:
    """A missing row's outcome, sent from a worker to the consumer (pickled by torch)."""

    index: int
    origin: SampleOrigin
    tier: str = ""  # the name of the tier that served a hit (the per-tier counts)
    sample: dict[str, np.ndarray] | None = None
    error: SampleError | None = None
    in_memory: bool = False  # the sample is in the first tier: gather it, nothing sent


@dataclass
class BatchPlan:
    """One batch, planned: indices, keys (``uint8 [n, 16]``), planned hits, misses' results."""

    indices: np.ndarray
    keys: np.ndarray
    planned_hit: np.ndarray  # bool per row: the first tier held it when planned
    results: list[TaskResult]  # one per row that was not a planned hit, in row order
    stamps: np.ndarray | None = None  # int64 [n, STAMP_WORDS]: the files' stamps keyed on
    # Made in the training process from the keys learnt in an earlier epoch, all
    # assumed in memory: gathered at once, served only once the file-check board (or
    # a stat here) shows every file unchanged this epoch. ``round``: the check round.
    guessed: bool = False
    round: int = 0
    # A gathered guess: the index of the reader's tier that served each row.
    served: np.ndarray | None = None


@dataclass(frozen=True)
class WorkerTask:
    """Plan (and produce the misses of) one batch; ``gate``: wait for it first (0: none);
    ``at``: ``(epoch, batch)``, where it is in the order (what the worker foresees from)."""

    gate: int
    indices: np.ndarray
    at: tuple[int, int] | None = None


@dataclass
class PackedPlan:
    """A batch plan as a worker sends it: raw keys, hit mask and the files' stamps
    (cheap to pickle), and the misses' results."""

    keys: bytes
    planned_hit: bytes
    results: list[TaskResult]
    stamps: bytes | None = None

    def unpack(self, indices: np.ndarray) -> BatchPlan:
        keys = np.frombuffer(self.keys, dtype=np.uint8).reshape(len(indices), -1)
        hit = np.frombuffer(self.planned_hit, dtype=bool)
        stamps = None
        if self.stamps is not None:
            stamps = np.frombuffer(self.stamps, dtype=np.int64).reshape(len(indices), STAMP_WORDS)
        return BatchPlan(indices, keys, hit, self.results, stamps)


class _Gate(Protocol):
    """What a worker needs of the :class:`~mmcache.loader.warm_epoch.gate.EpochGate`."""

    def wait(self, number: int) -> None: ...


class WorkerPlanner(torch.utils.data.Dataset[PackedPlan]):
    """The dataset the internal torch DataLoader's workers run: one task per batch.

    A task is the batch's dataset indices (:meth:`plan`): the worker computes
    the keys (a ``stat`` per file for a ``StampKind.FILE`` source, so
    staleness is checked every epoch), asks the first tier which it holds, and
    for each missing sample asks the cache (another process may have produced
    it, or a lower tier holds it), else produces it and admits it, measuring
    the CPU time it took as the entry's miss cost. With ``num_workers=0`` the
    training process runs the same tasks itself.
    """

    def __init__(
        self,
        source: SampleSource,
        cache: Cache | None,
        gate: _Gate | None = None,
        *,
        batches: Batches | None = None,
    ) -> None:
        self.source = source
        self.cache = cache
        self.gate = gate
        # What a source that shares reads is told this process produces next (batches:
        # the epochs' order; None: nothing is foreseen).
        self._lookahead = Lookahead(source, batches)
        # A mixture weighs its misses by planned reads; asked once (a protocol check
        # per sample costs ~15 us of the cold path).
        self._draws = isinstance(source, DrawsEpochs)
        # The training process plans on both of its assembling threads; the source's
        # key memo takes one at a time (the stat calls before it run unlocked).
        self._keys_lock = threading.Lock()
        self._reader: BatchReader | None = None
        self._reader_known = False  # resolved once per process (see _first_tier)
        self._claims_obj: Claims | None = None
        self._claims_known = False  # resolved once per process (see _claims)
        #: scope="cluster": which samples are homed on another node (the in-flight tier's).
        self.guests: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_keys_lock"]  # sent to spawned workers: a lock does not pickle
        state["_reader"], state["_reader_known"] = None, False  # that process's own
        state["_claims_obj"], state["_claims_known"] = None, False
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._keys_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.source)

    def _first_tier(self) -> BatchReader | None:
        """The cache's first tier when it gathers batches (``cache.reader``), else None."""
        if not self._reader_known:
            self._reader = self.cache.reader if self.cache is not None else None
            self._reader_known = True
        return self._reader

    def run(self, index: int, key: bytes, *, cached: bool = True) -> TaskResult:
        """Look ``key`` up, else produce and admit it.

        In a worker process, a sample that is (or has just been put) in the
        node-shared first tier is not sent back: the training process gathers
        it from shared memory like a hit, which saves pickling 150 KB through a
        pipe per sample (torch's own workers avoid that copy with shared-memory
        tensors). Everything else travels as arrays.

        A miss is produced under the node's claim on its key (``cache.claims``): when
        another process (another job on this node with the same pipeline and order, or
        another worker) is producing the same key right now, this one waits for it and
        takes the entry it publishes instead of decoding the sample a second time. The
        wait is bounded, and a producer that dies releases its claim as it dies.
        """
        return self._waited(index, key, cached=cached)

    def _waited(self, index: int, key: bytes, *, cached: bool, looked: bool = False) -> TaskResult:
        """:meth:`_run`, waiting for another producer (so never None)."""
        result = self._run(index, key, cached=cached, wait=True, looked=looked)
        if result is None:  # pragma: no cover - only wait=False returns None
            raise RuntimeError("a waited task returned nothing")
        return result

    def _run(
        self,
        index: int,
        key: bytes,
        *,
        cached: bool,
        wait: bool,
        looked: bool = False,
        asked: bool = False,
    ) -> TaskResult | None:
        """:meth:`run`; with ``wait=False``, None instead of waiting for another producer.

        ``looked``: this task already looked ``key`` up and missed (a row deferred while
        another process produced it), so it is not looked up again before the claim: a
        second lookup would count the sample as a miss twice in every tier's counters.
        ``asked``: the first tier was asked for ``key`` a moment ago (:meth:`plan`'s
        ``contains_many`` of the batch) and did not hold it; it is not asked again.
        """
        if self.cache is None or not cached:  # produced (and admitted), nothing asked
            return self._result(index, self._read(index, key, wait=wait, claimed=False))
        if not looked:
            found = self._look(key, asked=asked)
            if found is not None:
                return self._result(index, found)
        got = self._read(index, key, wait=wait, claimed=True)
        return None if got.deferred else self._result(index, got)

    def _read(self, index: int, key: bytes, *, wait: bool, claimed: bool) -> ReadThrough:
        """The read-through of a row :meth:`_run` has looked up and missed (or, not
        ``claimed``, is to produce as it is): claimed, produced, admitted write-behind
        (the first tier at once, the rest from a background thread), its cost weighed by
        a mixture's planned reads."""
        source, cache = self.source, self.cache
        weight = 1.0
        if self._draws:
            # A mixture knows its future: an entry read r times per epoch saves r misses.
            weight = float(cast(DrawsEpochs, source).planned_reads(index))
        return read_through(
            cache,
            key,
            lambda: source.produce(index),
            claims=self._claims() if claimed else None,
            wait=wait,
            write=self._writer(cache, index) if cache is not None else None,
            on_error="skip",  # returned as REJECTED; the consumer applies on_error
            tag=source.fingerprint(),
            lookup=False,  # looked up by _run (or deferred after a lookup)
            look=self._look,
            published=self._published,
            weight=weight,
        )

    def _writer(self, cache: Cache, index: int) -> Write:
        """How row ``index``'s produced entry is admitted: in flight to its home node when
        another node homes it (``scope="cluster"``), else this process's write-behind."""
        guest = self.guests is not None and bool(self.guests[index])
        behind = write_behind(cache)

        def write(key: bytes, raw: bytes, cost: float, tag: str | None) -> bool:
            ctime = codec.read_header(raw).ctime
            held = guest and cache.put_side(FLIGHT, key, raw, cost=cost, ctime=ctime)
            return held or bool(behind(key, raw, cost, tag))

        return write

    def _result(self, index: int, got: ReadThrough) -> TaskResult:
        """The row's :class:`TaskResult` from what :func:`read_through` did. In a worker
        an entry the first tier holds (a hit left in place, or a produced sample it
        admitted) is not sent: the training process gathers it like a hit."""
        if got.error is not None:
            return TaskResult(index, SampleOrigin.REJECTED, error=got.error)
        in_worker = torch.utils.data.get_worker_info() is not None
        if not got.hit:
            if got.admitted and in_worker:
                return TaskResult(index, SampleOrigin.PRODUCED, in_memory=True)
            return TaskResult(index, SampleOrigin.PRODUCED, sample=got.sample)
        reader = self._first_tier()
        first = reader is not None and got.tier == reader.name
        origin = SampleOrigin.MEMORY_HIT if first else SampleOrigin.DISK_HIT
        if got.waited:  # made by the process this one waited for
            origin = SampleOrigin.WAITED
        return TaskResult(index, origin, got.tier or "", got.sample, in_memory=got.held)

    def _published(self, key: bytes, waited: bool) -> bool:
        """Whether to look ``key`` up again once claimed: after waiting for another
        producer, if some tier (or this process's write-behind) now holds it; otherwise
        only if the first tier does (another process produced and released it between
        this one's lookup and its claim). Both ask without counting: the lookup that
        missed has counted the miss, and a producer that died publishing nothing must
        not make it two."""
        if waited:
            cache = self.cache
            return cache is not None and (
                cache.contains(key) or pending_write(cache, key) is not None
            )
        reader = self._first_tier()
        return reader is not None and bool(reader.contains_many([key])[0])

    def _claims(self) -> Claims | None:
        """The cache's production claims, resolved once per process (like the reader)."""
        if not self._claims_known:
            self._claims_obj = self.cache.claims if self.cache is not None else None
            self._claims_known = True
        return self._claims_obj

    def _look(self, key: bytes, *, asked: bool = False) -> ReadThrough | None:
        """The hit when some tier (or this process's write-behind) holds ``key``: in a
        worker, an entry of the first tier is left there (``held``: the training process
        gathers it) and a hit of a lower tier that ``lookup`` promoted into it too.

        ``asked``: the first tier has just said it does not hold ``key`` (see :meth:`_run`).
        """
        cache = self.cache
        if cache is None:
            return None
        in_worker = torch.utils.data.get_worker_info() is not None
        reader = self._first_tier()
        if in_worker and not asked and reader is not None and reader.contains_many([key])[0]:
            return ReadThrough(None, reader.name, held=True)
        sample, tier = cache.lookup(key)
        if sample is not None:
            first = reader is not None and tier == reader.name
            if (
                in_worker
                and not first
                and reader is not None
                and reader.contains_many([key])[0]  # promoted by lookup
            ):
                return ReadThrough(None, tier, held=True)
            return ReadThrough({k: np.array(v) for k, v in sample.items()}, tier)
        raw = pending_write(cache, key)  # produced here a moment ago, not yet committed
        if raw is not None:
            queued = {k: np.array(v) for k, v in codec.decode(raw, verify=False).items()}
            return ReadThrough(queued, list(cache.tiers)[-1])  # the tier it is on its way to
        return None

    def plan(
        self,
        indices: np.ndarray,
        *,
        produce: bool = True,
        known: tuple[np.ndarray, np.ndarray] | None = None,
        at: tuple[int, int] | None = None,
    ) -> BatchPlan | None:
        """Plan one batch: its keys, which rows the first tier holds, and the misses made.

        The rows the first tier holds are only named (their bytes are gathered
        by the training process); every other row is :meth:`run`, in order.
        ``produce=False``: return None instead when a row is missing. ``known``: the
        batch's keys and file stamps, made this epoch by the stat prefetcher (see
        :mod:`mmcache.loader.warm_epoch`), not made again here. ``at``: ``(epoch,
        batch)`` of a batch of the loader's order: before its misses are produced, a
        source that shares reads is told what this process produces next
        (:mod:`~mmcache.loader.lookahead`).
        """
        source = self.source
        stamps: np.ndarray | None
        if known is not None:
            keys, stamps = known
        else:
            stamps = source.stamps(indices) if source.stamp_kind is StampKind.FILE else None
            with self._keys_lock:
                keys = source.key_rows(indices, stamps=stamps)
        reader = self._first_tier()
        if reader is not None:
            planned = self._held(reader, keys)
        else:
            planned = np.zeros(len(indices), dtype=bool)
        if not produce and not planned.all():
            return None
        missing = np.flatnonzero(~planned).tolist()
        if missing and at is not None:
            self._lookahead.follow(at[0], at[1], indices)
        if missing and self.cache is not None:
            # A tier far away (the shared tier) reads the batch's misses at once, grouped
            # by pack, before they are looked up one by one below.
            self.cache.fetch_ahead(keys[missing])
        # First the misses nobody else is producing, then (waiting) the ones another
        # process is: jobs that share an order then split a batch's decodes between them.
        # A deferred row has been looked up once (``looked``): one miss counted, not two.
        first = [
            self._run(
                int(indices[r]),
                keys[r].tobytes(),
                cached=True,
                wait=False,
                asked=reader is not None,
            )
            for r in missing
        ]
        results = [
            res
            if res is not None
            else self._waited(int(indices[r]), keys[r].tobytes(), cached=True, looked=True)
            for r, res in zip(missing, first, strict=True)
        ]
        return BatchPlan(indices, keys, planned, results, stamps)

    def _held(self, reader: BatchReader, keys: np.ndarray) -> np.ndarray:
        """Which of ``keys`` some tier of ``reader`` holds (``bool [n]``), after :meth:`ahead`
        of the batch's gather where it has work.

        Over several tiers the first is asked first: when it holds every key (every batch
        of a warm epoch), nothing lies below it to promote or read ahead, and
        :meth:`ahead` is not run (both of its steps would ask the first tier again for
        each key, for nothing: two lookups a batch, ~0.2 ms each for 16 keys, in the
        training process when it plans a new process's first epoch). Otherwise the
        lower tiers are asked for the rest and :meth:`ahead` runs as before.
        """
        stores = reader_stores(reader)
        if len(stores) == 1:
            planned = np.asarray(reader.contains_many(keys), dtype=bool)
            self.ahead(keys)
            return planned
        first: BatchReader = stores[0]  # a BatchReader (TieredReader checks each tier)
        planned = np.asarray(first.contains_many(keys), dtype=bool)
        if planned.all():
            return planned
        left = np.flatnonzero(~planned)
        planned[left] = np.asarray(reader.contains_many(keys[left]), dtype=bool)
        self.ahead(keys)
        return planned

    def ahead(self, keys: np.ndarray) -> int:
        """Ahead of a batch's gather (planning runs batches ahead, in the epoch's order):
        :meth:`promote`, then :meth:`read_ahead` the rest. Returns the entries promoted."""
        promoted = self.promote(keys)
        self.read_ahead(keys)
        return promoted

    def promote(self, keys: np.ndarray) -> int:
        """Promote into the first tier the entries only a lower tier holds, while it has
        room (a :class:`~mmcache.stores.base.Promotes` reader; the verified
        ``cache.lookup`` offers each to its policy).
        Callers keep the epoch's order (the budget then holds the entries used first).
        Returns the entries promoted."""
        reader = self._first_tier()
        if not isinstance(reader, Promotes) or self.cache is None:
            return 0
        promoted = 0
        for key in reader.promotable(keys):
            promoted += self.cache.lookup(key)[0] is not None
        return promoted

    def reads_ahead(self) -> bool:
        """Whether :meth:`read_ahead` does anything (a tier that can ``prefetch``)."""
        return isinstance(self._first_tier(), ReadsAhead)

    def read_ahead(self, keys: np.ndarray) -> None:
        """Ask the reader's tiers that can (``prefetch``) to read ``keys``' pages ahead."""
        reader = self._first_tier()
        if isinstance(reader, ReadsAhead):
            reader.prefetch(keys)

    def produced(self, indices: np.ndarray, *, at: tuple[int, int] | None = None) -> BatchPlan:
        """:meth:`plan` with every missing row produced (``at``: as :meth:`plan`'s)."""
        plan = self.plan(indices, at=at)
        if plan is None:  # pragma: no cover - plan() returns None only with produce=False
            raise RuntimeError("a produced plan is missing")
        return plan

    def __getitem__(self, task: Any) -> PackedPlan:
        return self.__getitems__([task])[0]

    def __getitems__(self, tasks: Sequence[Any]) -> list[PackedPlan]:
        """Plan the batches of one task (one or, in warm stretches, several batches)
        in a worker, in the compact form sent back to the training process."""
        out = []
        for task in tasks:
            if task.gate and self.gate is not None:
                self.gate.wait(task.gate)  # a batch of an epoch the training loop has not begun
            plan = self.produced(np.asarray(task.indices, dtype=np.int64), at=task.at)
            stamps = plan.stamps.tobytes() if plan.stamps is not None else None
            out.append(
                PackedPlan(plan.keys.tobytes(), plan.planned_hit.tobytes(), plan.results, stamps)
            )
        return out
