"""The disk tier's batch gather (issue 17): the copy-then-check gather equals the
key-by-key reads (a corrupt entry in the middle of a batch included), the warm
read-ahead reads on several threads, and guessed epochs promote into free memory."""

from __future__ import annotations

import cProfile
import os
import threading
import time
from pathlib import Path
from types import CodeType
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import codec
from mmcache.cache import Cache, check_reads
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.loader.batchlayout import byte_ranges
from mmcache.loader.readahead import ReadAhead
from mmcache.loader.tasks import WorkerPlanner
from mmcache.loader.warm_epoch import WarmEpochs
from mmcache.stores.disk import DiskStore
from mmcache.stores.gathering import TieredReader
from mmcache.transforms.pipeline import Pipeline

N = 24


def _samples() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [
        {
            "image": rng.integers(0, 256, (3, 40, 40), dtype=np.uint8),
            "ids": rng.integers(0, 1000, 16).astype(np.int64),
            "mask": np.ones(16, np.int64),
        }
        for _ in range(N)
    ]


def _keys() -> list[bytes]:
    return [bytes([i + 1]) * 16 for i in range(N)]


def _flip(raw: bytes, at: int) -> bytes:
    bad = bytearray(raw)
    bad[at] ^= 0x21
    return bytes(bad)


def _store(path: Path, raws: list[bytes], *, copied: bool, rows: bool = False) -> DiskStore:
    disk = DiskStore(path, capacity="16MiB")
    for k, raw in zip(_keys(), raws, strict=True):
        disk.put(k, raw)
    if copied:
        disk.enable_gather(
            codec.checksum_matches,
            copied=codec.checksum_matches_copied,
            rows=codec.checksums_match_rows if rows else None,
        )
    else:
        disk.enable_gather(codec.checksum_matches)
    return disk


@pytest.mark.parametrize("ranges", ["layout", "image-only", "whole"])
def test_copy_then_check_gather_equals_key_by_key_reads_with_corrupt_entries_mid_batch(
    tmp_path: Path, ranges: str
) -> None:
    samples = _samples()
    raws = [codec.encode(s, ctime=1.0, cost=0.5) for s in samples]
    layout = codec.read_header(raws[0])
    image = next(f for f in layout.fields if f.name == "image")
    ids = next(f for f in layout.fields if f.name == "ids")
    # Damage in the image (copied), in the token ids (not copied by "image-only"), and
    # in the stored checksum itself: each entry must be refused by both gathers.
    raws[7] = _flip(raws[7], image.offset + 100)
    raws[11] = _flip(raws[11], ids.offset + 3)
    raws[15] = _flip(raws[15], codec.HEADER["checksum"].offset + 2)
    bad = {7, 11, 15}
    if ranges == "layout":
        spans = [(a, b - a) for a, b, _ in byte_ranges(layout).segments]
    elif ranges == "image-only":
        spans = [(image.offset, image.nbytes)]
    else:
        spans = [(0, layout.length)]
    keys = np.frombuffer(b"".join(_keys()), np.uint8).reshape(N, 16)
    rows = np.arange(N, dtype=np.int64)[::-1].copy()  # into rows in another order
    results = []
    for copied, batch in ((True, True), (True, False), (False, False)):
        disk = _store(tmp_path / f"d{copied}{batch}", raws, copied=copied, rows=batch)
        try:
            targets = [(off, n, np.full((N, n), 0xEE, np.uint8)) for off, n in spans]
            found = disk.gather_rows(keys, rows, targets)
            assert disk.stats().corrupt == 3
            assert not any(disk.contains(_keys()[i]) for i in bad)  # discarded
            results.append((found, [t[2] for t in targets]))
        finally:
            disk.close()
    (found_a, outs_a), *others = results
    for found_b, _ in others:
        assert found_a.tolist() == found_b.tolist() == [i not in bad for i in range(N)]
    for i, (off, n) in enumerate(spans):
        for j in range(N):
            if j in bad:
                continue
            want = np.frombuffer(raws[j], np.uint8)[off : off + n]
            for _, outs in results:
                assert np.array_equal(outs[i][rows[j]], want)
    # The served bytes decode to the samples: the copies are the entries' bytes.
    if ranges == "whole":
        for j in (0, 12, N - 1):
            back = codec.decode(bytes(outs_a[0][rows[j]]))
            assert np.array_equal(back["image"], samples[j]["image"])


