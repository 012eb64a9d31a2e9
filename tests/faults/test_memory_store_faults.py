"""Crashes never block the memory tier, never corrupt it, and leave nothing behind."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.errors import CacheError
from mmcache.stores.memory import (
    EntryState,
    MemoryStore,
    reclaim_orphans,
    store_dir,
    unlink_store,
)
from mmcache.stores.memory import session as session_mod
from mmcache.stores.memory.layout import H_ITEMS, H_NBYTES
from mmcache.stores.memory.session import Session
from mmcache.stores.memory.shm import Segment
from mmcache.stores.memory.table import EntryTable

FORK = mp.get_context("fork")
# 300 B and 20 KB are copied inside the exclusive section, 200 KB and 1 MB outside it.
SIZES = (300, 20_000, 200_000, 1_000_000)
N_KEYS = 64
CAPACITY = 4_000_000


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "big")


def value_of(i: int) -> bytes:
    size = SIZES[i % len(SIZES)]
    word = (i * 0x9E3779B97F4A7C15 + 1) % (1 << 64)
    pattern = np.arange(size // 8 + 1, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(word)
    return bytes(pattern.tobytes()[:size])


def shm_files(name: str) -> list[str]:
    return glob.glob(f"{store_dir()}/mmcache-{glob.escape(name)}*")


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"tmemf-{uuid.uuid4().hex[:12]}"
    yield name
    unlink_store(name)
    assert shm_files(name) == []


def assert_whole_and_consistent(store: MemoryStore) -> None:
    """Only whole values are served and the shared counts match the entries."""
    assert store.check() == []
    keys = list(store.keys())
    for k in keys:
        assert store.get(k) == value_of(int.from_bytes(k, "big"))
    sizes = [len(value_of(int.from_bytes(k, "big"))) for k in keys]
    table = store._session.table
    held_writing = int(table.size[table.state == EntryState.WRITING].sum())
    assert store.nbytes() == sum(sizes) + held_writing <= store.capacity()


def put_forever(name: str, seed: int, ready: Any) -> None:
    store = MemoryStore(name, capacity=CAPACITY, create=False, policy="lru")
    rng = np.random.default_rng(seed)
    ready.set()
    while True:
        i = int(rng.integers(0, N_KEYS))
        store.put(key_of(i), value_of(i))
        if rng.random() < 0.1:
            store.delete(key_of(int(rng.integers(0, N_KEYS))))


OPEN_AND_CHECK = """
import sys
from mmcache.stores.memory import MemoryStore
s = MemoryStore(sys.argv[1], capacity=1, create=False)
assert s.check() == [], s.check()
print(len(s))
s.close()
"""


def test_writers_killed_at_random_moments_leave_a_whole_store(shm_name: str) -> None:
    store = MemoryStore(shm_name, capacity=CAPACITY, policy="lru")
    rng = np.random.default_rng(0)
    for round_ in range(10):
        ready = FORK.Event()
        p = FORK.Process(target=put_forever, args=(shm_name, round_, ready))
        p.start()
        assert ready.wait(30)
        time.sleep(float(rng.uniform(0.02, 0.25)))
        p.kill()  # SIGKILL: no cleanup, possibly inside the lock or mid-copy
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
    # A fresh process opens it without blocking and finds it consistent.
    proc = subprocess.run(
        [sys.executable, "-c", OPEN_AND_CHECK, shm_name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 0
    assert_whole_and_consistent(store)
    store.gc()
    assert int((store._session.table.state == EntryState.WRITING).sum()) == 0
    assert_whole_and_consistent(store)
    assert store.put(key_of(1), value_of(1)) and store.get(key_of(1)) == value_of(1)
    store.close()


def hold_the_lock_and_corrupt(name: str, ready: Any) -> None:
    store = MemoryStore(name, capacity=CAPACITY, create=False)
    with store._session.exclusive():
        store._session.meta.header[H_NBYTES] += 12_345  # half-done bookkeeping
        store._session.meta.header[H_ITEMS] += 7
        ready.set()
        time.sleep(600)


def test_a_process_killed_inside_the_lock_blocks_nobody(shm_name: str) -> None:
    store = MemoryStore(shm_name, capacity=CAPACITY)
    for i in range(6):
        store.put(key_of(i), value_of(i))
    ready = FORK.Event()
    p = FORK.Process(target=hold_the_lock_and_corrupt, args=(shm_name, ready))
    p.start()
    assert ready.wait(30)
    p.kill()
    p.join(10)
    t0 = time.monotonic()
    other = MemoryStore(shm_name, capacity=CAPACITY, create=False)
    assert time.monotonic() - t0 < 5
    assert_whole_and_consistent(other)
    assert len(other) == 6
    # The store object that was open all along sees the repaired state too.
    assert store.get(key_of(0)) == value_of(0) and store.nbytes() == other.nbytes()
    other.close()
    store.close()


def test_a_live_lock_holder_makes_open_time_out(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryStore(shm_name, capacity=CAPACITY)
    ready = FORK.Event()
    p = FORK.Process(target=hold_the_lock_and_corrupt, args=(shm_name, ready))
    p.start()
    try:
        assert ready.wait(30)
        monkeypatch.setattr(session_mod, "OPEN_TIMEOUT", 0.3)
        with pytest.raises(CacheError, match="timed out"):
            MemoryStore(shm_name, capacity=CAPACITY, create=False)
    finally:
        p.kill()
        p.join(10)
    store.close()


def stall_in_copy(name: str, ready: Any) -> None:
    def stuck(self: Segment, offset: int, data: memoryview) -> None:
        ready.set()
        time.sleep(600)

    Segment.write = stuck  # type: ignore[method-assign]
    store = MemoryStore(name, capacity=CAPACITY, create=False)
    store.put(key_of(3), value_of(3))


def test_a_half_written_entry_of_a_dead_writer_is_reclaimed(shm_name: str) -> None:
    store = MemoryStore(shm_name, capacity=CAPACITY)
    ready = FORK.Event()
    p = FORK.Process(target=stall_in_copy, args=(shm_name, ready))
    p.start()
    assert ready.wait(30)
    # While the writer lives, its reservation is invisible and not stolen.
    assert store.get(key_of(3)) is None
    assert not store.put(key_of(3), value_of(3))
    assert store.nbytes() == len(value_of(3))  # reserved bytes count against the budget
    p.kill()
    p.join(10)
    assert store.put(key_of(3), value_of(3))  # the dead writer's entry is reclaimed
    assert store.get(key_of(3)) == value_of(3)
    assert_whole_and_consistent(store)
    assert store.gc() == 0
    store.close()


def test_an_error_inside_a_critical_section_is_repaired(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryStore(shm_name, capacity=CAPACITY)
    store.put(key_of(0), value_of(0))

    def broken(self: EntryTable, e: int, k0: int, k1: int) -> None:
        raise MemoryError("simulated failure after the entry was written")

    monkeypatch.setattr(EntryTable, "insert", broken)
    with pytest.raises(MemoryError):
        store.put(key_of(1), value_of(1))
    monkeypatch.undo()
    assert_whole_and_consistent(store)
    assert store.get(key_of(1)) is None
    assert store.put(key_of(1), value_of(1)) and store.get(key_of(1)) == value_of(1)
    store.close()


def die_while_creating(name: str, ready: Any) -> None:
    original = Session._bind

    def bind_then_die(self: Session, seg: Segment) -> None:
        original(self, seg)
        ready.set()
        time.sleep(600)  # header still says INITIALISING

    Session._bind = bind_then_die  # type: ignore[method-assign]
    MemoryStore(name, capacity=CAPACITY)


def test_a_creator_that_died_while_initialising_is_replaced(shm_name: str) -> None:
    ready = FORK.Event()
    p = FORK.Process(target=die_while_creating, args=(shm_name, ready))
    p.start()
    assert ready.wait(30)
    p.kill()
    p.join(10)
    assert os.path.exists(f"{store_dir()}/mmcache-{shm_name}-meta")
    assert reclaim_orphans(shm_name)  # the node-wide scan removes it...
    assert shm_files(shm_name) == []
    p = FORK.Process(target=die_while_creating, args=(shm_name, ready := FORK.Event()))
    p.start()
    assert ready.wait(30)
    p.kill()
    p.join(10)
    store = MemoryStore(shm_name, capacity=CAPACITY)  # ...and so does the next opener
    assert store.put(key_of(0), value_of(0)) and store.check() == []
    store.close()


def attach_and_wait(name: str, ready: Any) -> None:
    store = MemoryStore(name, capacity=CAPACITY, temporary=True)
    ready.set()
    time.sleep(600)
    store.close()


def test_a_temporary_store_of_dead_processes_is_reclaimed(shm_name: str) -> None:
    ready = FORK.Event()
    p = FORK.Process(target=attach_and_wait, args=(shm_name, ready))
    p.start()
    assert ready.wait(30)
    assert reclaim_orphans(shm_name) == []  # its user is alive
    assert os.path.exists(f"{store_dir()}/mmcache-{shm_name}-meta")
    p.kill()
    p.join(10)
    removed = reclaim_orphans(shm_name)
    assert f"{store_dir()}/mmcache-{shm_name}-meta" in removed
    assert shm_files(shm_name) == []


# ------------------------------------------------------------------ a truncated data segment


def data_segment(store: MemoryStore) -> str:
    return next(p for p in store.segment_paths() if p[-5:-3] == "-d")


def test_a_truncated_data_segment_is_removed_by_gc(shm_name: str, tmp_path: Path) -> None:
    """`: > /dev/shm/...-dNNN` between runs (SIGBUS while mapped cannot be prevented):
    the error's advice, `mmcache gc`, must remove the store."""
    store = MemoryStore(shm_name, capacity=CAPACITY, owner_path=str(tmp_path))
    assert store.put(key_of(0), value_of(0))
    segment = data_segment(store)
    store.close()
    os.truncate(segment, 0)
    removed = reclaim_orphans(shm_name)
    assert segment in removed and shm_files(shm_name) == []


