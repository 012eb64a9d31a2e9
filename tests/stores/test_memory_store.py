"""Behaviour of the node-shared memory tier within one process (see also multiproc/, faults/)."""

from __future__ import annotations

import gc
import glob
import json
import logging
import os
import pickle
import stat
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.errors import CacheError, ConfigError
from mmcache.policies import Policy, Residents
from mmcache.stores.memory import MemoryStore, layout, reclaim_orphans, store_dir, unlink_store
from mmcache.stores.memory import shm as shm_mod
from mmcache.stores.memory.slabs import slot_sizes_upto

MiB = 1 << 20


def key(i: int) -> bytes:
    # Sequential, non-random keys on purpose: the index must spread them anyway.
    return i.to_bytes(16, "big")


def value(i: int, size: int) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def shm_files(name: str) -> list[str]:
    return glob.glob(f"{store_dir()}/mmcache-{glob.escape(name)}*")


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"tmem-{uuid.uuid4().hex[:12]}"
    yield name
    unlink_store(name)
    assert shm_files(name) == []


@pytest.fixture
def make(shm_name: str) -> Iterator[Callable[..., MemoryStore]]:
    opened: list[MemoryStore] = []

    def factory(**kw: Any) -> MemoryStore:
        kw.setdefault("capacity", MiB)
        s = MemoryStore(kw.pop("name", shm_name), **kw)
        opened.append(s)
        return s

    yield factory
    for s in opened:
        s.close()


def test_put_get_contains_info_delete(make: Callable[..., MemoryStore]) -> None:
    s = make(clock=lambda: 42.0)
    assert s.get(key(1)) is None
    assert s.put(key(1), b"hello", cost=0.5, ctime=7.0)
    assert s.get(key(1)) == b"hello"
    assert s.contains(key(1)) and key(1) in s and key(2) not in s
    info = s.info(key(1))
    assert info is not None
    assert (info.size, info.cost, info.ctime, info.atime, info.hits) == (5, 0.5, 7.0, 42.0, 1)
    assert s.put(key(1), b"replaced!")
    assert s.get(key(1)) == b"replaced!" and len(s) == 1 and s.nbytes() == 9
    assert s.delete(key(1)) and not s.delete(key(1))
    assert s.get(key(1)) is None and s.nbytes() == 0 and len(s) == 0
    assert s.check() == []


def test_values_of_every_shape_and_size(make: Callable[..., MemoryStore]) -> None:
    s = make(capacity=4 * MiB)
    sizes = [0, 1, 63, 64, 65, 4095, 4096, 4097, 70_000, 150_528, 1_000_000]
    for i, n in enumerate(sizes):
        assert s.put(key(i), value(i, n)), n
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert s.put(key(100), arr.data)
    assert s.put(key(101), bytearray(b"abc"))  # type: ignore[arg-type]  # any buffer works
    assert s.put(key(102), arr[:, ::2])  # type: ignore[arg-type]  # not contiguous: copied
    for i, n in enumerate(sizes):
        assert s.get(key(i)) == value(i, n)
    assert s.get(key(100)) == arr.tobytes()
    assert s.get(key(101)) == b"abc"
    assert s.get(key(102)) == np.ascontiguousarray(arr[:, ::2]).tobytes()
    assert s.nbytes() == sum(sizes) + 48 + 3 + 24
    assert s.check() == []


def test_bad_keys_and_config_are_rejected(make: Callable[..., MemoryStore], shm_name: str) -> None:
    s = make()
    with pytest.raises(ValueError, match="16-byte"):
        s.put(b"short", b"x")
    with pytest.raises(TypeError):
        s.get("0123456789abcdef")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="16-byte"):
        s.gather([b"x"], 0, 0, np.zeros((1, 0), np.uint8))
    with pytest.raises(ConfigError):
        MemoryStore("bad/name", capacity=MiB)
    with pytest.raises(ConfigError):
        MemoryStore(shm_name, capacity=0)
    with pytest.raises(ConfigError):
        MemoryStore(shm_name, capacity=MiB, policy="mru")
    with pytest.raises(CacheError, match="create=True"):
        MemoryStore(f"{shm_name}-missing", capacity=MiB, create=False)


