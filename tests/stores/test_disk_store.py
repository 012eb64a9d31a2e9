"""Disk-tier behaviour beyond the store contract: persistence, processes, faults."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing as mp
import os
import pickle
import random
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from mmcache.errors import CacheError, ConfigError
from mmcache.stores.disk import DiskStore
from mmcache.stores.disk import reserve as disk_reserve
from mmcache.testing.store_contract import key


def _value(k: bytes, size: int | None = None) -> bytes:
    """Deterministic value of a key (what the kill -9 writer stores)."""
    n = size if size is not None else 1000 + int.from_bytes(k, "big") * 7919 % 20000
    digest = hashlib.sha256(k).digest()
    return (digest * (n // 32 + 1))[:n]


def _checked(payload: bytes) -> bytes:
    return payload + hashlib.blake2b(payload, digest_size=8).digest()


def _check(blob: bytes) -> bool:
    return hashlib.blake2b(blob[:-8], digest_size=8).digest() == blob[-8:]


# ---------------------------------------------------------------- persistence and layout


def test_entries_and_stats_persist_across_reopen(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "c", capacity=10_000, policy="lru") as store:
        for i in range(5):
            store.put(key(i), _value(key(i), 100), cost=i / 10, ctime=100.0 + i)
        store.get(key(1))
        store.get(key(99))
    with DiskStore(tmp_path / "c", capacity=10_000, policy="lru") as store:
        assert sorted(store.keys()) == [key(i) for i in range(5)]
        assert all(store.get(key(i)) == _value(key(i), 100) for i in range(5))
        info = store.info(key(3))
        assert info is not None
        assert (info.size, info.cost, info.ctime) == (100, 0.3, 103.0)
        stats = store.stats()  # counters are cumulative over runs
        assert (stats.puts, stats.hits, stats.misses) == (5, 1 + 5, 1)
        assert (stats.bytes, stats.items) == (500, 5)
        store.reset_stats()
        assert store.stats().hits == 0


def test_reads_recorded_before_close_order_lru_after_reopen(tmp_path: Path) -> None:
    clock = iter(range(1000)).__next__
    with DiskStore(tmp_path / "c", capacity=300, policy="lru", clock=lambda: clock()) as store:
        for i in range(3):
            store.put(key(i), b"x" * 100)
        store.get(key(0))  # buffered in-process, written on close
    with DiskStore(tmp_path / "c", capacity=300, policy="lru", clock=lambda: clock()) as store:
        assert store.put(key(3), b"y" * 100)
        assert sorted(store.keys()) == [key(0), key(2), key(3)]


def test_directory_and_file_modes(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        with DiskStore(tmp_path / "c", capacity=1000) as store:
            store.put(key(1), b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "c").st_mode) == 0o700
    names = sorted(os.listdir(tmp_path / "c"))
    assert names == ["data.mdb", "lock.mdb", "stats.i64"]
    for name in names:
        assert stat.S_IMODE(os.stat(tmp_path / "c" / name).st_mode) == 0o600


def test_other_format_major_is_refused(tmp_path: Path) -> None:
    DiskStore(tmp_path / "c", capacity=1000).close()
    with lmdb.open(str(tmp_path / "c"), max_dbs=3) as env:
        info = env.open_db(b"info", create=False)
        with env.begin(write=True) as txn:
            txn.put(b"format", struct.pack("<8sHH", b"MMCDISK\x00", 99, 0), db=info)
    with pytest.raises(CacheError, match=r"format 99\.0"):
        DiskStore(tmp_path / "c", capacity=1000)


def test_foreign_lmdb_is_refused_and_left_alone(tmp_path: Path) -> None:
    with lmdb.open(str(tmp_path / "c"), max_dbs=2) as env:
        other = env.open_db(b"theirs")
        with env.begin(write=True) as txn:
            txn.put(b"k", b"v", db=other)
    before = (tmp_path / "c" / "data.mdb").read_bytes()
    with pytest.raises(CacheError, match="did not create"):
        DiskStore(tmp_path / "c", capacity=1000)
    assert (tmp_path / "c" / "data.mdb").read_bytes() == before


def test_smaller_capacity_trims_on_open(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "c", capacity=1000, policy="keep") as store:
        for i in range(10):
            assert store.put(key(i), b"z" * 100)
    with DiskStore(tmp_path / "c", capacity=450, policy="keep") as store:
        assert store.nbytes() <= 450
        assert len(store) == 4
        assert store.stats().evictions == 6


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        DiskStore(tmp_path / "a", capacity=-1)
    with pytest.raises(CacheError):
        DiskStore(tmp_path / "b", capacity=100, map_size=0)
    with DiskStore(tmp_path / "c", capacity="1MiB") as store:
        assert store.capacity() == 1024**2
        with pytest.raises(ValueError, match="cost"):
            store.put(key(1), b"x", cost=-1.0)
        with pytest.raises(TypeError):
            store.put(key(1), "text")  # type: ignore[arg-type]


def test_compact_copy_is_a_smaller_working_cache(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "c", capacity=10 << 20, policy="lru") as store:
        for i in range(40):
            store.put(key(i), bytes([i]) * 100_000)
        for i in range(30):
            store.delete(key(i))
        store.compact_copy(tmp_path / "copy")
        with pytest.raises(CacheError):
            store.compact_copy(tmp_path / "copy")  # never overwrites an environment
    size = (tmp_path / "c" / "data.mdb").stat().st_size
    assert (tmp_path / "copy" / "data.mdb").stat().st_size < size / 2
    with DiskStore(tmp_path / "copy", capacity=10 << 20, policy="lru") as copy:
        assert sorted(copy.keys()) == [key(i) for i in range(30, 40)]
        assert copy.get(key(35)) == bytes([35]) * 100_000
        assert copy.stats().bytes == 10 * 100_000


# ---------------------------------------------------------------- policies on disk


def test_value_policy_is_default_and_replaces_only_denser(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "c", capacity=300) as store:
        for i in range(3):
            assert store.put(key(i), b"a" * 100, cost=1.0)
        assert not store.put(key(3), b"b" * 100, cost=1.2)  # within the margin
        assert store.put(key(4), b"c" * 100, cost=10.0)  # clearly denser
        assert store.contains(key(4))
        assert len(store) == 3
        assert store.stats().evictions == 1


def test_lru_evicts_in_batches_value_per_entry(tmp_path: Path) -> None:
    # lru evicts at least 1/256 of the capacity (here 1000 bytes) at a time
    with DiskStore(tmp_path / "lru", capacity=256_000, policy="lru") as store:
        for i in range(10):
            store.put(key(i), b"s" * 100)
        store.put(key(100), b"b" * 255_000)
        assert store.put(key(200), b"n" * 100)
        assert store.stats().evictions == 10
        assert sorted(store.keys()) == [key(100), key(200)]
    # value decides per entry: it evicts only what the newcomer needs
    with DiskStore(tmp_path / "value", capacity=256_000, policy="value") as store:
        for i in range(10):
            store.put(key(i), b"s" * 100, cost=0.01)
        store.put(key(100), b"b" * 255_000, cost=100.0)
        assert store.put(key(200), b"n" * 100, cost=1.0)
        assert store.stats().evictions == 1
        assert len(store) == 11


def test_two_stores_on_one_directory_share_data_and_budget(tmp_path: Path) -> None:
    a = DiskStore(tmp_path / "c", capacity=1000, policy="lru")
    b = DiskStore(tmp_path / "c", capacity=1000, policy="lru")
    try:
        for i in range(8):
            assert a.put(key(i), b"a" * 100)
        for i in range(0, 8, 2):  # b removes some of a's entries behind a's snapshot
            assert b.delete(key(i))
        for i in range(8, 14):
            assert b.put(key(i), b"b" * 100)
        for i in range(20, 40):
            assert a.put(key(i), b"c" * 100)
            assert a.nbytes() <= 1000
        assert b.nbytes() == sum(len(a.get(k) or b"") for k in b.keys())  # noqa: SIM118
        b.close()
        assert a.get(key(39)) == b"c" * 100  # a's environment survives b's close
    finally:
        a.close()
        b.close()


def test_get_many_reads_in_one_call(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "c", capacity=1000) as store:
        store.put(key(1), b"one")
        store.put(key(2), b"two")
        assert store.get_many([key(1), key(3), key(2)]) == [b"one", None, b"two"]
        stats = store.stats()
        assert (stats.hits, stats.misses) == (2, 1)
        with pytest.raises(ValueError):
            store.get_many([key(1), b"short"])


def test_views_lend_buffers_of_a_batch(tmp_path: Path) -> None:
    # view_many is gone (only a benchmark used it): a batch is one view per key
    with DiskStore(tmp_path / "c", capacity=1000) as store:
        store.put(key(1), b"one")
        store.put(key(2), b"two")
        with contextlib.ExitStack() as stack:
            views = [stack.enter_context(store.view(k)) for k in (key(2), key(3), key(1))]
            assert [None if v is None else bytes(v) for v in views] == [b"two", None, b"one"]
        stats = store.stats()
        assert (stats.hits, stats.misses) == (2, 1)


def test_put_many_commits_a_batch_with_the_same_rules_as_put(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "c", capacity=300, policy="keep") as store:
        entries = [(key(i), bytes([i]) * 100, 0.0, float(i)) for i in range(4)]
        entries.append((key(9), b"x" * 301, 0.0, 0.0))  # oversize
        assert store.put_many(entries) == [True, True, True, False, False]
        assert sorted(store.keys()) == [key(0), key(1), key(2)]
        stats = store.stats()
        assert (stats.puts, stats.admitted, stats.refused) == (5, 3, 2)
        info = store.info(key(2))
        assert info is not None
        assert info.ctime == 2.0


def test_put_many_keeps_what_fits_when_the_map_fills(tmp_path: Path) -> None:
    big = b"m" * 150_000
    with DiskStore(tmp_path / "c", capacity=100 << 20, map_size=2 << 20) as store:
        results = store.put_many([(key(i), big, 0.0, 0.0) for i in range(30)])
        assert results[0] is True
        assert False in results
        assert len(store) == results.count(True)
        assert store.stats().refused == results.count(False)


# ---------------------------------------------------------------- processes


def _fork_child(store: DiskStore, q: mp.Queue[object]) -> None:
    try:
        q.put((store.get(key(1)), store.put(key(os.getpid()), b"child"), store.get(key(2))))
        store.close()
    except BaseException as exc:  # reported to the parent, which would wait otherwise
        q.put(repr(exc))


def test_forked_child_uses_the_store_while_parent_writes(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c", capacity=1 << 20, policy="lru")
    store.put(key(1), b"one")
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:  # keeps the parent busy across the forks
        try:
            i = 0
            while not stop.is_set():
                store.put(key(2), b"two")
                assert store.get(key(1)) == b"one"
                i += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    ctx = mp.get_context("fork")
    q: mp.Queue[object] = ctx.Queue()
    try:
        children = []
        for _ in range(3):
            p = ctx.Process(target=_fork_child, args=(store, q))
            p.start()
            assert q.get(timeout=60) == (b"one", True, b"two")
            p.join(timeout=60)
            assert p.exitcode == 0
            children.append(p.pid)
    finally:
        stop.set()
        thread.join()
        q.close()
    assert not errors
    for pid in children:
        assert store.get(key(pid)) == b"child"
    assert store.stats().hits >= 6  # the children's reads are counted node-wide
    store.close()


def _spawn_child(store: DiskStore, q: mp.Queue[object]) -> None:
    try:
        q.put((store.get(key(1)), store.put(key(7), b"from spawn")))
        store.close()
    except BaseException as exc:
        q.put(repr(exc))


def test_spawned_child_reopens_from_pickle(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "c", capacity=1 << 20) as store:
        store.put(key(1), b"one")
        state = store.__getstate__()
        assert set(state) == {"path", "capacity", "policy", "readonly", "clock", "map_size", "mode"}
        ctx = mp.get_context("spawn")
        q: mp.Queue[object] = ctx.Queue()
        p = ctx.Process(target=_spawn_child, args=(store, q))
        p.start()
        assert q.get(timeout=120) == (b"one", True)
        p.join(timeout=60)
        assert p.exitcode == 0
        assert store.get(key(7)) == b"from spawn"


def test_unpickling_in_the_same_process_shares_the_environment(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "c", capacity=1000)
    twin = pickle.loads(pickle.dumps(store))
    try:
        store.put(key(1), b"x")
        assert twin.get(key(1)) == b"x"
        twin.close()
        assert store.get(key(1)) == b"x"
    finally:
        twin.close()
        store.close()


def _mixed_worker(path: str, seed: int, q: mp.Queue[object]) -> None:
    rng = random.Random(seed)
    over = 0
    try:
        with DiskStore(path, capacity=150_000, policy="lru") as store:
            for _ in range(300):
                k = key(rng.randrange(200))
                op = rng.random()
                if op < 0.5:
                    store.put(k, _value(k))
                elif op < 0.9:
                    got = store.get(k)
                    assert got is None or got == _value(k)
                else:
                    store.delete(k)
                over += store.nbytes() > 150_000
        q.put(over)
    except BaseException as exc:
        q.put(repr(exc))


def test_concurrent_processes_keep_budget_and_values(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    DiskStore(path, capacity=150_000).close()
    ctx = mp.get_context("fork")
    q: mp.Queue[object] = ctx.Queue()
    procs = [ctx.Process(target=_mixed_worker, args=(path, seed, q)) for seed in range(3)]
    for p in procs:
        p.start()
    overs = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert overs == [0, 0, 0]
    with DiskStore(path, capacity=150_000, policy="lru") as store:
        keys = list(store.keys())
        assert all(store.get(k) == _value(k) for k in keys)
        totals = (store.nbytes(), len(store))
        assert totals == (sum(len(_value(k)) for k in keys), len(keys))
        assert store.rebuild_totals() == totals
        assert store.stats().puts > 0


_WRITER = textwrap.dedent(
    """
    import hashlib, sys
    from mmcache.stores.disk import DiskStore

    def value(k):
        n = 1000 + int.from_bytes(k, "big") * 7919 % 20000
        return (hashlib.sha256(k).digest() * (n // 32 + 1))[:n]

    store = DiskStore(sys.argv[1], capacity=200_000, policy="lru")
    print("ready", flush=True)
    i = int(sys.argv[2])
    while True:
        k = (i % 300).to_bytes(16, "big")
        if i % 7 == 0:
            store.delete(k)
        else:
            store.put(k, value(k))
            store.get(((i * 31) % 300).to_bytes(16, "big"))
        i += 1
    """
)


def test_kill_9_during_puts_leaves_a_consistent_store(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    rng = random.Random(0)
    for round_ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, path, str(round_ * 1000)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.1, 0.4))
        finally:
            proc.kill()
            proc.wait()
    with DiskStore(path, capacity=200_000, policy="lru") as store:
        keys = list(store.keys())
        assert keys, "the writer never committed anything"
        for k in keys:
            assert store.get(k) == _value(k)
        stats = store.stats()
        assert stats.bytes <= 200_000
        assert (stats.bytes, stats.items) == (sum(len(_value(k)) for k in keys), len(keys))
        assert store.rebuild_totals() == (stats.bytes, stats.items)
        assert store.verify(lambda blob: True) == []
        assert store.put(key(100_000), b"still writable")


def test_adopts_a_map_grown_by_another_process(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    with DiskStore(path, capacity=100 << 20, map_size=1 << 20) as small:
        small.put(key(1), b"first")
        grow = (
            "import sys\n"
            "from mmcache.stores.disk import DiskStore\n"
            "with DiskStore(sys.argv[1], capacity=100 << 20, map_size=64 << 20) as big:\n"
            "    for i in range(2, 40):\n"
            "        assert big.put(i.to_bytes(16, 'big'), bytes(100_000))\n"
        )
        subprocess.run([sys.executable, "-c", grow, path], check=True)
        assert small.get(key(1)) == b"first"
        assert small.get(key(39)) == bytes(100_000)
        assert len(small) == 39


# ---------------------------------------------------------------- faults


def test_map_full_put_fails_cleanly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    big = b"m" * 150_000
    with caplog.at_level(logging.WARNING, logger="mmcache.stores.disk"):
        store = DiskStore(tmp_path / "c", capacity=100 << 20, map_size=2 << 20, policy="keep")
        results = [store.put(key(i), big) for i in range(30)]
    try:
        assert results[0] is True
        assert results.count(False) > 0
        full = [r for r in caplog.records if "full" in r.getMessage()]
        assert len(full) == 1  # logged once
        stats = store.stats()
        assert stats.refused == results.count(False)
        held = list(store.keys())
        assert len(held) == results.count(True) == stats.items
        assert store.nbytes() == len(held) * len(big)
        assert all(store.get(k) == big for k in held)
        # the store keeps working: freeing space lets puts in again
        for k in held[:3]:
            assert store.delete(k)
        assert store.put(key(999), big)
        assert store.get(key(999)) == big
    finally:
        store.close()


def test_readonly_store_reads_and_never_writes(tmp_path: Path) -> None:
    with DiskStore(tmp_path / "c", capacity=1000) as store:
        store.put(key(1), b"kept")
    data = tmp_path / "c" / "data.mdb"
    before = data.read_bytes()
    with DiskStore(tmp_path / "c", capacity=1000, readonly=True) as ro:
        assert ro.get(key(1)) == b"kept"
        assert ro.put(key(2), b"new") is False
        assert ro.stats().refused == 1
        with pytest.raises(CacheError, match="read-only"):
            ro.delete(key(1))
        with pytest.raises(CacheError, match="read-only"):
            ro.expire(1e12)
        with pytest.raises(CacheError, match="read-only"):
            DiskStore(tmp_path / "c", capacity=1000)  # rw while this process has it ro
    assert data.read_bytes() == before
    with pytest.raises(CacheError):
        DiskStore(tmp_path / "missing", capacity=1000, readonly=True)
    assert not (tmp_path / "missing").exists()


def test_verify_finds_a_corrupted_value(tmp_path: Path) -> None:
    path = tmp_path / "c"
    with DiskStore(path, capacity=10_000) as store:
        for i in range(5):
            store.put(key(i), _checked(bytes([i]) * 200))
        assert store.verify(_check) == []
    with lmdb.open(str(path), max_dbs=3) as env:  # bypass the store: flip bytes in place
        data = env.open_db(b"data", create=False)
        with env.begin(write=True) as txn:
            blob = bytearray(txn.get(key(3), db=data) or b"")
            blob[10] ^= 0xFF
            txn.put(key(3), bytes(blob), db=data)
            txn.put(key(4), b"short", db=data)  # disagrees with its meta record
    with DiskStore(path, capacity=10_000) as store:
        assert sorted(store.verify(_check)) == [key(3), key(4)]
        assert store.stats().corrupt == 2
        assert store.rebuild_totals() == (4 * 208, 4)  # key 4 (size mismatch) removed
        assert store.discard(key(3), why="corrupt")
        assert store.stats().corrupt == 3
        assert store.verify(_check) == []


# ---------------------------------------------------------------- a full file system


def test_the_lock_file_has_the_size_lmdb_gives_it(tmp_path: Path) -> None:
    """The store allocates lock.mdb before LMDB opens it: at exactly LMDB's size, so
    LMDB neither grows it (a sparse tail) nor reads a larger reader table from it."""
    with DiskStore(tmp_path / "c", capacity=10_000) as store:
        assert store.put(key(1), b"x")
        assert (tmp_path / "c" / "lock.mdb").stat().st_size == disk_reserve._LOCK_FILE_SIZE
    with lmdb.open(str(tmp_path / "c"), max_dbs=3) as env:  # what LMDB reads back from it
        assert env.info()["max_readers"] == disk_reserve.MAX_READERS


# A child process: a regression (SIGBUS from LMDB's mapped lock file) must fail the test.
_FULL_AT_OPEN = textwrap.dedent(
    """
    import contextlib, json, mmap, os, sys
    from mmcache.errors import CacheError
    from mmcache.stores import disk
    from mmcache.stores.disk import reserve
    mnt = sys.argv[1]
    path = os.path.join(mnt, "cache")
    spare = os.path.join(mnt, "spare")
    lock_pages = -(-reserve._LOCK_FILE_SIZE // mmap.PAGESIZE)
    with open(spare, "wb") as f:  # room for lock.mdb and one page: half of data.mdb's metas
        f.write(bytes((lock_pages + 1) * mmap.PAGESIZE))
    with contextlib.suppress(OSError), open(os.path.join(mnt, "filler"), "wb", 0) as f:
        while True:
            f.write(bytes(4096))

    def attempt():
        try:
            with disk.DiskStore(path, capacity="1MiB") as store:
                store.put(bytes(16), b"value")
                return "opened: " + repr(store.get(bytes(16)))
        except CacheError as exc:
            return str(exc)

    out = {"full": attempt()}
    os.unlink(spare)
    out["room for lock.mdb only"] = attempt()
    os.unlink(os.path.join(mnt, "filler"))
    out["space freed"] = attempt()
    st = os.stat(os.path.join(path, "lock.mdb"))
    out["lock"] = [st.st_size, st.st_blocks * 512]
    print(json.dumps(out))
    """
)


def test_a_full_file_system_at_open_is_a_cache_error(
    tmpfs: Callable[[str, str], Path],
) -> None:
    mnt = tmpfs("fs", "512k")
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_AT_OPEN, str(mnt)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-1500:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in ("full", "room for lock.mdb only"):
        assert "no space left" in out[case].lower() and str(mnt / "cache") in out[case], out[case]
    # nothing half-made: the cache opens and works once there is room (a data.mdb whose
    # meta pages were half written would be refused forever as "not an LMDB file")
    assert out["space freed"] == "opened: b'value'"
    size, allocated = out["lock"]
    assert size == disk_reserve._LOCK_FILE_SIZE and allocated >= size  # no hole left to fault