def test_a_tiled_batch_is_checked_with_one_python_call_per_entry(tmp_path: Path) -> None:
    """Entries the gathered ranges tile (the loader's layout) are checked as one batch:
    one Python-level call per entry (its copy) beside a fixed number per batch; the
    entry-by-entry check made three or more (the check, its views and pieces), paid on
    every disk hit of a warm epoch. A count of calls is the same busy or quiet."""
    raws = [codec.encode(s, ctime=1.0, cost=0.5) for s in _samples()]
    layout = codec.read_header(raws[0])
    spans = [(a, b - a) for a, b, _ in byte_ranges(layout).segments]
    disk = DiskStore(tmp_path / "d", capacity="16MiB")
    keys = [os.urandom(16) for _ in range(2 * N)]
    for k, raw in zip(keys, raws + raws, strict=True):
        disk.put(k, raw)
    check_reads(disk)  # as the cache installs it

    def calls(n: int) -> int:
        targets = [(off, m, np.empty((n, m), np.uint8)) for off, m in spans]
        rows = np.arange(n, dtype=np.int64)
        assert disk.gather_rows(keys[:n], rows, targets).all()
        prof = cProfile.Profile()
        found = prof.runcall(disk.gather_rows, keys[:n], rows, targets)
        # Calls of Python functions (not of C ones: numpy's copies, LMDB's gets).
        count = sum(e.callcount for e in prof.getstats() if isinstance(e.code, CodeType))
        assert found.all()
        for j in range(n):  # what is served is the entry's bytes
            for off, m, out in targets:
                assert bytes(out[j]) == raws[j % N][off : off + m]
        return count

    try:
        per_entry = (calls(2 * N) - calls(N)) / N
    finally:
        disk.close()
    assert per_entry < 1.5, per_entry


def test_checksum_over_copies_matches_checksum_for_every_split_and_every_flip() -> None:
    raw = codec.encode({"x": np.arange(300, dtype=np.uint8), "y": np.arange(7, dtype=np.int64)})
    arr = np.frombuffer(raw, np.uint8)
    splits = [[], [(0, len(raw))], [(0, 8)], [(10, 20)], [(0, 30), (64, 200)], [(100, len(raw))]]
    for spans in splits:
        copies = [(a, arr[a:b].copy()) for a, b in spans]
        assert codec.checksum_matches_copied(raw, copies)
        for i in range(len(raw)):
            bad = _flip(raw, i)
            # Each byte is read from the copy where there is one, else from the entry.
            covered = any(a <= i < b for a, b in spans)
            in_sum = codec.HEADER["checksum"].offset <= i < codec.HEADER["length"].stop
            want = codec.checksum_matches(bad) if not covered or in_sum else True
            assert codec.checksum_matches_copied(bad, copies) == want, (spans, i)
            if not covered:
                assert not codec.checksum_matches_copied(bad, copies)


def test_read_ahead_reads_chunks_on_several_threads_at_once_in_order() -> None:
    """Entries are read from the device by as many threads at once (queue depth): a
    chunk waits at a barrier that only ``threads`` concurrent calls pass."""
    barrier = threading.Barrier(4, timeout=10)
    seen: list[int] = []
    lock = threading.Lock()

    def fn(keys: np.ndarray) -> None:
        with lock:
            seen.append(int(keys[0, 0]))
        barrier.wait()

    ahead = ReadAhead(fn, threads=4, chunk=16)
    keys = np.repeat(np.arange(64, dtype=np.uint8)[:, None], 16, axis=1)
    try:
        ahead.submit(keys)  # four chunks of 16 keys: all four run at once, or time out
        deadline = time.monotonic() + 10
        while len(seen) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(seen) == [0, 16, 32, 48] and not barrier.broken
    finally:
        ahead.close()


