"""A flipped byte in any tier is never served (issue 24): memory, disk (each form), in flight.

Each test fills a tier through the loader, flips one byte of one entry's image where the
tier keeps it (the shared segment in ``/dev/shm``, the LMDB file, the in-flight tier's
segment), and reads the next epoch: the damaged entry is not served (it is dropped,
counted ``corrupt`` in the tier's stats, and produced again), so the batches equal the
uncached run's. The raw-bytes tier has its own (``tests/sources/test_raw_checksum.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from loader_support import FIELDS, epoch_batches, same_batches

from mmcache import codec
from mmcache.cache import Cache
from mmcache.cluster.flight import open_flight
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.stores.disk import DiskStore
from mmcache.stores.memory import MemoryStore
from mmcache.testing.store_contract import flip_in_files
from mmcache.transforms.pipeline import Pipeline


@pytest.fixture
def ds(tiny_data: Path, small_pipeline: Pipeline) -> MultimodalDataset:
    return MultimodalDataset(tiny_data, pipeline=small_pipeline)


@pytest.fixture
def reference(ds: MultimodalDataset) -> list[list[dict[str, Any]]]:
    loader = DataLoader(ds, cache=None, batch_size=10, seed=3)
    return [epoch_batches(loader, e) for e in range(2)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_flipped_byte_in_the_memory_tier_is_never_served(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path, workers: int
) -> None:
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=workers)
        same_batches(epoch_batches(loader, 0), reference[0])
        memory = cache.memory
        assert isinstance(memory, MemoryStore)
        raw = memory.get(ds.key(5))
        assert raw is not None and codec.verify(raw)
        flip_in_files(memory.segment_paths(), raw[-600:-100])  # inside the image
        same_batches(
            epoch_batches(loader, 1), reference[1]
        )  # the flipped byte never reaches a batch
        e1 = loader.stats().epochs[1]
        assert e1.hits == 47 and e1.misses == 1
        assert cache.stats()["memory"].corrupt == 1
        again = memory.get(ds.key(5))
        assert again is not None and codec.verify(again)  # produced again, intact


def test_a_flipped_byte_is_never_returned_by_get(ds: MultimodalDataset, cache_root: Path) -> None:
    """The per-sample read (``Cache.get``, ``CachedDataset``) checks memory hits too."""
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        cache.put(ds.key(0), ds.produce(0))
        memory = cache.memory
        assert isinstance(memory, MemoryStore)
        raw = memory.get(ds.key(0))
        assert raw is not None
        flip_in_files(memory.segment_paths(), raw[-600:-100])
        assert cache.get(ds.key(0)) is None
        assert cache.stats()["memory"].corrupt == 1


def _stored(cache: Cache, key: bytes) -> bytes:
    """The bytes the disk tier keeps for ``key`` (its compact form, if any)."""
    disk = cache.disk
    assert isinstance(disk, DiskStore)
    stored = DiskStore.get(disk, key)  # the value as stored, bypassing a form's unpack
    assert stored is not None
    return stored


@pytest.mark.parametrize("form", ["raw", "zstd", "jpeg:90"])
def test_a_flipped_byte_in_each_disk_form_is_never_served(
    ds: MultimodalDataset,
    reference: list[list[dict[str, Any]]],
    cache_root: Path,
    tmp_path: Path,
    form: str,
) -> None:
    with Cache(cache_root, memory=0, disk="64MiB", disk_form=form) as cache:
        same_batches(
            epoch_batches(DataLoader(ds, cache=cache, batch_size=10, seed=3), 0), reference[0]
        )
        stored = _stored(cache, ds.key(5))
        folder = Path(cache.disk.path)  # type: ignore[union-attr]
    intact = tmp_path / "intact"
    shutil.copytree(cache_root, intact)  # the undamaged cache: what a lossy form serves
    flip_in_files([str(folder / "data.mdb")], stored[len(stored) // 2 - 200 :][:400])
    with Cache(intact, memory=0, disk="64MiB", disk_form=form) as cache:
        expected = epoch_batches(DataLoader(ds, cache=cache, batch_size=10, seed=3), 1)
    with Cache(cache_root, memory=0, disk="64MiB", disk_form=form) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3)
        got = epoch_batches(loader, 1)
        e = loader.stats().epochs[0]
        assert e.hits == 47 and e.misses == 1
        assert cache.stats()["disk"].corrupt == 1
    victim = ds.ids([5])[0]
    for batch, want, plain in zip(got, expected, reference[1], strict=True):
        for row, sid in enumerate(batch["id"]):
            # The damaged sample is produced again: the uncached pixels; the others are
            # what the intact cache serves (equal to the uncached run's for a lossless form).
            src = plain if sid == victim else want
            for name in FIELDS:
                assert torch.equal(batch[name][row], src[name][row]), (sid, name)
    if form != "jpeg:90":
        same_batches(got, reference[1])


def test_a_flipped_byte_in_the_in_flight_tier_is_never_served(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path
) -> None:
    """``scope="cluster"``'s in-flight tier (a memory store gathered after the memory
    tier, :mod:`mmcache.cluster.flight`) is checked like the memory tier."""
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        flight = open_flight(cache, entries=len(ds))  # removed with the cache root's tiers
        for i in range(len(ds)):  # every entry in flight, none in memory
            assert flight.put(ds.key(i), codec.encode(ds.produce(i)))
        raw = flight.get(ds.key(5))
        assert raw is not None
        flip_in_files(flight.segment_paths(), raw[-600:-100])
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3)
        same_batches(epoch_batches(loader, 1), reference[1])
        e = loader.stats().epochs[0]
        assert e.hits <= 47 and e.misses >= 1  # (without the exchange a batch may miss)
        assert flight.stats().corrupt == 1
