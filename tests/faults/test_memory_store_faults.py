"""Crashes never block the memory tier, never corrupt it, and leave nothing behind."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mmcache.errors import CacheError
from mmcache.stores import memory as memory_mod
from mmcache.stores._shm import Segment
from mmcache.stores.memory import (
    EntryState,
    MemoryStore,
    reclaim_orphans,
    store_dir,
    unlink_store,
)

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
    held_writing = int(store._esize[store._state == EntryState.WRITING].sum())
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
    assert int((store._state == EntryState.WRITING).sum()) == 0
    assert_whole_and_consistent(store)
    assert store.put(key_of(1), value_of(1)) and store.get(key_of(1)) == value_of(1)
    store.close()


def hold_the_lock_and_corrupt(name: str, ready: Any) -> None:
    store = MemoryStore(name, capacity=CAPACITY, create=False)
    with store._exclusive():
        store._h[memory_mod._H_NBYTES] += 12_345  # half-done bookkeeping
        store._h[memory_mod._H_ITEMS] += 7
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
        monkeypatch.setattr(memory_mod, "OPEN_TIMEOUT", 0.3)
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

    def broken(self: MemoryStore, e: int, k0: int, k1: int) -> None:
        raise MemoryError("simulated failure after the entry was written")

    monkeypatch.setattr(MemoryStore, "_insert_locked", broken)
    with pytest.raises(MemoryError):
        store.put(key_of(1), value_of(1))
    monkeypatch.undo()
    assert_whole_and_consistent(store)
    assert store.get(key_of(1)) is None
    assert store.put(key_of(1), value_of(1)) and store.get(key_of(1)) == value_of(1)
    store.close()


def die_while_creating(name: str, ready: Any) -> None:
    original = memory_mod.MemoryStore._bind

    def bind_then_die(self: MemoryStore, seg: Segment) -> None:
        original(self, seg)
        ready.set()
        time.sleep(600)  # header still says INITIALISING

    memory_mod.MemoryStore._bind = bind_then_die  # type: ignore[method-assign]
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
