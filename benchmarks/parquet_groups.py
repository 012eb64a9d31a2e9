"""A shuffled cold epoch over Parquet of tiny samples: CPU per sample and row groups read.

The scale study's Parquet (``scale_data``: 250k rows a file, 1000-row row groups, 32x32
JPEGs and ~100-character captions) read by ``mmcache.DataLoader`` in a shuffled order with
the source's default ``row_group_memory`` (128 MiB per process): the cold epoch's CPU (this
process and its workers, rusage) per sample, its wall time, and the row groups every
process read (``ParquetFile.read_row_group`` counted through a wrapper installed before the
workers fork). Run it once per mmcache to compare, e.g. main's sources and a branch's::

    git archive main src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python benchmarks/parquet_groups.py --n 100000 --tag main
    PYTHONPATH=src python benchmarks/parquet_groups.py --n 100000 --tag branch

``--cache none``: the uncached loader (no cache bookkeeping: the reads are the cost);
``memory``: a memory tier holding every entry, as the scale study's. ``--batches K``: only
the epoch's first K batches (at 10^6 a whole cold epoch of main's sources takes ~25 CPU
minutes; the workers' few batches planned ahead are counted in the CPU, not the samples).
Prints one JSON line and appends it to ``benchmarks/results/parquet_groups.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import scale_data  # noqa: E402
from scale import delta, snap  # noqa: E402


def _count_group_reads() -> Any:
    """A counter of row groups read, shared by this process and the workers it forks."""
    import pyarrow.parquet as pq

    count = multiprocessing.get_context("fork").Value("q", 0)
    original = pq.ParquetFile.read_row_group

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        with count.get_lock():
            count.value += 1
        return original(self, *args, **kwargs)

    pq.ParquetFile.read_row_group = counting
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--cache", choices=("memory", "none"), default="memory")
    ap.add_argument("--work", default=str(HERE / "results" / "scale"))
    ap.add_argument("--batches", type=int, default=0, help="stop after this many (0: all)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    import mmcache as mc

    data = scale_data.ensure(Path(args.work) / "data", "parquet", args.n)
    tok = scale_data.tokenizer(Path(args.work) / "data")
    pipe = mc.Pipeline(image=mc.ImageSpec(size=16), text=mc.TextSpec(tok, max_length=16))
    src = mc.open_source(
        data,
        pipeline=pipe,
        format="parquet",
        columns={"id": "id", "image": "image", "text": "text"},
    )
    reads = _count_group_reads()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if args.cache == "memory" else None) as tmp:
        cache = None
        if args.cache == "memory":
            cache = mc.Cache(Path(tmp) / "root", memory=max(256 << 20, args.n * 3072), disk=None)
        loader = mc.DataLoader(
            src,
            cache=cache,
            batch_size=args.batch,
            shuffle=True,
            seed=0,
            num_workers=args.workers,
            persistent_workers=True,
            multiprocessing_context="fork",
        )
        loader.set_epoch(0)
        a = snap()
        samples = 0
        for j, batch in enumerate(loader, 1):
            samples += len(batch["id"])
            if j == args.batches:
                break
        d = delta(a, snap())
        # The workers' private memory (USS) after the epoch: kept rows and groups included.
        uss = [c.memory_full_info().uss for c in psutil.Process().children() if c.is_running()]
        del loader
        if cache is not None:
            if cache.memory is not None:
                cache.memory.unlink()
            cache.close()
    out = {
        "tag": args.tag,
        "n": args.n,
        "workers": args.workers,
        "batch": args.batch,
        "cache": args.cache,
        "batches": args.batches or "all",
        "samples": samples,
        "group_reads": int(reads.value),
        "groups": -(-args.n // 1000),
        "worker_uss_mib": sorted(round(u / 2**20) for u in uss),
        "cpu_us_per_sample": round(d["cpu"] / samples * 1e6, 1),
        "wall_us_per_sample": round(d["wall"] / samples * 1e6, 1),
        "load": os.getloadavg()[0],
        "machine": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    line = json.dumps(out)
    print(line)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    with open(results / "parquet_groups.jsonl", "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
