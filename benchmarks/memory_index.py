"""The memory tier's index at scale (issue 41): put/get cost per entry, bytes per entry,
and how many tiny entries one node holds.

``--compare OLD_SRC NEW_SRC``: put/get cost per entry of two source trees side by side in
one run. Each round runs this script's ``--putget`` in a fresh process per tree, the
trees in turns (old, new, new, old, ...), so a change of the machine's load hits both;
the medians and the ratio new/old are printed. ``--putget``: ``--entries`` puts of
``--size`` B into a fresh store, then ``get`` of each, ``get_many`` in batches of 256
(the best of 10 passes: one pass is ~70 ms), and the index's bytes per entry (its
``/dev/shm`` file's blocks over the entries held, hash table included).

``--fill N``: N entries of ``--size`` B into one store whose budget holds them (the
largest case this node can hold: N x (slot + index) of ``/dev/shm``), then reads a
sample of them back, and times one more put (the store is full: the ``lru`` policy
chooses a victim among all N); prints the time per put, ``/dev/shm`` bytes per entry
(payload slots, index rows and hash cells, bitmaps) and the index's alone.

    PYTHONPATH=src python benchmarks/memory_index.py --compare /tmp/old/src src
    PYTHONPATH=src python benchmarks/memory_index.py --fill 1000000 --size 64
    PYTHONPATH=src python benchmarks/memory_index.py --bulk 40000000

``--bulk N``: N entries of 64 B held without N puts (a put costs tens of microseconds:
10**8 of them are an hour): rows, slots and payloads written in bulk, then the crash
repair derives the hash table, counts and bitmaps from the rows; a sample read back
through the API, one evicting put, and the same bytes per entry.

A benchmark, not a test: it measures and checks only that every entry was held.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np

from mmcache.stores.memory import EntryState, MemoryStore
from mmcache.stores.memory.index import index_paths
from mmcache.stores.memory.layout import C_MARKED


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def index_bytes(store: MemoryStore) -> int:
    """RAM of the store's index file(s) now (tmpfs blocks)."""
    paths = index_paths(os.path.dirname(store.claims_path), store.shm_name)
    return sum(os.stat(p).st_blocks * 512 for p in paths)


