"""The loader's plan stream: workers plan the batches, across epochs with persistent
workers; the order, the batches and staleness checks stay exactly as without it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader, Distributed
from mmcache.loader.stream import MissWorkers
from mmcache.loader.tasks import WorkerPlanner
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert [x["id"] for x in a] == [y["id"] for y in b]
    for x, y in zip(a, b, strict=True):
        for name in ("image", "input_ids", "attention_mask"):
            assert torch.equal(x[name], y[name]), name


def _count_worker_starts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets a 1 each time a loader starts (or wakes) its miss workers."""
    started: list[int] = []
    real = MissWorkers.torch_loader

    def spy(self: MissWorkers) -> Any:
        started.append(1)
        return real(self)

    monkeypatch.setattr(MissWorkers, "torch_loader", spy)
    return started


@pytest.fixture
def own_data(tmp_path: Path) -> Path:
    """A dataset of its own: these tests rewrite image files."""
    return make_dataset(tmp_path / "data", 40, seed=5)


def test_epochs_skips_breaks_and_resumes_match_the_uncached_order(
    own_data: Path, small_pipeline: Pipeline, cache_root: Path
) -> None:
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    ref = DataLoader(ds, cache=None, batch_size=6, seed=2)
    want = {e: _epoch(ref, e) for e in (0, 1, 2, 3, 6, 7)}
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(
            ds, cache=cache, batch_size=6, seed=2, num_workers=2, persistent_workers=True
        )
        for e in (0, 1, 2):  # cold, then warm epochs run into each other
            _same(_epoch(loader, e), want[e])
        loader.set_epoch(6)  # skip ahead: the stream planned epoch 3 for nothing
        it = iter(loader)
        first = [next(it), next(it)]
        del it  # leave epoch 6 early
        rest = list(loader)  # and come back to it: the remaining batches
        _same(first + rest, want[6])
        _same(_epoch(loader, 7), want[7])
        _same(_epoch(loader, 3), want[3])  # back in time
        assert all(s.hit_rate == 1.0 for s in loader.stats().epochs[1:])
        loader.close()


