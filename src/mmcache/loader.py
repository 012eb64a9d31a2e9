"""``mmcache.DataLoader``: hits gathered in the training process, misses made by workers.

How a batch is made (every epoch's order is known in advance, see
:mod:`mmcache.sampler`):

1. *Planning*, in order, by the worker processes of a plain
   ``torch.utils.data.DataLoader`` over an internal task dataset (fork or
   spawn, persistent or not, with the user's ``worker_init_fn``;
   ``prefetch`` tasks per worker in flight, as torch's ``prefetch_factor``).
   A task is one batch, or up to eight while the epoch is warm: the worker
   ``stat``-s the image files (so a changed file gets a new key every epoch),
   computes the cache keys, asks the node-shared memory tier which it holds,
   and for every other sample looks in the disk tier (promoting hits to
   memory) or decodes it, admitting the result (write-behind: nobody waits
   on a disk put). What comes back is the keys and a hit mask; a sample the
   worker put in shared memory is not sent either. With ``num_workers=0``
   the training process runs the same tasks.
2. *Assembly* in the training process (:class:`~mmcache.inorder.InOrderBuilder`:
   on a helper thread one batch ahead, or by the training loop itself when
   it asks first): the hits are gathered straight from shared memory into
   the batch tensors, all byte ranges under one shared lock, then the rows a
   worker sent are filled in. Hits never travel through a worker. A planned
   hit evicted in the meantime is produced here (a *late miss*, counted).
3. *Across epochs* with persistent workers the plan stream runs on while
   epochs have misses: the next epoch's tasks wait at a
   :class:`~mmcache.gate.Gate` in the workers until the training loop
   begins that epoch (so nothing changed between epochs is missed).
4. *Sweep epochs*: an epoch that begins warm is not planned by the workers.
   The training process gathers each batch at once from the keys (and file
   stamps) it learnt, while a low-priority :class:`~mmcache.sweeper.Sweeper`
   process ``stat``-s the epoch's files in order and publishes the results on
   a :class:`~mmcache.board.StampBoard`; a batch is served once every file of
   it is known unchanged this epoch (files the sweeper has not reached are
   ``stat``-ed here), else it is planned and produced here and the rest of
   the epoch is planned as in 1.

The batch is what torch's default collate would make of the dataset's items,
plus the cache keys: ``{"id": list[str], "key": list[str], "image": uint8
[B,3,H,W], "input_ids": [B,L], "attention_mask": [B,L]}``. Nothing about it
depends on the cache: the same seed gives bitwise the same batches with the
cache on, off, cold or warm.

Thread/process safety: one loader is driven by one thread (like torch's);
internally a helper thread assembles batches too (the buffer pool, layout and
counters it shares are locked). Its worker processes share the cache through
the node-shared tiers.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import operator
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmcache import codec
from mmcache.board import StampBoard
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.dist import rank_and_world
from mmcache.errors import ConfigError, SampleError
from mmcache.gate import Gate
from mmcache.inorder import Helper, InOrderBuilder
from mmcache.keys import STAT_FIELDS
from mmcache.sampler import EpochSampler
from mmcache.stats import EpochStats, LoaderStats
from mmcache.sweeper import Sweeper
from mmcache.units import format_size
from mmcache.writeback import flush_all, write_behind

__all__ = ["DataLoader"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 2  # 2: the ids digest, distributed_drop_last
#: What fixes the order of the batches: a state to resume must match the loader in each.
_STATE_ORDER = (
    "seed",
    "shuffle",
    "size",
    "ids",
    "rank",
    "world_size",
    "batch_size",
    "drop_last",
    "distributed_drop_last",
)

#: int64 words of a file's stat stamp (:func:`mmcache.keys.stat_fields`).
_STAMP_W = len(STAT_FIELDS)

# Where a sample of a batch came from.
_MEMORY, _DISK, _PRODUCED, _REJECTED = "memory", "disk", "produced", "rejected"


@dataclass
class _Result:
    """A miss task's outcome, sent from a worker to the consumer (pickled by torch)."""

    index: int
    source: str
    sample: dict[str, np.ndarray] | None = None
    error: SampleError | None = None
    in_memory: bool = False  # the sample is in the memory tier: gather it, nothing sent


class _BatchTasks(torch.utils.data.Dataset["_Planned"]):
    """The dataset the internal torch DataLoader's workers run: one task per batch.

    A task is the batch's dataset indices (:meth:`plan`): the worker computes
    the keys (a ``stat`` per image file, so staleness is checked every epoch),
    asks the memory tier which it holds, and for each missing sample asks the
    other tiers (another process may have produced it, or the disk tier holds
    it), else produces it with the pipeline and admits it, measuring the CPU
    time it took as the entry's miss cost. With ``num_workers=0`` the training
    process runs the same tasks itself.
    """

    def __init__(
        self,
        dataset: MultimodalDataset,
        cache: Cache | None,
        gate: Gate | None = None,
    ) -> None:
        self.dataset = dataset
        self.cache = cache
        self.gate = gate
        # The training process plans on both of its assembling threads; the dataset's
        # key memo takes one at a time (the stat calls before it run unlocked).
        self._keys_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_keys_lock"]  # sent to spawned workers: a lock does not pickle
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._keys_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.dataset)

    def run(self, index: int, key: bytes, *, cached: bool = True) -> _Result:
        """Look ``key`` up, else produce and admit it.

        In a worker process, a sample that is (or has just been put) in the
        node-shared memory tier is not sent back: the training process gathers
        it from shared memory like a hit, which saves pickling 150 KB through a
        pipe per sample (torch's own workers avoid that copy with shared-memory
        tensors). Everything else travels as arrays.
        """
        cache = self.cache
        in_worker = torch.utils.data.get_worker_info() is not None
        memory = cache.memory if cache is not None else None
        if cache is not None and cached:
            if in_worker and memory is not None and memory.contains(key):
                return _Result(index, _MEMORY, in_memory=True)
            sample, tier = cache.lookup(key)
            if sample is not None:
                if in_worker and tier == _DISK and memory is not None and memory.contains(key):
                    return _Result(index, _DISK, in_memory=True)  # promoted by lookup
                return _Result(index, tier or _MEMORY, {k: np.array(v) for k, v in sample.items()})
        t0 = time.thread_time()
        try:
            produced = self.dataset.produce(index)
        except SampleError as err:
            return _Result(index, _REJECTED, error=err)
        cost = time.thread_time() - t0
        if cache is not None:
            # Write-behind: the memory tier now, the disk tier from a background thread.
            raw = codec.encode(produced, ctime=cache.clock(), cost=cost)
            if write_behind(cache)(key, raw, cost, self.dataset.fingerprint()) and in_worker:
                return _Result(index, _PRODUCED, in_memory=True)
        return _Result(index, _PRODUCED, produced)

    def plan(self, indices: np.ndarray, *, produce: bool = True) -> _Plan | None:
        """Plan one batch: its keys, which rows the memory tier holds, and the misses made.

        The rows the memory tier holds are only named (their bytes are gathered
        by the training process); every other row is :meth:`run`, in order.
        ``produce=False``: return None instead when a row is missing.
        """
        stamps = None if self.dataset.content_stamp else self.dataset.stat_stamps(indices)
        with self._keys_lock:
            keys = self.dataset.key_rows(indices, stamps=stamps)
        memory = self.cache.memory if self.cache is not None else None
        if memory is not None:
            planned = memory.contains_many(keys)
        else:
            planned = np.zeros(len(indices), dtype=bool)
        if not produce and not planned.all():
            return None
        results = [
            self.run(int(indices[r]), keys[r].tobytes()) for r in np.flatnonzero(~planned).tolist()
        ]
        return _Plan(indices, keys, planned, results, stamps)

    def produced(self, indices: np.ndarray) -> _Plan:
        """:meth:`plan` with every missing row produced."""
        plan = self.plan(indices)
        if plan is None:  # pragma: no cover - plan() returns None only with produce=False
            raise RuntimeError("a produced plan is missing")
        return plan

    def __getitem__(self, task: Any) -> _Planned:
        return self.__getitems__([task])[0]

    def __getitems__(self, tasks: Sequence[Any]) -> list[_Planned]:
        """Plan the batches of one task (one or, in warm stretches, several batches)
        in a worker, in the compact form sent back to the training process."""
        out = []
        for task in tasks:
            if task.gate and self.gate is not None:
                self.gate.wait(task.gate)  # a batch of an epoch the training loop has not begun
            plan = self.produced(np.asarray(task.indices, dtype=np.int64))
            stamps = plan.stamps.tobytes() if plan.stamps is not None else None
            out.append(
                _Planned(plan.keys.tobytes(), plan.planned_hit.tobytes(), plan.results, stamps)
            )
        return out


