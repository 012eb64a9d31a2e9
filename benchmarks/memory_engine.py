"""The memory tier's engine against LMDB on tmpfs (issue 38): warm epochs, in turns.

Could the node-shared memory tier (``stores/memory``: its hash index, slabs, per-process
rows and crash repair, about 4.7k lines) be the disk tier's LMDB environment rooted in
``/dev/shm``? LMDB there gives node-wide sharing, lock-free readers, zero-copy buffers and
crash safety too. This measures what the warm path would lose, on ``benchmarks/loader.py``'s
data and settings (its :func:`~loader.make_dataset`: COCO-sized synthetic samples, resize
256 / crop 224, 32 tokens; batch 64; the budget 1.2x the data; the ``value`` policy), with
every sample resident in both (``beyond_ram.py``'s rows (b) and (c), the disk tier on tmpfs
instead of a disk):

* ``memory``: ``Cache(root, memory=budget, disk=None)``, the memory tier alone;
* ``lmdb-tmpfs``: ``Cache(<a folder under /dev/shm>, memory=0, disk=budget)``, the disk
  tier's code (``DiskStore``, LMDB) alone, its environment opened with ``sync=False``
  (``stores/disk/env.py`` always passes ``sync=True`` and has no option for it, so this
  process's ``lmdb.open`` is wrapped to pass ``sync=False``; forked workers inherit it;
  on tmpfs an fsync does nothing anyway, and a warm epoch commits no write: the script
  checks that ``data.mdb`` did not change);
* ``bound``: ``loader.py``'s upper bound, a whole-batch ``np.take`` of the preprocessed
  samples held in one numpy array per field in the training process.

Each cache is read two ways. ``gather_ranges alone``: the engine by itself, each batch's 64
keys gathered by the store's ``gather_ranges`` into the loader's byte ranges of the entry
(the lookups, one copy per range, the read check), no loader around it. ``loader 0/2
workers``: a warm epoch of ``mmcache.DataLoader`` with 0 and with 2 (persistent) workers;
the hits are gathered into the batch in the training process either way (the batch gather),
but the loader also plans each batch (the tier's ``contains_many``) and, for a tier that can
(the disk tier), reads its pages ahead (``prefetch``, from threads). Every loader is warmed
first (a cold epoch, then a warm one). Then each round runs one epoch of every row, the
order reversed every other round, so that the machine's noise falls on all rows alike; the
ratios are taken per round (the LMDB epoch over the memory epoch of the same round and
workers) and reported as median and spread. Also per row: the median batch time without each
epoch's first and last batch (the steady state) and the training process's CPU per sample,
which other jobs on the machine move far less than the wall time.

    .venv/bin/python benchmarks/memory_engine.py            # 1-3 min on 2 cores
    .venv/bin/python benchmarks/memory_engine.py --quick    # seconds: a smoke run

Prints a Markdown table and writes the figures as JSON (``--json``, default
``benchmarks/results/memory_engine.json``). Every figure is a ratio or rate measured in
this run; nothing here is a pass/fail time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch

import mmcache as mc
from loader import (  # benchmarks/ (the script's folder is on sys.path)
    make_dataset,
    memory_cache,
    numpy_arrays,
    numpy_epoch,
    stamped_epoch,
)
from mmcache import codec
from mmcache.cache import Cache
from mmcache.loader.batchlayout import byte_ranges
from mmcache.stores.base import BatchReader

torch.set_num_threads(1)

#: The ``sync`` flag of each LMDB environment this process opened (see :func:`open_without_sync`).
SYNC_FLAGS: list[bool] = []


def open_without_sync() -> None:
    """From now on every ``lmdb.open`` of this process, and of the workers it forks, passes
    ``sync=False`` (MDB_NOSYNC: no fsync at commit); each environment's resulting flag
    is appended to :data:`SYNC_FLAGS`. For this benchmark's process only."""
    real = lmdb.open

    def open_nosync(path: str, **options: Any) -> Any:
        env = real(path, **{**options, "sync": False})
        SYNC_FLAGS.append(bool(env.flags()["sync"]))
        return env

    lmdb.open = open_nosync


@contextlib.contextmanager
def lmdb_cache(root: Path, disk: int, policy: str = "value") -> Iterator[Cache]:
    """A cache whose only tier is the disk tier (LMDB) in ``root``; the folder goes afterwards."""
    cache = Cache(root, memory=0, disk=disk, policy=policy, temporary=True)
    try:
        yield cache
    finally:
        cache.close()
        shutil.rmtree(root, ignore_errors=True)


