"""TieredStore beyond the contract: the read check, promotion, the front/deferred split
of writes, a failing tier, and the write-behind over it."""

from __future__ import annotations

import errno
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache import codec
from mmcache.stats import TierStats
from mmcache.stores import writebehind
from mmcache.stores.base import EntryInfo, Store
from mmcache.stores.disk import DiskStore
from mmcache.stores.memory import MemoryStore, unlink_store
from mmcache.stores.tiered import Accepted, Tier, TieredStore
from mmcache.stores.writebehind import WriteBehind
from mmcache.testing.store_contract import key


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[MemoryStore, DiskStore, TieredStore]]:
    name = f"ttier-u-{uuid.uuid4().hex[:12]}"
    memory = MemoryStore(name, capacity=1 << 20, policy="lru")
    disk = DiskStore(tmp_path / "disk", capacity=1 << 22, policy="lru")
    store = TieredStore([Tier(memory, verify=False), Tier(disk, deferred=True)])
    yield memory, disk, store
    store.close()
    unlink_store(name)


def _entry(i: int, ctime: float = 100.0, cost: float = 0.25) -> bytes:
    return codec.encode({"x": np.full(500, i, dtype=np.uint8)}, ctime=ctime, cost=cost)


def _check(raw: bytes, verify: bool) -> Accepted[dict[str, np.ndarray]] | None:
    sample = codec.decode(raw, verify=verify)
    header = codec.read_header(raw)
    return None if header.ctime < 50.0 else Accepted(sample, header.cost, header.ctime)


def test_a_hit_below_is_promoted_with_its_cost_and_ctime(
    pair: tuple[MemoryStore, DiskStore, TieredStore],
) -> None:
    memory, disk, store = pair
    disk.put(key(1), _entry(1), cost=0.25, ctime=100.0)
    hit = store.lookup(key(1), _check)
    assert hit is not None and hit.tier is disk and int(hit.value["x"][0]) == 1
    info = memory.info(key(1))
    assert info is not None and (info.cost, info.ctime) == (0.25, 100.0)
    again = store.lookup(key(1), _check)
    assert again is not None and again.tier is memory
    assert store.holder(key(1)) is memory and store.holder(key(2)) is None
    assert store.lookup(key(2), _check) is None
    assert (store.stats().hits, store.stats().misses) == (2, 1)


def test_the_read_check_drops_corrupt_and_expired_entries_and_goes_on(
    pair: tuple[MemoryStore, DiskStore, TieredStore], caplog: pytest.LogCaptureFixture
) -> None:
    memory, disk, store = pair
    good = _entry(3)
    memory.put(key(3), good[:-1] + bytes([good[-1] ^ 1]))  # bad checksum
    disk.put(key(3), good, ctime=100.0)
    with caplog.at_level(logging.ERROR, logger="mmcache.stores.tiered"):
        hit = store.lookup(key(3), lambda raw, verify: _check(raw, True))
    assert hit is not None and hit.tier is disk  # the corrupt copy was skipped
    assert "corrupt memory-tier entry" in caplog.text
    assert memory.stats().corrupt == 1
    assert memory.get(key(3)) == good  # and replaced by the promotion
    old = _entry(4, ctime=10.0)
    memory.put(key(4), old)
    disk.put(key(4), old)
    assert store.lookup(key(4), _check) is None
    assert not memory.contains(key(4)) and not disk.contains(key(4))
    assert (memory.stats().expired, disk.stats().expired) == (1, 1)


def test_writes_split_into_front_and_deferred_tiers(
    pair: tuple[MemoryStore, DiskStore, TieredStore],
) -> None:
    memory, disk, store = pair
    raw = _entry(5)
    assert store.put_front(key(5), raw, cost=0.1, ctime=100.0)
    assert memory.contains(key(5)) and not disk.contains(key(5))
    assert store.put_many([(key(5), raw, 0.1, 100.0)], skip_front=True) == [True]
    assert disk.contains(key(5))
    assert store.put_many([(key(6), raw, 0.1, 100.0), (key(7), raw, 0.1, 100.0)]) == [True] * 2
    assert all(t.contains(key(7)) for t in store.tiers)
    assert store.deferred and store.tier("disk") is disk and store.tier("gpu") is None
    assert list(store.by_name()) == ["memory", "disk"]


class _Broken(Store):
    """A tier whose writes fail as a full file system does."""

    name = "broken"

    def get(self, key: bytes) -> bytes | None:
        return None

    def put(
        self, key: bytes, value: bytes | memoryview, *, cost: float = 0.0, ctime: float = 0.0
    ) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device")

    def delete(self, key: bytes) -> bool:
        return False

    def contains(self, key: bytes) -> bool:
        return False

    def info(self, key: bytes) -> EntryInfo | None:
        return None

    def keys(self) -> Iterator[bytes]:
        return iter(())

    def nbytes(self) -> int:
        return 0

    def capacity(self) -> int:
        return 1 << 20

    def stats(self) -> TierStats:
        return TierStats()

    def expire(self, before: float) -> int:
        return 0

    def close(self) -> None:
        pass


