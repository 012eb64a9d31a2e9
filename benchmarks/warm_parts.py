"""Where a warm batch's time goes, part by part, against the bound (not a test).

``benchmarks/loader.py`` says how far a warm epoch is from the numpy bound; this says which
part of a batch costs what, each part timed in the same run, in turns with the bound (same
data as ``loader.py``: 1,500 COCO-sized samples, 224 px, batch 64, a memory tier, 2 workers):

- ``bound``: the bound's batch, ``np.take`` of preprocessed samples into a fresh array;
- ``loader``: a batch of a warm ``mmcache.DataLoader`` epoch, and inside it the time of
  ``BatchAssembler.gather_guess`` (the hit gather of a guessed batch, its ids and keys) and
  of the rows' copy-and-hash loop (``codec._digests_flat``: each row copied out of shared
  memory, then its xxh3 taken while it is in the CPU cache);
- ``gather_hits``: the same batches gathered by :func:`mmcache.loader.gather.gather_hits`
  alone, one batch after another, in one thread;
- the same with two batches at once, on two threads, and in two forked processes (into
  shared-memory batches): whether a second core would help;
- ``hash``: the xxh3 of 64 rows of the image's size, each right after it was copied (as the
  read check does), and the copies alone: what the read check itself costs a batch.

    .venv/bin/python benchmarks/warm_parts.py [--rounds 10]

Every figure is a median of ``--rounds`` turns, in ms a batch, and its ratio to the bound of
the same run; nothing here is a pass/fail time.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

import mmcache as mc
from loader import make_inputs, memory_cache, numpy_arrays, numpy_epoch  # benchmarks/
from mmcache import codec
from mmcache.loader import assemble
from mmcache.loader.gather import gather_hits

torch.set_num_threads(1)


class Timed:
    """Wraps ``owner.name`` so that each call's seconds are appended to :attr:`times`."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name, self.times = owner, name, []  # type: ignore[var-annotated]
        self.original = getattr(owner, name)
        original, times = self.original, self.times

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - t0)

        setattr(owner, name, timed)


def per_batch(fn: Callable[[], int]) -> float:
    """Seconds a batch of ``fn`` (which returns how many batches it made)."""
    t0 = time.perf_counter()
    batches = fn()
    return (time.perf_counter() - t0) / batches


def hash_parts(src: np.ndarray, rng: np.random.Generator, reps: int = 32) -> tuple[float, float]:
    """Seconds a batch of 64 rows of ``src``: copies alone, and copies each followed by the
    row's xxh3 (the read check's order: the row is hashed while it is in the CPU cache)."""
    dst = torch.empty((64, src.shape[1]), dtype=torch.uint8).numpy()  # as a batch buffer
    copy_s, both_s = [], []
    for _ in range(reps):
        idx = rng.integers(0, len(src), 64).tolist()
        t0 = time.perf_counter()
        for r, i in enumerate(idx):
            dst[r] = src[i]
        t1 = time.perf_counter()
        idx = rng.integers(0, len(src), 64).tolist()
        t2 = time.perf_counter()
        for r, i in enumerate(idx):
            dst[r] = src[i]
            xxhash.xxh3_64(dst[r].data).intdigest()
        t3 = time.perf_counter()
        copy_s.append(t1 - t0)
        both_s.append(t3 - t2)
    return statistics.median(copy_s), statistics.median(both_s)


def shm_copy_of(arr: np.ndarray) -> tuple[np.ndarray, mmap.mmap]:
    """``arr``'s bytes in a mapping of a ``/dev/shm`` file (unlinked at once), as the memory
    tier holds entries: shared memory, 4 KiB pages where ``shmem_enabled`` is ``never``."""
    fd, path = tempfile.mkstemp(prefix="mmcache-bench-parts-", dir="/dev/shm")
    try:
        os.ftruncate(fd, arr.nbytes)
        buf = mmap.mmap(fd, arr.nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)
    view = np.frombuffer(buf, dtype=np.uint8).reshape(arr.shape)
    view[:] = arr
    return view, buf