def test_prefetch_reads_the_entries_pages_and_counts_their_bytes(tmp_path: Path) -> None:
    raws = [codec.encode(s) for s in _samples()]
    disk = _store(tmp_path / "d", raws, copied=True)
    keys = np.frombuffer(b"".join(_keys()), np.uint8).reshape(N, 16)
    try:
        assert disk.prefetch(keys[:5]) == sum(len(r) for r in raws[:5])
        assert disk.prefetch([b"\x00" * 16]) == 0
    finally:
        disk.close()


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["key"] == y["key"]
        for name in ("image", "input_ids", "attention_mask"):
            assert torch.equal(x[name], y[name]), name


@pytest.mark.parametrize("read_ahead", [True, False])
def test_read_ahead_on_or_off_gives_the_uncached_batches(
    tiny_data: Path,
    small_pipeline: Pipeline,
    cache_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    read_ahead: bool,
) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    reference = [_epoch(DataLoader(ds, cache=None, batch_size=10, seed=3), e) for e in range(4)]
    if not read_ahead:
        monkeypatch.setattr(WorkerPlanner, "reads_ahead", lambda self: False)
        monkeypatch.setattr(WorkerPlanner, "ahead", lambda self, keys: None)
    asked: list[int] = []
    real = DiskStore.prefetch

    def spy(self: Any, keys: Any, **kw: Any) -> int:
        asked.append(len(keys))
        return int(real(self, keys, **kw))

    monkeypatch.setattr(DiskStore, "prefetch", spy)
    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2)
        for e in range(4):
            _same(_epoch(loader, e), reference[e])
        assert all(ep.misses == 0 for ep in loader.stats().epochs[1:])
    assert bool(asked) == read_ahead


def test_a_loaders_read_ahead_threads_start_once_for_all_its_epochs(
    tiny_data: Path, small_pipeline: Pipeline, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With workers that end with each epoch the plan stream does too; its read-ahead
    is the loader's, so the threads are started once (starting and joining four of
    them at each epoch cost the training loop 1-18 ms of an epoch of 150-280 ms on a
    busy 2-core machine), and the batches stay the uncached loader's. Closing the
    loader stops them."""
    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    reference = [_epoch(DataLoader(ds, cache=None, batch_size=10, seed=3), e) for e in range(5)]
    starts: list[int] = []
    real_start = ReadAhead._start

    def spy(self: ReadAhead) -> None:
        starts.append(id(self))
        real_start(self)

    monkeypatch.setattr(ReadAhead, "_start", spy)
    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2)
        for e in range(5):
            _same(_epoch(loader, e), reference[e])
        assert loader.stats().epochs[-1].misses == 0
        assert len(starts) == 1, starts  # guessed epochs 1-4 read ahead; threads started once
        loader.close()
        left = [t for t in threading.enumerate() if t.name.startswith("mmcache-readahead")]
        for t in left:
            t.join(10)
        assert not any(t.is_alive() for t in left)


def test_guessed_epochs_that_memory_serves_stop_reading_ahead_until_the_disk_serves_again(
    tiny_data: Path, small_pipeline: Pipeline, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory + disk, memory holding everything: once the first tier has served
    ``FIRST_TIER_CALM`` guessed batches in a row the loader submits nothing to its
    read-ahead (its calls had nothing to read and took the GIL from the loop: 13% of
    a warm epoch); when entries leave memory the disk serves them, and the read-ahead
    (its promotion into free memory included) comes back. The batches stay the
    uncached loader's throughout."""
    from mmcache.loader.stream import FIRST_TIER_CALM

    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    reference = [_epoch(DataLoader(ds, cache=None, batch_size=4, seed=3), e) for e in range(7)]
    submitted: list[int] = []
    real_submit = ReadAhead.submit

    def spy(self: ReadAhead, keys: np.ndarray) -> None:
        submitted.append(len(keys))
        real_submit(self, keys)

    monkeypatch.setattr(ReadAhead, "submit", spy)
    with Cache(cache_root, memory="64MiB", disk="64MiB") as cache:
        assert cache.memory is not None
        loader = DataLoader(ds, cache=cache, batch_size=4, seed=3, num_workers=2)
        per_epoch = []
        for e in range(5):
            before = len(submitted)
            _same(_epoch(loader, e), reference[e])
            per_epoch.append(len(submitted) - before)
        stats = loader.stats().epochs
        assert all(ep.tier_hits == {"memory": 48} for ep in stats[1:]), stats
        assert sum(per_epoch) > 0  # the first guessed batches read ahead, as before
        assert FIRST_TIER_CALM < 2 * 12 and per_epoch[4] == 0, per_epoch
        for key in [ds.key(i) for i in range(len(ds))]:
            cache.memory.delete(key)  # the disk serves the next epoch
        before = len(submitted)
        _same(_epoch(loader, 5), reference[5])
        assert len(submitted) > before  # a lower tier served: reading ahead again
        e5 = loader.stats().epochs[-1]
        assert e5.misses == 0 and e5.tier_hits.get("disk", 0) > 0, e5
        _same(_epoch(loader, 6), reference[6])
        assert cache.memory.nbytes() > 0  # promoted back while reading ahead
        loader.close()


