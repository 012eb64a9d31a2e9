"""mmcache.DataLoader: same batches whatever the cache does; hits skip the workers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError, SampleError
from mmcache.loader import DataLoader, Distributed
from mmcache.transforms.pipeline import Pipeline

SAMPLE_BYTES = 3 * 64 * 64 + 2 * 16 * 4  # payload of one 64 px sample


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"]
        assert x["key"] == y["key"]
        for name in ("image", "input_ids", "attention_mask"):
            assert x[name].dtype == y[name].dtype
            assert torch.equal(x[name], y[name]), name


@pytest.fixture
def ds(tiny_data: Path, small_pipeline: Pipeline) -> MultimodalDataset:
    return MultimodalDataset(tiny_data, pipeline=small_pipeline)


@pytest.fixture
def reference(ds: MultimodalDataset) -> list[list[dict[str, Any]]]:
    """Two epochs without a cache: the batches every configuration must reproduce."""
    loader = DataLoader(ds, cache=None, batch_size=10, seed=3)
    return [_epoch(loader, 0), _epoch(loader, 1)]


def test_batch_shape_and_len(ds: MultimodalDataset, reference: list[list[dict[str, Any]]]) -> None:
    batches = reference[0]
    assert len(batches) == 5 == len(DataLoader(ds, cache=None, batch_size=10))
    assert len(DataLoader(ds, cache=None, batch_size=10, drop_last=True)) == 4
    b = batches[0]
    assert b["image"].shape == (10, 3, 64, 64) and b["image"].dtype == torch.uint8
    assert b["input_ids"].shape == (10, 16) and len(b["id"]) == len(b["key"]) == 10
    assert sorted(i for batch in batches for i in batch["id"]) == sorted(
        ds.sample_id(i) for i in range(len(ds))
    )
    # the order is a fresh permutation each epoch
    assert [i for x in reference[0] for i in x["id"]] != [i for x in reference[1] for i in x["id"]]


@pytest.mark.parametrize("workers", [0, 2])
def test_cold_warm_and_partly_warm_give_identical_batches(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path, workers: int
) -> None:
    cache = Cache(cache_root, memory=48 * 200 * 1024, disk=None, temporary=True)
    loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=workers)
    _same(_epoch(loader, 0), reference[0])  # cold
    _same(_epoch(loader, 1), reference[1])  # warm
    stats = loader.stats()
    assert stats.epochs[0].misses == 48 and stats.epochs[0].hits == 0
    assert stats.epochs[1].hits == 48 and stats.epochs[1].misses == 0
    assert stats.epochs[1].tier_hits == {"memory": 48}
    assert stats.epochs[1].samples_per_s > 0 and stats.epochs[1].stall_s >= 0
    cache.close()
    # partly warm: a budget of about half the data, a fresh loader
    half = Cache(
        cache_root.parent / "half", memory=24 * SAMPLE_BYTES + 4096, temporary=True, policy="keep"
    )
    try:
        loader = DataLoader(ds, cache=half, batch_size=10, seed=3, num_workers=workers)
        _same(_epoch(loader, 0), reference[0])
        _same(_epoch(loader, 1), reference[1])
        e1 = loader.stats().epochs[1]
        assert 0 < e1.hits < 48 and e1.hits + e1.misses == 48
    finally:
        half.memory.unlink() if half.memory is not None else None  # type: ignore[attr-defined]
        half.close()


def test_hits_do_not_travel_through_workers(
    ds: MultimodalDataset, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Cache(cache_root, memory="16MiB", temporary=True)
    loader = DataLoader(ds, cache=cache, batch_size=8, num_workers=0)
    _epoch(loader, 0)
    calls: list[int] = []
    original = ds.produce

    def counting(index: int) -> Any:
        calls.append(index)
        return original(index)

    monkeypatch.setattr(ds, "produce", counting)
    from mmcache.loader.tasks import WorkerPlanner

    ran: list[int] = []
    real_run = WorkerPlanner.run

    def spy(self: Any, index: int, key: bytes) -> Any:
        ran.append(index)
        return real_run(self, index, key)

    monkeypatch.setattr(WorkerPlanner, "run", spy)
    _epoch(loader, 1)
    assert calls == [] and ran == []
    cache.close()


def test_disk_tier_serves_a_new_run(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path
) -> None:
    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2)
        _same(_epoch(loader, 0), reference[0])
    with Cache(cache_root, memory=0, disk="64MiB") as cache:  # a new run
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2)
        _same(_epoch(loader, 1), reference[1])
        e = loader.stats().epochs[0]
        assert e.tier_hits == {"disk": 48} and e.misses == 0


@pytest.mark.parametrize("resume_workers", [0, 2])
def test_resume_mid_epoch_yields_exactly_the_rest(
    ds: MultimodalDataset,
    reference: list[list[dict[str, Any]]],
    cache_root: Path,
    resume_workers: int,
) -> None:
    cache = Cache(cache_root, memory="16MiB", temporary=True)
    loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2)
    loader.set_epoch(0)
    it = iter(loader)
    first = [next(it), next(it)]
    state = loader.state_dict()
    del it
    assert state["epoch"] == 0 and state["position"] == 2
    fresh = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=resume_workers)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    fresh.set_epoch(0)  # the usual loop calls set_epoch; the position is kept
    rest = list(fresh)
    _same(first + rest, reference[0])
    _same(list(fresh), reference[1])  # then the next epoch, as if never interrupted
    cache.close()


def test_resume_refuses_a_different_order(ds: MultimodalDataset) -> None:
    state = DataLoader(ds, cache=None, batch_size=10, seed=3).state_dict()
    with pytest.raises(ConfigError, match="seed"):
        DataLoader(ds, cache=None, batch_size=10, seed=4).load_state_dict(state)


def test_ranks_take_disjoint_parts(ds: MultimodalDataset) -> None:
    parts = []
    for rank in range(3):
        loader = DataLoader(
            ds,
            cache=None,
            batch_size=4,
            drop_last=True,
            distributed=Distributed(rank=rank, world_size=3),
        )
        parts.append([i for b in _epoch(loader, 0) for i in b["id"]])
    assert all(len(p) == 16 for p in parts)
    assert len(set(parts[0]) | set(parts[1]) | set(parts[2])) == 48


def _bad_manifest(tmp_path: Path, tiny_data: Path) -> Path:
    recs = [json.loads(x) for x in tiny_data.read_text().splitlines()[:12]]
    for r in recs:
        r["image_path"] = str(tiny_data.parent / r["image_path"])
    recs[3]["image_path"] = str(tmp_path / "missing.jpg")
    (tmp_path / "empty.jpg").write_bytes(b"")
    recs[7]["image_path"] = str(tmp_path / "empty.jpg")
    m = tmp_path / "bad.jsonl"
    m.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return m


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_drops_bad_samples_every_good_one_once(
    tmp_path: Path, tiny_data: Path, small_pipeline: Pipeline, cache_root: Path, workers: int
) -> None:
    ds = MultimodalDataset(
        _bad_manifest(tmp_path, tiny_data), pipeline=small_pipeline, on_error="skip"
    )
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=5, num_workers=workers)
        for epoch in range(2):
            ids = [i for b in _epoch(loader, epoch) for i in b["id"]]
            assert len(ids) == 10 == len(set(ids))
        assert {r.sample_id for r in ds.rejects()} == {ds.sample_id(3), ds.sample_id(7)}
        assert loader.stats().epochs[0].rejects == 2


def test_raise_names_the_sample(tmp_path: Path, tiny_data: Path, small_pipeline: Pipeline) -> None:
    ds = MultimodalDataset(_bad_manifest(tmp_path, tiny_data), pipeline=small_pipeline)
    loader = DataLoader(ds, cache=None, batch_size=12, shuffle=False, num_workers=2)
    with pytest.raises(SampleError) as info:
        list(loader)
    assert info.value.sample_id == ds.sample_id(3)


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_persistent_workers_and_start_methods(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path, ctx: str
) -> None:
    seen: list[int] = []

    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(
            ds,
            cache=cache,
            batch_size=10,
            seed=3,
            num_workers=2,
            persistent_workers=True,
            multiprocessing_context=ctx,
            worker_init_fn=_noop_init,
        )
        _same(_epoch(loader, 0), reference[0])
        _same(_epoch(loader, 1), reference[1])
        ref2 = _epoch(DataLoader(ds, cache=None, batch_size=10, seed=3), 2)
        _same(_epoch(loader, 2), ref2)  # warm into warm: an early plan, then the gate
        _same(_epoch(loader, 0), reference[0])  # back in time: a new plan stream
        del loader
    assert seen == []


def _noop_init(worker_id: int) -> None:
    torch.manual_seed(worker_id)


def _iter_batches(loader: DataLoader) -> Iterator[dict[str, Any]]:
    yield from loader


def test_epoch_callback_and_low_hit_rate_warning(
    ds: MultimodalDataset, cache_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[dict[str, float]] = []
    cache = Cache(cache_root, memory=24 * SAMPLE_BYTES, policy="lru", temporary=True)
    try:
        loader = DataLoader(ds, cache=cache, batch_size=8, seed=1, on_epoch_end=seen.append)
        with caplog.at_level("WARNING", logger="mmcache.loader"):
            for epoch in range(3):
                _epoch(loader, epoch)
        assert [d["epoch"] for d in seen] == [0.0, 1.0, 2.0]
        assert {"samples_per_s", "hit_rate", "hit_rate/memory", "stall_s"} <= set(seen[0])
        warnings = [r for r in caplog.records if "far below" in r.getMessage()]
        assert len(warnings) == 1 and "lru" in warnings[0].getMessage()  # once, with a reason
    finally:
        loader.close()
        cache.close()


@pytest.mark.parametrize("partial", [False, True])
def test_foreign_layout_or_expired_entry_is_never_served(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path, partial: bool
) -> None:
    import numpy as np

    from mmcache import codec

    clock = [1000.0]
    cache = Cache(cache_root, memory="16MiB", ttl=100, clock=lambda: clock[0], temporary=True)
    try:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3)
        _same(_epoch(loader, 0), reference[0])
        assert cache.memory is not None
        # Forge: same key, another layout (a smaller image); and one entry that expires.
        forged = codec.encode(
            {
                "input_ids": np.zeros(16, np.int32),
                "attention_mask": np.zeros(16, np.int32),
                "image": np.zeros((3, 8, 8), np.uint8),
            },
            ctime=clock[0],
        )
        victims = [ds.key(i) for i in range(0, 48, 7)]
        for k in victims:
            cache.memory.put(k, forged)
        if partial:  # a batch with planned misses too
            cache.memory.delete(ds.key(1))
        clock[0] += 50
        _same(_epoch(loader, 1), reference[1])
        e1 = loader.stats().epochs[1]
        rewritten = len(victims) + int(partial)  # discarded at t=1050 and produced again
        assert e1.misses == rewritten and e1.hits == 48 - rewritten
        assert cache.stats()["memory"].corrupt >= len(victims)
        clock[0] += 80  # every entry written at t=1000 is now expired, not those of t=1050
        _same(_epoch(loader, 2), _epoch(DataLoader(ds, cache=None, batch_size=10, seed=3), 2))
        assert loader.stats().epochs[2].hits == rewritten
    finally:
        cache.close()


def test_recycled_batch_buffers_never_overwrite_what_the_loop_holds(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path
) -> None:
    """Batch tensors are reused only when nothing refers to them any more: views and
    numpy arrays taken from a batch keep their content across later batches."""
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3)
        _epoch(loader, 0)
        views, arrays, ids = [], [], []
        loader.set_epoch(1)
        for i, batch in enumerate(loader):  # warm: every batch from recycled buffers
            views.append(batch["image"][1])
            if i % 2:
                arrays.append(batch["input_ids"].numpy())
            ids.append(batch["id"])
        for i, (view, ref) in enumerate(zip(views, reference[1], strict=True)):
            assert ids[i] == ref["id"]
            assert torch.equal(view, ref["image"][1])
        for arr, ref in zip(arrays, reference[1][1::2], strict=True):
            assert (arr == ref["input_ids"].numpy()).all()
        # and buffers are really recycled when nothing is held
        loader.set_epoch(2)
        seen = {batch["image"].data_ptr() for batch in loader}
        assert len(seen) < len(loader)
        loader.close()


@pytest.fixture
def ds17(tmp_path: Path, tiny_data: Path, small_pipeline: Pipeline) -> MultimodalDataset:
    recs = [json.loads(line) for line in tiny_data.read_text().splitlines()[:17]]
    for r in recs:
        r["image_path"] = str(tiny_data.parent / r["image_path"])
    path = tmp_path / "m17.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return MultimodalDataset(path, pipeline=small_pipeline)


def _torch_batches(n: int, world: int, rank: int, batch: int, *, trim: bool) -> int:
    """Batches per epoch of torch's DataLoader(drop_last=True) over a DistributedSampler."""
    sampler = torch.utils.data.DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=False, drop_last=trim
    )
    return len(
        torch.utils.data.DataLoader(range(n), sampler=sampler, batch_size=batch, drop_last=True)
    )


