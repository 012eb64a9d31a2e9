"""CPU per put into a full memory tier (issue 41): fill a store of N entries of 64 B to its
budget, then time 200 more puts, each of which makes the policy choose a victim.

    PYTHONPATH=src python benchmarks/memory_evict.py --n 300000 --policy lru

Above ``stores/memory/table.EXACT_BELOW`` entries the policy decides on a random sample of
residents; at or below it, on every one (run both sides of 2^16 to see each path).
"""

from __future__ import annotations

import argparse
import time
import uuid

from mmcache.stores.memory import MemoryStore


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300_000)
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--puts", type=int, default=200)
    args = parser.parse_args()
    name = f"bench-evict-{uuid.uuid4().hex[:8]}"
    with MemoryStore(name, capacity=args.n * 64, temporary=True, policy=args.policy) as store:
        for i in range(args.n):
            store.put(key(i), bytes(64))
        t0 = time.process_time()
        for i in range(args.n, args.n + args.puts):
            store.put(key(i), bytes(64))
        per_put = (time.process_time() - t0) / args.puts
    print(f"{args.policy}, {args.n} entries: {per_put * 1e6:.0f} us CPU per put into a full store")


if __name__ == "__main__":
    main()