@dataclass(frozen=True)
class _PlanTask:
    """Plan (and produce the misses of) one batch; ``gate``: wait for it first (0: none)."""

    gate: int
    indices: np.ndarray


@dataclass
class _Planned:
    """A batch plan as a worker sends it: raw keys, hit mask and the files' stamps
    (cheap to pickle), and the misses' results."""

    keys: bytes
    planned_hit: bytes
    results: list[_Result]
    stamps: bytes | None = None

    def unpack(self, indices: np.ndarray) -> _Plan:
        keys = np.frombuffer(self.keys, dtype=np.uint8).reshape(len(indices), -1)
        hit = np.frombuffer(self.planned_hit, dtype=bool)
        stamps = None
        if self.stamps is not None:
            stamps = np.frombuffer(self.stamps, dtype=np.int64).reshape(len(indices), _STAMP_W)
        return _Plan(indices, keys, hit, self.results, stamps)


@dataclass(frozen=True)
class _Order:
    """The batches of each epoch: what the loader and its workers both compute."""

    sampler: EpochSampler
    batch_size: int
    drop_last: bool

    def batches(self, epoch: int) -> list[np.ndarray]:
        order = self.sampler.indices(epoch)
        bs = self.batch_size
        stop = len(order) - len(order) % bs if self.drop_last else len(order)
        return [order[i : i + bs] for i in range(0, stop, bs)]


def _identity(batch: list[_Planned]) -> list[_Planned]:
    return batch


#: Batches assembled ahead on the helper thread: the next one, while the training
#: step runs. More would keep more batch buffers in flight (colder caches) and,
#: when loading is the bottleneck, two threads copying at once share the memory
#: bandwidth without gaining anything: measured slower on the warm benchmark.
_BUILD_AHEAD = 1


@dataclass
class _Plan:
    """One batch, planned: indices, keys (``uint8 [n, 16]``), planned hits, misses' results."""

    indices: np.ndarray
    keys: np.ndarray
    planned_hit: np.ndarray  # bool per row: the memory tier held it when planned
    results: list[_Result]  # one per row that was not a planned hit, in row order
    stamps: np.ndarray | None = None  # int64 [n, _STAMP_W]: the files' stat stamps keyed on
    # Made in the training process from the keys learnt in an earlier epoch, all
    # assumed in memory: gathered at once, served only once the stamp board (or a
    # stat here) shows every file unchanged this epoch. ``round``: the sweep's.
    speculative: bool = False
    round: int = 0


@dataclass
class _EpochRun:
    """The batches of one epoch and the batch to start from (a resumed position)."""

    epoch: int
    batches: list[np.ndarray]
    start: int


#: Most batches per worker task while the epoch is warm (no misses lately): one
#: result crosses the process boundary per task, and that costs about as much
#: as gathering a few samples, so a warm stretch is planned in groups. Groups
#: start at one batch each epoch and double, so the first batch is not late.
_WARM_GROUP = 8


class _EpochBatches:
    """The internal DataLoader's batch sampler: the workers' tasks from a start point on.

    Read lazily by torch in the training process as it keeps its workers busy
    (``prefetch`` tasks each), so the workers plan and produce the batches in
    exactly the order the training loop takes them. A task is one batch, or
    up to :data:`_WARM_GROUP` consecutive batches while the last plans received
    had no misses (then a task is only ``stat`` calls and index lookups).

    With persistent workers the stream goes on into the next epochs (each
    epoch's order is known in advance), so the workers hold the next epoch's
    tasks when it begins instead of waiting for a round trip. Those tasks carry
    a :class:`~mmcache.gate.Gate` number: the worker runs them only once the
    training loop has begun that epoch, so nothing the user's code changes
    between epochs is missed, and a cold epoch's misses are all in the cache
    before the next epoch looks for them.

    The stream ends instead at an epoch boundary reached while warm (the last
    plans had no misses) when the loader has a sweeper: the next epoch is a
    *sweep* epoch, gathered by the training process from the keys it learnt,
    while the :class:`~mmcache.sweeper.Sweeper` checks its files (see
    :class:`_PlanSource`). The loader starts a new stream when it needs the
    workers again (a miss, another epoch, a resumed position, a loop left early).
    """

    def __init__(self, loader: DataLoader) -> None:
        # A weak reference: the loader owns the torch DataLoader that owns this
        # sampler; a strong one would make a cycle that keeps persistent workers
        # alive after the user drops the loader.
        self._loader = weakref.ref(loader)

    def __iter__(self) -> Iterator[list[_PlanTask]]:
        loader = self._loader()
        if loader is None:
            return
        epoch, j = loader._stream_from
        base = loader._stream_gate
        continuous = bool(loader._inner_kwargs["persistent_workers"])
        del loader
        group, gate = 1, 0  # the stream's first epoch has begun: no gate
        while True:
            loader = self._loader()
            if loader is None:
                return
            batches = loader._epoch_batches(epoch)
            if j >= len(batches):
                if not continuous or not batches or loader._sweeps():
                    loader._stream_stop = (epoch + 1, 0)
                    return
                epoch, j, group = epoch + 1, 0, 1
                gate = gate + 1 if gate else base + 1
                batches = loader._epoch_batches(epoch)
            del loader
            task = batches[j : j + group]
            yield [_PlanTask(gate, b) for b in task]
            j += len(task)
            loader = self._loader()
            warm = loader is not None and loader._warm_stretch
            del loader
            group = min(2 * group, _WARM_GROUP) if warm else 1