def test_budget_holds_and_counts_payload_bytes(make: Callable[..., MemoryStore]) -> None:
    cap = 300_000
    s = make(capacity=cap, policy="lru")
    rng = np.random.default_rng(0)
    held: dict[bytes, int] = {}
    for i in range(400):
        n = int(rng.integers(1, 40_000))
        s.put(key(i), value(i, n))
        assert s.nbytes() <= cap
    for k in s.keys():  # noqa: SIM118 - a Store is not iterable
        info = s.info(k)
        assert info is not None
        held[k] = info.size
    assert s.nbytes() == sum(held.values()) == s.stats().bytes
    assert len(s) == len(held) == s.stats().items
    assert s.check() == []


def test_oversize_is_refused_and_logged_once(
    make: Callable[..., MemoryStore], caplog: pytest.LogCaptureFixture
) -> None:
    s = make(capacity=1000)
    with caplog.at_level(logging.WARNING, logger="mmcache.stores.memory"):
        assert not s.put(key(1), b"x" * 1001)
        assert not s.put(key(2), b"x" * 5000)
    warnings = [r for r in caplog.records if "larger than the whole capacity" in r.getMessage()]
    assert len(warnings) == 1 and "1001" in warnings[0].getMessage()
    assert "1000" in warnings[0].getMessage()
    assert s.stats().refused == 2 and s.put(key(3), b"x" * 1000)


def test_lru_evicts_the_least_recently_read(make: Callable[..., MemoryStore]) -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    s = make(capacity=4000, policy="lru", clock=clock)
    for i in range(4):
        assert s.put(key(i), value(i, 1000))
    assert s.get(key(0)) is not None  # 0 is now the most recent
    assert s.put(key(9), value(9, 1000))
    assert not s.contains(key(1))
    assert all(s.contains(key(i)) for i in (0, 2, 3, 9))
    assert s.stats().evictions == 1


def test_keep_refuses_when_full(make: Callable[..., MemoryStore]) -> None:
    s = make(capacity=3000, policy="keep")
    for i in range(3):
        assert s.put(key(i), value(i, 1000), cost=1.0)
    assert not s.put(key(9), value(9, 1000), cost=100.0)
    assert sorted(s.keys()) == [key(0), key(1), key(2)]
    assert s.stats().refused == 1 and s.stats().evictions == 0


def test_value_replaces_only_clearly_denser(make: Callable[..., MemoryStore]) -> None:
    s = make(capacity=3000, policy="value")
    for i, cost in enumerate([1.0, 2.0, 3.0]):
        assert s.put(key(i), value(i, 1000), cost=cost)
    assert not s.put(key(8), value(8, 1000), cost=1.2)  # < 1.5x the least dense
    assert s.put(key(9), value(9, 1000), cost=10.0)  # clearly denser: replaces cost 1.0
    assert sorted(s.keys()) == [key(1), key(2), key(9)]


def test_a_refused_new_value_drops_the_stale_old_one(make: Callable[..., MemoryStore]) -> None:
    s = make(capacity=3000, policy="keep")
    for i in range(3):
        assert s.put(key(i), value(i, 1000))
    assert not s.put(key(0), b"y" * 2000)  # refused by the policy
    assert s.get(key(0)) is None and s.nbytes() == 2000
    assert s.put(key(0), b"z" * 1000)
    assert not s.put(key(0), b"w" * 4000)  # larger than the capacity
    assert s.get(key(0)) is None and s.check() == []


