"""The warm hit path on a memory store whose index grew vs one that never did (F13).

Two stores hold the same entries: one that started at the default index and grew while
the entries arrived, and one made with its index fixed at the size the first one
reached (``index_capacity``: it never grows), so both tables have the same load. Timed side by side,
interleaved, in one run: ``get_many`` and ``gather`` of random batches of present keys.
The ratio grown / never-grown is the figure: growth must not slow the hit path (both
look up in one hash table of the same load; the grown one also checks the generation
word at each locked section).

    PYTHONPATH=src python benchmarks/index_growth.py [--entries 12000] [--size 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import numpy as np

from mmcache.stores.memory import MemoryStore, default_index_capacity


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=12_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args()
    capacity = args.entries * args.size * 2
    first = default_index_capacity(capacity)
    payload = bytes(range(256)) * (args.size // 256 + 1)
    values = [payload[i % 256 : i % 256 + args.size] for i in range(args.entries)]
    grown = MemoryStore(f"bench-grown-{uuid.uuid4().hex[:8]}", capacity=capacity, temporary=True)
    fixed: MemoryStore | None = None
    try:
        if not all(grown.put(key(i), v) for i, v in enumerate(values)):
            raise SystemExit("an entry was refused")
        # Never grows: made at the size the grown one reached (same table load).
        fixed = MemoryStore(
            f"bench-fixed-{uuid.uuid4().hex[:8]}",
            capacity=capacity,
            temporary=True,
            index_capacity=grown.index_entries,
        )
        if not all(fixed.put(key(i), v) for i, v in enumerate(values)):
            raise SystemExit("an entry was refused")
        rng = np.random.default_rng(0)
        batches = [
            [key(int(j)) for j in rng.integers(0, args.entries, args.batch)]
            for _ in range(args.rounds)
        ]
        out = np.empty((args.batch, args.size), np.uint8)
        times: dict[str, list[float]] = {"get_many": [], "gather": []}
        per: dict[tuple[str, str], list[float]] = {}
        for b in batches:  # interleaved: the machine's load hits both alike
            for name, store in (("grown", grown), ("fixed", fixed)):
                t0 = time.perf_counter()
                store.get_many(b)
                per.setdefault(("get_many", name), []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                store.gather(b, 0, args.size, out)
                per.setdefault(("gather", name), []).append(time.perf_counter() - t0)
        for op in times:
            g = statistics.median(per[(op, "grown")])
            f = statistics.median(per[(op, "fixed")])
            times[op] = [g * 1e6, f * 1e6]
        print(
            json.dumps(
                {
                    "entries": args.entries,
                    "size": args.size,
                    "batch": args.batch,
                    "grown_index": grown.index_entries,
                    "fixed_index": fixed.index_entries,
                    "first_index": first,
                    "median_us": {op: {"grown": v[0], "fixed": v[1]} for op, v in times.items()},
                    "ratio_grown_over_fixed": {op: v[0] / v[1] for op, v in times.items()},
                },
                indent=1,
            )
        )
    finally:
        grown.close()
        if fixed is not None:
            fixed.close()


if __name__ == "__main__":
    main()