def _serve(conn: Any, gather: Callable[..., int], outs: list[dict[str, torch.Tensor]]) -> None:
    """A forked gathering process: ``(order, part, of)`` -> that part's batches gathered."""
    torch.set_num_threads(1)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        order, part, of = msg
        conn.send(gather(order, outs[part], part, of))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    bs = args.batch_size
    tmp = Path(tempfile.mkdtemp(prefix="mmcache-bench-parts-"))
    guess = Timed(assemble.BatchAssembler, "gather_guess")
    rows_loop = Timed(codec, "_digests_flat")
    try:
        manifest, tok = make_inputs(tmp / "inputs", args.n)
        pipe = mc.Pipeline(
            image=mc.ImageSpec(size=224, resize=256), text=mc.TextSpec(tok, max_length=32)
        )
        ds = mc.MultimodalDataset(manifest, pipeline=pipe)
        n = len(ds)
        arrays = numpy_arrays(ds)
        images = arrays["image"].reshape(n, -1)  # the bound's source: private, huge pages
        shm_images, _buf = shm_copy_of(images)
        entry = mc.codec.encoded_size(ds.produce(0))
        with memory_cache(tmp / "c", int(n * entry * 1.2)) as cache:
            loader = mc.DataLoader(
                ds, cache=cache, batch_size=bs, seed=0, num_workers=2, persistent_workers=True
            )
            for _ in range(2):  # cold, then one warm epoch
                for _batch in loader:
                    pass
            asm = loader._assembler  # the loader's own layout, reader and batch buffers
            layout, reader = asm.layout, asm.reader
            assert layout is not None and reader is not None
            keys = np.asarray(ds.key_rows(np.arange(n)))
            rows = np.arange(bs)
            starts = list(range(0, n - bs + 1, bs))
            rng = np.random.default_rng(0)
            shared = [asm._allocate(layout, bs) for _ in range(2)]
            for out in shared:
                for t in out.values():
                    t.share_memory_()  # type: ignore[no-untyped-call]

            def gather(order: np.ndarray, out: dict[str, torch.Tensor], part: int, of: int) -> int:
                for s in starts[part::of]:
                    got = gather_hits(
                        reader,
                        layout,
                        keys[order[s : s + bs]],
                        rows,
                        out,
                        ttl_cutoff=None,
                        count=False,
                    )
                    if not got.ok.all():
                        raise RuntimeError("a warm batch was not all hits")
                return len(starts[part::of])

            def two_threads() -> int:
                order = rng.permutation(n)
                ts = [
                    threading.Thread(target=gather, args=(order, shared[w], w, 2)) for w in range(2)
                ]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                return len(starts)

            # Two gathering processes, forked once (their pages of the tier mapped before
            # the rounds begin, as a kept pool's would be), two batches at once.
            ctx = mp.get_context("fork")
            conns, procs = [], []
            for _ in range(2):
                here, there = ctx.Pipe()
                p = ctx.Process(target=_serve, args=(there, gather, shared), daemon=True)
                p.start()
                conns.append(here)
                procs.append(p)

            def two_processes() -> int:
                order = rng.permutation(n)
                for w, conn in enumerate(conns):
                    conn.send((order, w, 2))
                return sum(conn.recv() for conn in conns)

            for _ in range(2):
                two_processes()  # each process maps the tier's pages once

            def loader_epoch(e: int) -> int:
                loader.set_epoch(e)
                count = 0
                for _batch in loader:
                    count += 1
                return count

            res: dict[str, list[float]] = {}

            def add(name: str, value: float) -> None:
                res.setdefault(name, []).append(value)

            for r in range(args.rounds):
                add("bound", per_batch(lambda: len(numpy_epoch(arrays, rng.permutation(n), bs))))
                guess.times.clear()
                rows_loop.times.clear()
                add("loader", per_batch(lambda r=r: loader_epoch(2 + r)))
                add("loader: gather_guess", statistics.median(guess.times))
                if rows_loop.times:  # (none: the gathering process copies and hashes)
                    add("loader: rows copied and hashed", statistics.median(rows_loop.times))
                add(
                    "gather_hits, 1 thread",
                    per_batch(lambda: gather(rng.permutation(n), shared[0], 0, 1)),
                )
                add("gather_hits, 2 threads", per_batch(two_threads))
                add("gather_hits, 2 processes", per_batch(two_processes))
                for name, src in (("private", images), ("/dev/shm", shm_images)):
                    copy_s, both_s = hash_parts(src, rng)
                    add(f"64 image rows copied from {name} memory", copy_s)
                    add(f"64 image rows copied from {name} memory, each hashed", both_s)
            for conn in conns:
                conn.send(None)
            for p in procs:
                p.join(5)
            loader.close()
        bound = statistics.median(res["bound"])
        print(f"{n} samples, batch {bs}, entry {entry} B, {args.rounds} rounds (medians)")
        print("| part | ms a batch | x bound |\n|---|---:|---:|")
        for name, values in res.items():
            m = statistics.median(values)
            print(f"| {name} | {m * 1e3:.3f} | {m / bound:.2f} |")
        for name in ("private", "/dev/shm"):
            key = f"64 image rows copied from {name} memory"
            extra = statistics.median(res[key + ", each hashed"]) - statistics.median(res[key])
            print(f"the xxh3 of 64 rows copied from {name} memory: {extra * 1e3:.3f} ms a batch")
        del shm_images, src  # the mapping closes with its last view
    finally:
        guess.owner.gather_guess = guess.original
        codec._digests_flat = rows_loop.original
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