def test_a_policy_that_frees_too_little_is_refused(make: Callable[..., MemoryStore]) -> None:
    class Stingy(Policy):
        def select_victims(self, residents: Residents, *, size: int, cost: float, need: int) -> Any:
            return np.array([0])  # one row, whatever is needed

    s = make(capacity=2000, policy=Stingy())
    assert s.put(key(0), value(0, 500)) and s.put(key(1), value(1, 1500))
    assert not s.put(key(2), value(2, 2000))
    assert s.nbytes() == 2000 and s.check() == []


def test_index_capacity_limits_entries(make: Callable[..., MemoryStore]) -> None:
    s = make(capacity=MiB, index_capacity=8, policy="fifo")
    for i in range(20):
        assert s.put(key(i), value(i, 10))
    assert len(s) == 8 and sorted(s.keys()) == [key(i) for i in range(12, 20)]
    k = make(name=f"{s.shm_name}-k", capacity=MiB, index_capacity=8, policy="keep")
    assert all(k.put(key(i), b"v") for i in range(8))
    assert not k.put(key(8), b"v")
    k.unlink()


def test_index_survives_churn_with_tombstones(make: Callable[..., MemoryStore]) -> None:
    s = make(capacity=MiB, index_capacity=64, policy="lru")
    for i in range(2000):  # far more deletes than cells: forces rehashes
        assert s.put(key(i), value(i, 8))
        if i % 3:
            assert s.delete(key(i))
    present = sorted(s.keys())
    assert present and all(s.get(k) == value(int.from_bytes(k, "big"), 8) for k in present)
    assert s.check() == []
    s.gc()
    assert s.check() == []


def test_gather_copies_the_asked_range(make: Callable[..., MemoryStore]) -> None:
    s = make(capacity=4 * MiB)
    for i in range(10):
        s.put(key(i), value(i, 150_000))
    s.put(key(50), value(50, 100))  # too short for the range: counts as absent
    s.put(key(51), value(51, 300_000))  # another size class
    keys = [key(3), key(99), key(7), key(50), key(51), key(3)]
    out = np.full((len(keys), 1000), 255, np.uint8)
    found = s.gather(keys, 500, 1000, out)
    assert found.tolist() == [True, False, True, False, True, True]
    for row, i in ((0, 3), (2, 7), (4, 51), (5, 3)):
        assert out[row].tobytes() == value(i, 300_000)[500:1500]
    assert (out[1] == 255).all() and (out[3] == 255).all()
    st = s.stats()
    assert (st.hits, st.misses) == (4, 2)
    info = s.info(key(3))
    assert info is not None and info.hits == 2
    empty = np.zeros((0, 4), np.uint8)
    assert s.gather([], 0, 4, empty).shape == (0,)
    with pytest.raises(ValueError, match="shape"):
        s.gather([key(1)], 0, 10, np.zeros((1, 11), np.uint8))
    with pytest.raises(ValueError):
        s.gather([key(1)], 0, 10, np.zeros((1, 10), np.int16))


def test_batched_calls_take_keys_as_one_array(make: Callable[..., MemoryStore]) -> None:
    """What the loader passes: a uint8 [n, 16] array, same answers as a list of bytes."""
    s = make(capacity=4 * MiB)
    for i in range(4):
        s.put(key(i), value(i, 2000))
    keys = [key(2), key(9), key(0)]
    rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(3, 16)
    assert s.contains_many(rows).tolist() == s.contains_many(keys).tolist() == [True, False, True]
    out_a = np.zeros((3, 100), np.uint8)
    out_b = np.zeros((3, 100), np.uint8)
    assert s.gather(rows[::1], 10, 100, out_a).tolist() == [True, False, True]
    s.gather(keys, 10, 100, out_b)
    assert (out_a == out_b).all() and out_a[0].tobytes() == value(2, 2000)[10:110]
    assert s.contains_many(np.zeros((0, 16), np.uint8)).shape == (0,)
    with pytest.raises(ValueError, match="uint8"):
        s.contains_many(np.zeros((2, 8), np.uint8))