def test_a_guessed_epoch_promotes_disk_entries_into_free_memory(
    tiny_data: Path, small_pipeline: Pipeline, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    reference = [_epoch(DataLoader(ds, cache=None, batch_size=10, seed=3), e) for e in range(4)]
    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        _epoch(DataLoader(ds, cache=cache, batch_size=10, seed=3), 0)
    guessed: list[int] = []
    real_guess = WarmEpochs.guess

    def spy(self: Any, epoch: int, indices: np.ndarray) -> Any:
        plan = real_guess(self, epoch, indices)
        if plan is not None and epoch not in guessed:
            guessed.append(epoch)
        return plan

    monkeypatch.setattr(WarmEpochs, "guess", spy)
    entry = 3 * 64 * 64 + 2 * 16 * 4 + 256
    cache = Cache(cache_root, memory=24 * entry, disk="64MiB", policy="keep", temporary=True)
    try:
        assert cache.memory is not None
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2)
        _same(_epoch(loader, 1), reference[1])  # planned by the workers: they promote
        assert guessed == [] and cache.memory.nbytes() > 0
        for key in [ds.key(i) for i in range(len(ds))]:
            cache.memory.delete(key)  # room again, before an epoch the loader guesses
        assert cache.memory.nbytes() == 0
        _same(_epoch(loader, 2), reference[2])
        assert guessed == [2]
        # Promoted while the epoch was guessed, within the budget and in its order.
        held = cache.memory.nbytes()
        assert 0 < held <= 24 * entry
        late = [bytes.fromhex(k) for k in reference[2][-1]["key"]]
        assert not all(cache.memory.contains(k) for k in late)  # no room was left for those
        _same(_epoch(loader, 3), reference[3])
        e3 = loader.stats().epochs[-1]
        assert e3.misses == 0 and e3.tier_hits.get("memory", 0) >= 10
    finally:
        cache.close()