class _PlanSource:
    """The plans of the batches, in order from a start point: from the workers, or made here.

    ``fetch(epoch, j)`` is called for consecutive batches (then epoch+1's from
    0), one call at a time (:class:`~mmcache.inorder.InOrderBuilder` holds its
    fetch lock); ``cursor`` is the next batch it is asked for. With workers, a
    task's result holds the plans of one or more batches, and the stream may
    outlive one epoch (see :class:`_EpochBatches`).

    In a sweep epoch (``loader._swept[epoch]`` holds its sweep round) a batch
    whose keys and file stamps were learnt before gets a *speculative* plan at
    once (all its keys assumed in memory): the training process gathers it
    while the sweeper ``stat``-s its files, and serves it only when
    :meth:`verified` finds every file unchanged this epoch.
    """

    def __init__(self, loader: DataLoader, epoch: int, start: int) -> None:
        self._ref = weakref.ref(loader)  # the loader holds us: no reference cycle
        self._gate = loader._gate
        self.cursor = (epoch, start)
        self._first_epoch = epoch  # of the workers' current stream
        self._base = 0  # the gate value its tasks count from
        self._plans: Iterator[list[_Planned]] | None = None
        # Plans received in a task's result for the batches after the one asked for.
        self._received: collections.deque[_Planned] = collections.deque()
        # Non-persistent workers are started for every epoch (a fork or spawn each):
        # the batches are planned here until the first miss (a warm epoch: all of them),
        # and from that batch on by the workers.
        self._local = loader.num_workers > 0 and not loader._inner_kwargs["persistent_workers"]

    def _loader(self) -> DataLoader:
        loader = self._ref()
        if loader is None:  # pragma: no cover - the loader drives us
            raise RuntimeError("the mmcache.DataLoader of this plan stream was garbage-collected")
        return loader

    def streams(self, epoch: int) -> bool:
        """Whether the workers' stream runs on into ``epoch`` (its tasks wait at the gate)."""
        if self._plans is None:
            return False
        stop = self._loader()._stream_stop
        return stop is None or (epoch, 0) < stop

    def fetch(self, epoch: int, j: int) -> _Plan:
        if (epoch, j) != self.cursor:  # pragma: no cover - the loader keeps them aligned
            raise RuntimeError(f"plan stream at {self.cursor}, asked for {(epoch, j)}")
        loader = self._loader()
        batches = loader._epoch_batches(epoch)
        indices = batches[j]
        plan = None
        round_ = loader._swept.get(epoch)
        if round_ is not None:  # a sweep epoch: planned here
            plan = loader._known.speculate(indices, round_)
            if plan is None:
                # A sample whose key this process never learnt (another rank had it
                # before): the rest of the epoch is planned as in one not swept.
                loader._swept.pop(epoch, None)
        if plan is None and self._local:
            plan = loader._tasks.plan(indices, produce=False)
            self._local = plan is not None  # after a miss the workers plan and produce the rest
        if plan is None and loader.num_workers > 0:
            plan = self.confirmed(epoch, j)
        if plan is None:
            plan = loader._tasks.produced(indices)
        if not plan.speculative:
            loader._known.learn(plan)
            loader._warm_stretch = bool(plan.planned_hit.all())
        self.cursor = (epoch, j + 1) if j + 1 < len(batches) else (epoch + 1, 0)
        return plan

    def confirmed(self, epoch: int, j: int) -> _Plan:
        """The workers' plan of batch ``j`` of ``epoch``: the next one they deliver
        (:meth:`fetch` asks in order, one call at a time)."""
        if not self._received:
            self._received.extend(self._next_task())
        return self._received.popleft().unpack(self._loader()._epoch_batches(epoch)[j])

    def verified(self, guess: _Plan) -> bool:
        """Whether every file of a speculative plan is unchanged this epoch. Thread-safe.

        The stamp board says so for the files the sweeper has ``stat``-ed
        already in this round; the others are ``stat``-ed here.
        """
        loader = self._loader()
        board = loader._board
        if board is None or guess.stamps is None:  # pragma: no cover - speculate() needs both
            return False
        ok = board.verified(guess.indices, guess.stamps, guess.round)
        if ok.all():
            return True
        late = np.flatnonzero(~ok)
        return np.array_equal(loader.dataset.stat_stamps(guess.indices[late]), guess.stamps[late])

    def _next_task(self) -> list[_Planned]:
        """The next task's plans; (re)starts the workers' stream at the batch to plan
        next when it has not started or has ended (without persistent workers it
        ends with the epoch; with them, at an epoch to sweep)."""
        if self._plans is not None:
            with contextlib.suppress(StopIteration):
                return next(self._plans)
        loader = self._loader()
        self._received.clear()
        loader._stream_stop = None
        loader._stream_from = self.cursor
        self._first_epoch = self.cursor[0]
        self._base = loader._stream_gate = loader._gate.value if loader._gate is not None else 0
        if loader._sweeper is not None and loader._sweeper.pid is None:
            loader._sweeper.start()  # closed since: started again with the workers
        self._plans = iter(loader._inner_loader())  # starts or wakes the workers
        return next(self._plans)

    def begin_epoch(self, epoch: int) -> None:
        """The training loop begins ``epoch``: let the workers plan its batches."""
        gate = self._gate
        if gate is not None and self._plans is not None and epoch > self._first_epoch:
            gate.open_to(self._base + epoch - self._first_epoch)

    def close(self) -> None:
        if self._plans is not None and self._gate is not None:
            self._gate.open_all()  # tasks held for epochs that will not come
        self._plans = None  # a non-persistent torch iterator stops its workers when dropped
        self._received.clear()


class _KnownKeys:
    """Each sample's cache key and the file stamps it was made from, as last planned.

    49 bytes per sample of the dataset, in the training process: what a
    speculative plan is made of (see :class:`_PlanSource`), never trusted on
    its own. Rows are written whole by the thread that fetches plans; a row
    read while another thread writes it at most makes a speculation fail.
    """

    def __init__(self, n: int) -> None:
        self._n = n
        self._rows: np.ndarray | None = None  # uint8 [n, 48]: key, then the int64 stamp
        self._have: np.ndarray | None = None

    def learn(self, plan: _Plan) -> None:
        if plan.stamps is None:
            return  # keys of file contents (content_stamp): nothing a stat can verify
        if self._rows is None or self._have is None:
            self._rows = np.zeros((self._n, 16 + 8 * _STAMP_W), dtype=np.uint8)
            self._have = np.zeros(self._n, dtype=bool)
        self._rows[plan.indices, :16] = plan.keys
        self._rows[plan.indices, 16:] = np.ascontiguousarray(plan.stamps).view(np.uint8)
        self._have[plan.indices] = True

    def count(self) -> int:
        """Samples whose key is known."""
        return int(self._have.sum()) if self._have is not None else 0

    def speculate(self, indices: np.ndarray, round_: int) -> _Plan | None:
        """A plan of ``indices`` from their known keys, all in memory; None if one is unknown."""
        if self._rows is None or self._have is None or not self._have[indices].all():
            return None
        rows = self._rows[indices]
        keys, stamps = rows[:, :16], rows[:, 16:].view(np.int64)
        hit = np.ones(len(indices), dtype=bool)
        return _Plan(indices, keys, hit, [], stamps, speculative=True, round=round_)