def test_get_many(make: Callable[..., MemoryStore]) -> None:
    s = make()
    s.put(key(1), b"one")
    s.put(key(2), b"")
    assert s.get_many([key(1), key(3), key(2)]) == [b"one", None, b""]
    assert s.get_many([]) == []


def test_view_is_zero_copy_read_only_and_scoped(make: Callable[..., MemoryStore]) -> None:
    s = make()
    s.put(key(1), value(1, 10_000))
    t = s._session.table
    e = t.find_ready(key(1))
    slab = s._session.slabs.get(int(t.cls[e]))
    with s.view(key(1)) as v:
        assert v is not None and v.readonly and bytes(v) == value(1, 10_000)
        address = np.frombuffer(v, np.uint8).__array_interface__["data"][0]
        assert address == slab.rows[int(t.slot[e])].__array_interface__["data"][0]
        with pytest.raises(RuntimeError, match="view"):
            s.put(key(2), b"no writes inside a view")
    with pytest.raises(ValueError):
        bytes(v)  # released with the block
    with s.view(key(2)) as missing:
        assert missing is None
    assert s.stats().hits == 1 and s.stats().misses == 1


def test_expire_on_ctime(make: Callable[..., MemoryStore]) -> None:
    s = make()
    for i in range(6):
        s.put(key(i), b"v", ctime=float(i))
    assert s.expire(3.0) == 3
    assert sorted(s.keys()) == [key(3), key(4), key(5)]
    assert s.stats().expired == 3 and s.expire(3.0) == 0


def test_stats_count_every_operation(make: Callable[..., MemoryStore]) -> None:
    s = make(capacity=2000, policy="lru")
    s.put(key(1), b"a" * 1000)
    s.put(key(2), b"b" * 1000)
    s.put(key(3), b"c" * 1000)  # evicts one
    s.put(key(4), b"d" * 5000)  # oversize
    s.get(key(3))
    s.get(key(99))
    st = s.stats()
    assert (st.puts, st.admitted, st.refused, st.evictions) == (4, 3, 1, 1)
    assert (st.hits, st.misses, st.bytes, st.budget, st.items) == (1, 1, 2000, 2000, 2)
    assert st.hit_rate == 0.5


def test_reopen_by_name_sees_the_same_entries(
    make: Callable[..., MemoryStore], shm_name: str
) -> None:
    a = make()
    a.put(key(1), b"shared")
    b = make(create=False)
    assert b.get(key(1)) == b"shared"
    b.put(key(2), b"both ways")
    assert a.get(key(2)) == b"both ways"
    assert a.stats().hits == b.stats().hits == 2  # one set of counters per node
    # A different capacity does not re-create a store others are attached to.
    c = make(capacity=2 * MiB)
    assert c.capacity() == MiB and c.get(key(1)) == b"shared"


def test_reopen_with_new_capacity_when_nobody_is_attached(make: Callable[..., MemoryStore]) -> None:
    a = make()
    a.put(key(1), b"old")
    a.close()
    a.close()  # idempotent
    b = make(capacity=2 * MiB)
    assert b.capacity() == 2 * MiB and b.get(key(1)) is None
    c = make(capacity=2 * MiB)
    assert c.capacity() == 2 * MiB


def test_pickle_round_trip_reattaches(make: Callable[..., MemoryStore]) -> None:
    s = make(policy="lru", capacity=3 * MiB)
    s.put(key(1), b"pickled")
    t = pickle.loads(pickle.dumps(s))
    try:
        assert t.get(key(1)) == b"pickled" and t.capacity() == 3 * MiB
        assert t.policy.name == "lru" and t.shm_name == s.shm_name
    finally:
        t.close()
    assert s.get(key(1)) == b"pickled"


def test_closed_store_raises(make: Callable[..., MemoryStore]) -> None:
    s = make()
    s.close()
    with pytest.raises(CacheError, match="closed"):
        s.get(key(1))