def test_promotable_answers_at_once_when_the_memory_tier_has_no_room_for_an_entry(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-ahead asks for every chunk of every batch: with the memory tier full, it
    must not look up each key below (that cost ~20-35 µs a sample)."""
    raws = [codec.encode(s) for s in _samples()]
    cache = Cache(cache_root, memory=3 * len(raws[0]) + 100, disk="16MiB", temporary=True)
    try:
        assert cache.memory is not None and cache.disk is not None
        for k, raw in zip(_keys(), raws, strict=True):
            cache.disk.put(k, raw)
        for k, raw in list(zip(_keys(), raws, strict=True))[:3]:
            assert cache.memory.put(k, raw, cost=1.0, ctime=0.0)
        reader = cache.reader
        assert isinstance(reader, TieredReader)
        looked: list[bytes] = []
        real = DiskStore.info

        def spy(self: Any, key: bytes) -> Any:
            looked.append(key)
            return real(self, key)

        monkeypatch.setattr(DiskStore, "info", spy)
        keys = np.frombuffer(b"".join(_keys()), np.uint8).reshape(N, 16)
        assert reader.promotable(keys) == []  # 100 bytes of room: nothing fits
        first = len(looked)
        assert first >= 1
        for _ in range(5):
            assert reader.promotable(keys) == []
        assert len(looked) == first  # answered from the smallest entry seen
        cache.memory.delete(_keys()[0])  # room for one entry again
        assert reader.promotable(keys) == [_keys()[0]]  # the first one lacking, alone
    finally:
        cache.close()


def _drain(ahead: ReadAhead, done: int) -> None:
    deadline = time.monotonic() + 10
    while ahead.chunks_read < done and time.monotonic() < deadline:
        time.sleep(0.002)
    assert ahead.chunks_read >= done


def test_read_ahead_only_probes_while_its_reads_fault_nothing_in_and_resumes_on_a_fault() -> None:
    """On resident pages the read-ahead's reads are useless and cost the loop the GIL:
    after CALM_CHUNKS calm chunks only one chunk in PROBE_EVERY submissions is read;
    a probe that faults (pages gone) brings every chunk back, and an epoch's start
    (wake) reads its first chunks whole."""
    from mmcache.loader import readahead as ra

    count = {"faults": 0}
    faulting = {"on": False}

    def faults() -> int:
        if faulting["on"]:
            count["faults"] += 1
        return count["faults"]

    calls: list[int] = []
    ahead = ReadAhead(lambda keys: calls.append(len(keys)), threads=1, chunk=16, faults=faults)
    keys = np.zeros((64, 16), np.uint8)  # four chunks a submission
    try:
        per = ra.CALM_CHUNKS // 4
        for i in range(per):  # every chunk is read until CALM_CHUNKS calm ones
            ahead.submit(keys)
            _drain(ahead, 4 * (i + 1))
        assert ahead.chunks_skipped == 0
        read = ahead.chunks_read
        for _ in range(2 * ra.PROBE_EVERY):  # calm: one probe chunk per PROBE_EVERY
            ahead.submit(keys)
        _drain(ahead, read + 2)
        time.sleep(0.05)
        assert ahead.chunks_read == read + 2
        assert ahead.chunks_skipped == 2 * ra.PROBE_EVERY * 4 - 2
        ahead.wake()  # an epoch starts: its first WAKE_CHUNKS chunks are read whole
        read = ahead.chunks_read
        for _ in range(ra.WAKE_CHUNKS // 4):
            ahead.submit(keys)
        _drain(ahead, read + ra.WAKE_CHUNKS)
        faulting["on"] = True  # the pages went: the next probe faults
        read = ahead.chunks_read
        for _ in range(ra.PROBE_EVERY):
            ahead.submit(keys)
        _drain(ahead, read + 1)
        read = ahead.chunks_read
        ahead.submit(keys)  # every chunk is read again
        _drain(ahead, read + 4)
    finally:
        ahead.close()


def test_read_ahead_runs_its_ordered_calls_in_submission_order_across_threads() -> None:
    """Promotion runs as ``ordered``: one chunk at a time in the epoch's order, however
    the 4 threads are scheduled, so the memory budget holds the entries used first."""
    rng = np.random.default_rng(0)
    delays = rng.uniform(0, 0.004, 64)
    order: list[int] = []
    reads: list[int] = []
    lock = threading.Lock()

    def ordered(keys: np.ndarray) -> int:
        time.sleep(float(delays[int(keys[0, 0])]))  # uneven: threads would overtake
        order.append(int(keys[0, 0]))
        return 0

    def fn(keys: np.ndarray) -> None:
        time.sleep(float(delays[63 - int(keys[0, 0])]))
        with lock:
            reads.append(int(keys[0, 0]))

    ahead = ReadAhead(fn, ordered=ordered, threads=4, chunk=1)
    try:
        for i in range(64):
            ahead.submit(np.full((1, 16), i, np.uint8))
        _drain(ahead, 64)
        assert order == list(range(64))
        assert sorted(reads) == list(range(64))
    finally:
        ahead.close()
