"""F13: the memory tier's index grows, so many tiny samples use the whole budget.

The index starts at one entry per 4 KiB of budget and, when it is full while bytes are
free, is replaced by a larger generation (``stores/memory/index.py``) that every
attached process adopts at its next locked operation. Tested here: tiny samples fill
the budget, ``index_capacity``/``memory_entries`` caps the growth, a spawned process
attached before a grow reads what was written before and after it, and a process
killed (SIGKILL) in the middle of a grow leaves a store the next opener repairs.
"""

from __future__ import annotations

import glob
import logging
import multiprocessing as mp
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.errors import CacheError
from mmcache.stores.memory import MemoryStore, store_dir

KiB, MiB = 1 << 10, 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def value(i: int, size: int = 100) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def index_files(name: str) -> list[str]:
    return sorted(glob.glob(f"{store_dir()}/mmcache-{glob.escape(name)}-i*"))


@pytest.fixture
def make(shm_name: str) -> Iterator[Callable[..., MemoryStore]]:
    opened: list[MemoryStore] = []

    def factory(**kw: Any) -> MemoryStore:
        kw.setdefault("capacity", 2 * MiB)
        s = MemoryStore(kw.pop("name", shm_name), **kw)
        opened.append(s)
        return s

    yield factory
    for s in opened:
        s.close()


def test_four_thousand_tiny_samples_are_all_held_in_two_mib(
    make: Callable[..., MemoryStore], caplog: pytest.LogCaptureFixture
) -> None:
    """4,000 samples of ~100 B in 2 MiB: the first index (1,024 entries) grows; nothing is
    evicted or refused while bytes are free, and no "index is full" warning."""
    s = make(policy="lru")
    first = s.index_entries
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        assert all(s.put(key(i), value(i, 96 + i % 9)) for i in range(4000))
    assert len(s) == 4000 and s.stats().evictions == 0
    assert s.index_entries > first and s.index_entries >= 4000
    assert [r.getMessage() for r in caplog.records if "index" in r.getMessage()] == []
    assert s.get_many([key(i) for i in range(4000)]) == [value(i, 96 + i % 9) for i in range(4000)]
    assert s.check() == []
    assert len(index_files(s.shm_name)) == 1  # the old generations are gone


def test_tiny_samples_fill_the_whole_budget(make: Callable[..., MemoryStore]) -> None:
    """Entries of 100 B up to 95% of the budget: all held (the index follows the bytes)."""
    s = make(capacity=MiB, policy="lru")
    n = int(0.95 * MiB) // 100
    assert all(s.put(key(i), value(i)) for i in range(n))
    assert len(s) == n and s.nbytes() == 100 * n and s.check() == []


def test_a_grown_index_is_found_again_by_a_new_opener(
    make: Callable[..., MemoryStore], shm_name: str
) -> None:
    s = make(policy="lru")
    for i in range(3000):
        s.put(key(i), value(i))
    grown = s.index_entries
    s.close()
    again = make()
    assert again.index_entries == grown and len(again) == 3000
    assert again.get(key(0)) == value(0) and again.get(key(2999)) == value(2999)
    assert again.check() == []
    out = np.zeros((3000, 100), np.uint8)
    assert again.gather([key(i) for i in range(3000)], 0, 100, out).all()
    assert out[1234].tobytes() == value(1234)


def test_index_capacity_is_the_most_the_index_grows_to(
    make: Callable[..., MemoryStore], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """``index_capacity`` (``Cache(memory_entries=)``) fixes the index's size: made at
    that size, never grown; once it is full while bytes are free, one warning names
    the knob."""
    s = make(policy="lru", index_capacity=1500)
    assert s.index_capacity == 1500 and s.index_entries == 1500
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        for i in range(3000):
            s.put(key(i), value(i, 140))
    assert len(s) == 1500 and s.index_entries == 1500
    assert sorted(s.keys()) == [key(i) for i in range(1500, 3000)]
    warned = [r.getMessage() for r in caplog.records if "index" in r.getMessage()]
    assert len(warned) == 1 and "memory_entries" in warned[0], warned
    small = make(name=f"{s.shm_name}-small", index_capacity=8, policy="keep")
    assert small.index_entries == 8
    assert all(small.put(key(i), b"v") for i in range(8)) and not small.put(key(8), b"v")
    small.unlink()
    from mmcache.cache import Cache

    with Cache(tmp_path / "c", memory=MiB, disk=None, memory_entries=4096, temporary=True) as c:
        assert c.memory is not None and c.memory.index_capacity == 4096  # type: ignore[attr-defined]
        assert c.memory.index_entries == 4096  # type: ignore[attr-defined]


def _reader(name: str, ready: Any, go: Any, out: Any) -> None:
    """Attach before the parent grows the index; read everything once told to."""
    store = MemoryStore(name, capacity=2 * MiB, create=False)
    try:
        first = store.index_entries
        assert store.get(key(0)) == value(0)  # a locked operation on the first generation
        ready.set()
        go.wait(60)
        got = store.get_many([key(i) for i in range(4000)])
        wrong = [i for i, v in enumerate(got) if v != value(i)]
        outb = np.zeros((4000, 100), np.uint8)
        found = store.gather([key(i) for i in range(4000)], 0, 100, outb)
        put_after = store.put(key(5000), value(5000))  # a write into the adopted generation
        out.put((first, store.index_entries, wrong, int(found.sum()), put_after))
    except BaseException as exc:  # report it: an assertion in a child is silent otherwise
        out.put(repr(exc))
    finally:
        store.close()


def test_a_spawned_process_attached_before_a_grow_reads_entries_from_before_and_after(
    make: Callable[..., MemoryStore], shm_name: str
) -> None:
    s = make(policy="lru")
    for i in range(500):
        assert s.put(key(i), value(i))
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_reader, args=(shm_name, ready, go, out))
    child.start()
    try:
        assert ready.wait(120), "the child never attached"
        first = s.index_entries
        for i in range(500, 4000):  # grows the index while the child is attached
            assert s.put(key(i), value(i))
        assert s.index_entries > first
        go.set()
        result = out.get(timeout=120)
    finally:
        child.join(60)
        if child.is_alive():  # pragma: no cover - only if the child hangs
            child.kill()
    assert not isinstance(result, str), result
    child_first, child_now, wrong, gathered, put_after = result
    assert child_first == first and child_now == s.index_entries
    assert wrong == [] and gathered == 4000 and put_after
    assert s.get(key(5000)) == value(5000) and s.check() == []