def test_a_truncated_data_segment_is_recreated_when_nobody_is_attached(
    shm_name: str, tmp_path: Path
) -> None:
    store = MemoryStore(shm_name, capacity=CAPACITY, owner_path=str(tmp_path))
    assert store.put(key_of(0), value_of(0))
    segment = data_segment(store)
    store.close()
    os.truncate(segment, 0)
    again = MemoryStore(shm_name, capacity=CAPACITY, owner_path=str(tmp_path))  # a later run
    try:
        assert again.get(key_of(0)) is None  # never a CacheError on the first read
        assert again.put(key_of(0), value_of(0)) and again.get(key_of(0)) == value_of(0)
        assert again.check() == []
    finally:
        again.close()


@pytest.mark.parametrize("fallback", ["raise", "uncached"])
def test_a_truncated_data_segment_in_use_is_a_failed_tier(
    shm_name: str, tmp_path: Path, fallback: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process still attached: not re-created under it; Cache treats the tier as
    failed (fallback), and a process that had not mapped the segment yet reads misses."""
    from mmcache import cache as cache_mod
    from mmcache.cache import Cache

    monkeypatch.setattr(cache_mod, "_memory_name", lambda root, identity=None: shm_name)
    first = Cache(tmp_path / "root", memory=CAPACITY, disk=None)
    try:
        first.put(key_of(0), {"x": np.arange(10)})
        assert first.memory is not None
        other = MemoryStore(shm_name, capacity=CAPACITY)  # attached, nothing mapped yet
        os.truncate(data_segment(first.memory), 0)
        assert other.get(key_of(0)) is None and not other.put(key_of(1), b"x" * 10)
        other.close()
        if fallback == "raise":
            with pytest.raises(CacheError, match="truncated"):
                Cache(tmp_path / "root", memory=CAPACITY, disk=None)
        else:
            with Cache(tmp_path / "root", memory=CAPACITY, disk=None, fallback="uncached") as c:
                assert c.memory is None and "truncated" in c.stats().degraded["memory"]
    finally:
        first.close()


# ------------------------------------------------------------------ a stopped lock holder

STOP_INSIDE = """
import os, signal, sys
from mmcache.stores.memory import MemoryStore
store = MemoryStore(sys.argv[1], capacity=1 << 22)
store.put(bytes(16), b"v" * 100)
if sys.argv[2] == "exclusive":
    section = store._session.exclusive()  # a put's critical section
else:
    section = store.view(bytes(16))  # a reader's (a gather's) section
with section:
    print("inside", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


def wait_stopped(pid: int) -> None:
    for _ in range(500):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError("the child never stopped")


@pytest.mark.parametrize("section", ["exclusive", "shared"])
def test_a_stopped_lock_holder_costs_a_bounded_wait_and_one_warning(
    shm_name: str, section: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(session_mod, "DATA_LOCK_TIMEOUT", 0.5, raising=False)
    store = MemoryStore(shm_name, capacity=1 << 22)
    child = subprocess.Popen(
        [sys.executable, "-c", STOP_INSIDE, shm_name, section], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "inside"
        wait_stopped(child.pid)
        results: dict[str, Any] = {}

        def use() -> None:
            results["put"] = store.put(key_of(1), b"w" * 100)
            results["get"] = store.get(bytes(16))
            out = np.zeros((1, 10), np.uint8)
            results["gather"] = store.gather([bytes(16)], 0, 10, out).tolist()

        with caplog.at_level("WARNING", logger="mmcache"):
            t0 = time.monotonic()
            user = threading.Thread(target=use, daemon=True)
            user.start()
            user.join(10)
            waited = time.monotonic() - t0
            assert not user.is_alive(), "a stopped holder blocked this process"
        assert results["put"] is False  # refused, not blocked
        if section == "exclusive":
            assert results["get"] is None and results["gather"] == [False]  # misses
        else:
            assert results["get"] == b"v" * 100 and results["gather"] == [True]  # readers share
        assert waited < 5  # one bounded wait, then no wait while it stays stuck
        warned = [r.getMessage() for r in caplog.records if str(child.pid) in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    finally:
        child.kill()  # SIGKILL ends a stopped process too; the kernel drops its lock
        child.wait(10)
    time.sleep(0.6)  # the holder is gone: the store works again
    assert store.put(key_of(2), b"z" * 100) and store.get(key_of(2)) == b"z" * 100
    assert store.check() == []
    store.close()


# ------------------------------------------------------------------ gc stays in its root


def test_gc_of_one_root_leaves_the_orphans_of_other_roots_unless_asked(tmp_path: Path) -> None:
    from mmcache import cli
    from mmcache.cache import Cache, _memory_name

    mine, other = tmp_path / "mine", tmp_path / "other"
    for root in (mine, other):
        with Cache(root, memory="1MiB", disk="1MiB") as cache:
            cache.put(key_of(0), {"x": np.arange(4)})
    other_name = _memory_name(other)  # (named after the root's identity, gone with it)
    other_files = shm_files(other_name)
    assert other_files
    for path in other.rglob("*"):
        if path.is_file():
            path.unlink()
    for path in sorted(other.rglob("*"), reverse=True):
        path.rmdir()
    other.rmdir()  # an orphan now: its owner path is gone
    try:
        assert cli.main(["gc", "--cache", str(mine)]) == 0
        assert shm_files(other_name) == other_files  # not this root's to remove
        assert cli.main(["gc", "--cache", str(mine), "--all"]) == 0
        assert shm_files(other_name) == []
        assert shm_files(_memory_name(mine))  # its root exists: kept
    finally:
        unlink_store(_memory_name(mine))
        unlink_store(other_name)


def test_gc_all_sweeps_the_nodes_orphans_without_a_cache_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 22: ``mmcache gc --all`` needs no root (it used to say ``--cache is
    required``): the orphans of a private and of a group-shared root whose folders are
    gone are removed; a live root's store is kept."""
    from mmcache import cli
    from mmcache.cache import Cache, _memory_name

    live, private, shared = tmp_path / "live", tmp_path / "private", tmp_path / "shared"
    for root, mode in ((live, 0o600), (private, 0o600), (shared, 0o660)):
        with Cache(root, memory="1MiB", disk=None, mode=mode) as cache:
            cache.put(key_of(0), {"x": np.arange(4)})
    names = {root: _memory_name(root) for root in (live, private, shared)}
    shared_files = glob.glob(f"{store_dir(os.getegid())}/mmcache-{names[shared]}*")
    assert shared_files and shm_files(names[private])
    shutil.rmtree(private)
    shutil.rmtree(shared)  # orphans now: their owner paths are gone
    try:
        assert cli.main(["gc", "--all"]) == 0
        assert "orphaned shared-memory segments removed" in capsys.readouterr().out
        assert shm_files(names[private]) == []
        assert not any(os.path.exists(p) for p in shared_files)
        assert shm_files(names[live])  # its root exists: kept
        for argv in (["gc"], ["gc", "--all", "--older-than", "1d"]):
            assert cli.main(argv) == 2
            err = capsys.readouterr().err
            assert "needs --cache ROOT" in err and len(err.splitlines()) == 1
        assert "--older-than needs --cache" in err
    finally:
        for name in names.values():
            unlink_store(name)
            unlink_store(name, group=os.getegid())