def engine_epoch(
    reader: BatchReader, keys: np.ndarray, order: np.ndarray, targets: list[Any]
) -> list[float]:
    """One epoch of a store's engine alone: each full batch's keys gathered by
    ``reader.gather_ranges`` into the loader's byte ranges (the lookups, the copies and
    the read check, without the loader around them); each batch's seconds."""
    bs = len(targets[0][2])
    out = []
    for s in range(0, len(order) - bs + 1, bs):
        t0 = time.perf_counter()
        found = reader.gather_ranges(keys[order[s : s + bs]], targets, count=False)
        out.append(time.perf_counter() - t0)
        if not found.all():
            raise RuntimeError(f"{reader!r}: a warm batch was not all hits")
    return out


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles and extremes of ``values``."""
    q = np.percentile(values, [0, 25, 50, 75, 100])
    return {"min": q[0], "p25": q[1], "median": q[2], "p75": q[3], "max": q[4], "n": len(values)}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the machine type."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def commit_of(tree: Path) -> str:
    """The tree's commit (``+dirty`` with uncommitted changes), or ``unknown``."""

    def git(*argv: str) -> str:
        cmd = ["git", "-C", str(tree), *argv]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def measure(args: argparse.Namespace, tmp: Path, shm: Path) -> dict[str, Any]:
    """Build the data, both caches and their loaders, warm them, then run the rounds."""
    ds = make_dataset(tmp / "inputs", args.n)
    n = len(ds)
    entry = codec.encoded_size(ds.produce(0))
    budget = int(n * entry * 1.2)
    arrays = numpy_arrays(ds)
    keys = np.asarray(ds.key_rows(np.arange(n)))
    segments = byte_ranges(codec.read_header(codec.encode(ds.produce(0)))).segments
    targets = [(a, b - a, np.empty((args.batch_size, b - a), np.uint8)) for a, b, _ in segments]
    rng = np.random.default_rng(1)
    rows: dict[str, dict[str, list[float]]] = {}
    loaders: dict[str, mc.DataLoader] = {}
    readers: dict[str, BatchReader] = {}
    served: dict[str, dict[str, int]] = {}
    with contextlib.ExitStack() as stack:
        caches = {
            "memory": stack.enter_context(memory_cache(tmp / "memory", budget)),
            "lmdb-tmpfs": stack.enter_context(lmdb_cache(shm / "root", budget)),
        }
        for name, cache in caches.items():
            reader = cache.reader
            if reader is None:
                raise RuntimeError(f"the {name} cache gathers no batches")
            readers[f"{name}, gather_ranges alone"] = reader
        for w in args.workers:
            for name, cache in caches.items():
                loader = mc.DataLoader(
                    ds,
                    cache=cache,
                    batch_size=args.batch_size,
                    seed=0,
                    num_workers=w,
                    persistent_workers=w > 0,
                )
                stack.callback(loader.close)
                for e in range(2):  # cold (for the cache's first loader), then warm
                    stamped_epoch(loader, e)
                loaders[f"{name}, loader {w} workers"] = loader
        mdb = shm / "root" / "disk" / "data.mdb"
        before = mdb.stat()
        names = ["bound", *readers, *loaders]
        for name in names:
            rows[name] = {"samples_per_s": [], "batch_us": [], "cpu_us_per_sample": []}
        loads = [load_average()]
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                row = rows[name]
                if name == "bound":
                    c0, t0 = time.process_time(), time.perf_counter()
                    batches = numpy_epoch(arrays, rng.permutation(n), args.batch_size)
                    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
                    row["batch_us"] += [b * 1e6 for b in batches[1:-1]]
                elif name in readers:
                    c0 = time.process_time()
                    batches = engine_epoch(readers[name], keys, rng.permutation(n), targets)
                    seconds, cpu = sum(batches), time.process_time() - c0
                    row["batch_us"] += [b * 1e6 for b in batches]
                else:
                    stamps, cpu = stamped_epoch(loaders[name], 2 + r)
                    seconds = stamps[-1] - stamps[0]
                    row["batch_us"] += [b * 1e6 for b in np.diff(stamps)[1:-1]]
                done = len(batches) * args.batch_size if name in readers else n
                row["samples_per_s"].append(done / seconds)
                row["cpu_us_per_sample"].append(cpu / done * 1e6)
            loads.append(load_average())
        after = mdb.stat()
        for name, loader in loaders.items():
            last = loader.stats().epochs[-1]
            served[name] = {**dict(last.tier_hits), "misses": round((1 - last.hit_rate) * n)}
    pairs: dict[str, dict[str, float]] = {}
    for what in ["gather_ranges alone", *(f"loader {w} workers" for w in args.workers)]:
        mem, db = rows[f"memory, {what}"], rows[f"lmdb-tmpfs, {what}"]
        pairs[what] = {
            "epoch": spread(
                [b / a for a, b in zip(mem["samples_per_s"], db["samples_per_s"], strict=True)]
            ),
            "batch": statistics.median(mem["batch_us"]) / statistics.median(db["batch_us"]),
            "cpu": statistics.median(mem["cpu_us_per_sample"])
            / statistics.median(db["cpu_us_per_sample"]),
        }
    bound = rows["bound"]["samples_per_s"]
    summary = {
        name: {
            "samples_per_s": spread(row["samples_per_s"]),
            "batch_us_median": statistics.median(row["batch_us"]),
            "cpu_us_per_sample_median": statistics.median(row["cpu_us_per_sample"]),
            "vs_bound": spread([a / b for a, b in zip(row["samples_per_s"], bound, strict=True)]),
        }
        for name, row in rows.items()
    }
    return {
        "samples": n,
        "entry_bytes": entry,
        "budget_bytes": budget,
        "rows": summary,
        "lmdb_vs_memory": pairs,
        "served_last_epoch": served,
        "data_mdb_unchanged": (before.st_mtime_ns, before.st_size)
        == (after.st_mtime_ns, after.st_size),
        "lmdb_sync_flags": SYNC_FLAGS,
        "load_average": loads,
    }


