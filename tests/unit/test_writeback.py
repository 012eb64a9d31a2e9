"""Write-behind: memory tier at once, disk tier in groups, nothing lost at flush or exit."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np

from mmcache import codec
from mmcache.cache import Cache
from mmcache.keys import sample_key
from mmcache.writeback import WriteBehind, flush_all, write_behind


def _entry(i: int) -> tuple[bytes, bytes, float]:
    raw = codec.encode({"x": np.full(20_000, i % 256, dtype=np.uint8)}, ctime=float(i), cost=0.01)
    return sample_key(str(i), "s", "fp"), raw, 0.01


def test_memory_at_once_disk_after_flush(cache_root: Path) -> None:
    with Cache(cache_root, memory="8MiB", disk="64MiB", temporary=True) as cache:
        submit = write_behind(cache)
        entries = [_entry(i) for i in range(40)]
        for k, raw, cost in entries:
            submit(k, raw, cost)
            assert cache.memory is not None and cache.memory.contains(k)  # visible now
        flush_all()
        assert cache.disk is not None
        assert all(cache.disk.contains(k) for k, _, _ in entries)
        assert cache.disk.get(entries[7][0]) == entries[7][1]


def test_full_queue_writes_in_the_caller(cache_root: Path) -> None:
    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        writer = WriteBehind(cache, max_pending=1)
        for k, raw, cost in (_entry(i) for i in range(30)):
            writer.submit(k, raw, cost)
        writer.flush()
        assert cache.disk is not None and len(cache.disk) == 30


def _child(root: str) -> None:
    cache = Cache(root, memory=0, disk="64MiB")
    submit = write_behind(cache)
    for k, raw, cost in (_entry(i) for i in range(25)):
        submit(k, raw, cost)
    # no explicit flush: the process's normal exit must write the queue


def test_a_worker_exit_flushes_its_queue(cache_root: Path) -> None:
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_child, args=(str(cache_root),))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        assert cache.disk is not None and len(cache.disk) == 25


def test_this_process_reads_its_pending_writes(cache_root: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An entry queued for the disk tier is served from the queue until it is committed
    (a worker asked again for a sample it produced a moment ago), then from the disk."""
    import threading

    from mmcache.writeback import pending_write

    with Cache(cache_root, memory=0, disk="64MiB") as cache:
        store = cache.store
        release = threading.Event()
        put_many = store.put_many

        def slow_put_many(rows, **kw):  # type: ignore[no-untyped-def]
            release.wait(10)  # the deferred commit is late (a loaded machine)
            return put_many(rows, **kw)

        monkeypatch.setattr(store, "put_many", slow_put_many)
        k, raw, cost = _entry(3)
        assert pending_write(cache, k) is None  # no writer yet: nothing made
        write_behind(cache)(k, raw, cost)
        assert cache.get(k) is None  # not committed yet
        assert pending_write(cache, k) == raw
        release.set()
        flush_all()
        assert pending_write(cache, k) is None
        assert cache.disk is not None and cache.disk.get(k) == raw
