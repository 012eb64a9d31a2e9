"""The batch plans in order: from the miss workers, from learnt keys, or made here.

Every epoch's order is known in advance (:mod:`mmcache.sampler`), so the
workers plan and produce the batches in exactly the order the training loop
takes them: :class:`WorkerTaskSampler` is the internal torch DataLoader's
batch sampler, :class:`MissWorkers` that DataLoader, and
:class:`BatchPlanStream` hands the training process one plan per batch, in
order, from the source its :class:`PlanMode` names.

Across epochs, with persistent workers, the workers' stream runs on while
epochs have misses: the next epoch's tasks wait at an
:class:`~mmcache.loader.warm_epoch.gate.EpochGate` in the workers until the
training loop begins that epoch (so nothing changed between epochs is
missed, and a cold epoch's misses are all in the cache before the next
epoch looks for them). The stream ends instead at an epoch boundary reached
while warm, when the next epoch is to be guessed (see
:mod:`mmcache.loader.warm_epoch`).

What the three share is a :class:`StreamState`, passed to each explicitly:
none of them refers to the ``DataLoader``, so dropping the loader drops its
workers at once (no reference cycle keeps them alive).

Thread safety: training process only; the plan fetch runs one call at a time
(:class:`~mmcache.loader.warm_epoch.assembler.InOrderBuilder` holds its fetch
lock); :class:`EpochOrder` is called from up to three threads.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np
import torch

from mmcache.loader.lifeline import WorkerStart
from mmcache.loader.readahead import Calm, ReadAhead
from mmcache.loader.shmroom import ShmRoom
from mmcache.loader.tasks import BatchPlan, PackedPlan, WorkerPlanner, WorkerTask
from mmcache.loader.warm_epoch import WarmEpochs
from mmcache.loader.warm_epoch.gate import EpochGate
from mmcache.sampler import EpochSampler

__all__ = [
    "BatchOrder",
    "BatchPlanStream",
    "EpochOrder",
    "MissWorkers",
    "PlanMode",
    "StreamState",
    "WorkerTaskSampler",
]

#: Most batches per worker task while the epoch is warm (no misses lately): one
#: result crosses the process boundary per task, and that costs about as much
#: as gathering a few samples, so a warm stretch is planned in groups. Groups
#: start at one batch each epoch and double, so the first batch is not late.
_WARM_GROUP = 8
#: Epochs whose batches are remembered (the consumer, the stream and the sampler
#: may be in two consecutive epochs).
_MEMO_EPOCHS = 3
#: Batches of a guessed epoch whose cache pages are asked for ahead of their gather.
_READ_AHEAD = 8  # with ReadAhead's 4 threads: ~0.5 of dd's bandwidth with pages dropped (4: ~0.4)
#: Guessed batches in a row served wholly by the first tier (memory) after which a
#: guessed epoch stops reading ahead, until a lower tier serves a row again. In a warm
#: epoch that memory holds the read-ahead has nothing to read, yet its calls (even
#: calm: a probe every 8 submissions, 8 chunks at each epoch's start) took the GIL
#: from the loop: a warm epoch of memory + disk ran 13% slower than memory alone
#: (56.2 against 49.5 ms for 1,500 samples, measured in turns); without them, 3%.
FIRST_TIER_CALM = 2 * _READ_AHEAD


@dataclass(frozen=True)
class BatchOrder:
    """The batches (index arrays) of each epoch: a pure function of the sampler.

    Immutable and lock-free, so it is safe in a process forked at any moment
    (the stat prefetcher computes the epochs it is asked for with it).
    """

    sampler: EpochSampler
    batch_size: int
    drop_last: bool
    #: epoch -> ``(start, stop)``: the part of its order that remains (an epoch
    #: resumed under another world size, see :meth:`EpochSampler.span_indices`).
    spans: dict[int, tuple[int, int]] = field(default_factory=dict, compare=False)

    def for_rank(self, rank: int) -> BatchOrder:
        """The same order as another rank of the job sees it (spans included)."""
        return replace(self, sampler=replace(self.sampler, rank=rank), spans=dict(self.spans))

    def batches(self, epoch: int) -> list[np.ndarray]:
        span = self.spans.get(epoch)
        if span is None:
            order = self.sampler.indices(epoch)
        else:
            order = self.sampler.span_indices(epoch, *span)
        bs = self.batch_size
        stop = len(order) - len(order) % bs if self.drop_last else len(order)
        return [order[i : i + bs] for i in range(0, stop, bs)]


class EpochOrder:
    """:class:`BatchOrder`'s batches, remembered for the last few epochs: what the
    loader, its workers' task sampler and its plan stream ask for. Thread-safe."""

    def __init__(self, order: BatchOrder) -> None:
        self.order = order
        self._memo: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def resume_span(self, epoch: int, span: tuple[int, int] | None) -> None:
        """Make ``epoch`` the part ``span`` of its order (None: the whole epochs again)."""
        with self._lock:
            self.order.spans.clear()
            if span is not None:
                self.order.spans[epoch] = span
            self._memo.clear()

    def span(self, epoch: int) -> tuple[int, int] | None:
        return self.order.spans.get(epoch)

    def batches(self, epoch: int) -> list[np.ndarray]:
        with self._lock:
            batches = self._memo.get(epoch)
            if batches is None:
                batches = self.order.batches(epoch)
                if len(self._memo) >= _MEMO_EPOCHS:
                    del self._memo[next(iter(self._memo))]
                self._memo[epoch] = batches
            return batches


