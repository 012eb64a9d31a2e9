"""``mmcache.DataLoader``: hits gathered in the training process, misses made by workers.

How a batch is made (every epoch's order is known in advance, see
:mod:`mmcache.sampler`):

1. *Planning* (:mod:`~mmcache.loader.tasks`): the batch's keys, which of them
   the cache's first tier holds, and the misses produced, by the worker
   processes of a plain torch DataLoader (:mod:`~mmcache.loader.stream`), in
   exactly the order the training loop takes the batches; with persistent
   workers across epochs, the next epoch's tasks held at a gate until the
   training loop begins it. Workers not started yet (a process's first
   epoch) are started at the first miss: until then the training process
   plans each batch, from the keys the stat prefetcher publishes for it when
   it has got there (the next run over a filled cache forks no worker).
2. *Assembly* in the training process (:mod:`~mmcache.loader.assemble`, on a
   helper thread one batch ahead, or by the training loop itself when it asks
   first): the hits are gathered straight from shared memory into the batch
   tensors (:mod:`~mmcache.loader.gather`), then the rows a worker sent are
   filled in. Hits never travel through a worker.
3. *Guessed epochs* (:mod:`~mmcache.loader.warm_epoch`): an epoch that begins
   warm is not planned by the workers; the training process gathers each
   batch at once from the keys it learnt, and serves it once every file of it
   is known unchanged this epoch.
4. *Hooks* (:mod:`~mmcache.loader.hooks`): after each batch is assembled, and
   before each epoch begins.

This module is the configuration and public face: epochs, resumption
(``state_dict``), iteration, statistics.

Thread/process safety: one loader is driven by one thread (like torch's);
internally a helper thread assembles batches too. Its worker processes share
the cache through the node-shared tiers.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import operator
import os
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmcache.cache import Cache
from mmcache.checks import check_int
from mmcache.cluster.hook import cluster_exchange
from mmcache.dist import rank_and_world
from mmcache.errors import ConfigError
from mmcache.loader.assemble import BatchAssembler
from mmcache.loader.augmenting import AugmentHook
from mmcache.loader.batching import plan_batching
from mmcache.loader.counters import EpochCounter, HitRateWatch, epoch_scalars
from mmcache.loader.hooks import BatchContext, EpochContext, Hooks, LoaderHook
from mmcache.loader.mixing import (
    STATE_KEY,
    PartHook,
    PartTally,
    check_mixture_state,
    mixture_state,
    new_samples_each_epoch,
)
from mmcache.loader.options import Augment, Distributed, SFTBatching, loader_options
from mmcache.loader.packing import PackSpec
from mmcache.loader.progress import check_progress, with_progress
from mmcache.loader.readahead import Calm, ReadAhead
from mmcache.loader.shmroom import ShmRoom
from mmcache.loader.state import STATE_VERSION, check_batching, read_state
from mmcache.loader.stream import (
    BatchPlanStream,
    EpochOrder,
    MissWorkers,
    StreamState,
    WorkerTaskSampler,
)
from mmcache.loader.tasks import BatchPlan, WorkerPlanner
from mmcache.loader.warm_epoch import WarmEpochs
from mmcache.loader.warm_epoch.assembler import AssemblerThread, InOrderBuilder
from mmcache.loader.warm_epoch.gate import epoch_gate
from mmcache.sampler import EpochSampler
from mmcache.sources.base import SampleSource
from mmcache.sources.capabilities import DrawsEpochs
from mmcache.stats import EpochStats, LoaderStats
from mmcache.writeback import flush_all

__all__ = [
    "Augment",
    "BatchContext",
    "DataLoader",
    "Distributed",
    "EpochContext",
    "LoaderHook",
    "PackSpec",
    "SFTBatching",
]

logger = logging.getLogger(__name__)

#: Batches assembled ahead on the helper thread: the next one, while the training
#: step runs. More would keep more batch buffers in flight (colder caches) and,
#: when loading is the bottleneck, two threads copying at once share the memory
#: bandwidth without gaining anything.
_BUILD_AHEAD = 1

#: Epoch iterators of this process not yet finished (a loop broken out of, an iterator
#: kept in a global). They are closed at exit while every module is whole: left to the
#: interpreter's teardown, a generator's ``finally`` (stopping the read-ahead threads)
#: runs after modules' globals were cleared and prints "Exception ignored in:
#: <generator object DataLoader._iterate>" ('NoneType' has no 'current_thread'). A
#: weak set, so an iterator dropped early is closed by the garbage collector as before.
_OPEN_EPOCHS: weakref.WeakSet[Generator[dict[str, Any], None, None]] = weakref.WeakSet()


@atexit.register
def _close_open_epochs() -> None:
    for epoch_iterator in list(_OPEN_EPOCHS):
        with contextlib.suppress(Exception):  # at exit nobody could catch it
            epoch_iterator.close()


# A forked child never closes its parent's iterators (their threads are not its own).
os.register_at_fork(after_in_child=_OPEN_EPOCHS.clear)


@dataclass
class _EpochRun:
    """The batches of one epoch and the batch to start from (a resumed position)."""

    epoch: int
    batches: list[np.ndarray]
    start: int


class DataLoader:
    """Batches of a :class:`~mmcache.sources.base.SampleSource` (a
    :class:`~mmcache.MultimodalDataset`) through a :class:`Cache`.

    >>> loader = DataLoader(ds, cache=cache, batch_size=64, num_workers=4)  # doctest: +SKIP
    >>> for epoch in range(3):                                              # doctest: +SKIP
    ...     loader.set_epoch(epoch)
    ...     for batch in loader: ...

    Args:
        dataset: the samples (any :class:`~mmcache.sources.base.SampleSource`).
        cache: a :class:`Cache`, or None for no caching (same batches, slower).
        batch_size: samples per batch.
        shuffle: a fresh permutation each epoch (a pure function of seed and epoch).
        seed: the order's seed.
        num_workers: processes that produce misses (0: in the training process).
            With workers, a cache and a source of file stamps the loader also
            starts one low-priority process that ``stat``-s the files of warm
            epochs ahead of use (see :mod:`mmcache.loader.warm_epoch`).
        drop_last: drop each rank's last incomplete batch, as torch's DataLoader
            does (every epoch has ``len(loader)`` full batches).
        pin_memory: allocate batch tensors in pinned memory (when CUDA is present).
        prefetch_factor: worker tasks (batches to plan and produce) in flight per
            worker (as torch's).
        persistent_workers, worker_init_fn, multiprocessing_context, generator, timeout: as
            in ``torch.utils.data.DataLoader``, for the miss workers.
        distributed: this process's part of each epoch, a :class:`Distributed`
            (``rank``, ``world_size``, ``drop_last``: how ranks get equal parts);
            None: torch.distributed's rank and world size when it is initialised,
            else a single process. A loader with no batches (``len(loader) == 0``)
            logs a warning.
        batching: how SFT batches (a source with varying ``input_ids`` and
            ``labels``) are padded, grouped by length or packed, an
            :class:`SFTBatching`; None: ``SFTBatching()`` (padded to the longest row
            with the source's pad id, a multiple of 8).
        augment: a random transform of each batch's images after the cache, an
            :class:`Augment` (``Augment(fn, device="cuda")``) or a plain callable
            (``Augment(fn)``: on the CPU); see :mod:`mmcache.loader.augmenting`.
        hooks: objects with an ``after_assemble(batch, ctx)`` and/or a
            ``before_epoch(ctx)`` method (see :mod:`mmcache.hooks`). The loader's
            own run first: SFT padding or packing, then ``augment``, then the
            cluster exchange; then these, in order.
        on_epoch_end: called after each complete epoch with a dict of scalars
            (``epoch``, ``samples_per_s``, ``hit_rate``, ``hit_rate/<tier>`` for
            each tier of the cache (``hit_rate/memory``, ``hit_rate/disk``),
            ``stall_s``, ...), ready for TensorBoard or W&B.
        progress: a tqdm bar per epoch with samples/s and the hit rate of each tier
            (see :mod:`mmcache.loader.progress`).
    """

    def __init__(
        self,
        dataset: SampleSource,
        *,
        cache: Cache | None,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        drop_last: bool = False,
        pin_memory: bool = False,
        prefetch_factor: int = 2,
        persistent_workers: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        timeout: float = 0,
        distributed: Distributed | None = None,
        batching: SFTBatching | None = None,
        augment: Augment | Callable[..., Any] | None = None,
        hooks: Sequence[LoaderHook] = (),
        on_epoch_end: Callable[[dict[str, float]], None] | None = None,
        progress: bool = False,
    ) -> None:
        batching, augment, distributed = loader_options(
            batching=batching, augment=augment, distributed=distributed
        )
        if not isinstance(dataset, SampleSource):
            raise ConfigError(
                "dataset must be a mmcache SampleSource (a MultimodalDataset, or any source "
                f"with the members of mmcache.sources.base.SampleSource), got "
                f"{type(dataset).__name__}"
            )
        check_int("batch_size", batch_size, minimum=1)
        check_int("num_workers", num_workers, minimum=0)
        check_int("prefetch_factor", prefetch_factor, minimum=1)
        rank, world_size = rank_and_world(distributed.rank, distributed.world_size)
        self.dataset = dataset
        self.cache = cache
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.pin_memory = pin_memory and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            logger.info("pin_memory=True ignored: CUDA is not available")
        self.sampler = EpochSampler(
            len(dataset),
            seed=seed,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
            drop_last=distributed.drop_last,
            # A mixture: each epoch's samples are drawn (repeats included), then shuffled.
            draw=dataset.draw if isinstance(dataset, DrawsEpochs) else None,
        )
        plan = plan_batching(
            dataset, self.sampler, batch_size=batch_size, drop_last=drop_last, options=batching
        )
        self._batching = plan.name
        self._order = EpochOrder(plan.order)
        self._epoch = 0  # (len(self) of a grouped or packed loader reads it)
        if len(self) == 0:
            logger.warning(
                "this DataLoader has no batches: every epoch is empty (%d samples, "
                "world_size=%d: %d per rank, batch_size=%d, drop_last=%s); use a "
                "smaller batch_size or drop_last=False",
                len(dataset),
                world_size,
                self.sampler.num_samples(),
                batch_size,
                drop_last,
            )
        self.num_workers = num_workers
        self.on_epoch_end = on_epoch_end
        self.progress = check_progress(progress)
        #: The random transform after the cache and its device (None: none); FeatureCache.wrap
        #: refuses a loader with one.
        self.augment: Augment | None = augment
        if isinstance(hooks, (str, bytes)) or not isinstance(hooks, Sequence):
            raise ConfigError(f"hooks must be a list of hook objects, got {type(hooks).__name__}")
        # The loader's own hooks run first, in this order: SFT padding or packing (the
        # batch's shape), augment (on the padded batch), the cluster exchange (which
        # only counts batches), then the user's ``hooks`` in their order.
        first: list[Any] = [] if plan.hook is None else [plan.hook]
        if isinstance(dataset, DrawsEpochs):  # each row's part, kept by padding and packing
            first.insert(0, PartHook(dataset))
        if augment is not None:
            first.append(AugmentHook(augment.fn, augment.device))
        #: The cluster exchange (``Cache(scope=Cluster(...))`` under torch.distributed), or None.
        order = self._order  # (not self: the finalizer below closes the exchange)
        self.exchange = cluster_exchange(
            cache,
            dataset,
            lambda rank, epoch: list(order.order.for_rank(rank).batches(epoch)),
            seed,
            planned_ahead=max(num_workers * prefetch_factor, 2),
        )
        if self.exchange is not None:
            first.append(self.exchange)
            weakref.finalize(self, self.exchange.close)
        self._hooks = Hooks([*first, *hooks])
        self._hooks_closing = [h for h in first if isinstance(h, AugmentHook)]
        # The loader's own pieces in /dev/shm, and whether it still has room for them.
        self._shm = ShmRoom()
        # Holds back workers' tasks of epochs not begun yet (only persistent workers get
        # such tasks). Opened whenever the loader goes, before torch stops the workers.
        # Without room in /dev/shm for it, the workers are not persistent.
        gate = None
        if persistent_workers and num_workers > 0:
            gate = epoch_gate(multiprocessing_context, num_workers, self._shm)
        persistent = gate is not None
        if gate is not None:
            weakref.finalize(self, gate.open_all)
        # The order, for a source that shares reads between samples (loader/lookahead.py):
        # lock-free, as workers forked at any time read it.
        self._planner = WorkerPlanner(dataset, cache, gate, batches=self._order.order.batches)
        if self.exchange is not None:  # produced here for another node: to the in-flight tier
            self._planner.guests = self.exchange.guests
        self._assembler = BatchAssembler(
            dataset, cache, self._planner, pin_memory=self.pin_memory, shm=self._shm
        )
        for hook in first:  # the crops in crop processes (forked before any thread starts)
            if isinstance(hook, AugmentHook):
                hook.attach(self._assembler, num_workers, multiprocessing_context, self, self._shm)
        self._warm = WarmEpochs(
            dataset,
            self._order.order,  # lock-free: the prefetcher process is forked at any time
            cache=cache,
            num_workers=num_workers,
            num_samples=self.sampler.num_samples(),
            entry_bytes=self._assembler.entry_bytes,
            context=multiprocessing_context,
            shm=self._shm,
        )
        weakref.finalize(self, self._warm.close)
        self._state = StreamState()  # where the workers' stream is (shared explicitly)
        self._calm = Calm()  # whether the read-ahead finds pages resident, across epochs
        # The next batches' promotion and page reads (loader/readahead.py), one for all
        # epochs: its threads start once.
        self._ahead = ReadAhead(
            self._planner.read_ahead, ordered=self._planner.promote, calm=self._calm
        )
        if self._hooks.plan:
            self._state.before_plan = self._hooks.before_plan
        if self.exchange is not None:  # one batch a task: none planned beyond its horizon
            self._state.max_group = 1
        self._workers: MissWorkers | None = None
        if num_workers > 0:
            warm = self._warm
            state = self._state
            sampler = WorkerTaskSampler(
                state,
                self._order,
                persistent=persistent,
                guess_next=lambda: warm.should_guess(state.warm),
            )
            kwargs: dict[str, Any] = {
                "num_workers": num_workers,
                "worker_init_fn": worker_init_fn,
                "multiprocessing_context": multiprocessing_context,
                "generator": generator,
                "timeout": timeout,
                "prefetch_factor": prefetch_factor,
            }
            self._workers = MissWorkers(
                self._planner,
                sampler,
                gate=gate,
                persistent=persistent,
                kwargs=kwargs,
                shm=self._shm,
            )
        self._stream: BatchPlanStream | None = None  # plans of the batches to come
        self._live: EpochCounter | None = None  # the epoch being iterated
        self._position = 0  # batches of the current epoch already yielded
        self._chosen = False  # set_epoch called since the last iteration began
        self._resumed = False  # the position came from load_state_dict
        self._ids: str | None = None  # the dataset's ids digest (state_dict)
        self._mixture = mixture_state(dataset)  # a mixture's parts (state_dict), or None
        # One record per pass over an epoch, in the order they ran (stats()); a pass
        # that left early and is continued (a later `for`, or a resume of the same
        # epoch) goes on in its own record, a new pass from the start gets a new one.
        self._history: list[EpochStats] = []
        self._live_slot = 0  # the record of self._live in self._history
        self._hit_rate = HitRateWatch(cache)
        # The thread that assembles batches ahead, kept from epoch to epoch.
        self._helper = AssemblerThread()
        weakref.finalize(self, self._helper.close, 5.0)

    # -- public API -------------------------------------------------------------------------
    def __len__(self) -> int:
        if self._batching != "plain":  # grouped or packed: the epoch's own count
            return len(self._order.batches(self._epoch))
        n = self.sampler.num_samples()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration yields: all of epoch ``epoch``, whatever
        was iterated before (its order is a pure function of seed and epoch), or,
        right after :meth:`load_state_dict` of that epoch, what remains of it (maybe
        nothing).

        Without ``set_epoch``, a second ``for batch in loader`` after a finished
        epoch is the next epoch (a new order, exactly what ``set_epoch(epoch + 1)``
        would give: as torch's ``RandomSampler`` draws a new order per pass, and
        unlike a ``DistributedSampler`` nobody calls ``set_epoch`` on, which
        silently repeats the first order); after a loop that left early it is the
        rest of that epoch. Each pass has its own record in :meth:`stats`, so
        iterating an epoch again (``set_epoch`` of an epoch already seen) adds a
        record with the same ``epoch`` instead of adding to the first one."""
        try:
            epoch = operator.index(epoch)  # an int or a numpy integer
        except TypeError:
            raise ConfigError(f"epoch must be an int >= 0, got {epoch!r}") from None
        check_int("epoch", epoch, minimum=0)
        if not (self._resumed and epoch == self._epoch):
            self._position = 0
            self._resumed = False
            self._order.resume_span(epoch, None)  # a resumed epoch's rest no more
        self._epoch = epoch
        self._chosen = True

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: resuming from it yields exactly the remaining batches.

        Independent of ``num_workers`` (the order never depends on it). ``ids`` is
        a digest of the dataset's ids in order (the source's ``ids_digest``), so a
        reordered manifest of the same length is refused on resume.

        Elastic: ``consumed`` is the global position, the samples of the epoch's
        order that all ranks together have consumed (ranks step together, as DDP
        makes them: every rank's state holds the same ``consumed``; save any
        one), ``stop`` where the epoch's order ends, ``span`` the part of it this
        run was given (a resumed epoch) or None. A loader of another world size
        resumes from it with exactly the rest of the epoch (see
        :meth:`load_state_dict`).
        """
        span = self._order.span(self._epoch)
        start, stop = span if span is not None else (0, self.sampler.epoch_stop())
        batches = self._epoch_batches(self._epoch)
        if self._position >= len(batches):
            consumed = stop
        else:
            per_rank = self._position * self.batch_size * self.sampler.world_size
            consumed = min(start + per_rank, stop)
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            **self._order_state(),
            "consumed": consumed,
            "stop": stop,
            "span": None if span is None else list(span),
            **({} if self._mixture is None else {STATE_KEY: self._mixture}),
        }

    def _order_state(self) -> dict[str, Any]:
        """The fields of :meth:`state_dict` that fix the order of the batches (what a
        state to resume must match): no epoch's order is computed for them."""
        if self._ids is None:
            self._ids = self.dataset.ids_digest()
        return {
            "seed": self.sampler.seed,
            "shuffle": self.sampler.shuffle,
            "size": self.sampler.size,
            "ids": self._ids,
            "rank": self.sampler.rank,
            "world_size": self.sampler.world_size,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "distributed_drop_last": self.sampler.drop_last,
            "batching": self._batching,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the configuration that fixes the order must match.

        Raises :class:`ConfigError` naming the key for a missing, mistyped or
        out-of-range value, or one that differs from this loader's (another seed,
        dataset order, batch size...); nothing is restored then.

        A version-3 state (this mmcache's) may come from another world size (or
        rank): the rest of its epoch, positions ``[consumed, stop)`` of the
        epoch's order, is split over this loader's world size (padded or cut to
        equal parts as ``distributed_drop_last`` says, see
        :mod:`mmcache.sampler`), then the next epochs follow as if never
        interrupted. With the same world size the same batches as before
        continue. Versions 1 and 2 (saved before) resume on the same rank and
        world size only.
        """
        if not isinstance(state, dict):
            raise ConfigError(
                f"a loader state is a dict (from state_dict()), got {type(state).__name__}"
            )
        check_batching(state, self._batching, self.sampler.world_size)
        check_mixture_state(state, self._mixture)
        order = self._order.order
        resume = read_state(
            state,
            self._order_state(),
            world_size=self.sampler.world_size,
            count=lambda e: self._whole_epoch_count(order, e),
        )
        self._order.resume_span(resume.epoch, resume.span)
        self._epoch, self._position = resume.epoch, resume.position
        self._resumed = True  # set_epoch(epoch) keeps the position
        self._chosen = False

    def _whole_epoch_count(self, order: Any, epoch: int) -> int:
        """Batches of the whole of ``epoch`` (no resumed span): counted for plain batches,
        whose count is every epoch's (at 10^8 samples an epoch's order takes seconds and
        800 MB), made for grouped or packed ones, whose count is the epoch's own."""
        if self._batching == "plain":
            return len(self)
        return len(dataclasses.replace(order, spans={}).batches(epoch))

    def close(self) -> None:
        """Stop the worker processes (persistent ones included) and the stat prefetcher
        now. Idempotent.

        Dropping the loader does the same; ``close`` makes it deterministic. A
        later iteration starts new workers.
        """
        flush_all()
        self._stop_workers()
        self._helper.close()
        self._warm.close()
        if self.exchange is not None:
            self.exchange.close()
        for hook in self._hooks_closing:
            hook.close()

    def _stop_workers(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        self._ahead.close()  # (a later epoch starts its threads again)
        if self._workers is not None:
            self._workers.stop()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Only stop the workers: flushing takes locks, and __del__ may run inside
        # the garbage collector while this thread holds one of them.
        with contextlib.suppress(Exception):
            self._stop_workers()

    def stats(self) -> LoaderStats:
        """Hits, misses, stall time and throughput, per pass over an epoch (in the
        order they ran, see :meth:`set_epoch`) and overall."""
        history = list(self._history)
        live = self._live
        if live is not None:
            history[self._live_slot] = live.snapshot()
        return LoaderStats(tuple(history))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch = self._epoch
        batches = self._epoch_batches(epoch)
        if self._position >= len(batches) and not self._chosen:
            # A finished epoch and no set_epoch since: go on with the next one.
            epoch = self._epoch = epoch + 1
            self._position = 0
            batches = self._epoch_batches(epoch)
        self._chosen = self._resumed = False
        if self.cache is not None:
            self.cache.register(self.dataset.fingerprint(), self.dataset.describe())
        run = _EpochRun(epoch=epoch, batches=batches, start=self._position)
        epoch_iterator = self._iterate(run)
        _OPEN_EPOCHS.add(epoch_iterator)
        if not self.progress:
            return epoch_iterator
        tiers = list(self.cache.tiers) if self.cache is not None else []
        live = lambda: None if self._live is None else self._live.snapshot()  # noqa: E731
        total = len(batches) - run.start
        return with_progress(epoch_iterator, epoch=epoch, total=total, tiers=tiers, live=live)

    # -- per epoch -----------------------------------------------------------------------
    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The batches (index arrays) of ``epoch`` (remembered for the last few epochs)."""
        return self._order.batches(epoch)

    def _epoch_done(self, stats: EpochStats, seen: set[int]) -> None:
        """Per-epoch checks: the user's callback, and the low-hit-rate warning
        (``seen``: the epochs of the passes before this one)."""
        if self.on_epoch_end is not None:
            tiers = list(self.cache.tiers) if self.cache is not None else []
            self.on_epoch_end(epoch_scalars(stats, tiers))
        fresh = new_samples_each_epoch(self.dataset)  # a mixture's walk: misses by design
        if (stats.epoch - 1 in seen or stats.epoch in seen) and not fresh:
            self._hit_rate.check(
                stats,
                entry_bytes=self._assembler.entry_bytes(),
                samples=self.sampler.num_samples() * self.sampler.world_size,
            )

    def _part_tally(self, last: EpochStats | None) -> PartTally | None:
        """A mixture's per-part counts of the pass that begins (going on from ``last``)."""
        source = self.dataset
        if not isinstance(source, DrawsEpochs):
            return None
        return PartTally(source.part_names, source.part_of, None if last is None else last.parts)

    # -- consuming (training process) ------------------------------------------------------
    def _iterate(self, run: _EpochRun) -> Generator[dict[str, Any], None, None]:
        """Yield the batches of ``run`` in order, assembled ahead while the training step runs.

        An :class:`~mmcache.loader.warm_epoch.assembler.InOrderBuilder` assembles
        the next batch (``_BUILD_AHEAD``) on a helper thread while the training
        loop holds this one (numpy copies and torch's IPC release the GIL); when
        the loop asks for a batch nobody has started, it assembles it itself
        instead of waiting. ``stall_s`` is the time the training loop spends in
        ``next()``, waiting or assembling.
        """
        if self._hooks:
            self._hooks.before_epoch(
                EpochContext(run.epoch, run.start, len(run.batches), self._order.batches)
            )
        last = self._history[-1] if self._history else None
        if run.start > 0 and last is not None and last.epoch == run.epoch:
            slot = len(self._history) - 1  # goes on with the pass that left early
        else:
            slot, last = len(self._history), None
            self._history.append(EpochStats(epoch=run.epoch))
        promotions = self.cache.store.promotions if self.cache is not None else None
        stats = EpochCounter(run.epoch, last, promotions, self._part_tally(last))
        self._live, self._live_slot = stats, slot
        source = self._stream
        workers = self._workers
        if (
            source is None
            or source.cursor != (run.epoch, run.start)
            or workers is None
            or not workers.started
        ):
            if source is not None:
                source.close()
            source = self._stream = BatchPlanStream(
                run.epoch,
                run.start,
                order=self._order,
                state=self._state,
                planner=self._planner,
                workers=workers,
                warm=self._warm,
                ahead=self._ahead,
            )
        streams = source.streams(run.epoch)
        self._warm.begin(
            run.epoch, run.start, warm=self._state.warm, streams=streams, local=source.plans_here
        )
        source.begin_epoch(run.epoch)
        builder: InOrderBuilder[BatchPlan, dict[str, Any] | None] = InOrderBuilder(
            run.start,
            len(run.batches),
            fetch=lambda j: source.fetch(run.epoch, j),
            build=lambda j, plan: self._build(run.epoch, j, plan, stats),
            ahead=_BUILD_AHEAD,
            helper=self._helper,
        )
        persistent = workers is not None and workers.persistent
        try:
            t0 = time.perf_counter()
            stats.begin(t0)
            for j in range(run.start, len(run.batches)):
                batch = builder.take()
                self._position = j + 1
                if batch is None:  # every sample of it was rejected
                    continue
                t1 = time.perf_counter()
                stats.stall(t1 - t0)
                stats.end(t1)
                yield batch
                t0 = time.perf_counter()
            flush_all()  # this process's pending puts (num_workers=0, late misses)
            if self.cache is not None:
                self.cache.commit()  # and promotions into the disk tier, the shared tier's pack
            stats.end(time.perf_counter())
            self._history[slot] = stats.snapshot()
            self._live = None
            self._epoch_done(self._history[slot], {r.epoch for r in self._history[:slot]})
        finally:
            builder.close()
            if source.cursor != (run.epoch + 1, 0) or not persistent:
                # Left early (or workers end with the epoch): nobody continues this stream.
                source.close()
                self._stream = None
            if self._live is stats:
                self._history[slot] = stats.snapshot()
                self._live = None
            if workers is not None and not persistent:
                workers.release()  # non-persistent workers exit with their iterator

    def _build(
        self, epoch: int, j: int, plan: BatchPlan, stats: EpochCounter
    ) -> dict[str, Any] | None:
        """Batch ``j`` of ``epoch``. A guessed plan is gathered at once and served when
        every key was in memory and every file is unchanged this epoch; otherwise (a file
        changed, an entry went) the batch is planned and its misses produced here."""
        assembler = self._assembler
        if plan.guessed:
            batch = assembler.gather_guess(plan)
            if batch is not None and self._warm.verified(plan):
                below = assembler.count_guess(plan, stats)
                state = self._state  # read by the plan stream: whether to read ahead
                state.first_tier_run = 0 if below else state.first_tier_run + 1
                if self._hooks.after:
                    batch = self._after_assemble(batch, epoch, j, plan.indices, guessed=True)
                return batch
            # A file changed or an entry went: this batch is planned and its misses are
            # produced here; the next ones are planned as in an epoch that is not guessed.
            self._warm.stop_guessing(epoch)
            self._state.first_tier_run = 0
            plan = self._planner.produced(plan.indices)
            self._warm.learn(plan)
            self._state.warm = self._state.warm and bool(plan.planned_hit.all())
        made = assembler.assemble(plan, stats)
        if made is None:
            return None
        batch, indices = made
        if self._hooks.after:
            batch = self._after_assemble(batch, epoch, j, indices, guessed=False)
        return batch

    def _after_assemble(
        self, batch: dict[str, Any], epoch: int, j: int, indices: np.ndarray, *, guessed: bool
    ) -> dict[str, Any]:
        sampler = self.sampler
        ctx = BatchContext(
            epoch, j, indices, sampler.seed, sampler.rank, sampler.world_size, guessed
        )
        return self._hooks.after_assemble(batch, ctx)