def test_temporary_store_goes_with_its_last_user(shm_name: str) -> None:
    a = MemoryStore(shm_name, capacity=MiB, temporary=True)
    a.put(key(1), b"x" * 100_000)
    b = MemoryStore(shm_name, capacity=MiB, create=False)
    assert b.temporary and b.get(key(1)) is not None
    a.close()
    assert shm_files(shm_name)
    b.close()
    assert shm_files(shm_name) == []


def test_unlink_removes_files_and_stops_other_users(shm_name: str) -> None:
    a = MemoryStore(shm_name, capacity=MiB)
    b = MemoryStore(shm_name, capacity=MiB)
    a.put(key(1), b"x")
    removed = a.unlink()
    assert f"{store_dir()}/mmcache-{shm_name}.lock" in removed and shm_files(shm_name) == []
    with pytest.raises(CacheError, match="removed"):
        b.get(key(1))
    b.close()
    c = MemoryStore(shm_name, capacity=MiB)  # a fresh one under the same name
    assert c.get(key(1)) is None
    c.unlink()


def test_files_are_private_to_the_user(make: Callable[..., MemoryStore]) -> None:
    s = make()
    s.put(key(1), b"x" * 100)
    paths = s.segment_paths()
    assert len(paths) == 4  # lock, meta, the index, one size class
    for path in paths:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


def test_freed_slots_give_their_pages_back(make: Callable[..., MemoryStore]) -> None:
    s = make(capacity=32 * MiB)
    base = s.resident_bytes()
    for i in range(16):
        assert s.put(key(i), value(i, MiB))
    grown = s.resident_bytes() - base
    slot = int(slot_sizes_upto(MiB)[-1])
    metadata = 256 * 1024  # first pages of the entry arrays, the bitmap, a few index cells
    assert 16 * MiB <= grown <= 16 * slot + metadata
    for i in range(16):
        s.delete(key(i))
    assert s.resident_bytes() - base < metadata


def test_threads_share_one_store(make: Callable[..., MemoryStore]) -> None:
    s = make(capacity=200_000, policy="lru")
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                i = int(rng.integers(0, 50))
                n = 100 + 97 * i
                if rng.random() < 0.5:
                    s.put(key(i), value(i, n))
                else:
                    with s.view(key(i)) as v:
                        assert v is None or bytes(v) == value(i, n)
                    got = s.get(key(i))
                    assert got is None or got == value(i, n)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and s.check() == []


def test_reclaim_orphans_removes_stores_of_deleted_roots(shm_name: str, tmp_path: Path) -> None:
    gone_root, kept_root = tmp_path / "gone", tmp_path / "kept"
    gone_root.mkdir()
    kept_root.mkdir()
    names = {w: f"{shm_name}-{w}" for w in ("gone", "kept", "live", "temp")}
    for w in ("gone", "kept"):
        MemoryStore(names[w], capacity=MiB, owner_path=str(tmp_path / w)).close()
    live = MemoryStore(names["live"], capacity=MiB, owner_path=str(gone_root))
    temp = MemoryStore(names["temp"], capacity=MiB, temporary=True)
    temp._session.meta.procs[:] = 0  # as if its last user had died without closing
    try:
        gone_root.rmdir()
        removed = reclaim_orphans(f"{shm_name}-*")
        assert shm_files(names["gone"]) == [] and shm_files(names["temp"]) == []
        assert shm_files(names["kept"]) and shm_files(names["live"])  # in use: kept
        assert all(names["gone"] in p or names["temp"] in p for p in removed)
        live.put(key(1), b"still works")
    finally:
        live.close()
        temp.close()
        for n in names.values():
            unlink_store(n)
    assert reclaim_orphans(f"{shm_name}-*") == []