@dataclass
class StreamState:
    """Where the workers' stream of tasks is: shared by the loader, its task sampler and
    its plan stream, each given it explicitly (training process only).

    ``start``: (epoch, batch) where the workers' next stream starts; ``gate``: the
    gate value its tasks count from; ``stop``: where the last stream ended (None:
    it runs on, or never started); ``warm``: the last batch planned had no misses;
    ``before_plan``: called with (epoch, batch) before a batch is planned (the
    loader's ``before_plan`` hooks; None: none); ``max_group``: the most batches in
    one task (1 under a cluster exchange: a task of batches far ahead would be planned
    before the exchange may bring them); ``first_tier_run``: guessed batches in a row
    the first tier served wholly (from :data:`FIRST_TIER_CALM` on, a guessed epoch
    reads nothing ahead; the loader resets it when a lower tier serves a row).
    """

    start: tuple[int, int] = (0, 0)
    gate: int = 0
    stop: tuple[int, int] | None = None
    warm: bool = False
    before_plan: Callable[[int, int], None] | None = None
    max_group: int = _WARM_GROUP
    first_tier_run: int = 0


class WorkerTaskSampler:
    """The internal DataLoader's batch sampler: the workers' tasks from ``state.start`` on.

    Read lazily by torch in the training process as it keeps its workers busy
    (``prefetch`` tasks each). A task is one batch, or up to :data:`_WARM_GROUP`
    consecutive batches while the last plans received had no misses (then a
    task is only ``stat`` calls and index lookups). With persistent workers
    the stream goes on into the next epochs, its tasks carrying gate numbers,
    and ends at the first epoch boundary where ``guess_next()`` says the next
    epoch is guessed. A new stream starts when the loader needs the workers
    again (a miss, another epoch, a resumed position, a loop left early).
    """

    def __init__(
        self,
        state: StreamState,
        order: EpochOrder,
        *,
        persistent: bool,
        guess_next: Callable[[], bool],
    ) -> None:
        self._state = state
        self._order = order
        self._persistent = persistent
        self._guess_next = guess_next

    def __iter__(self) -> Iterator[list[WorkerTask]]:
        state = self._state
        epoch, j = state.start
        base = state.gate
        group, gate = 1, 0  # the stream's first epoch has begun: no gate
        while True:
            batches = self._order.batches(epoch)
            if j >= len(batches):
                if not self._persistent or not batches or self._guess_next():
                    state.stop = (epoch + 1, 0)
                    return
                epoch, j, group = epoch + 1, 0, 1
                gate = gate + 1 if gate else base + 1
                batches = self._order.batches(epoch)
            task = batches[j : j + group]
            if state.before_plan is not None:
                for k in range(j, j + len(task)):
                    state.before_plan(epoch, k)
            yield [WorkerTask(gate, b, (epoch, j + k)) for k, b in enumerate(task)]
            j += len(task)
            group = min(2 * group, state.max_group) if state.warm else 1


