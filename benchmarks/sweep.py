"""Several jobs on one node, one preparation: K training jobs started together on one cache.

A learning-rate sweep starts K jobs at once with the same data, pipeline and seed (so the
same order). Each job's first epoch misses every sample; without production claims each
job decodes each sample itself (K decodes per sample, and K jobs share the CPU). With
them (:mod:`mmcache.stores.claims`, on by default) a process that misses a key another
process is producing waits for that entry instead.

For K = 1, 2, 3 (and K = 3 with the claims turned off, what the code before them did) it
starts K processes, each a ``mmcache.DataLoader`` with 2 workers over the same synthetic
data and one cache root, lets them begin at one instant, and reports:

* decodes in all / samples (target <= 1.1 with claims);
* each job's first epoch against one job alone (the K = 1 row), median over the jobs
  (target <= 1.0: no slower);
* the CPU all K jobs spent in their first epochs (training processes and their workers,
  by ``time.process_time`` and ``getrusage(RUSAGE_CHILDREN)``) against one job alone's,
  and how busy the cores were (that CPU over the cores times the slowest job's epoch):
  where the epoch's time goes when it is slower. A last row runs one job with 6 workers:
  as many processes on the cores as K = 3, without the other jobs' work (what crowding
  the cores alone costs).

Every figure is a ratio from this run.

    .venv/bin/python benchmarks/sweep.py            # 600 samples, ~5 min on 2 cores
    .venv/bin/python benchmarks/sweep.py --quick    # 120 samples
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _children_cpu() -> float:
    """CPU seconds of this process's children that have exited (its workers, once joined)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def job(spec: dict[str, Any], ready: Any, out: Any, done: Any) -> None:
    """One training job: its first epoch; puts (misses, seconds, training-process CPU
    seconds, workers' CPU seconds) on ``out``."""
    import mmcache as mc
    from mmcache.cache import Cache

    if not spec["claims"]:  # the code before claims; forked workers inherit this
        Cache.claims = property(lambda self: None)  # type: ignore[assignment,method-assign]
    tok = mc.train_tokenizer(mc.synth.synth_captions(500), vocab_size=512)
    pipe = mc.Pipeline(
        image=mc.ImageSpec(size=224, resize=256), text=mc.TextSpec(tok, max_length=32)
    )
    ds = mc.MultimodalDataset(spec["manifest"], pipeline=pipe)
    cache = Cache(spec["root"], memory="1GiB", disk=None, temporary=True)
    loader = mc.DataLoader(
        ds,
        cache=cache,
        batch_size=32,
        shuffle=True,
        seed=0,
        num_workers=spec["workers"],
        multiprocessing_context="fork",
    )
    ready.wait(600)  # every job built: start together
    t0, cpu0, kids0 = time.perf_counter(), time.process_time(), _children_cpu()
    for _batch in loader:
        pass
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    misses = loader.stats().epochs[0].misses
    loader.close()  # joins the workers (and the stat prefetcher): their CPU is counted now
    out.put((misses, seconds, cpu, _children_cpu() - kids0))
    done.wait(600)  # nobody drops the shared tier while another job still reads it
    cache.close()


def sweep(
    manifest: Path, tmp: Path, k: int, claims: bool, workers: int = 2
) -> list[tuple[int, float, float, float]]:
    ctx = mp.get_context("spawn")
    ready, done, out = ctx.Barrier(k), ctx.Barrier(k), ctx.Queue()
    spec = {
        "manifest": str(manifest),
        "root": str(tmp / f"cache-{k}-{claims}-{workers}"),
        "claims": claims,
        "workers": workers,
    }
    procs = [ctx.Process(target=job, args=(spec, ready, out, done)) for _ in range(k)]
    for p in procs:
        p.start()
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(120)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n = 120 if args.quick else args.n
    import mmcache as mc

    tmp = Path(tempfile.mkdtemp(prefix="mmcache-bench-sweep-"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        manifest = Path(mc.synth.make_dataset(tmp / "data", n, seed=0))
        rows = []
        alone = alone_cpu = 0.0
        cores = os.cpu_count() or 1
        for k, claims, workers in (
            (1, True, 2),
            (2, True, 2),
            (3, True, 2),
            (3, False, 2),
            (1, True, 6),
        ):
            res = sweep(manifest, tmp, k, claims, workers)
            decodes = sum(r[0] for r in res)
            epoch = statistics.median(r[1] for r in res)
            train_cpu, worker_cpu = sum(r[2] for r in res), sum(r[3] for r in res)
            total = train_cpu + worker_cpu
            busy = total / (cores * max(r[1] for r in res))
            if not rows:  # the first row: one job alone, 2 workers
                alone, alone_cpu = epoch, total
            rows.append(
                (
                    k,
                    claims,
                    workers,
                    decodes / n,
                    epoch / alone,
                    total / alone_cpu,
                    busy,
                )
            )
            print(
                f"K={k} claims={claims} workers={workers}: decodes {decodes}/{n}, "
                f"epoch {epoch:.2f} s, CPU {train_cpu:.2f} s training processes "
                f"+ {worker_cpu:.2f} s workers",
                flush=True,
            )
        print()
        print(f"{n} samples, 224 px, {cores} cores")
        print()
        print(
            "| jobs | claims | workers per job | decodes / samples | first epoch vs one job alone "
            "| CPU in all vs one job alone | cores busy |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|")
        for k, claims, workers, dec, ratio, cpu, busy in rows:
            print(
                f"| {k} | {'on' if claims else 'off'} | {workers} | {dec:.2f} | {ratio:.2f} "
                f"| {cpu:.2f} | {busy:.2f} |"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