def test_reclaim_orphans_removes_half_initialised_stores(shm_name: str) -> None:
    s = MemoryStore(shm_name, capacity=MiB)
    s.put(key(1), b"x")
    s._session.meta.header[2] = 1  # header state INITIALISING, as a dead creator leaves it
    s._session.meta.procs[:] = 0
    s._session.closed = True  # drop it without touching the files
    s._session.unmap()
    s._session.lock.close()
    # An opener repairs it by re-creating it...
    t = MemoryStore(shm_name, capacity=MiB)
    assert t.get(key(1)) is None
    t._session.meta.header[2] = 1
    t._session.meta.procs[:] = 0
    t._session.closed = True
    t._session.unmap()
    t._session.lock.close()
    # ...and the node-wide scan removes it.
    removed = reclaim_orphans(shm_name)
    assert removed and shm_files(shm_name) == []


def test_a_store_dropped_without_close_detaches(shm_name: str) -> None:
    s = MemoryStore(shm_name, capacity=MiB, temporary=True)
    s.put(key(1), b"x" * 1000)
    del s
    gc.collect()
    assert shm_files(shm_name) == []  # it was the last user of a temporary store


@pytest.mark.parametrize("size", [64, 150, 5000])
def test_small_slots_free_a_page_only_when_all_its_slots_are_free(
    make: Callable[..., MemoryStore], size: int
) -> None:
    s = make()
    n = 3 * 4096 // size + 1  # slots spanning at least three pages
    for i in range(n):
        assert s.put(key(i), value(i, size))
    data = [p for p in s.segment_paths() if p[-4:-3] == "d"]
    assert len(data) == 1

    def pages() -> int:
        return os.stat(data[0]).st_blocks * 512 // 4096 - 1  # minus the bitmap page

    full = pages()
    assert full >= 3
    for i in range(1, n):  # keep only the first slot
        s.delete(key(i))
    assert pages() == -(-size // 4096)  # the pages its bytes are on
    s.delete(key(0))
    assert pages() == 0
    assert s.check() == []


def test_a_store_of_another_pid_namespace_is_refused(make: Callable[..., MemoryStore]) -> None:
    s = make()
    s._session.meta.header[layout.H_PID_NAMESPACE] += 1  # as if created in another container
    with pytest.raises(CacheError, match="pid namespace"):
        MemoryStore(s.shm_name, capacity=MiB)
    assert reclaim_orphans(s.shm_name) == []  # nor judged from here
    s._session.meta.header[layout.H_PID_NAMESPACE] -= 1


def test_repair_and_check_are_functions_of_the_arrays(make: Callable[..., MemoryStore]) -> None:
    """check() and the crash repair take the entry table and the slabs, not the store."""
    from mmcache.stores.memory import repair

    s = make()
    for i in range(5):
        assert s.put(key(i), value(i, 300 + 1000 * i))
    session = s._session
    with session.exclusive():
        t, slabs, cap = session.table, session.slabs, s.capacity()
        assert repair.check(t, slabs, capacity=cap) == []
        t.header[layout.H_NBYTES] += 7  # as a holder that died mid-update leaves it
        t.cells[:] = 0  # and an index it had not filled yet
        problems = repair.check(t, slabs, capacity=cap)
        assert any(p.startswith("bytes:") for p in problems), problems
        assert any("unreachable" in p for p in problems), problems
        done = repair.rebuild(t, slabs, capacity=cap)
        assert (done.corrupt, done.reclaimed, done.damaged) == (0, 0, None)
        assert repair.check(t, slabs, capacity=cap) == []
    assert [s.get(key(i)) for i in range(5)] == [value(i, 300 + 1000 * i) for i in range(5)]


def test_gather_ranges_copies_several_ranges_under_one_lock(
    make: Callable[..., MemoryStore],
) -> None:
    s = make()
    for i in range(4):
        s.put(key(i), value(i, 1000 + 500 * i))
    keys = [key(3), key(0), key(9), key(2)]
    head = np.zeros((4, 16), np.uint8)
    tail = np.zeros((4, 100), np.uint8)
    found = s.gather_ranges(keys, [(0, 16, head), (1400, 100, tail)])
    assert found.tolist() == [True, False, False, True]  # key 0 is too short for the tail
    for row, i in ((0, 3), (3, 2)):
        assert head[row].tobytes() == value(i, 16) and tail[row].tobytes() == value(i, 1500)[1400:]
    assert not head[1].any() and not tail[1].any()
    assert (s.stats().hits, s.stats().misses) == (2, 2)
    assert s.gather_ranges(keys, []).tolist() == [True, True, False, True]


# ------------------------------------------------------------------ a missing or full /dev/shm


def test_a_missing_shm_directory_is_named_in_the_error(
    tmp_path: Path, shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-shm"
    monkeypatch.setattr(shm_mod, "SHM_DIR", str(missing))
    with pytest.raises(CacheError) as info:
        MemoryStore(shm_name, capacity=MiB)
    message = str(info.value)
    assert f"{missing} does not exist" in message and "memory=0" in message
    assert "create it first" not in message
    assert not missing.exists()


@pytest.fixture
def small_shm(tmpfs: Callable[[str, str], Path]) -> Path:
    """A 1 MiB tmpfs to stand for /dev/shm, unmounted afterwards."""
    return tmpfs("shm", "1m")


# Runs in a child: a regression (SIGBUS on a full tmpfs) must fail the test, not kill pytest.
FULL_SHM = textwrap.dedent(
    """
    import contextlib, json, logging, os, sys
    from mmcache.errors import CacheError
    from mmcache.stores import memory
    from mmcache.stores.memory import shm as memory_shm
    shm, name = sys.argv[1:3]
    memory_shm.SHM_DIR = shm
    warnings = []
    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
    logging.getLogger("mmcache").addHandler(Keep())

    def key(i):
        return i.to_bytes(16, "big")

    def fill(path):  # another program takes every byte left
        with contextlib.suppress(OSError), open(path, "wb", 0) as f:
            while True:
                f.write(bytes(4096))

    def left():  # files in /dev/shm and in the store directory (kept, empty, like /run/user)
        mine = memory.store_dir()
        found = [f for f in os.listdir(shm) if f != os.path.basename(mine)]
        return sorted(found + (os.listdir(mine) if os.path.isdir(mine) else []))

    out = {}
    # 1. open on a full /dev/shm: CacheError, nothing left behind
    fill(os.path.join(shm, "filler"))
    try:
        memory.MemoryStore(name, capacity=8 << 20, temporary=True)
        out["open"] = "opened"
    except CacheError as exc:
        out["open"] = str(exc)
    out["left"] = left()
    os.unlink(os.path.join(shm, "filler"))
    # 2. full mid-run: every kind of put is refused cleanly
    s = memory.MemoryStore(name, capacity=8 << 20, temporary=True)
    assert s.put(key(0), b"a" * 10_000) and s.put(key(1), b"b" * 100_000)
    assert s.put(key(2), b"c" * 60)  # size class of tiny values: one payload page
    fill(os.path.join(shm, "filler"))
    out["refused"] = {
        "new class": s.put(key(10), b"n" * 1_000),
        "new class, large": s.put(key(11), b"n" * 500_000),
        "payload page, inline copy": s.put(key(12), b"p" * 10_000),
        "payload page, copy outside the lock": s.put(key(13), b"p" * 100_000),
        "replaced key": s.put(key(0), b"r" * 100_000),  # more than its old pages
    }
    out["tiny"] = [s.put(key(100 + i), b"t" * 60) for i in range(300)]  # payload pages
    out["empty"] = [s.put(key(1000 + i), b"") for i in range(1000)]  # entry rows only
    st = s.stats()
    out["stats"] = [st.puts, st.admitted, st.refused, len(s), s.nbytes()]
    out["values"] = [s.get(key(1)) == b"b" * 100_000, s.get(key(2)) == b"c" * 60]
    out["gone"] = s.get(key(0)) is None
    out["problems"] = s.check()
    # 3. space comes back: puts are admitted again, without reopening
    os.unlink(os.path.join(shm, "filler"))
    out["again"] = [s.put(key(10), b"n" * 1_000), s.put(key(11), b"n" * 500_000)]
    out["problems_after"] = s.check()
    s.close()
    out["warnings"] = warnings
    out["left_at_end"] = left()
    print(json.dumps(out))
    """
)


def test_a_full_shm_is_a_cache_error_at_open_and_a_refused_put_later(
    small_shm: Path, shm_name: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", FULL_SHM, str(small_shm), shm_name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-1500:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "no space left in" in out["open"] and str(small_shm) in out["open"]
    assert out["left"] == ["filler"]  # not even the lock file
    assert not any(out["refused"].values()), out["refused"]
    tiny, empty = out["tiny"], out["empty"]
    # tiny values fit while their payload pages have room (the dropped key(0) freed some);
    # empty values need no payload, only entry rows, refused once rows need a new page
    assert tiny[0] and False in tiny and tiny == sorted(tiny, reverse=True)
    assert False in empty and empty == sorted(empty, reverse=True)
    puts, admitted, refused, items, nbytes = out["stats"]
    stored = 3 + sum(tiny) + sum(empty)  # key(0) was dropped: its new value was refused
    assert (puts, admitted, refused) == (3 + 5 + 1300, stored, 5 + 1300 - stored + 3)
    assert items == stored - 1 and nbytes == 100_000 + 60 + 60 * sum(tiny)
    assert out["values"] == [True, True] and out["gone"]
    assert out["problems"] == [] and out["problems_after"] == []
    assert out["again"] == [True, True]
    # a warning at each open (budget > free space), one when it filled up mid-run
    warnings = out["warnings"]
    assert len(warnings) == 3 and all(str(small_shm) in w for w in warnings), warnings
    assert "is full" in warnings[2]
    assert out["left_at_end"] == []


# ------------------------------------------------------------------ dropped without close


def test_a_store_collected_in_a_reference_cycle_raises_nothing(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The garbage collector may finalize the store's lock (closing its descriptors)
    before the store's __del__ runs: nothing may be raised ("Exception ignored in")."""
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    for _ in range(3):
        s = MemoryStore(shm_name, capacity=MiB)
        s.put(key(1), value(1, 100))
        s.cycle = s  # type: ignore[attr-defined]
        del s
        gc.collect()
    assert [str(u.exc_value) for u in unraisable] == []
    again = MemoryStore(shm_name, capacity=MiB)  # the store is still usable
    assert again.get(key(1)) == value(1, 100) and again.check() == []
    again.close()
    again.close()  # idempotent


# Many small entries (the index grows, F13): test_memory_index_growth.py.


def test_one_key_presence_answers_as_the_vectorised_lookup(
    make: Callable[..., MemoryStore],
) -> None:
    """``contains_many([key])`` (a worker's check of each miss) takes a single probe of the
    table; it must say what the vectorised lookup says: held, never held, deleted,
    replaced, and a malformed key refused the same way."""
    s = make()
    for i in range(50):
        assert s.put(key(i), value(i, 100))
    for i in range(0, 50, 3):
        assert s.delete(key(i))
    assert s.put(key(4), value(5, 300))  # replaced
    probe = [key(i) for i in range(80)]
    vectorised = s.contains_many(np.frombuffer(b"".join(probe), np.uint8).reshape(-1, 16))
    one_by_one = [bool(s.contains_many([k])[0]) for k in probe]
    assert one_by_one == vectorised.tolist()
    assert one_by_one == [(i < 50 and i % 3 != 0) or i == 4 for i in range(80)]
    assert [bool(s.contains_many((k,))[0]) for k in probe[:5]] == one_by_one[:5]
    for bad in ([b"short"], [b"x" * 17]):
        with pytest.raises((ValueError, TypeError)):
            s.contains_many(bad)  # type: ignore[arg-type]