def test_warm_epochs_are_planned_by_the_workers_not_here(
    own_data: Path, small_pipeline: Pipeline, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(
            ds, cache=cache, batch_size=8, seed=0, num_workers=2, persistent_workers=True
        )
        _epoch(loader, 0)
        _epoch(loader, 1)
        here: list[int] = []
        real = WorkerPlanner.plan

        def spy(self: Any, indices: np.ndarray, **kw: Any) -> Any:
            here.append(len(indices))  # only this process: the workers forked before
            return real(self, indices, **kw)

        monkeypatch.setattr(WorkerPlanner, "plan", spy)
        for e in (2, 3, 4):
            _epoch(loader, e)
        # Early plans of each next epoch were checked with a stat and kept.
        assert here == []
        loader.close()


def _rewrite(path: str, colour: tuple[int, int, int]) -> None:
    with Image.open(path) as im:
        size = im.size
    Image.new("RGB", size, colour).save(path, quality=95)


@pytest.mark.parametrize("position", ["first batch", "later batch"])
def test_an_image_rewritten_between_epochs_is_seen_in_the_next(
    own_data: Path, small_pipeline: Pipeline, cache_root: Path, position: str
) -> None:
    """The next epoch's first batches are planned before it begins (warm stream):
    the training process re-checks their files when it does, the rest wait at the gate."""
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    ref = DataLoader(ds, cache=None, batch_size=8, seed=1)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(
            ds, cache=cache, batch_size=8, seed=1, num_workers=2, persistent_workers=True
        )
        _epoch(loader, 0)
        _epoch(loader, 1)
        _epoch(loader, 2)  # warm: epoch 3's first batch is planned as this one ends
        order = loader._epoch_batches(3)
        index = int(order[0][3] if position == "first batch" else order[3][2])
        path = ds.records.image_path(index)
        assert path is not None
        _rewrite(path, (250, 10, 10))
        got = _epoch(loader, 3)
        want = _epoch(ref, 3)
        _same(got, want)  # the uncached loader reads the new file: so did we
        sample_id = ds.sample_id(index)
        batch = next(b for b in got if sample_id in b["id"])
        image = batch["image"][batch["id"].index(sample_id)]
        assert image[0].float().mean() > 200 and image[1].float().mean() < 60  # red now
        e3 = loader.stats().epochs[3]
        assert e3.misses == 1 and e3.hits == len(ds) - 1
        loader.close()


@pytest.mark.parametrize("memory", ["16MiB", "200KiB"])
def test_dropping_a_loader_stops_its_processes_at_once(
    own_data: Path, small_pipeline: Pipeline, cache_root: Path, memory: str
) -> None:
    """Dropping the loader stops its workers and its sweeper at once. With a budget that
    holds everything the epochs are swept; with one that does not (misses every epoch)
    the workers hold the next epoch's tasks at the gate, where they do not read torch's
    stop signal: the loader must open it first (else torch waits 5 s per worker)."""
    import gc
    import time

    import psutil

    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    before = {p.pid for p in psutil.Process().children()}
    with Cache(cache_root, memory=memory, temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=8, num_workers=2, persistent_workers=True)
        for e in range(3):
            _epoch(loader, e)
        swept = bool(loader._warm.guessed)
        assert swept == (memory == "16MiB")
        assert (loader._state.stop is None) == (memory != "16MiB")  # tasks held at the gate
        children = [p for p in psutil.Process().children() if p.pid not in before]
        assert len(children) == 3  # two workers and the sweeper
        t0 = time.monotonic()
        del loader
        gc.collect()
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive
        # torch's timeouts would take 10 s (5 s per worker at the gate); the stop itself
        # takes ~1 s quiet and took 4.1 s at a load of 12 on two cores: 8 s tells them apart
        assert time.monotonic() - t0 < 8


def test_non_persistent_workers_are_not_started_for_a_warm_epoch(
    own_data: Path, small_pipeline: Pipeline, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch starts non-persistent workers anew each epoch: a warm epoch is gathered in the
    training process instead (swept: the sweeper checks the files), and a miss found there
    is produced there too; the batches after it are planned as in an epoch not swept."""
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    ref = DataLoader(ds, cache=None, batch_size=8, seed=4)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=8, seed=4, num_workers=2)
        _same(_epoch(loader, 0), _epoch(ref, 0))
        started = _count_worker_starts(monkeypatch)
        _same(_epoch(loader, 1), _epoch(ref, 1))
        assert started == [] and loader.stats().epochs[1].hit_rate == 1.0
        # a miss in the middle of a warm epoch: produced here, no worker started for it
        order = loader._epoch_batches(2)
        assert cache.memory is not None
        cache.memory.discard(ds.key(int(order[2][1])), why="test")
        _same(_epoch(loader, 2), _epoch(ref, 2))
        assert started == []
        e2 = loader.stats().epochs[2]
        assert (e2.hits, e2.misses) == (len(ds) - 1, 1)
        # misses in every batch: the workers plan and produce them from the first one on
        for batch in loader._epoch_batches(3):
            cache.memory.discard(ds.key(int(batch[0])), why="test")
        _same(_epoch(loader, 3), _epoch(ref, 3))
        assert started == [1]
        e3 = loader.stats().epochs[3]
        assert e3.misses == len(loader._epoch_batches(3))


@pytest.mark.parametrize("sweeper_works", [True, False])
def test_a_swept_epoch_checks_every_file_with_or_without_the_sweeper(
    own_data: Path,
    small_pipeline: Pipeline,
    cache_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    sweeper_works: bool,
) -> None:
    """A warm epoch is swept: gathered from the keys learnt, served once each file is
    known unchanged this epoch, from the sweeper's results or (when it has not got
    there: here, never) from a stat in the training process. A file rewritten between
    two swept epochs is read again either way."""
    from mmcache.loader.warm_epoch.prefetch import StatPrefetcher

    if not sweeper_works:
        monkeypatch.setattr(StatPrefetcher, "request", lambda self, *a, **k: None)
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    ref = DataLoader(ds, cache=None, batch_size=6, seed=1)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(
            ds, cache=cache, batch_size=6, seed=1, num_workers=2, persistent_workers=True
        )
        for e in range(3):
            _same(_epoch(loader, e), _epoch(ref, e))
        assert 2 in loader._warm.guessed  # epoch 0 cold, 1 planned by the workers, 2 swept
        index = 7
        path = Path(ds.records.image_path(index) or "")
        Image.new("RGB", (80, 60), (0, 0, 255)).save(path, quality=95)
        got = _epoch(loader, 3)
        _same(got, _epoch(ref, 3))
        e3 = loader.stats().epochs[3]
        assert (e3.hits, e3.misses) == (len(ds) - 1, 1)
        loader.close()


def test_a_rank_sweeps_only_while_it_knows_the_keys_of_its_samples(
    own_data: Path, small_pipeline: Pipeline, cache_root: Path
) -> None:
    """With two ranks each epoch splits the samples anew: rank 0 meets samples whose keys it
    never learnt (rank 1 had them). A swept epoch hands such batches, and the rest of the
    epoch, back to the workers; the batches stay exactly those of the uncached loader."""
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    ref = DataLoader(
        ds, cache=None, batch_size=4, seed=3, distributed=Distributed(rank=0, world_size=2)
    )
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(
            ds,
            cache=cache,
            batch_size=4,
            seed=3,
            num_workers=2,
            persistent_workers=True,
            distributed=Distributed(rank=0, world_size=2),
        )
        for e in range(5):
            _same(_epoch(loader, e), _epoch(ref, e))
        seen = {int(i) for e in range(5) for b in loader._epoch_batches(e) for i in b}
        assert len(seen) > len(ds) // 2  # it did meet samples it had not planned before
        assert loader._warm.learnt.count() == len(seen)
        loader.close()


class _FakePlanner:
    """Plans here: a row is "in memory" unless its index is in ``missing``."""

    def __init__(self, missing: set[int]) -> None:
        self.missing = missing
        self.calls: list[tuple[str, int]] = []

    def plan(self, indices: np.ndarray, *, produce: bool = True, known: Any = None) -> Any:
        from mmcache.loader.tasks import BatchPlan

        self.calls.append(("plan" if not produce else "produced", int(indices[0])))
        hit = np.array([int(i) not in self.missing for i in indices])
        if not produce and not hit.all():
            return None
        keys = np.zeros((len(indices), 16), dtype=np.uint8)
        return BatchPlan(indices, keys, np.ones(len(indices), dtype=bool), [])

    def produced(self, indices: np.ndarray, *, at: tuple[int, int] | None = None) -> Any:
        return self.plan(indices)

    def reads_ahead(self) -> bool:
        return False

    def read_ahead(self, keys: np.ndarray) -> None:
        pass


class _FakeWarm:
    def __init__(self, guessed: set[int]) -> None:
        self.guessed = guessed
        self.learnt: list[int] = []

    def is_guessed(self, epoch: int) -> bool:
        return epoch in self.guessed

    def guess(self, epoch: int, indices: np.ndarray) -> Any:
        from mmcache.loader.tasks import BatchPlan

        if int(indices[0]) == 4:  # a key never learnt: the epoch is guessed no more
            self.guessed.discard(epoch)
            return None
        keys = np.zeros((len(indices), 16), dtype=np.uint8)
        hit = np.ones(len(indices), dtype=bool)
        return BatchPlan(indices, keys, hit, [], guessed=True)

    def learn(self, plan: Any) -> None:
        self.learnt.append(int(plan.indices[0]))

    def known_keys(self, indices: np.ndarray) -> None:
        return None  # nothing to read ahead

    def published(self, epoch: int, indices: np.ndarray) -> None:
        return None  # no prefetcher

    def stop_publishing(self, epoch: int) -> None:
        pass

    def restart_prefetcher(self) -> None:
        pass


class _FakeWorkers:
    """Non-persistent workers: their stream plans batches 2 and 3 of epoch 0."""

    gate = None
    persistent = False

    def __init__(self, *, can_start: bool = True) -> None:
        self.can_start = can_start
        self.unavailable = False

    def plans(self) -> Any:
        from mmcache.loader.tasks import PackedPlan

        if not self.can_start:  # (MissWorkers.plans: torch's queues found no room)
            self.unavailable = True
            return None
        hit = np.ones(2, dtype=bool).tobytes()
        return iter([[PackedPlan(bytes(32), hit, [])], [PackedPlan(bytes(32), hit, [])]])


def test_plan_modes_follow_their_documented_transitions() -> None:
    from mmcache.loader.stream import (
        BatchOrder,
        BatchPlanStream,
        EpochOrder,
        PlanMode,
        StreamState,
    )
    from mmcache.sampler import EpochSampler

    order = EpochOrder(BatchOrder(EpochSampler(8, shuffle=False), batch_size=2, drop_last=False))
    planner, warm = _FakePlanner(missing={4}), _FakeWarm(guessed=set())
    kwargs: dict[str, Any] = {"order": order, "state": StreamState(), "planner": planner}
    # LOCAL (non-persistent workers): planned here until the first miss, then WORKERS.
    stream = BatchPlanStream(0, 0, workers=_FakeWorkers(), warm=warm, **kwargs)  # type: ignore[arg-type]
    assert stream.mode(0) is PlanMode.LOCAL
    plans = [stream.fetch(0, j) for j in range(4)]
    assert stream.mode(0) is PlanMode.WORKERS
    assert planner.calls == [("plan", 0), ("plan", 2), ("plan", 4)]  # then the workers'
    assert [int(p.indices[0]) for p in plans] == [0, 2, 4, 6] and not any(p.guessed for p in plans)
    assert warm.learnt == [0, 2, 4, 6] and stream.cursor == (1, 0)
    # WORKERS that cannot be started (a full /dev/shm): PRODUCE from there on.
    planner, warm = _FakePlanner(missing={4}), _FakeWarm(guessed=set())
    kwargs["planner"] = planner
    workers = _FakeWorkers(can_start=False)
    stream = BatchPlanStream(0, 0, workers=workers, warm=warm, **kwargs)  # type: ignore[arg-type]
    plans = [stream.fetch(0, j) for j in range(4)]
    assert stream.mode(0) is PlanMode.PRODUCE and workers.unavailable
    assert planner.calls == [
        ("plan", 0),
        ("plan", 2),
        ("plan", 4),
        ("produced", 4),
        ("produced", 6),
    ]
    assert [int(p.indices[0]) for p in plans] == [0, 2, 4, 6]
    again = BatchPlanStream(1, 0, workers=workers, warm=warm, **kwargs)  # type: ignore[arg-type]
    assert again.mode(1) is PlanMode.PRODUCE
    # GUESS: from learnt keys until a key is unknown; then the base mode (PRODUCE here).
    planner.calls.clear()
    warm = _FakeWarm(guessed={0})
    stream = BatchPlanStream(0, 0, workers=None, warm=warm, **kwargs)  # type: ignore[arg-type]
    assert stream.mode(0) is PlanMode.GUESS
    plans = [stream.fetch(0, j) for j in range(4)]
    assert [p.guessed for p in plans] == [True, True, False, False]
    assert stream.mode(0) is PlanMode.PRODUCE
    assert planner.calls == [("produced", 4), ("produced", 6)]
    assert warm.learnt == [4, 6]  # guesses teach nothing


def test_a_new_loaders_first_epoch_over_a_filled_cache_starts_no_worker(
    own_data: Path, small_pipeline: Pipeline, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next run's first epoch (a new loader, persistent workers, nothing learnt) over a
    cache the first run filled is planned in the training process: no worker is forked and
    nobody waits for their first plans. A batch with a miss hands it and the rest of the
    epoch to the workers; the batches are those of the uncached loader either way."""
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    ref = DataLoader(ds, cache=None, batch_size=8, seed=6)
    started = _count_worker_starts(monkeypatch)
    kwargs: dict[str, Any] = {"batch_size": 8, "seed": 6, "num_workers": 2}
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        first = DataLoader(ds, cache=cache, persistent_workers=True, **kwargs)
        _same(_epoch(first, 0), _epoch(ref, 0))  # the first run fills the cache
        assert started == [1]
        first.close()
        started.clear()
        second = DataLoader(ds, cache=cache, persistent_workers=True, **kwargs)
        _same(_epoch(second, 0), _epoch(ref, 0))
        assert started == []
        e0 = second.stats().epochs[0]
        assert (e0.hits, e0.misses) == (len(ds), 0)
        _same(_epoch(second, 1), _epoch(ref, 1))  # then guessed from the keys it learnt
        assert started == [] and 1 in second._warm.guessed
        second.close()
        # A partly filled cache: the batches before the first miss planned here, then the
        # workers plan and produce the rest (and the misses are counted once each).
        order = ref._epoch_batches(2)
        assert cache.memory is not None
        gone = {int(order[1][3]), int(order[3][0]), int(order[3][5])}
        for index in gone:
            cache.memory.discard(ds.key(index), why="test")
        third = DataLoader(ds, cache=cache, persistent_workers=True, **kwargs)
        _same(_epoch(third, 2), _epoch(ref, 2))
        assert started == [1]
        e2 = third.stats().epochs[0]
        assert (e2.hits, e2.misses) == (len(ds) - len(gone), len(gone))
        _same(_epoch(third, 3), _epoch(ref, 3))
        third.close()


def test_a_new_loaders_first_epoch_takes_the_keys_the_prefetcher_published(
    own_data: Path, small_pipeline: Pipeline, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stat prefetcher keys a new loader's first epoch (planned in the training
    process until a miss) from the stamps it takes this epoch: a batch it has published
    is not keyed in the training process, and the batches, counters and the next
    (guessed) epoch are those of a loader that keyed every batch itself."""
    from mmcache.loader.warm_epoch import WarmEpochs

    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    ref = DataLoader(ds, cache=None, batch_size=8, seed=7)
    kwargs: dict[str, Any] = {"batch_size": 8, "seed": 7, "num_workers": 2}
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        with DataLoader(ds, cache=cache, persistent_workers=True, **kwargs) as first:
            _same(_epoch(first, 0), _epoch(ref, 0))
        second = DataLoader(ds, cache=cache, persistent_workers=True, **kwargs)
        real = WarmEpochs.published
        served: list[int] = []

        def waited(self: WarmEpochs, epoch: int, indices: np.ndarray) -> Any:
            """The real answer once the prefetcher has got there (it runs at idle priority)."""
            for _ in range(3000):
                got = real(self, epoch, indices)
                if got is not None:
                    served.append(len(indices))
                    return got
                time.sleep(0.01)
            return None

        monkeypatch.setattr(WarmEpochs, "published", waited)
        keyed: list[int] = []  # training-process key computations (after the fork)
        own = ds.key_rows
        want = _epoch(ref, 0)  # (keyed here: before the spy)
        monkeypatch.setattr(ds, "key_rows", lambda i, **kw: keyed.append(1) or own(i, **kw))
        _same(_epoch(second, 0), want)
        assert sum(served) == len(ds) and keyed == []
        e0 = second.stats().epochs[0]
        assert (e0.hits, e0.misses) == (len(ds), 0)
        assert second._warm.learnt.count() == len(ds)
        _same(_epoch(second, 1), _epoch(ref, 1))
        assert 1 in second._warm.guessed and second.stats().epochs[1].hits == len(ds)
        assert second._warm._keying_prefetcher() is not None
        second.close()
        # Closed and iterated again: the prefetcher forked now (threads running) keys nothing.
        _same(_epoch(second, 2), _epoch(ref, 2))
        assert second._warm._keying_prefetcher() is None
        second.close()