ROW_HEAD = [
    "row",
    "warm samples/s, median [min-max]",
    "vs bound, median",
    "batch, us (median)",
    "training-process CPU, us/sample",
]
RATIO_HEAD = [
    "LMDB on tmpfs / memory tier",
    "warm epoch, median of the rounds [p25-p75] [min-max]",
    "median batch time",
    "training-process CPU",
]


def table(head: list[str], body: list[list[str]]) -> list[str]:
    """A Markdown table: ``head``'s first column left-aligned, the others right-aligned."""
    rule = "|---|" + "---:|" * (len(head) - 1)
    return ["| " + " | ".join(head) + " |", rule, *("| " + " | ".join(r) + " |" for r in body)]


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    loads = res["load_average"]
    lines = [
        f"{res['samples']} samples of {res['entry_bytes'] / 1e3:.0f} kB "
        f"({res['samples'] * res['entry_bytes'] / 2**20:.0f} MiB), batch {args.batch_size}, "
        f"budget {res['budget_bytes'] / 2**20:.0f} MiB, policy value; {args.rounds} rounds "
        f"in turns; {res['machine']}, commit {res['commit']}; load average (1 min) "
        f"{min(x[0] for x in loads):.1f}-{max(x[0] for x in loads):.1f} during the rounds",
        "",
    ]
    lines += table(
        ROW_HEAD,
        [
            [
                name,
                f"{s['median']:,.0f} [{s['min']:,.0f}-{s['max']:,.0f}]",
                f"{row['vs_bound']['median']:.2f}",
                f"{row['batch_us_median']:,.0f}",
                f"{row['cpu_us_per_sample_median']:.1f}",
            ]
            for name, row in res["rows"].items()
            for s in [row["samples_per_s"]]
        ],
    )
    lines.append("")
    lines += table(
        RATIO_HEAD,
        [
            [
                what,
                f"**{e['median']:.2f}** [{e['p25']:.2f}-{e['p75']:.2f}] "
                f"[{e['min']:.2f}-{e['max']:.2f}]",
                f"{p['batch']:.2f}",
                f"{p['cpu']:.2f}",
            ]
            for what, p in res["lmdb_vs_memory"].items()
            for e in [p["epoch"]]
        ],
    )
    lines += [
        "",
        f"served in the last epoch: {res['served_last_epoch']}",
        f"LMDB environments opened here with sync: {res['lmdb_sync_flags']}; data.mdb "
        f"unchanged over the rounds (no commit): {res['data_mdb_unchanged']}",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=1500, help="samples")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", default="0,2", help="the loaders' worker counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=40, help="epochs per row, taken in turns")
    ap.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="the tmpfs for LMDB")
    ap.add_argument("--quick", action="store_true", help="300 samples, 4 rounds")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/memory_engine.json"))
    args = ap.parse_args()
    if args.quick:
        args.n, args.rounds = 300, 4
    args.workers = [int(w) for w in args.workers.split(",")]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    open_without_sync()
    tmp = Path(tempfile.mkdtemp(prefix="mmcache-bench-engine-"))
    shm = Path(tempfile.mkdtemp(prefix="mmcache-bench-engine-", dir=args.shm))
    try:
        t0 = time.perf_counter()
        res = measure(args, tmp, shm)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    res["seconds"] = time.perf_counter() - t0
    res["commit"] = commit_of(Path(__file__).resolve().parent)
    res["machine"] = f"{os.cpu_count()} cores, {cpu_model()}"
    res["torch"], res["mmcache"] = torch.__version__, mc.__version__
    text = report(res, args)
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**res, "table": text}, indent=1, default=float))


if __name__ == "__main__":
    main()