#: What the loader does without workers (ShmRoom's warning).
_PRODUCE_HERE = "the training process plans and produces every batch (as num_workers=0)"


def _identity(batch: list[PackedPlan]) -> list[PackedPlan]:
    return batch


class MissWorkers:
    """The worker processes that plan batches and produce misses: a torch DataLoader
    over a :class:`~mmcache.loader.tasks.WorkerPlanner`, made when first needed.

    ``gate`` (persistent workers only) holds back the tasks of epochs not begun;
    it is opened whenever the workers stop, before torch stops them: a worker
    held at the gate does not read torch's stop signal.

    Each worker first holds a :class:`~mmcache.loader.lifeline.Lifeline` (then runs
    the user's ``worker_init_fn``): it ends with the training process, even one
    killed with ``kill -9`` (torch's own check runs only between tasks, and an
    orphan's exit blocks joining its queue's feeder thread).
    """

    def __init__(
        self,
        planner: WorkerPlanner,
        sampler: WorkerTaskSampler,
        *,
        gate: EpochGate | None,
        persistent: bool,
        kwargs: dict[str, Any],
        shm: ShmRoom | None = None,
    ) -> None:
        self.gate = gate
        self.persistent = persistent
        #: The workers could not be started (their queues found no room in /dev/shm):
        #: the training process produces every batch from then on.
        self.unavailable = False
        self._shm = shm if shm is not None else ShmRoom()
        self._planner = planner
        self._sampler = sampler
        self._start = WorkerStart(kwargs.get("worker_init_fn"))
        self._kwargs = {
            **kwargs,
            "worker_init_fn": self._start,
            "collate_fn": _identity,
            "persistent_workers": persistent,
        }
        self._inner: torch.utils.data.DataLoader[PackedPlan] | None = None

    @property
    def started(self) -> bool:
        return self._inner is not None

    def torch_loader(self) -> torch.utils.data.DataLoader[PackedPlan]:
        """The torch DataLoader (its ``iter``, next, in this thread, starts or wakes the
        workers: their lifeline is made here)."""
        self._start.renew()
        if self._inner is None:
            self._inner = torch.utils.data.DataLoader(
                self._planner, batch_sampler=self._sampler, **self._kwargs
            )
        return self._inner

    def plans(self) -> Iterator[list[PackedPlan]] | None:
        """Start (or wake) the workers: the iterator of their results; None when they
        cannot be started, reported once (torch makes each worker's queue of three
        POSIX semaphores in ``/dev/shm``: ENOSPC when it is full). The workers started
        before the failure are stopped, and none is started again."""
        if self.unavailable:
            return None
        before = set(multiprocessing.active_children())
        try:
            return iter(self.torch_loader())
        except OSError as exc:
            self.unavailable = True
            self._inner = None
            for process in set(multiprocessing.active_children()) - before:
                process.kill()  # torch registers its workers only once all started
                process.join(5.0)
            self._shm.report("worker queues", exc, _PRODUCE_HERE)
            return None

    def release(self) -> None:
        """Forget the torch DataLoader (non-persistent workers exit with their iterator)."""
        self._inner = None

    def stop(self) -> None:
        """Stop the workers now (persistent ones included)."""
        if self.gate is not None:
            self.gate.open_all()  # no worker may wait at the gate while torch stops it
        inner, self._inner = self._inner, None
        iterator = getattr(inner, "_iterator", None) if inner is not None else None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class PlanMode(Enum):
    """Where :class:`BatchPlanStream` takes a batch's plan from.

    ``GUESS``: from the keys learnt before (a guessed epoch, see
    :mod:`mmcache.loader.warm_epoch`); ends for the rest of the epoch at a
    batch with a key never learnt here, or one whose guess fails its check.
    ``LOCAL``: planned here until the first miss (non-persistent workers are
    started anew each epoch, a fork or spawn each: a warm epoch needs none; and
    persistent workers are started at the first miss, so the first epoch of a
    process over a cache another run filled starts none); then ``WORKERS`` for
    the rest of the epoch. ``WORKERS``: the workers' stream (persistent workers
    once started). ``PRODUCE``: planned and produced here
    (``num_workers=0``).
    """

    GUESS = "guess"
    LOCAL = "local"
    WORKERS = "workers"
    PRODUCE = "produce"


