"""Freshness at scale (issue 41): an epoch's file checks run in parallel when ``stat`` is
slow, ``recheck=`` skips files checked recently, ``freshness="run"`` checks once per run,
and with the default settings a file rewritten in place is still caught at the next check.

The slow file system is a wrapper over ``os.stat`` that sleeps and counts the calls it is
in at once (concurrency, not wall time: the test machine is shared and noisy).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache import keys
from mmcache.dataset import MultimodalDataset, open_source
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader
from mmcache.sources.freshness import FOLDER_RECHECK_S, FileChecks, StatTaker, stat_rows
from mmcache.transforms.pipeline import Pipeline

_real_stat = os.stat


class _CountingStat:
    """``os.stat`` of files in ``folder`` counted (calls, most at once), each after sleeping
    ``delay`` seconds; other paths (the folder itself too) pass through untouched. The
    counts are in shared memory: a forked process (the stat prefetcher) counts in them."""

    def __init__(self, folder: Path, delay: float = 0.0) -> None:
        ctx = multiprocessing.get_context("fork")
        self.folder = os.fsencode(os.path.abspath(folder))
        self._delay = ctx.RawValue("d", delay)
        self._counts = ctx.RawArray("q", 3)  # calls, in a call now, most at once
        self._lock = ctx.Lock()

    @property
    def delay(self) -> float:
        return float(self._delay.value)

    @delay.setter
    def delay(self, seconds: float) -> None:
        self._delay.value = seconds

    @property
    def calls(self) -> int:
        return int(self._counts[0])

    @property
    def most(self) -> int:
        return int(self._counts[2])

    @most.setter
    def most(self, value: int) -> None:
        self._counts[2] = value

    def __call__(self, path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        inside = isinstance(path, str | bytes) and os.fsencode(path).startswith(self.folder + b"/")
        if not inside:
            return _real_stat(path, *args, **kwargs)
        counts = self._counts
        with self._lock:
            counts[0] += 1
            counts[1] += 1
            counts[2] = max(counts[2], counts[1])
        try:
            if self.delay:
                time.sleep(self.delay)
            return _real_stat(path, *args, **kwargs)
        finally:
            with self._lock:
                counts[1] -= 1


def _manifest(folder: Path, n: int) -> Path:
    """``n`` small files (their bytes do not matter to a stamp) and a manifest of them."""
    (folder / "img").mkdir(parents=True)
    rows = []
    for i in range(n):
        (folder / "img" / f"{i:04d}.jpg").write_bytes(b"x" * (i + 1))
        rows.append({"id": f"{i:04d}", "image_path": f"img/{i:04d}.jpg", "caption": "a cat"})
    manifest = folder / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


@pytest.fixture
def counting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_CountingStat]:
    wrapper = _CountingStat(tmp_path / "data" / "img")
    monkeypatch.setattr(os, "stat", wrapper)
    yield wrapper


def _real_stamps(ds: MultimodalDataset, n: int) -> np.ndarray:
    paths = ds.records.stat_paths(np.arange(n, dtype=np.int64))
    return np.array([keys.stat_fields(_real_stat(p)) for p in paths if p], dtype=np.int64)


def test_an_epochs_stats_run_in_parallel_when_stat_is_slow(
    tmp_path: Path, small_pipeline: Pipeline, counting: _CountingStat
) -> None:
    n = 96
    ds = MultimodalDataset(_manifest(tmp_path / "data", n), pipeline=small_pipeline)
    counting.delay = 0.005  # a network file system's round trip (x10)
    got = ds.stamps(np.arange(n))
    assert counting.calls == n
    assert counting.most >= 8, f"at most {counting.most} stat at once: one after another"
    np.testing.assert_array_equal(got, _real_stamps(ds, n))


class _Order:
    """An epoch's batches in index order (what the stat prefetcher needs of a loader)."""

    def __init__(self, n: int, batch: int) -> None:
        self.n, self.batch = n, batch

    def batches(self, epoch: int) -> list[np.ndarray]:
        return [np.arange(a, min(a + self.batch, self.n)) for a in range(0, self.n, self.batch)]


def test_the_stat_prefetcher_stats_in_parallel_and_exits_when_closed(
    tmp_path: Path, small_pipeline: Pipeline, counting: _CountingStat
) -> None:
    """The process that checks a guessed epoch's files ahead of the training loop stats
    each batch's files at once; its pool of threads does not keep it from exiting."""
    from mmcache.loader.warm_epoch.board import FileCheckBoard
    from mmcache.loader.warm_epoch.prefetch import StatPrefetcher

    n = 64
    ds = MultimodalDataset(_manifest(tmp_path / "data", n), pipeline=small_pipeline)
    want = _real_stamps(ds, n)
    counting.delay = 0.005
    board = FileCheckBoard(n, "fork")
    prefetcher = StatPrefetcher(board, ds, _Order(n, 32), "fork")
    try:
        prefetcher.request(1, epoch=0)
        deadline = time.monotonic() + 60
        while not board.verified(np.arange(n), want, 1).all():
            assert time.monotonic() < deadline, "the prefetcher published no epoch"
            time.sleep(0.01)
        assert counting.most >= 4, f"at most {counting.most} stat at once in the prefetcher"
    finally:
        began = time.monotonic()
        prefetcher.close()  # kills it if it has not exited within 5 s
    assert time.monotonic() - began < 4.0


