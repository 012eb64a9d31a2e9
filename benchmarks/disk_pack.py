"""Bytes on disk per entry, and CPU per put, get and gather, of the disk tier (issue 41).

    PYTHONPATH=src python benchmarks/disk_pack.py --n 20000 --sizes 1024,4096,65536

N entries of each size, keys in random order (digests, as the cache's), written as the
write-behind writes them (``put_many`` of 64 entries, its ``MAX_PENDING``); then read
back in another random order, by ``get_many`` and by ``gather_ranges`` (64 keys a call,
the check a no-op: the store's own cost). Bytes per entry: the pages LMDB has used
(``(last_pgno + 1) * psize``: the extent of ``data.mdb`` every page ever written
reaches, free pages included) over N, next to the payload. Run it on another
commit's sources (``git archive <commit> src``) to compare.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import tempfile
import time

import lmdb
import numpy as np

from mmcache.stores.disk import DiskStore

BATCH = 64


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def used_bytes(path: str) -> int:
    """Bytes of ``data.mdb`` LMDB has used: up to its last page, free pages included."""
    with lmdb.open(path, readonly=True, lock=False, max_dbs=8) as env:
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]


def measure(n: int, size: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    values = [rng.randbytes(size) for _ in range(min(n, 256))]
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/c"
        with DiskStore(path, capacity=4 * n * size + (64 << 20), policy="fifo") as store:
            t0 = time.process_time()
            for start in range(0, n, BATCH):
                rows = [
                    (key(i), values[i % len(values)], 0.0, 0.0)
                    for i in order[start : start + BATCH]
                ]
                store.put_many(rows)
            put_s = time.process_time() - t0
            assert len(store) == n
            rng.shuffle(order)
            keys = [key(i) for i in order]
            t0 = time.process_time()
            for start in range(0, n, BATCH):
                got = store.get_many(keys[start : start + BATCH])
                assert all(v is not None for v in got)
            get_s = time.process_time() - t0
            store.enable_gather(lambda buf: True)
            out = np.zeros((BATCH, size), dtype=np.uint8)
            t0 = time.process_time()
            for start in range(0, n, BATCH):
                found = store.gather_ranges(keys[start : start + BATCH], [(0, size, out)])
                assert found.all()
            gather_s = time.process_time() - t0
        used = used_bytes(path)
    return {
        "size": size,
        "n": n,
        "bytes_per_entry": used / n,
        "ratio": used / (n * size),
        "put_us": put_s / n * 1e6,
        "get_us": get_s / n * 1e6,
        "gather_us": gather_s / n * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="entries per size (64 KiB: n/10)")
    parser.add_argument("--sizes", default="1024,4096,65536")
    args = parser.parse_args()
    for size in (int(s) for s in args.sizes.split(",")):
        n = args.n if size < 65536 else max(BATCH, args.n // 10)
        print(json.dumps(measure(n, size)))


if __name__ == "__main__":
    main()