def test_a_failing_tier_is_logged_and_skipped(
    pair: tuple[MemoryStore, DiskStore, TieredStore], caplog: pytest.LogCaptureFixture
) -> None:
    memory, _, _ = pair
    store = TieredStore([Tier(memory, verify=False), Tier(_Broken(), deferred=True)])
    with caplog.at_level(logging.WARNING, logger="mmcache.stores.tiered"):
        assert store.put(key(8), _entry(8)) is True  # the memory tier admitted it
        assert store.put_many([(key(9), _entry(9), 0.0, 0.0)], skip_front=True) == [False]
    assert caplog.text.count("put to broken tier failed") == 2
    assert not memory.contains(key(9))
    assert not store.contains(key(8))  # the store of record refused it
    assert store.get(key(8)) is not None  # ... and the memory tier still serves it


def test_replace_empty_and_bad_lists(pair: tuple[MemoryStore, DiskStore, TieredStore]) -> None:
    memory, disk, store = pair
    disk.put(key(1), b"v")
    twin = DiskStore(disk.path, capacity=disk.capacity(), policy=disk.policy)
    assert store.replace("disk", twin) is disk and store.tier("disk") is twin
    disk.close()
    assert store.get(key(1)) == b"v"
    with pytest.raises(ValueError, match="replace"):
        store.replace("memory", twin)
    with pytest.raises(ValueError, match="names must differ"):
        TieredStore([memory, memory])
    empty = TieredStore([])
    assert empty.get(key(1)) is None and not empty.put(key(1), b"x") and len(empty) == 0
    assert empty.capacity() == 0 and empty.record is None and not empty.deferred
    store.close()
    assert store.tiers == () and store.put(key(2), b"x") is False  # closed: writes nothing


def test_write_behind_writes_the_front_now_and_the_rest_at_flush(
    pair: tuple[MemoryStore, DiskStore, TieredStore],
) -> None:
    memory, disk, store = pair
    tags: list[tuple[str, list[bytes]]] = []
    writer = WriteBehind(store, tag=lambda fp, keys: tags.append((fp, keys)))
    for i in range(20):
        assert writer.submit(key(i), _entry(i), 0.01, "fp" if i == 3 else None)
        assert memory.contains(key(i))
    writer.flush()
    assert all(disk.contains(key(i)) for i in range(20))
    info = disk.info(key(7))
    assert info is not None and info.ctime == 100.0  # the entry's own creation time
    assert tags == [("fp", [key(3)])]
    assert writer.submit(key(30), _entry(30), 0.01)  # after flush: written here
    assert disk.contains(key(30))


def test_write_behind_logs_a_groups_keys_in_one_call_per_fingerprint(
    pair: tuple[MemoryStore, DiskStore, TieredStore],
) -> None:
    """The key log is one append per call: a worker's cold epoch logged each produced key
    on its own (~14 us, and two workers' appends to one file contended: ~180 us per
    sample of a tiny pipeline's cold epoch); the writer's thread logs a group's keys in
    one call per fingerprint, before the group's deferred commit, and a full queue's
    direct write logs its row itself."""
    _, disk, store = pair
    calls: list[tuple[str, list[bytes]]] = []
    writer = WriteBehind(store, tag=lambda fp, keys: calls.append((fp, list(keys))))
    writer._queue.put(None)  # the thread stops: what follows waits in the queue
    writer._thread.join()
    writer._thread = threading.Thread(target=writer._run, daemon=True)
    for i in range(40):
        writer.submit(key(i), _entry(i), 0.01, "fa" if i % 2 else "fb")
    writer._thread.start()  # one group: the queue holds all 40 (< 1 MiB)
    writer.flush()
    assert all(disk.contains(key(i)) for i in range(40))
    assert sorted(fp for fp, _ in calls) == ["fa", "fb"]  # 40 calls of one key before
    logged = {fp: keys for fp, keys in calls}
    assert logged["fa"] == [key(i) for i in range(1, 40, 2)]
    assert logged["fb"] == [key(i) for i in range(0, 40, 2)]


def test_write_behind_commits_a_slow_producers_entries_together(
    pair: tuple[MemoryStore, DiskStore, TieredStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker producing a tiny sample every few milliseconds: the writer's thread found
    one entry queued each time and committed it alone (one LMDB commit per entry, and the
    disk tier packs only small entries of one commit). It now waits up to ``LINGER_S``
    for more, so they go in some dozens per commit."""
    _, disk, store = pair
    commits: list[int] = []
    real = store.put_many

    def counted(rows: list[Any], **kw: Any) -> list[bool]:
        commits.append(len(rows))
        return real(rows, **kw)

    monkeypatch.setattr(store, "put_many", counted)
    # a loaded machine may stretch the 1 ms sleeps past the gap that ends a group early
    monkeypatch.setattr(writebehind, "LINGER_GAP_S", writebehind.LINGER_S)
    writer = WriteBehind(store)
    for i in range(40):
        writer.submit(key(i), _entry(i), 0.01)
        time.sleep(0.001)
    writer.flush()
    assert sum(commits) == 40 and all(disk.contains(key(i)) for i in range(40))
    assert len(commits) <= 8, commits  # ~40 commits of one entry before


def test_write_behind_without_a_front_tier_defers_everything(tmp_path: Path) -> None:
    disk = DiskStore(tmp_path / "disk", capacity=1 << 22)
    store = TieredStore([Tier(disk, deferred=True)])
    writer = WriteBehind(store, max_pending=1)
    for i in range(10):
        assert writer.submit(key(i), _entry(i), 0.01) is False  # no front tier admitted it
    writer.flush()
    assert len(disk) == 10
    store.close()