# A process that puts until its index grows, killed with SIGKILL at one step of the grow.
GROW_AND_DIE = textwrap.dedent(
    """
    import os, signal, sys
    from mmcache.stores.memory import MemoryStore, session, table

    name, step = sys.argv[1], sys.argv[2]
    store = MemoryStore(name, capacity=2 << 20, policy="lru")

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if step == "copy":  # the new generation exists, the header still names the old one
        table.EntryTable.copy_to = die
    else:  # the header names the new generation, the old file is still there
        session.remove_file = die
    for i in range(5000):
        store.put(i.to_bytes(16, "big"), (i.to_bytes(4, "little") * 25))
    print("never grew")
    """
)


@pytest.mark.parametrize("step", ["copy", "commit"])
def test_a_process_killed_during_a_grow_leaves_a_store_the_next_opener_repairs(
    shm_name: str, step: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", GROW_AND_DIE, shm_name, step],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert len(index_files(shm_name)) == 2  # both generations are left behind
    s = MemoryStore(shm_name, capacity=2 * MiB, policy="lru")
    try:
        assert s.check() == [] and len(index_files(shm_name)) == 1
        assert len(s) == 1024 and s.stats().corrupt == 0  # all but the put that grew
        assert all(s.get(key(i)) == value(i) for i in range(1024))
        # Before the commit the old generation is the store's; after it, the new one.
        assert (s.index_entries == 1024) == (step == "copy")
        for i in range(1024, 4000):  # it grows again, over the leftovers
            assert s.put(key(i), value(i))
        assert len(s) == 4000 and s.check() == [] and len(index_files(shm_name)) == 1
    finally:
        s.close()


def test_gc_removes_every_generation_of_an_orphaned_store(shm_name: str, tmp_path: Path) -> None:
    """``reclaim_orphans`` (``mmcache gc``) and the test suite's leak guard see a store's
    index files of every generation, a stale one left by a dead grow included."""
    from mmcache.stores.memory import reclaim_orphans
    from mmcache.stores.memory.cleanup import _store_names

    root = tmp_path / "root"
    root.mkdir()
    s = MemoryStore(shm_name, capacity=2 * MiB, owner_path=str(root))
    for i in range(2000):
        s.put(key(i), value(i))
    s.close()
    (live,) = index_files(shm_name)
    stale = live[:-3] + "999"
    Path(stale).write_bytes(b"")  # as a grow that died before its commit leaves it
    assert set(_store_names(store_dir(), shm_name)[shm_name]) >= {live, stale}
    root.rmdir()  # the owner is gone: an orphan
    removed = reclaim_orphans(shm_name)
    assert {live, stale} <= set(removed)
    assert glob.glob(f"{store_dir()}/mmcache-{glob.escape(shm_name)}*") == []


def test_a_missing_index_file_is_a_clear_error_or_a_fresh_store(shm_name: str) -> None:
    s = MemoryStore(shm_name, capacity=2 * MiB)
    s.put(key(1), value(1))
    s.close()
    for path in index_files(shm_name):
        Path(path).unlink()  # removed by hand
    with pytest.raises(CacheError, match="index segment"):
        MemoryStore(shm_name, capacity=2 * MiB, create=False)
    again = MemoryStore(shm_name, capacity=2 * MiB)  # nobody attached: re-created empty
    try:
        assert len(again) == 0 and again.put(key(1), value(1)) and again.check() == []
    finally:
        again.close()