class BatchPlanStream:
    """The plans of the batches, in order from a start point (see :class:`PlanMode`).

    ``fetch(epoch, j)`` is called for consecutive batches (then epoch+1's from
    0), one call at a time; ``cursor`` is the next batch it is asked for. With
    workers, a task's result holds the plans of one or more batches, and the
    stream may outlive one epoch (see :class:`WorkerTaskSampler`).
    """

    def __init__(
        self,
        epoch: int,
        start: int,
        *,
        order: EpochOrder,
        state: StreamState,
        planner: WorkerPlanner,
        workers: MissWorkers | None,
        warm: WarmEpochs,
        calm: Calm | None = None,
        ahead: ReadAhead | None = None,
    ) -> None:
        self.cursor = (epoch, start)
        self._order = order
        self._state = state
        self._planner = planner
        self._workers = workers
        self._warm = warm
        self._gate = workers.gate if workers is not None else None
        # The next batches: promoted into free memory, their pages read ahead, off the loop.
        # Promotion in the epoch's order (one chunk at a time), page reads concurrently;
        # calm: the loader's, kept across epochs. ahead: the loader's read-ahead (its
        # threads kept across streams; cancelled, not closed, when this one ends).
        self._owns_ahead = ahead is None
        self._ahead = (
            ahead
            if ahead is not None
            else ReadAhead(self._read_ahead_of_use, ordered=self._promote_ahead_of_use, calm=calm)
        )
        self._first_epoch = epoch  # of the workers' current stream
        self._base = 0  # the gate value its tasks count from
        self._plans: Iterator[list[PackedPlan]] | None = None
        # Plans received in a task's result for the batches after the one asked for.
        self._received: collections.deque[PackedPlan] = collections.deque()
        # Persistent workers not started yet (a new process's first epoch, maybe over a
        # cache another run filled) are started at the first miss, not before: a warm
        # first epoch then costs no fork and no wait for the workers' first plans.
        self._mode = (
            PlanMode.PRODUCE
            if workers is None or workers.unavailable
            else PlanMode.WORKERS
            if workers.persistent and workers.started
            else PlanMode.LOCAL
        )

    # Looked up at call time (a planner without them never reads ahead).
    def _promote_ahead_of_use(self, keys: np.ndarray) -> int:
        return self._planner.promote(keys)  # entries promoted: work that keeps every chunk

    def _read_ahead_of_use(self, keys: np.ndarray) -> None:
        self._planner.read_ahead(keys)

    def mode(self, epoch: int) -> PlanMode:
        """Where the next plan of ``epoch`` comes from."""
        return PlanMode.GUESS if self._warm.is_guessed(epoch) else self._mode

    @property
    def plans_here(self) -> bool:
        """Whether the next batches are planned in the training process until a miss."""
        return self._mode is PlanMode.LOCAL

    def streams(self, epoch: int) -> bool:
        """Whether the workers' stream runs on into ``epoch`` (its tasks wait at the gate)."""
        if self._plans is None:
            return False
        stop = self._state.stop
        return stop is None or (epoch, 0) < stop

    def fetch(self, epoch: int, j: int) -> BatchPlan:
        if (epoch, j) != self.cursor:  # pragma: no cover - the loader keeps them aligned
            raise RuntimeError(f"plan stream at {self.cursor}, asked for {(epoch, j)}")
        batches = self._order.batches(epoch)
        indices = batches[j]
        plan = None
        if self._state.before_plan is not None:  # (the workers' task sampler calls it too)
            self._state.before_plan(epoch, j)
        if self.mode(epoch) is PlanMode.GUESS:
            plan = self._warm.guess(epoch, indices)  # None: the epoch is guessed no more
            calm = self._state.first_tier_run >= FIRST_TIER_CALM  # memory serves them all
            if plan is not None and not calm and self._planner.reads_ahead():  # next pages
                if j == 0:
                    self._ahead.wake()
                for k in range(_READ_AHEAD + 1) if j == 0 else (_READ_AHEAD,):
                    if j + k < len(batches):
                        ahead = self._warm.known_keys(batches[j + k])
                        if ahead is not None:
                            self._ahead.submit(ahead)
        if plan is None and self._mode is PlanMode.LOCAL:
            known = self._warm.published(epoch, indices)  # keys the prefetcher made
            plan = self._planner.plan(indices, produce=False, known=known)
            if plan is None:  # after a miss the workers plan and produce the rest
                self._mode = PlanMode.WORKERS
                self._warm.stop_publishing(epoch)
        if plan is None and self._mode is PlanMode.WORKERS:
            plan = self.confirmed(epoch, j)
            if plan is None:  # the workers could not be started: produced here from now on
                self._mode = PlanMode.PRODUCE
        if plan is None:
            plan = self._planner.produced(indices, at=(epoch, j))
        if not plan.guessed:
            self._warm.learn(plan)
            self._state.warm = bool(plan.planned_hit.all())
        self.cursor = (epoch, j + 1) if j + 1 < len(batches) else (epoch + 1, 0)
        return plan

    def confirmed(self, epoch: int, j: int) -> BatchPlan | None:
        """The workers' plan of batch ``j`` of ``epoch``: the next one they deliver
        (:meth:`fetch` asks in order, one call at a time); None when the workers
        cannot be started."""
        if not self._received:
            task = self._next_task()
            if task is None:
                return None
            self._received.extend(task)
        return self._received.popleft().unpack(self._order.batches(epoch)[j])

    def _next_task(self) -> list[PackedPlan] | None:
        """The next task's plans; (re)starts the workers' stream at the batch to plan
        next when it has not started or has ended (without persistent workers it
        ends with the epoch; with them, at an epoch to guess). None when the workers
        cannot be started (:meth:`MissWorkers.plans`)."""
        if self._plans is not None:
            with contextlib.suppress(StopIteration):
                return next(self._plans)
        if self._workers is None:  # pragma: no cover - WORKERS mode needs workers
            raise RuntimeError("no workers to plan batches")
        self._received.clear()
        state = self._state
        state.stop = None
        state.start = self.cursor
        self._first_epoch = self.cursor[0]
        self._base = state.gate = self._gate.value if self._gate is not None else 0
        self._warm.restart_prefetcher()  # closed since: started again with the workers
        self._plans = self._workers.plans()  # starts or wakes the workers
        if self._plans is None:
            return None
        return next(self._plans)

    def begin_epoch(self, epoch: int) -> None:
        """The training loop begins ``epoch``: let the workers plan its batches."""
        gate = self._gate
        if gate is not None and self._plans is not None and epoch > self._first_epoch:
            gate.open_to(self._base + epoch - self._first_epoch)

    def close(self) -> None:
        if self._owns_ahead:
            self._ahead.close()
        else:
            self._ahead.cancel()
        if self._plans is not None and self._gate is not None:
            self._gate.open_all()  # tasks held for epochs that will not come
        self._plans = None  # a non-persistent torch iterator stops its workers when dropped
        self._received.clear()