def test_fast_stats_stay_in_the_calling_thread(tmp_path: Path, counting: _CountingStat) -> None:
    """A local file system's stats are not handed to threads (the GIL bounds them there);
    a batch found slow goes to the pool, and one found fast again comes back."""
    (tmp_path / "data" / "img").mkdir(parents=True)
    paths: list[bytes | None] = []
    for i in range(64):
        p = tmp_path / "data" / "img" / f"{i}.jpg"
        p.write_bytes(b"x")
        paths.append(os.fsencode(p))
    taker = StatTaker(slow_s=1e-3)
    taker.stat_rows(paths)
    assert counting.most == 1
    counting.delay = 0.004
    taker.stat_rows(paths)
    assert counting.most > 1  # slow: on the pool
    counting.delay, counting.most = 0.0, 0
    taker.stat_rows(paths)  # on the pool once more, found fast
    counting.most = 0
    taker.stat_rows(paths)
    assert counting.most == 1


def test_missing_and_pathless_rows_are_minus_two(tmp_path: Path) -> None:
    there = tmp_path / "a.jpg"
    there.write_bytes(b"abc")
    rows = stat_rows([os.fsencode(there), None, os.fsencode(tmp_path / "gone.jpg"), b"a\0b"])
    assert rows.shape == (4, 4)
    assert rows[0].tolist() == list(keys.stat_fields(_real_stat(there)))
    assert (rows[1:] == -2).all()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_recheck_skips_files_checked_within_the_window(
    tmp_path: Path, small_pipeline: Pipeline, counting: _CountingStat
) -> None:
    n = 10
    ds = MultimodalDataset(_manifest(tmp_path / "data", n), pipeline=small_pipeline)
    clock = _Clock()
    checks = FileChecks(n, recheck=60.0, clock=clock)
    everything = np.arange(n, dtype=np.int64)
    take = ds._take_stamps
    first = checks.stamps(everything, take)
    assert counting.calls == n
    clock.now += 59.0
    np.testing.assert_array_equal(checks.stamps(everything, take), first)
    assert counting.calls == n  # all checked 59 s ago: none stat-ed
    half = everything[: n // 2]
    clock.now += 2.0  # 61 s after the first check: every file is due again
    checks.stamps(half, take)
    assert counting.calls == n + n // 2
    clock.now += 30.0  # the first half was checked 30 s ago, the rest 91 s ago
    checks.stamps(everything, take)
    assert counting.calls == 2 * n


def test_recheck_on_the_source_skips_a_second_sweep(
    tmp_path: Path, small_pipeline: Pipeline, counting: _CountingStat
) -> None:
    n = 12
    manifest = _manifest(tmp_path / "data", n)
    ds = MultimodalDataset(manifest, pipeline=small_pipeline, recheck=3600)
    first = ds.stamps(np.arange(n))
    again = ds.stamps(np.arange(n))
    assert counting.calls == n
    np.testing.assert_array_equal(first, again)
    plain = MultimodalDataset(manifest, pipeline=small_pipeline)
    assert (plain.freshness, plain.recheck) == ("epoch", 0.0)
    plain.stamps(np.arange(n))
    plain.stamps(np.arange(n))
    assert counting.calls == 3 * n  # the default: every sweep stats every file


def test_a_rewrite_is_caught_when_the_window_ends(tmp_path: Path, small_pipeline: Pipeline) -> None:
    n = 4
    ds = MultimodalDataset(_manifest(tmp_path / "data", n), pipeline=small_pipeline)
    clock = _Clock()
    checks = FileChecks(n, recheck=10.0, clock=clock)
    rows = np.arange(n, dtype=np.int64)
    before = checks.stamps(rows, ds._take_stamps)
    _rewrite_in_place(tmp_path / "data" / "img" / "0002.jpg")
    clock.now += 5.0
    np.testing.assert_array_equal(checks.stamps(rows, ds._take_stamps), before)  # trusted
    clock.now += 5.0
    after = checks.stamps(rows, ds._take_stamps)
    assert not np.array_equal(after[2], before[2])
    np.testing.assert_array_equal(np.delete(after, 2, axis=0), np.delete(before, 2, axis=0))


def test_a_file_replaced_by_a_rename_is_seen_before_the_window_ends(
    tmp_path: Path, small_pipeline: Pipeline, counting: _CountingStat
) -> None:
    """Under ``recheck``, a folder that changed (an entry added, removed or renamed) makes
    its files due at once; a file rewritten in place leaves its folder alone and waits for
    the window (the evidence of a folder never vouches for a file)."""
    n = 6
    ds = MultimodalDataset(_manifest(tmp_path / "data", n), pipeline=small_pipeline)
    clock = _Clock()
    checks = FileChecks(n, recheck=3600.0, clock=clock)
    rows = np.arange(n, dtype=np.int64)

    def stamps() -> np.ndarray:
        return checks.stamps(rows, ds._take_stamps, ds._single_paths)

    before = stamps()
    img = tmp_path / "data" / "img"
    _rewrite_in_place(img / "0001.jpg")
    clock.now += FOLDER_RECHECK_S + 1
    np.testing.assert_array_equal(stamps(), before)  # the folder is unchanged: all trusted
    assert counting.calls == n
    (img / "new.tmp").write_bytes(b"other bytes")
    os.replace(img / "new.tmp", img / "0003.jpg")  # rsync's way: a new inode, renamed over
    clock.now += 1.0
    np.testing.assert_array_equal(stamps(), before)  # the folder was checked 1 s ago
    clock.now += FOLDER_RECHECK_S
    after = stamps()
    assert counting.calls == 2 * n  # the folder changed: every file in it checked again
    assert after[3].tolist() == list(keys.stat_fields(_real_stat(img / "0003.jpg")))
    assert not np.array_equal(after[1], before[1])  # checked again with them: seen too
    clock.now += FOLDER_RECHECK_S + 1
    stamps()
    assert counting.calls == 2 * n  # unchanged since: trusted again


def _rewrite_in_place(path: Path) -> None:
    """Other bytes of the same size, the mtime put back (``cp -p``, ``tar x``): only the
    ctime tells; the directory's mtime does not change."""
    st = _real_stat(path)
    folder = _real_stat(path.parent).st_mtime_ns
    time.sleep(0.01)  # a later ctime on file systems with a coarse clock
    path.write_bytes(bytes(255 - b for b in path.read_bytes()))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _real_stat(path.parent).st_mtime_ns == folder


def test_the_default_catches_a_rewrite_at_the_next_check(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    n = 4
    ds = MultimodalDataset(_manifest(tmp_path / "data", n), pipeline=small_pipeline)
    before = ds.stamps(np.arange(n))
    keys_before = ds.key_rows(np.arange(n))
    _rewrite_in_place(tmp_path / "data" / "img" / "0001.jpg")
    after = ds.stamps(np.arange(n))
    assert not np.array_equal(after[1], before[1])
    assert ds.key_rows(np.arange(n))[1].tobytes() != keys_before[1].tobytes()


def test_freshness_run_stats_each_file_once_per_run(
    tiny_data: Path, small_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch, cache_root: Path
) -> None:
    """Three epochs through the loader (no workers: everything in this process) stat each
    image file once with ``freshness="run"``, three times by default."""
    from mmcache.cache import Cache

    counting = _CountingStat(tiny_data.parent / "images")
    monkeypatch.setattr(os, "stat", counting)
    calls = {}
    for freshness in ("epoch", "run"):
        ds = MultimodalDataset(tiny_data, pipeline=small_pipeline, freshness=freshness)
        n = len(ds)
        before = counting.calls
        with Cache(cache_root, memory="16MiB") as cache:
            loader = DataLoader(ds, cache=cache, batch_size=8, seed=0, num_workers=0)
            for epoch in range(3):
                loader.set_epoch(epoch)
                assert sum(len(b["id"]) for b in loader) == n
        calls[freshness] = counting.calls - before
    assert calls["run"] == n
    assert calls["epoch"] >= 3 * n


@pytest.mark.parametrize(
    ("freshness", "recheck", "says"),
    [
        ("sometimes", 0.0, "freshness must be"),
        ("epoch", -1.0, "recheck must be"),
        ("epoch", float("nan"), "recheck must be"),
        ("epoch", float("inf"), "freshness='run'"),
        ("epoch", "60", "recheck must be"),
        ("run", 60.0, "recheck=60.0 is for freshness='epoch'"),
    ],
)
def test_bad_freshness_options_are_refused(
    tmp_path: Path, small_pipeline: Pipeline, freshness: Any, recheck: Any, says: str
) -> None:
    manifest = _manifest(tmp_path / "data", 2)
    with pytest.raises(ConfigError, match=says):
        MultimodalDataset(manifest, pipeline=small_pipeline, freshness=freshness, recheck=recheck)


def test_freshness_options_are_for_loose_files(tmp_path: Path, small_pipeline: Pipeline) -> None:
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": ["a"], "image": [b"x"], "text": ["t"]})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match="loose image files"):
        open_source(tmp_path / "t.parquet", pipeline=small_pipeline, freshness="run")
    ds = open_source(_manifest(tmp_path / "data", 2), pipeline=small_pipeline, recheck=5)
    assert (ds.freshness, ds.recheck) == ("epoch", 5.0)
