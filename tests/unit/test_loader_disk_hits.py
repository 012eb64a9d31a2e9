"""Disk-tier hits gathered in the training process (issue 17): never through a worker,
bitwise the batches of an uncached run, verified, promoted and read ahead."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import codec
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.loader.tasks import WorkerPlanner
from mmcache.stores.disk import DiskStore
from mmcache.stores.gathering import TieredReader
from mmcache.transforms.pipeline import Pipeline

SAMPLE_BYTES = 3 * 64 * 64 + 2 * 16 * 4  # payload of one 64 px sample
FORK = mp.get_context("fork")


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"] and x["key"] == y["key"]
        for name in ("image", "input_ids", "attention_mask"):
            assert torch.equal(x[name], y[name]), name


@pytest.fixture
def ds(tiny_data: Path, small_pipeline: Pipeline) -> MultimodalDataset:
    return MultimodalDataset(tiny_data, pipeline=small_pipeline)


@pytest.fixture
def reference(ds: MultimodalDataset) -> list[list[dict[str, Any]]]:
    loader = DataLoader(ds, cache=None, batch_size=10, seed=3)
    return [_epoch(loader, e) for e in range(3)]


def _spy_workers(monkeypatch: pytest.MonkeyPatch, ds: MultimodalDataset) -> list[int]:
    """Every row a worker task looks up or produces (WorkerPlanner.run), and every produce."""
    ran: list[int] = []
    real_run = WorkerPlanner.run

    def spy(self: Any, index: int, key: bytes, **kw: Any) -> Any:
        ran.append(index)
        return real_run(self, index, key, **kw)

    monkeypatch.setattr(WorkerPlanner, "run", spy)
    original = ds.produce

    def counting(index: int) -> Any:
        ran.append(-1 - index)
        return original(index)

    monkeypatch.setattr(ds, "produce", counting)
    return ran


def _cache(root: Path, tiers: str, **kw: Any) -> Cache:
    if tiers == "disk":
        return Cache(root, memory=0, disk="64MiB", **kw)
    if tiers == "mixed":  # a memory tier of a quarter of the data, the disk tier of all
        return Cache(
            root, memory=12 * SAMPLE_BYTES + 4096, disk="64MiB", policy="keep", temporary=True, **kw
        )
    return Cache(root, memory="16MiB", disk="64MiB", temporary=True, **kw)


@pytest.mark.parametrize("tiers", ["memory", "disk", "mixed"])
def test_hits_of_every_tier_skip_the_workers_and_give_the_uncached_batches(
    ds: MultimodalDataset,
    reference: list[list[dict[str, Any]]],
    cache_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    tiers: str,
) -> None:
    cache = _cache(cache_root, tiers)
    try:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=0)
        _same(_epoch(loader, 0), reference[0])
        ran = _spy_workers(monkeypatch, ds)
        _same(_epoch(loader, 1), reference[1])
        assert ran == []  # no row was looked up or produced by a worker task
        e1 = loader.stats().epochs[1]
        assert e1.hits == 48 and e1.misses == 0
        if tiers == "mixed":
            assert isinstance(cache.reader, TieredReader)
            assert e1.tier_hits["memory"] == 12 and e1.tier_hits["disk"] == 36
        else:
            assert e1.tier_hits == {tiers: 48}
    finally:
        cache.close()
    # Two workers: the same batches (their plans name the disk hits; none is sent).
    monkeypatch.undo()
    cache = _cache(cache_root, tiers)
    try:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2)
        _same(_epoch(loader, 2), reference[2])
        assert loader.stats().epochs[0].misses == 0
    finally:
        cache.close()


def _flip_in_file(path: Path, needle: bytes) -> None:
    data = path.read_bytes()
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0
    with open(path, "r+b") as f:
        f.seek(at + len(needle) // 2)
        byte = f.read(1)
        f.seek(at + len(needle) // 2)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_disk_entry_is_discarded_and_produced_again_never_served(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path, workers: int
) -> None:
    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=workers)
        _same(_epoch(loader, 0), reference[0])
    victim = ds.key(5)
    with DiskStore(cache_root / "disk", capacity="64MiB") as disk:
        raw = disk.get(victim)
    assert raw is not None and codec.verify(raw)
    _flip_in_file(cache_root / "disk" / "data.mdb", raw[-600:-100])  # inside the image
    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=workers)
        _same(_epoch(loader, 1), reference[1])  # the flipped byte never reaches a batch
        e = loader.stats().epochs[0]
        assert e.hits == 47 and e.misses + e.late_misses >= 1
        assert cache.stats()["disk"].corrupt == 1
    with DiskStore(cache_root / "disk", capacity="64MiB") as disk:
        fresh = disk.get(victim)
    assert fresh is not None and codec.verify(fresh)  # produced again and written back


def test_a_new_run_promotes_disk_hits_into_free_memory_in_order(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path
) -> None:
    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        _epoch(DataLoader(ds, cache=cache, batch_size=10, seed=3), 0)
    budget = 24 * (SAMPLE_BYTES + 256)
    cache = Cache(cache_root, memory=budget, disk="64MiB", policy="keep", temporary=True)
    try:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2)
        _same(_epoch(loader, 1), reference[1])
        assert cache.memory is not None
        held = cache.memory.nbytes()
        assert 0 < held <= budget
        # The first samples of the epoch's order were promoted (they came first).
        first = [bytes.fromhex(k) for k in reference[1][0]["key"]]
        assert all(cache.memory.contains(k) for k in first)
        _same(_epoch(loader, 2), reference[2])
        e2 = loader.stats().epochs[1]
        assert e2.misses == 0 and e2.tier_hits["memory"] >= 20 and e2.tier_hits["disk"] >= 1
        assert cache.memory.nbytes() <= budget
    finally:
        cache.close()


def _drop_page_cache(path: Path) -> None:
    """Drop ``path``'s pages: unmap them from this process (the page cache keeps a page a
    process maps) and turn off the kernel's read-ahead on faults in the mapping
    (``MADV_RANDOM``: a lookup then reads only the pages it touches, whatever the
    device's ``read_ahead_kb``), then ``posix_fadvise(DONTNEED)``."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(real):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED)
                libc.madvise(lo, hi - lo, mmap.MADV_RANDOM)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident(path: Path) -> int:
    """Bytes of ``path`` in the page cache (``mincore`` over a fresh mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    vec = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, np.uint8)
        assert libc.mincore(view.ctypes.data, size, vec.ctypes.data) == 0
        del view
    return int((vec & 1).sum()) * mmap.PAGESIZE


def test_prefetch_brings_the_entries_into_the_page_cache(cache_root: Path) -> None:
    path = cache_root / "d" / "data.mdb"
    with DiskStore(cache_root / "d", capacity="64MiB") as disk:
        keys = [bytes([i + 1]) * 16 for i in range(8)]
        raws = [codec.encode({"x": np.full(2_000_000, k[0], np.uint8)}) for k in keys]
        for k, raw in zip(keys, raws, strict=True):
            disk.put(k, raw)
        arr = np.frombuffer(b"".join(keys), np.uint8).reshape(8, 16)
        assert disk.prefetch(arr) == sum(len(r) for r in raws)  # the bytes of those found
        _drop_page_cache(path)
        if _resident(path) > 1_000_000:
            pytest.skip("this file system keeps the pages (tmpfs): nothing to read ahead")
        disk.prefetch(arr[:4])
        assert _resident(path) >= 4 * 2_000_000  # read by the time it returns
        assert _resident(path) < 8 * 2_000_000  # only those asked for (MADV_RANDOM)
        assert disk.prefetch([b"\xff" * 16]) == 0  # absent: nothing read


def _gather_forever(path: str, keys: list[bytes], stop: Any) -> None:
    disk = DiskStore(path, capacity="4MiB")
    disk.enable_gather(codec.verify)
    out = np.empty((len(keys), 64), np.uint8)
    while not stop.is_set():
        disk.gather_ranges(keys, [(0, 64, out)])
        time.sleep(0.001)


def test_no_read_transaction_outlives_a_gather_the_file_stops_growing(tmp_path: Path) -> None:
    path = str(tmp_path / "d")
    size = 60_000
    disk = DiskStore(path, capacity=40 * size, policy="lru")
    rng = np.random.default_rng(0)

    def put_round(r: int) -> list[bytes]:
        keys = [rng.bytes(16) for _ in range(20)]
        for k in keys:
            disk.put(k, codec.encode({"x": np.full(size - 200, r, np.uint8)}))
        return keys

    keys = put_round(0) + put_round(1)
    stop = FORK.Event()
    reader = FORK.Process(target=_gather_forever, args=(path, keys[:8], stop))
    reader.start()
    try:
        sizes = []
        for r in range(2, 22):  # 20 rounds of puts that evict as many entries
            put_round(r)
            sizes.append(os.path.getsize(os.path.join(path, "data.mdb")))
        assert reader.is_alive()
        # Pages freed by evictions are reused: the file stops growing after the first
        # rounds (a reader transaction held for the whole loop would pin every freed
        # page, and the file would grow by a round's bytes each round).
        assert sizes[-1] <= sizes[4] + 2 * 20 * size, sizes
        assert sizes[-1] < 4 * 40 * size
    finally:
        stop.set()
        reader.join(10)
        disk.close()


def _promote_forever(root: str, keys: list[bytes], budget: int) -> None:
    cache = Cache(root, memory=budget, disk="64MiB", policy="lru")
    reader = cache.reader
    assert isinstance(reader, TieredReader)
    while True:
        for k in reader.promotable(np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 16)):
            cache.lookup(k)
        if cache.memory is not None:
            for k in keys[::2]:
                cache.memory.delete(k)  # room again: promotion never ends


def test_kill_during_promotion_leaves_both_tiers_consistent(
    ds: MultimodalDataset, cache_root: Path
) -> None:
    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        _epoch(DataLoader(ds, cache=cache, batch_size=10, seed=3), 0)
    keys = [ds.key(i) for i in range(len(ds))]
    budget = 24 * (SAMPLE_BYTES + 256)
    rng = np.random.default_rng(7)
    for _ in range(5):
        child = FORK.Process(target=_promote_forever, args=(str(cache_root), keys, budget))
        child.start()
        time.sleep(float(rng.uniform(0.3, 0.8)))
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        with Cache(cache_root, memory=budget, disk="64MiB", policy="lru") as cache:
            assert cache.memory is not None and cache.disk is not None
            cache.memory.gc()
            assert cache.memory.check() == []  # type: ignore[attr-defined]
            assert cache.memory.verify(codec.verify) == []  # type: ignore[attr-defined]
            assert cache.disk.verify(codec.verify) == []  # type: ignore[attr-defined]
            assert all(cache.disk.contains(k) for k in keys)  # promotion never moves off disk
    cache = Cache(cache_root, memory=budget, disk="64MiB", policy="lru")
    if cache.memory is not None:
        cache.memory.unlink()  # type: ignore[attr-defined]
    cache.close()


def test_checksum_matches_catches_every_flipped_byte() -> None:
    raw = codec.encode({"image": np.arange(3 * 8 * 8, dtype=np.uint8).reshape(3, 8, 8)})
    assert codec.checksum_matches(raw)
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        assert not codec.checksum_matches(bytes(bad)), i
    assert not codec.checksum_matches(raw[:-1]) and not codec.checksum_matches(raw[:10])
