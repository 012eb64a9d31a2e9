"""Several processes (fork and spawn, and an unrelated one) share one memory store."""

from __future__ import annotations

import glob
import multiprocessing as mp
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mmcache.stores.memory import MemoryStore, store_dir, unlink_store

# Sizes cover the copy-under-the-lock path (<= 64 KiB) and the copy-outside path.
SIZES = (700, 12_000, 90_000, 150_528)
N_KEYS = 160
CAPACITY = 2_500_000  # about 10% of the key space's bytes: constant eviction
DURATION = 2.0


def key_of(i: int) -> bytes:
    return i.to_bytes(16, "big")


def value_of(i: int) -> bytes:
    """Deterministic per key, different in every 8 bytes: a torn or mixed value shows."""
    size = SIZES[i % len(SIZES)]
    word = (i * 0x9E3779B97F4A7C15 + 1) % (1 << 64)
    pattern = np.arange(size // 8 + 1, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(word)
    return bytes(pattern.tobytes()[:size])


def index_of(k: bytes) -> int:
    return int.from_bytes(k, "big")


def worker(store: MemoryStore, seed: int, duration: float, queue: Any) -> None:
    """Random puts, reads, batched gathers, views and deletes; every read is verified."""
    rng = np.random.default_rng(seed)
    done = {"puts": 0, "reads": 0, "verified": 0, "gathers": 0}
    error = None
    try:
        deadline = time.monotonic() + duration
        out = np.empty((8, 600), np.uint8)
        while time.monotonic() < deadline:
            op = rng.random()
            i = int(rng.integers(0, N_KEYS))
            if op < 0.4:
                store.put(key_of(i), value_of(i), cost=float(rng.random()))
                done["puts"] += 1
            elif op < 0.6:
                got = store.get(key_of(i))
                done["reads"] += 1
                if got is not None:
                    if got != value_of(i):
                        raise AssertionError(f"key {i}: wrong value from get")
                    done["verified"] += 1
            elif op < 0.8:
                ids = rng.integers(0, N_KEYS, 8).tolist()
                found = store.gather([key_of(j) for j in ids], 100, 600, out)
                done["gathers"] += 1
                for row, (j, ok) in enumerate(zip(ids, found.tolist(), strict=True)):
                    if ok:
                        if out[row].tobytes() != value_of(j)[100:700]:
                            raise AssertionError(f"key {j}: wrong bytes from gather")
                        done["verified"] += 1
            elif op < 0.95:
                with store.view(key_of(i)) as v:
                    if v is not None:
                        if bytes(v) != value_of(i):
                            raise AssertionError(f"key {i}: wrong bytes from view")
                        done["verified"] += 1
            else:
                store.delete(key_of(i))
        store.close()
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
    queue.put((seed, done, error))


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"tmemmp-{uuid.uuid4().hex[:12]}"
    yield name
    unlink_store(name)
    assert glob.glob(f"{store_dir()}/mmcache-{name}*") == []


@pytest.mark.parametrize("policy", ["lru", "value"])
def test_fork_and_spawn_workers_read_and_write_at_once(shm_name: str, policy: str) -> None:
    store = MemoryStore(shm_name, capacity=CAPACITY, policy=policy)
    procs = []
    queue: Any = mp.get_context("spawn").Queue()
    for seed, method in enumerate(["fork", "fork", "spawn", "spawn"]):
        ctx: Any = mp.get_context(method)
        # fork: the child inherits the object; spawn: it is pickled and re-attaches by name.
        p = ctx.Process(target=worker, args=(store, seed, DURATION, queue))
        p.start()
        procs.append(p)
    samples = 0
    try:
        while any(p.is_alive() for p in procs):
            assert store.nbytes() <= store.capacity()
            samples += 1
            time.sleep(0.002)
        results = [queue.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    errors = [(seed, err) for seed, _, err in results if err]
    assert errors == []
    assert all(p.exitcode == 0 for p in procs)
    totals = {k: sum(r[1][k] for r in results) for k in results[0][1]}
    assert totals["puts"] > 100 and totals["verified"] > 100, totals
    assert samples > 50
    # Consistent afterwards: counts match entries, every value is whole, stats add up.
    assert store.check() == []
    for k in store.keys():  # noqa: SIM118 - a Store is not iterable
        assert store.get(k) == value_of(index_of(k))
    st = store.stats()
    assert st.puts == totals["puts"]
    assert st.admitted > 0 and st.bytes <= CAPACITY
    if policy == "lru":
        assert st.evictions > 0
    store.close()


UNRELATED = """
import sys
from mmcache.stores.memory import MemoryStore
s = MemoryStore(sys.argv[1], capacity=1, create=False)
value = s.get(bytes(16))
assert value == b"from the parent", value
assert s.put(b"\\x01" * 16, b"from an unrelated process")
s.close()
"""


def test_an_unrelated_process_opens_the_store_by_name(shm_name: str) -> None:
    store = MemoryStore(shm_name, capacity=1 << 20)
    store.put(bytes(16), b"from the parent")
    proc = subprocess.run(
        [sys.executable, "-c", UNRELATED, shm_name], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert store.get(b"\x01" * 16) == b"from an unrelated process"
    store.close()