@pytest.mark.parametrize(("world", "batch"), [(5, 4), (3, 2)])
@pytest.mark.parametrize("trim", [False, True])
def test_drop_last_drops_each_ranks_partial_batch_like_torch(
    ds17: MultimodalDataset, world: int, batch: int, trim: bool
) -> None:
    seen: list[str] = []
    for rank in range(world):
        loader = DataLoader(
            ds17,
            cache=None,
            batch_size=batch,
            drop_last=True,
            distributed=Distributed(rank=rank, world_size=world, drop_last=trim),
        )
        batches = _epoch(loader, 0)
        assert len(batches) == len(loader) == _torch_batches(17, world, rank, batch, trim=trim)
        assert all(len(b["id"]) == batch for b in batches)
        seen += [i for b in batches for i in b["id"]]
    if not trim:  # padded across ranks, as DistributedSampler's default: every sample seen
        assert len(set(seen)) == 17 and len(seen) > 0
    else:
        assert len(set(seen)) == len(seen)  # trimmed: disjoint


def test_an_empty_epoch_is_warned_about(
    ds17: MultimodalDataset, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="mmcache.loader"):
        part = Distributed(rank=0, world_size=5)
        loader = DataLoader(ds17, cache=None, batch_size=8, drop_last=True, distributed=part)
    assert len(loader) == 0 and _epoch(loader, 0) == []
    assert any("no batches" in r.getMessage() for r in caplog.records)


def test_rank_and_world_size_come_together_without_torch_distributed(
    ds17: MultimodalDataset,
) -> None:
    assert not torch.distributed.is_available() or not torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="rank"):
        DataLoader(ds17, cache=None, batch_size=4, distributed=Distributed(world_size=2))
    with pytest.raises(ConfigError, match="world_size"):
        DataLoader(ds17, cache=None, batch_size=4, distributed=Distributed(rank=1))
    assert len(DataLoader(ds17, cache=None, batch_size=4)) == 5  # neither: one process