def putget(entries: int, size: int) -> dict[str, float]:
    payload = bytes(range(256)) * (size // 256 + 2)  # every slice below is size bytes
    values = [payload[i % 256 : i % 256 + size] for i in range(entries)]
    keys = [key(i) for i in range(entries)]
    name = f"bench-idx-{uuid.uuid4().hex[:8]}"
    with MemoryStore(name, capacity=entries * size * 2, temporary=True, policy="lru") as s:
        t0 = time.process_time()
        held = sum(s.put(k, v) for k, v in zip(keys, values, strict=True))
        t1 = time.process_time()
        got = sum(s.get(k) is not None for k in keys)
        t2 = time.process_time()
        passes = []  # get_many is fast: the best of 10 passes over every key
        for _ in range(10):
            t3 = time.process_time()
            many = sum(
                v is not None for i in range(0, entries, 256) for v in s.get_many(keys[i : i + 256])
            )
            passes.append(time.process_time() - t3)
        if not held == got == many == entries:
            raise SystemExit(f"held {held}, got {got}, get_many {many} of {entries}")
        return {
            "put_us": (t1 - t0) / entries * 1e6,
            "get_us": (t2 - t1) / entries * 1e6,
            "get_many_us": min(passes) / entries * 1e6,
            "index_B_per_entry": index_bytes(s) / entries,
            "index_entries": s.index_entries,
        }


def compare(old: str, new: str, entries: int, size: int, rounds: int) -> None:
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    order = [("old", old), ("new", new)]
    for r in range(rounds):
        for label, src in order if r % 2 == 0 else order[::-1]:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
            cmd = [sys.executable, __file__, "--putget", "--entries", str(entries)]
            out = subprocess.run(
                [*cmd, "--size", str(size)], env=env, check=True, capture_output=True, text=True
            ).stdout
            runs[label].append(json.loads(out))
    print(f"{entries} entries of {size} B, {rounds} rounds each, medians (CPU time per entry)")
    print("| measure | old | new | new / old |")
    print("|---|---:|---:|---:|")
    for m in ("put_us", "get_us", "get_many_us", "index_B_per_entry"):
        a = statistics.median(x[m] for x in runs["old"])
        b = statistics.median(x[m] for x in runs["new"])
        print(f"| {m} | {a:.2f} | {b:.2f} | {b / a:.3f} |")


def fill(n: int, size: int) -> None:
    payload = bytes(range(256)) * (size // 256 + 2)  # every slice below is size bytes
    name = f"bench-fill-{uuid.uuid4().hex[:8]}"
    with MemoryStore(name, capacity=n * size, temporary=True, policy="lru") as s:
        t0 = time.perf_counter()
        step = max(n // 20, 1)
        for i in range(n):
            if not s.put(key(i), payload[i % 256 : i % 256 + size]):
                raise SystemExit(f"entry {i} refused ({len(s)} held)")
            if i % step == 0:
                print(f"  {i:>12,} entries, {time.perf_counter() - t0:8.1f} s", flush=True)
        put_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        sample = rng.integers(0, n, 100_000)
        got = s.get_many([key(int(i)) for i in sample])
        ok = all(
            g == payload[i % 256 : i % 256 + size]
            for g, i in zip(got, sample.tolist(), strict=True)
        )
        # The store is full: one more put asks the policy, over every resident entry.
        t1 = time.perf_counter()
        evicting = s.put(key(n), payload[:size])
        evict_s = time.perf_counter() - t1
        print(
            json.dumps(
                {
                    "entries": len(s),
                    "index_entries": s.index_entries,
                    "put_us": put_s / n * 1e6,
                    "shm_B_per_entry": s.resident_bytes() / n,
                    "index_B_per_entry": index_bytes(s) / n,
                    "sample_read_back": ok,
                    "evicting_put_s": evict_s if evicting else None,
                }
            )
        )


def bulk(n: int) -> None:
    """Hold ``n`` entries of 64 B without ``n`` puts: the rows, slots and payloads written in
    bulk (numpy, under the exclusive lock), then the crash repair derives the rest from the
    rows (hash table, counts, bitmaps), as after a holder died; then reads through the API."""
    name = f"bench-bulk-{uuid.uuid4().hex[:8]}"
    t0 = time.process_time()
    with MemoryStore(name, capacity=n * 64, index_capacity=n, temporary=True, policy="lru") as s:
        session = s._session
        with session.exclusive():
            t, slabs = session.table, session.slabs
            t.reserve_rows(n)
            slab = slabs.get(0, create=True)
            slab.seg.reserve(0, n)  # the bitmap: 1 B per slot
            slabs.classes[0, C_MARKED] = n
            step = 1 << 20
            for lo in range(0, n, step):
                ids = np.arange(lo, min(lo + step, n), dtype="<u8")
                payload = np.tile(ids.view(np.uint8).reshape(-1, 8), (1, 8))  # key(i)'s 64 B
                slab.write(lo, memoryview(payload).cast("B"))
                rows = slice(lo, lo + ids.shape[0])
                t.key[rows, 0] = 0  # key(i): 16 bytes big-endian, so the first word is 0
                t.key[rows, 1] = ids.astype(">u8").view(np.uint64)
                t.slot[rows] = ids
                t.seq[rows] = ids
            t.size[:n] = 64
            t.cls[:n] = 0
            t.state[:n] = EntryState.READY
            t1 = time.process_time()
            session._repair_locked("bulk fill of a benchmark")
            repair_s = time.process_time() - t1
        rng = np.random.default_rng(0)
        sample = rng.integers(0, n, 100_000).tolist()
        keys = [key(i) for i in sample]
        t2 = time.process_time()
        got = s.get_many(keys)  # this process's first touch of most of these pages
        first_us = (time.process_time() - t2) / len(sample) * 1e6
        t2 = time.process_time()
        s.get_many(keys)
        again_us = (time.process_time() - t2) / len(sample) * 1e6
        ok = all(g == i.to_bytes(8, "little") * 8 for g, i in zip(got, sample, strict=True))
        t3 = time.process_time()
        evicting = s.put(key(n), bytes(64))
        evict_s = time.process_time() - t3
        print(
            json.dumps(
                {
                    "entries": len(s),
                    "index_entries": s.index_entries,
                    "shm_B_per_entry": s.resident_bytes() / n,
                    "index_B_per_entry": index_bytes(s) / n,
                    "repair_cpu_s": repair_s,
                    "sample_read_back": ok,
                    "get_many_first_us": first_us,
                    "get_many_again_us": again_us,
                    "evicting_put_cpu_s": evict_s if evicting else None,
                    "total_cpu_s": time.process_time() - t0,
                }
            ),
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", nargs=2, metavar=("OLD_SRC", "NEW_SRC"))
    ap.add_argument("--putget", action="store_true")
    ap.add_argument("--fill", type=int)
    ap.add_argument("--bulk", type=int)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare, args.entries, args.size, args.rounds)
    elif args.putget:
        print(json.dumps(putget(args.entries, args.size)))
    elif args.fill:
        fill(args.fill, args.size)
    elif args.bulk:
        bulk(args.bulk)
    else:
        ap.error("one of --compare, --putget, --fill, --bulk")


if __name__ == "__main__":
    main()