class DataLoader:
    """Batches of a :class:`MultimodalDataset` through a :class:`Cache`.

    >>> loader = DataLoader(ds, cache=cache, batch_size=64, num_workers=4)  # doctest: +SKIP
    >>> for epoch in range(3):                                              # doctest: +SKIP
    ...     loader.set_epoch(epoch)
    ...     for batch in loader: ...

    Args:
        dataset: the samples.
        cache: a :class:`Cache`, or None for no caching (same batches, slower).
        batch_size: samples per batch.
        shuffle: a fresh permutation each epoch (a pure function of seed and epoch).
        seed: the order's seed.
        num_workers: processes that produce misses (0: in the training process).
            With workers (and a cache) the loader also starts one low-priority
            sweeper process, which checks the files of warm epochs.
        drop_last: drop each rank's last incomplete batch, as torch's DataLoader
            does (every epoch has ``len(loader)`` full batches).
        distributed_drop_last: how ranks get equal parts when the dataset does not
            divide by ``world_size``, as ``DistributedSampler``'s ``drop_last``:
            ``False`` (default) pads by repeating the epoch's first samples (every
            sample is seen, a few twice), ``True`` drops the last few samples of
            the epoch's order (see :mod:`mmcache.sampler`). A torch
            ``DataLoader(sampler=DistributedSampler(ds, drop_last=a), drop_last=b)``
            has the batch counts of ``distributed_drop_last=a, drop_last=b``.
        pin_memory: allocate batch tensors in pinned memory (when CUDA is present).
        rank, world_size: this process's part; default to torch.distributed's
            when it is initialised, else a single process; one without the other
            is refused unless torch.distributed is initialised. A loader with no
            batches (``len(loader) == 0``) logs a warning.
        prefetch: worker tasks (batches to plan and produce) in flight per worker
            (torch's ``prefetch_factor``).
        persistent_workers, worker_init_fn, multiprocessing_context, generator,
            timeout: as in ``torch.utils.data.DataLoader``, for the miss workers.
        on_epoch_end: called after each complete epoch with a dict of scalars
            (``epoch``, ``samples_per_s``, ``hit_rate``, ``hit_rate/memory``,
            ``hit_rate/disk``, ``stall_s``, ...), ready for TensorBoard or W&B.
    """

    def __init__(
        self,
        dataset: MultimodalDataset,
        *,
        cache: Cache | None,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        drop_last: bool = False,
        distributed_drop_last: bool = False,
        pin_memory: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 2,
        persistent_workers: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        timeout: float = 0,
        on_epoch_end: Callable[[dict[str, float]], None] | None = None,
    ) -> None:
        if not isinstance(dataset, MultimodalDataset):
            raise ConfigError(
                f"dataset must be a mmcache.MultimodalDataset, got {type(dataset).__name__}"
            )
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        if prefetch < 1:
            raise ConfigError(f"prefetch must be >= 1, got {prefetch}")
        rank, world_size = rank_and_world(rank, world_size)
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
            drop_last=distributed_drop_last,
        )
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
        # Holds back workers' tasks of epochs not begun yet (see _EpochBatches; only
        # persistent workers get such tasks). Opened whenever the loader goes, before
        # torch stops the workers: a worker held at the gate does not read torch's
        # stop signal.
        continuous = num_workers > 0 and persistent_workers
        self._gate = Gate(multiprocessing_context, num_workers) if continuous else None
        if self._gate is not None:
            weakref.finalize(self, self._gate.open_all)
        self._order = _Order(self.sampler, batch_size, drop_last)
        # Sweep epochs (see _PlanSource): a process stats the files and publishes the
        # results on a board. Only with workers (num_workers=0 starts no process), and
        # not for keys of file contents (content_stamp), which a stat cannot check.
        self._board: StampBoard | None = None
        self._sweeper: Sweeper | None = None
        if num_workers > 0 and cache is not None and not dataset.content_stamp:
            self._board = StampBoard(len(dataset), multiprocessing_context)
            self._sweeper = Sweeper(self._board, dataset, self._order, multiprocessing_context)
            weakref.finalize(self, self._sweeper.close)
            # Started now (a fork: ~7 ms, plus a copy of each page the training process
            # writes afterwards): not in the first epoch's time, and before any batch
            # buffer exists (started later, those pages are copied in the warm epochs).
            self._sweeper.start()
        self._tasks = _BatchTasks(dataset, cache, self._gate)
        self._inner_kwargs: dict[str, Any] = {
            "num_workers": num_workers,
            "collate_fn": _identity,
            "persistent_workers": persistent_workers and num_workers > 0,
            "worker_init_fn": worker_init_fn,
            "multiprocessing_context": multiprocessing_context if num_workers > 0 else None,
            "generator": generator,
            "timeout": timeout,
        }
        if num_workers > 0:
            self._inner_kwargs["prefetch_factor"] = prefetch
        self._inner: torch.utils.data.DataLoader[_Planned] | None = None
        self._warm_stretch = False  # the last batch planned had no misses
        self._live: _EpochCounter | None = None  # the epoch being iterated
        # Guards the layout learnt from the first batch and the buffer pool: batches
        # are assembled on two threads (see _iterate).
        self._assembly_lock = threading.Lock()
        self._epoch = 0
        self._position = 0  # batches of the current epoch already yielded
        self._chosen = False  # set_epoch called since the last iteration began
        self._resumed = False  # the position came from load_state_dict
        self._ids: str | None = None  # the dataset's ids digest (state_dict)
        self._stream: _PlanSource | None = None  # plans of the batches to come
        self._stream_from = (0, 0)  # where the workers' next stream starts (epoch, batch)
        self._stream_gate = 0  # the gate value its tasks count from
        self._stream_stop: tuple[int, int] | None = None  # where the workers' stream ended
        self._swept: dict[int, int] = {}  # sweep epochs (the last few): their sweep round
        self._rounds = 0  # sweep rounds handed out
        self._known = _KnownKeys(len(dataset))  # keys the workers sent (speculation)
        self._batches_memo: dict[int, list[np.ndarray]] = {}
        self._batches_lock = threading.Lock()
        self._history: dict[int, EpochStats] = {}
        self._layout: codec.Header | None = None
        # Pinned buffers may still be read by an asynchronous host-to-device copy
        # after the training loop dropped them: never recycle those.
        self._pool = _BufferPool(enabled=not self.pin_memory)
        # The thread that assembles batches ahead, kept from epoch to epoch.
        self._helper = Helper()
        weakref.finalize(self, self._helper.close, 5.0)
        self.on_epoch_end = on_epoch_end
        self._warned_low_hits = False

    # -- public API -------------------------------------------------------------------------
    def __len__(self) -> int:
        n = self.sampler.num_samples()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration yields: all of epoch ``epoch``, whatever
        was iterated before (its order is a pure function of seed and epoch), or,
        right after :meth:`load_state_dict` of that epoch, what remains of it (maybe
        nothing). An iteration without a ``set_epoch`` since the last one finished
        its epoch goes on with the next epoch."""
        try:
            epoch = operator.index(epoch)  # an int or a numpy integer
        except TypeError:
            raise ConfigError(f"epoch must be an int >= 0, got {epoch!r}") from None
        if isinstance(epoch, bool) or epoch < 0:
            raise ConfigError(f"epoch must be an int >= 0, got {epoch!r}")
        if not (self._resumed and epoch == self._epoch):
            self._position = 0
            self._resumed = False
        self._epoch = epoch
        self._chosen = True

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: resuming from it yields exactly the remaining batches.

        Independent of ``num_workers`` (the order never depends on it). ``ids`` is
        a digest of the dataset's ids in order (:meth:`~mmcache.manifest.Records.ids_digest`),
        so a reordered manifest of the same length is refused on resume.
        """
        if self._ids is None:
            self._ids = self.dataset.records.ids_digest()
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.sampler.seed,
            "shuffle": self.sampler.shuffle,
            "size": self.sampler.size,
            "ids": self._ids,
            "rank": self.sampler.rank,
            "world_size": self.sampler.world_size,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "distributed_drop_last": self.sampler.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the configuration that fixes the order must match.

        Raises :class:`ConfigError` naming the key for a missing, mistyped or
        out-of-range value, or one that differs from this loader's (another seed,
        dataset order, batch size, rank...); nothing is restored then.
        """
        if not isinstance(state, dict):
            raise ConfigError(
                f"a loader state is a dict (from state_dict()), got {type(state).__name__}"
            )
        mine = self.state_dict()
        if state.get("version") == 1:  # saved before the ids digest: order not checkable
            logger.warning(
                "loader state version 1 has no digest of the dataset's ids: resuming "
                "without checking that the manifest lists the same ids in the same order"
            )
            state = {**state, "version": _STATE_VERSION, "ids": mine["ids"]}
            # Its drop_last also trimmed across ranks (distributed_drop_last), which
            # changes nothing in a single process.
            alone = state.get("world_size") == 1
            state["distributed_drop_last"] = (
                mine["distributed_drop_last"] if alone else state.get("drop_last")
            )
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(
                f"unsupported loader state version {state.get('version')!r} (this mmcache "
                f"reads 1 and {_STATE_VERSION}): it was saved by another mmcache version"
            )
        for name in _STATE_ORDER:
            if name not in state:
                raise ConfigError(f"cannot resume: the loader state has no {name!r}")
            if state[name] != mine[name]:
                what = "the dataset's ids in order" if name == "ids" else name
                raise ConfigError(
                    f"cannot resume: state has {name}={state[name]!r} but this loader has "
                    f"{mine[name]!r} ({what} differs); the order (and so the remaining "
                    "batches) would differ"
                )
        epoch = _state_int(state, "epoch", 0, None)
        position = _state_int(state, "position", 0, len(self._epoch_batches(epoch)))
        self._epoch, self._position = epoch, position
        self._resumed = True  # set_epoch(epoch) keeps the position
        self._chosen = False

    def close(self) -> None:
        """Stop the worker processes (persistent ones included) and the sweeper now. Idempotent.

        Dropping the loader does the same; ``close`` makes it deterministic. A
        later iteration starts new workers.
        """
        flush_all()
        self._stop_workers()
        self._helper.close()
        if self._sweeper is not None:
            self._sweeper.close()

    def _stop_workers(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        if self._gate is not None:
            self._gate.open_all()  # no worker may wait at the gate while torch stops it
        inner, self._inner = self._inner, None
        iterator = getattr(inner, "_iterator", None) if inner is not None else None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

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
        """Hits, misses, stall time and throughput, per epoch and overall."""
        history = dict(self._history)
        live = self._live
        if live is not None:
            history[live.epoch] = live.snapshot()
        return LoaderStats(tuple(history[e] for e in sorted(history)))

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
            self.cache.register(self.dataset.fingerprint(), repr(self.dataset.pipeline))
        run = _EpochRun(epoch=epoch, batches=batches, start=self._position)
        return self._iterate(run)

    # -- planning (training process) -------------------------------------------------------
    def _sweeps(self, *, beginning: bool = False) -> bool:
        """Whether the next epoch is to be swept: with a sweeper, when warm (the last
        batch planned had no misses), or when the memory tier's budget holds every
        sample (after a cold epoch: its last batches had misses, but all are in now).

        ``beginning``: asked as the epoch begins, when the keys of all this rank's
        samples must be known too (the workers' stream asks earlier, while the last
        plans of the epoch before are still coming).
        """
        if self._sweeper is None:
            return False
        if self._warm_stretch:
            return True
        layout = self._layout
        if layout is None or self.cache is None or self.cache.memory is None:
            return False
        if self.cache.memory_budget < layout.length * len(self.dataset):
            return False
        return not beginning or self._known.count() >= self.sampler.num_samples()

    def _epoch_done(self, stats: EpochStats) -> None:
        """Per-epoch hooks: the user's callback, and the low-hit-rate warning."""
        if self.on_epoch_end is not None:
            scalars: dict[str, float] = {
                "epoch": float(stats.epoch),
                "samples": float(stats.samples),
                "samples_per_s": stats.samples_per_s,
                "hit_rate": stats.hit_rate,
                "stall_s": stats.stall_s,
                "misses": float(stats.misses),
                "rejects": float(stats.rejects),
            }
            total = max(stats.hits + stats.misses, 1)
            for tier in ("memory", "disk"):
                scalars[f"hit_rate/{tier}"] = stats.tier_hits.get(tier, 0) / total
            self.on_epoch_end(scalars)
        self._check_hit_rate(stats)

    def _check_hit_rate(self, stats: EpochStats) -> None:
        """Warn once when the hit rate stays far below what the budgets should give.

        After the first epoch every sample was offered to the cache, so from the
        second epoch on a tier whose budget holds the data should hit nearly
        always, and one that holds a fraction c of it about c of the time
        (``keep``/``value``). Far below that there is a reason worth telling.
        """
        if self._warned_low_hits or self.cache is None or stats.epoch < 1:
            return
        if stats.epoch - 1 not in self._history or self._layout is None:
            return
        entry = self._layout.length
        data = entry * max(self.sampler.num_samples() * self.sampler.world_size, 1)
        budget = (self.cache.memory_budget if self.cache.memory is not None else 0) + (
            self.cache.disk_budget or 0 if self.cache.disk is not None else 0
        )
        # What the tiers really hold bounds it too: a full file system or /dev/shm
        # holds less than the budget (and its store already warned about that).
        held = sum(tier.nbytes() for tier in self.cache.tiers.values())
        expected = min(1.0, min(budget, held) / data)
        if expected < 0.05 or stats.hit_rate >= 0.5 * expected:
            return
        if self.cache.policy.name == "lru":
            reason = (
                "policy 'lru' thrashes under per-epoch shuffling (each epoch evicts entries "
                "just before their reuse); use policy='value' (default) or 'keep'"
            )
        elif stats.late_misses > stats.misses // 2:
            reason = (
                "planned hits were evicted before use: another process is churning the "
                "memory tier (another job with another pipeline on the same root?)"
            )
        else:
            reason = (
                "the entries written last epoch are not found again: is the pipeline "
                "fingerprint changing between runs (a tokenizer or transform built "
                "differently each time), or are image files rewritten?"
            )
        logger.warning(
            "epoch %d hit rate %.2f is far below the %.2f the cache budgets should give "
            "(%s of budget for %s of data): %s",
            stats.epoch,
            stats.hit_rate,
            expected,
            format_size(budget),
            format_size(data),
            reason,
        )
        self._warned_low_hits = True

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The batches (index arrays) of ``epoch``, remembered for the last few epochs.

        Called by the consumer, the plan stream and the workers' sampler (all
        in the training process, on up to three threads).
        """
        with self._batches_lock:
            batches = self._batches_memo.get(epoch)
            if batches is None:
                batches = self._order.batches(epoch)
                if len(self._batches_memo) >= 3:
                    del self._batches_memo[next(iter(self._batches_memo))]
                self._batches_memo[epoch] = batches
            return batches

    def _inner_loader(self) -> torch.utils.data.DataLoader[_Planned]:
        if self._inner is None:
            self._inner = torch.utils.data.DataLoader(
                self._tasks, batch_sampler=_EpochBatches(self), **self._inner_kwargs
            )
        return self._inner

    # -- consuming (training process) ------------------------------------------------------
    def _iterate(self, run: _EpochRun) -> Iterator[dict[str, Any]]:
        """Yield the batches of ``run`` in order, assembled ahead while the training step runs.

        An :class:`~mmcache.inorder.InOrderBuilder` assembles the next batch
        (``_BUILD_AHEAD``) on a helper thread while the training loop holds
        this one (numpy copies and torch's IPC release the GIL); when the loop
        asks for a batch nobody has started, it assembles it itself instead of
        waiting. ``stall_s`` is the
        time the training loop spends in ``next()``, waiting or assembling.
        """
        stats = _EpochCounter(run.epoch, self._history.get(run.epoch))
        self._live = stats
        source = self._stream
        if source is None or source.cursor != (run.epoch, run.start) or self._inner is None:
            if source is not None:
                source.close()
            source = self._stream = _PlanSource(self, run.epoch, run.start)
        self._swept.pop(run.epoch, None)
        if self._sweeps(beginning=True) and not source.streams(run.epoch):
            # Warm, and the workers hold no plans of this epoch: a sweep epoch.
            self._rounds += 1
            self._swept[run.epoch] = self._rounds
            while len(self._swept) > 4:
                del self._swept[next(iter(self._swept))]
            if self._sweeper is not None:
                self._sweeper.request(self._rounds, run.epoch, run.start)
        source.begin_epoch(run.epoch)
        builder: InOrderBuilder[_Plan, dict[str, Any] | None] = InOrderBuilder(
            run.start,
            len(run.batches),
            fetch=lambda j: source.fetch(run.epoch, j),
            build=lambda j, plan: self._build(source, run.epoch, j, plan, stats),
            ahead=_BUILD_AHEAD,
            helper=self._helper,
        )
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
            stats.end(time.perf_counter())
            self._history[run.epoch] = stats.snapshot()
            self._live = None
            self._epoch_done(self._history[run.epoch])
        finally:
            builder.close()
            if source.cursor != (run.epoch + 1, 0) or not self._inner_kwargs["persistent_workers"]:
                # Left early (or workers end with the epoch): nobody continues this stream.
                source.close()
                self._stream = None
            if self._live is stats:
                self._history[run.epoch] = stats.snapshot()
                self._live = None
            if not self._inner_kwargs["persistent_workers"]:
                self._inner = None  # non-persistent workers exit with their iterator

    def _build(
        self, source: _PlanSource, epoch: int, j: int, plan: _Plan, stats: _EpochCounter
    ) -> dict[str, Any] | None:
        """Batch ``j`` of ``epoch``. A speculative plan is gathered at once and served when
        every key was in memory and every file is unchanged this epoch; otherwise (a file
        changed, an entry went) the batch is planned and its misses produced here."""
        if plan.speculative:
            batch = self._gather_all(plan)
            if batch is not None and source.verified(plan):
                self._count_memory_hits(len(plan.indices))
                stats.count_hits(_MEMORY, len(plan.indices))
                return batch
            # A file changed or an entry went: this batch is planned and its misses are
            # produced here; the next ones are planned as in an epoch that is not swept.
            self._swept.pop(epoch, None)
            plan = self._tasks.produced(plan.indices)
            self._known.learn(plan)
            self._warm_stretch = self._warm_stretch and bool(plan.planned_hit.all())
        return self._assemble(plan, stats)

    def _gather_all(self, plan: _Plan) -> dict[str, Any] | None:
        """The batch of a speculative plan, gathered from shared memory; None unless
        every key is there (nothing is produced for it, nothing counted)."""
        memory = self.cache.memory if self.cache is not None else None
        layout = self._layout
        if memory is None or layout is None:
            return None
        n = len(plan.indices)
        out = self._allocate(layout, n)
        rows = np.arange(n, dtype=np.int64)
        found = memory_gather(
            memory, layout, plan.keys, rows, out, ttl_cutoff=self._ttl_cutoff(), count=False
        )
        if not found.all():
            return None
        batch: dict[str, Any] = {
            "id": self.dataset.records.ids(plan.indices),
            "key": _hex_rows(plan.keys),
        }
        batch.update(out)
        return batch

    def _count_memory_hits(self, n: int) -> None:
        memory: Any = self.cache.memory if self.cache is not None else None
        if memory is not None:
            memory.count_reads(hits=n)  # the MemoryStore gathered with count=False

    def _assemble(self, plan: _Plan, stats: _EpochCounter) -> dict[str, Any] | None:
        n = len(plan.indices)
        rows: dict[int, dict[str, np.ndarray]] = {}
        sources: list[str] = [""] * n
        in_memory: list[int] = []
        miss_rows = np.flatnonzero(~plan.planned_hit).tolist()
        if len(miss_rows) != len(plan.results):  # pragma: no cover - plan() makes one per row
            raise RuntimeError("a batch plan has not one result per missing row")
        for r, res in zip(miss_rows, plan.results, strict=True):
            if res.error is not None:
                self._reject(res.error)
                sources[r] = _REJECTED
                continue
            sources[r] = res.source
            if res.in_memory:
                in_memory.append(r)
            elif res.sample is not None:
                rows[r] = res.sample
        planned = np.flatnonzero(plan.planned_hit)
        hit_rows = planned
        if in_memory:
            hit_rows = np.union1d(planned, np.asarray(in_memory, dtype=np.int64)).astype(np.int64)
        # Learn the layout (field names, dtypes, shapes) from the first sample we see.
        if self._layout is None:
            with self._assembly_lock:  # the other assembling thread may be learning it too
                if self._layout is None:
                    self._layout = self._find_layout(plan, rows, sources, hit_rows)
                    if self._layout is None and len(hit_rows):
                        # No trustworthy sample to learn the layout from (the cached ones
                        # fail their checksum): decode this batch's hits here instead.
                        for rr in hit_rows:
                            r = int(rr)
                            res = self._tasks.run(
                                int(plan.indices[r]), plan.keys[r].tobytes(), cached=False
                            )
                            stats.late_miss()
                            if res.error is not None:
                                self._reject(res.error)
                                sources[r] = _REJECTED
                            elif res.sample is not None:
                                rows[r], sources[r] = res.sample, _PRODUCED
                        planned = hit_rows = np.zeros(0, dtype=np.int64)
                        self._layout = self._find_layout(plan, rows, sources, hit_rows)
        layout = self._layout
        if layout is None:  # every sample of the batch was rejected
            stats.count(sources)
            return None
        out = self._allocate(layout, n)
        found = np.zeros(n, dtype=bool)
        if len(hit_rows) and self.cache is not None and self.cache.memory is not None:
            found[hit_rows] = self._gather(layout, plan.keys[hit_rows], hit_rows, out)
        for rr in hit_rows[~found[hit_rows]]:
            # Planned hit evicted (or expired) since planning: produce it here.
            r = int(rr)
            res = self._tasks.run(int(plan.indices[r]), plan.keys[r].tobytes())
            stats.late_miss()
            if res.error is not None:
                self._reject(res.error)
                sources[r] = _REJECTED
            elif res.sample is not None:
                rows[r] = res.sample
                # A sample a worker produced this epoch stays a miss, even when it is
                # fetched again (from disk) because it was evicted before the gather.
                if sources[r] != _PRODUCED:
                    sources[r] = res.source
        for rr in planned[found[planned]]:
            sources[int(rr)] = _MEMORY
        for r in list(rows):
            if sources[r] != _PRODUCED and not _shapes_match(layout, rows[r]):
                # A cached entry of another layout under this key: damaged. Drop it
                # from every tier and decode the sample instead.
                if self.cache is not None:
                    for tier in self.cache.tiers.values():
                        tier.discard(plan.keys[r].tobytes(), why="corrupt")
                res = self._tasks.run(int(plan.indices[r]), plan.keys[r].tobytes(), cached=False)
                if res.error is not None:
                    self._reject(res.error)
                    sources[r] = _REJECTED
                    del rows[r]
                    continue
                if res.sample is None:  # pragma: no cover - run() returns one or the other
                    raise RuntimeError("miss task returned neither a sample nor an error")
                rows[r], sources[r] = res.sample, _PRODUCED
        for r, sample in rows.items():
            self._check_shapes(layout, sample, int(plan.indices[r]))
            for f in layout.fields:
                out[f.name].numpy()[r] = sample[f.name]
        stats.count(sources)
        keep = [r for r in range(n) if sources[r] != _REJECTED]
        batch: dict[str, Any] = {
            "id": self.dataset.records.ids(plan.indices[keep]),
            "key": _hex_rows(plan.keys[keep]),
        }
        if not keep:
            return None
        if len(keep) < n:
            for name, tensor in out.items():
                kept = torch.from_numpy(tensor.numpy()[keep])
                batch[name] = kept.pin_memory() if self.pin_memory else kept
        else:
            batch.update(out)
        return batch

    def _reject(self, err: SampleError) -> None:
        if self.dataset.on_error == "raise":
            raise err
        self.dataset.record_reject(err)

    def _find_layout(
        self,
        plan: _Plan,
        rows: dict[int, dict[str, np.ndarray]],
        sources: list[str],
        hit_rows: np.ndarray,
    ) -> codec.Header | None:
        """The batch layout, from a freshly produced sample if there is one, else from a
        cached entry whose checksum verifies (memory-tier reads are not verified)."""
        for r, sample in rows.items():
            if sources[r] == _PRODUCED:
                return codec.read_header(codec.encode(sample))
        memory = self.cache.memory if self.cache is not None else None
        if memory is not None:
            for r in hit_rows:
                raw = memory.get(plan.keys[r].tobytes())
                if raw is None:
                    continue
                if codec.verify(raw):
                    return codec.read_header(raw)
                memory.discard(plan.keys[r].tobytes(), why="corrupt")  # never served, and dropped
        for sample in rows.values():  # from the disk tier (verified) via a worker
            return codec.read_header(codec.encode(sample))
        return None

    def _allocate(self, layout: codec.Header, n: int) -> dict[str, torch.Tensor]:
        with self._assembly_lock:
            reused = self._pool.acquire(layout.layout_key, n)
            if reused is not None:
                return reused
            out: dict[str, torch.Tensor] = {}
            for f in layout.fields:
                dtype = torch.from_numpy(np.empty(0, dtype=f.dtype)).dtype
                out[f.name] = torch.empty((n, *f.shape), dtype=dtype, pin_memory=self.pin_memory)
            self._pool.add(layout.layout_key, n, out)
            return out

    def _gather(
        self,
        layout: codec.Header,
        keys: np.ndarray,
        rows: np.ndarray,
        out: dict[str, torch.Tensor],
    ) -> np.ndarray:
        """Copy the planned hits' fields from shared memory into ``out``; found mask."""
        memory = self.cache.memory if self.cache is not None else None
        if memory is None:
            return np.zeros(len(keys), dtype=bool)
        return memory_gather(memory, layout, keys, rows, out, ttl_cutoff=self._ttl_cutoff())

    def _ttl_cutoff(self) -> float | None:
        if self.cache is None or self.cache.ttl is None:
            return None
        return self.cache.clock() - self.cache.ttl

    @staticmethod
    def _check_shapes(layout: codec.Header, sample: dict[str, np.ndarray], index: int) -> None:
        for f in layout.fields:
            arr = sample.get(f.name)
            if not _fits(f, arr):
                got = None if arr is None else (tuple(arr.shape), str(arr.dtype))
                raise ConfigError(
                    f"sample {index} has field {f.name!r} of shape/dtype {got}, but the batch "
                    f"expects {(tuple(f.shape), str(f.dtype))}: every sample of a batch must have "
                    "the same shapes (fixed image size and max_length)"
                )


def _hex_rows(keys: np.ndarray) -> list[str]:
    """The hex form of each row of ``uint8 [n, 16]`` keys (== :func:`mmcache.keys.key_hex`)."""
    text = keys.tobytes().hex()
    width = 2 * keys.shape[1]
    return [text[i : i + width] for i in range(0, len(text), width)]


def _fits(f: codec.Field, arr: np.ndarray | None) -> bool:
    return arr is not None and tuple(arr.shape) == tuple(f.shape) and arr.dtype == f.dtype


def _shapes_match(layout: codec.Header, sample: dict[str, np.ndarray]) -> bool:
    """Whether ``sample`` has exactly the fields of ``layout``, with their shapes and dtypes."""
    return len(sample) == len(layout.fields) and all(
        _fits(f, sample.get(f.name)) for f in layout.fields
    )


def memory_gather(
    memory: Any,
    layout: codec.Header,
    keys: np.ndarray,
    rows: np.ndarray,
    out: dict[str, torch.Tensor],
    *,
    ttl_cutoff: float | None,
    count: bool = True,
) -> np.ndarray:
    """Gather the fields of ``keys`` (``uint8 [n, 16]``) from the memory tier into rows
    ``rows`` of ``out``.

    All byte ranges of all keys are copied under one shared lock
    (:meth:`MemoryStore.gather_ranges`), so an entry evicted and replaced by
    another process in between can never mix into the batch. Besides the
    fields it copies each entry's fixed header and field table, and treats as
    absent an entry whose table differs from ``layout`` (a sample of another
    shape) or that expired: the caller produces those instead.

    Copies are numpy's, never torch's: a torch copy large enough to run on the
    intra-op (OpenMP) pool hangs in a process forked from one that used that pool
    (a training loop started with multiprocessing "fork"), seen in the crash tests.

    Ranges: each large field (the image) is copied straight into the batch
    tensor when every row of the batch is a hit; the header and the small
    fields (token ids, mask) that lie close together are merged into as few
    ranges as possible, because each range costs a Python-level row copy.
    ``count=False``: the tier's hit and miss counters are left alone (the caller
    counts what it serves).
    """
    n = len(keys)
    plan = _gather_plan(layout)
    full = len(rows) == next(iter(out.values())).shape[0]
    targets: list[tuple[int, int, np.ndarray]] = []
    seg_bufs: list[np.ndarray] = []
    direct: dict[str, np.ndarray] = {}
    for start, stop, names in plan.segments:
        if full and len(names) == 1 and start == plan.offsets[names[0]][0] and start > 0:
            f = names[0]
            dst = out[f].numpy().reshape(n, -1).view(np.uint8)  # straight into the batch
            direct[f] = dst
            seg_bufs.append(dst)
        else:
            dst = np.empty((n, stop - start), dtype=np.uint8)
            seg_bufs.append(dst)
        targets.append((start, stop - start, dst))
    found = np.asarray(memory.gather_ranges(keys, targets, count=count), dtype=bool)
    head = seg_bufs[0][:, : plan.table_end]
    foreign = found & ~_head_matches(head, plan.expected_head)
    ok = found & ~foreign
    expired = np.zeros(n, dtype=bool)
    if ttl_cutoff is not None:
        ctime = head[:, 24:32].copy().view("<f8").reshape(n)
        expired = ok & (ctime < ttl_cutoff)
        ok &= ~expired
    # Never serve them, and drop them so nobody else does: a layout that is not the
    # one this key must have can only be a damaged entry.
    for i in np.flatnonzero(foreign).tolist():
        memory.discard(keys[i].tobytes(), why="corrupt")
    for i in np.flatnonzero(expired).tolist():
        memory.discard(keys[i].tobytes(), why="expired")
    all_ok = bool(ok.all())
    sel_rows = rows[ok]
    for (start, _stop, names), buf in zip(plan.segments, seg_bufs, strict=True):
        for name in names:
            if name in direct:
                continue
            off, nbytes, dtype, shape = plan.offsets[name]
            src = buf[:, off - start : off - start + nbytes]
            if not all_ok:
                src = src[ok]
            if src.shape[0] == 0:
                continue
            arr = np.ascontiguousarray(src).view(dtype).reshape(-1, *shape)
            if full and all_ok:
                out[name].numpy()[...] = arr
            else:
                out[name].numpy()[sel_rows] = arr
    result: np.ndarray = ok
    return result


@dataclass(frozen=True)
class _GatherPlan:
    """How to read one layout: merged byte ranges, and what the header must say."""

    segments: tuple[tuple[int, int, tuple[str, ...]], ...]  # (start, stop, field names)
    offsets: dict[str, tuple[int, int, np.dtype[Any], tuple[int, ...]]]
    table_end: int
    expected_head: np.ndarray


#: Fields larger than this get a range of their own (copied straight into the batch).
_LARGE_FIELD = 4096
#: Merge neighbouring ranges separated by at most this many bytes (alignment padding).
_MERGE_GAP = 256
_PLANS: dict[bytes, _GatherPlan] = {}


def _gather_plan(layout: codec.Header) -> _GatherPlan:
    plan = _PLANS.get(layout.layout_key)
    if plan is not None:
        return plan
    table_end = codec.HEADER_SIZE + len(layout.layout_key) - _SIG_PREFIX
    segments: list[tuple[int, int, list[str]]] = [(0, table_end, [])]
    for f in sorted(layout.fields, key=lambda f: f.offset):
        start, stop = f.offset, f.offset + f.nbytes
        last = segments[-1]
        last_large = len(last[2]) == 1 and (last[1] - last[0]) > _LARGE_FIELD
        if f.nbytes <= _LARGE_FIELD and not last_large and start - last[1] <= _MERGE_GAP:
            segments[-1] = (last[0], stop, [*last[2], f.name])
        else:
            segments.append((start, stop, [f.name]))
    offsets = {f.name: (f.offset, f.nbytes, f.dtype, tuple(f.shape)) for f in layout.fields}
    plan = _GatherPlan(
        segments=tuple((a, b, tuple(names)) for a, b, names in segments),
        offsets=offsets,
        table_end=table_end,
        expected_head=_expected_head(layout, table_end),
    )
    if len(_PLANS) < 64:
        _PLANS[layout.layout_key] = plan
    return plan


# layout_key = uint16 version + uint32 nfields + the raw field table (codec.read_header).
_SIG_PREFIX = 6


def _expected_head(layout: codec.Header, table_end: int) -> np.ndarray:
    """The header bytes every entry of ``layout`` shares: all but checksum, ctime, cost."""
    ref = codec.encode(
        {f.name: np.zeros(f.shape, dtype=f.dtype) for f in layout.fields},
        bfloat16={f.name for f in layout.fields if f.logical_dtype == "bfloat16"},
    )
    return np.frombuffer(ref, dtype=np.uint8, count=table_end)


# Header bytes that vary between entries of one layout: checksum [8,16), ctime and cost [24,40).
_VARYING = np.zeros(512, dtype=bool)
_VARYING[8:16] = True
_VARYING[24:40] = True


def _head_matches(head: np.ndarray, expected: np.ndarray) -> np.ndarray:
    width = head.shape[1]
    care = (
        ~_VARYING[:width]
        if width <= _VARYING.shape[0]
        else np.concatenate([~_VARYING, np.ones(width - _VARYING.shape[0], dtype=bool)])
    )
    return np.asarray(((head == expected) | ~care).all(axis=1), dtype=bool)


class _BufferPool:
    """Recycles batch tensors that nobody outside the pool references any more.

    A fresh 10 MB batch tensor costs a page fault per 4 KiB page when it is
    first written (glibc returns large freed blocks to the OS): about as much
    as the copy itself, which halved the warm-epoch rate. A buffer is reused
    only when both its Python reference count and its storage's use count
    (tensors, views, ``.numpy()`` arrays of it) are back to what they were
    when the pool alone held it, so a batch (or any view of it) the training
    loop still holds is never overwritten. Without torch's use-count hook the
    pool stays empty and every batch is fresh. Used by one thread.
    """

    _MAX = 8

    def __init__(self, *, enabled: bool) -> None:
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)
        self.enabled = enabled and self._use_count is not None
        self._entries: list[tuple[bytes, int, dict[str, torch.Tensor], dict[str, int]]] = []

    def _use(self, held: dict[str, torch.Tensor], name: str) -> int:
        use = self._use_count(held[name].untyped_storage()._cdata) if self._use_count else 0
        return int(use)

    @staticmethod
    def _refs(held: dict[str, torch.Tensor], name: str) -> int:
        # Only the pool's dict and getrefcount's own argument: 2. Evaluated on a
        # subscript so no local variable of ours adds a reference.
        return sys.getrefcount(held[name])

    def acquire(self, layout_key: bytes, n: int) -> dict[str, torch.Tensor] | None:
        if not self.enabled:
            return None
        for key, size, held, base in self._entries:
            if key != layout_key or size != n:
                continue
            if all(
                self._refs(held, name) == 2 and self._use(held, name) == use
                for name, use in base.items()
            ):
                return dict(held)
        return None

    def add(self, layout_key: bytes, n: int, tensors: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        held = dict(tensors)
        base = {name: self._use(held, name) for name in held}
        self._entries.append((layout_key, n, held, base))
        if len(self._entries) > self._MAX:
            self._entries.pop(0)


class _EpochCounter:
    """Accumulates one epoch's :class:`EpochStats` in the training process. Thread-safe."""

    def __init__(self, epoch: int, previous: EpochStats | None) -> None:
        p = previous if previous is not None else EpochStats(epoch=epoch)
        self.epoch = epoch
        self.samples, self.batches = p.samples, p.batches
        self.hits, self.misses, self.rejects = p.hits, p.misses, p.rejects
        self.late = p.late_misses
        self.seconds, self.stall_s = p.seconds, p.stall_s
        self.tier_hits = dict(p.tier_hits)
        self._t_begin: float | None = None
        self._seconds_before = p.seconds
        # count() and late_miss() run on both assembling threads.
        self._lock = threading.Lock()

    def begin(self, t: float) -> None:
        if self._t_begin is None:
            self._t_begin = t

    def end(self, t: float) -> None:
        if self._t_begin is not None:
            self.seconds = self._seconds_before + (t - self._t_begin)

    def stall(self, dt: float) -> None:
        self.stall_s += dt

    def late_miss(self) -> None:
        with self._lock:
            self.late += 1

    def count(self, sources: list[str]) -> None:
        with self._lock:
            self._count(sources)

    def count_hits(self, tier: str, n: int) -> None:
        """A batch of ``n`` hits in ``tier``: ``count([tier] * n)``, cheaper."""
        with self._lock:
            self.batches += 1
            self.hits += n
            self.samples += n
            self.tier_hits[tier] = self.tier_hits.get(tier, 0) + n

    def _count(self, sources: list[str]) -> None:
        self.batches += 1
        for s, k in collections.Counter(sources).items():
            if s == _REJECTED:
                self.rejects += k
            elif s == _PRODUCED:
                self.misses += k
                self.samples += k
            elif s:
                self.hits += k
                self.samples += k
                self.tier_hits[s] = self.tier_hits.get(s, 0) + k

    def snapshot(self) -> EpochStats:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> EpochStats:
        return EpochStats(
            epoch=self.epoch,
            samples=self.samples,
            batches=self.batches,
            hits=self.hits,
            misses=self.misses,
            rejects=self.rejects,
            late_misses=self.late,
            seconds=self.seconds,
            stall_s=self.stall_s,
            tier_hits=dict(self.tier_hits),
        )


def _state_int(state: dict[str, Any], name: str, low: int, high: int | None) -> int:
    """``state[name]`` checked to be an int in ``[low, high]`` (ConfigError otherwise)."""
    if name not in state:
        raise ConfigError(f"cannot resume: the loader state has no {name!r}")
    value = state[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"cannot resume: state {name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"cannot resume: state {name}={value} is not {bound}")
    return value
