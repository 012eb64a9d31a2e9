"""Loader benchmark (issue 4): mmcache.DataLoader against the alternatives, side by side.

One run, same synthetic data, same preprocessing (resize 256, crop 224, 32 tokens),
same batch size, workers and seed:

(a) torch DataLoader over the uncached dataset (MultimodalDataset);
(b) the design note's pattern: an OrderedDict LRU with a capacity in items
    inside the dataset, used with (default, non-persistent) workers;
(c) the upper bound: a numpy array of all preprocessed samples in the training
    process, gathered into batches by fancy indexing;
mmcache with everything cached (warm: median of 8 epochs), cold, and with a memory
budget of 50%. The warm-vs-bound ratio is also measured with warm epochs and bound
epochs taken in turns (same machine noise for both) and per batch (the steady state,
without what each epoch costs once), both reported beside the verdict.
Plus a stall measurement (a fixed simulated training step) and the node's memory
(PSS summed over the loader's processes) with 1, 2 and 4 workers.

Every figure is a ratio measured in this run; nothing here is a pass/fail time.

    .venv/bin/python benchmarks/loader.py            # ~3-5 min on 2 cores
    .venv/bin/python benchmarks/loader.py --quick    # smoke run
    .venv/bin/python benchmarks/loader.py --compare REF [--rounds 4]

``--compare REF`` is the regression guard: it checks the commit REF out into a temporary git
worktree and measures the warm-vs-bound ratio (the interleaved one below) of this tree and of
REF in turns, each round a fresh process per tree importing mmcache from that tree's ``src``,
on the same generated data, then prints both medians and their quotient
(``benchmarks/treecompare.py``, shared with ``benchmarks/sources.py --compare``). Taking the
trees in turns puts the same machine noise on both; a single A-then-B run on a shared machine
cannot tell an 8% change from the noise.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

import mmcache as mc
from mmcache.cache import Cache
from treecompare import compare_trees  # benchmarks/ (the script's folder is on sys.path)

torch.set_num_threads(1)


# -- the design note's pattern ------------------------------------------------------------
class NoteLRUDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The design note: a list of dicts and an OrderedDict LRU with a capacity in items."""

    def __init__(self, ds: mc.MultimodalDataset, capacity: int) -> None:
        self.items = [
            {
                "id": ds.sample_id(i),
                "image_path": ds.records.image_path(i),
                "caption": ds.records.text(i),
            }
            for i in range(len(ds))
        ]
        self.pipeline = ds.pipeline
        self.capacity = capacity
        self.cache: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        rec = self.items[i]
        hit = self.cache.get(rec["id"])
        if hit is not None:
            self.cache.move_to_end(rec["id"])
            self.hits += 1
            return hit
        self.misses += 1
        s = self.pipeline.process(rec["image_path"], rec["caption"], sample_id=rec["id"])
        item = {"id": rec["id"], **{k: torch.from_numpy(v) for k, v in s.items()}}
        self.cache[rec["id"]] = item
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return item


# -- memory monitor -----------------------------------------------------------------------
class PssMonitor:
    """Peak PSS (proportional set size) summed over this process and its children."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        me = psutil.Process()
        total = 0
        for p in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += p.memory_full_info().pss
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> PssMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def shm_bytes(name_part: str) -> int:
    total = 0
    for entry in os.scandir("/dev/shm"):
        if name_part in entry.name:
            total += entry.stat().st_blocks * 512
    return total


# -- runners ------------------------------------------------------------------------------
def time_epochs(loader: Any, epochs: int, step: float = 0.0) -> list[float]:
    """Seconds per epoch (samples counted by the caller)."""
    out = []
    for e in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(e)
        t0 = time.perf_counter()
        for _batch in loader:
            if step:
                time.sleep(step)
        out.append(time.perf_counter() - t0)
    return out


def run_torch(ds: mc.MultimodalDataset, bs: int, workers: int, epochs: int) -> list[float]:
    g = torch.Generator()
    g.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=bs, shuffle=True, num_workers=workers, generator=g
    )
    return time_epochs(loader, epochs)


def run_note(
    ds: mc.MultimodalDataset, bs: int, workers: int, epochs: int, capacity: int
) -> list[float]:
    g = torch.Generator()
    g.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        NoteLRUDataset(ds, capacity),
        batch_size=bs,
        shuffle=True,
        num_workers=workers,
        generator=g,
    )
    return time_epochs(loader, epochs)


def numpy_arrays(ds: mc.MultimodalDataset) -> dict[str, np.ndarray]:
    """Every preprocessed sample in one in-memory numpy array per field (for the bound)."""
    n = len(ds)
    first = ds.produce(0)
    arrays = {k: np.empty((n, *v.shape), dtype=v.dtype) for k, v in first.items()}
    for i in range(n):
        for k, v in ds.produce(i).items():
            arrays[k][i] = v
    return arrays


def numpy_epoch(arrays: dict[str, np.ndarray], order: np.ndarray, bs: int) -> list[float]:
    """One epoch of the bound: whole-batch gathers; returns each batch's seconds."""
    out = []
    for s in range(0, len(order), bs):
        t0 = time.perf_counter()
        idx = order[s : s + bs]
        batch = {
            k: torch.from_numpy(np.take(a, idx, axis=0, mode="clip")) for k, a in arrays.items()
        }
        del batch
        out.append(time.perf_counter() - t0)
    return out


def run_numpy_bound(arrays: dict[str, np.ndarray], bs: int, epochs: int) -> float:
    """Samples/s of a whole-batch numpy gather of preprocessed samples (the upper bound)."""
    n = len(next(iter(arrays.values())))
    rng = np.random.default_rng(0)
    rates = []
    for _ in range(epochs):
        order = rng.permutation(n)
        t0 = time.perf_counter()
        numpy_epoch(arrays, order, bs)
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


@contextlib.contextmanager
def memory_cache(root: Path, memory: int, policy: str = "value") -> Iterator[Cache]:
    """A temporary memory-only cache; its shared memory and folder go afterwards."""
    cache = Cache(root, memory=memory, disk=None, policy=policy, temporary=True)
    try:
        yield cache
    finally:
        if cache.memory is not None:
            cache.memory.unlink()  # type: ignore[attr-defined]
        cache.close()
        shutil.rmtree(root, ignore_errors=True)


def stamped_epoch(loader: Any, epoch: int) -> tuple[list[float], float]:
    """One epoch of ``loader``: the ``perf_counter`` before it and after each batch, and
    the training process's CPU seconds over it (``time.process_time``, all its threads),
    which the load of other jobs on the machine moves far less than the wall times."""
    loader.set_epoch(epoch)
    c0 = time.process_time()
    stamps = [time.perf_counter()]
    for _batch in loader:
        stamps.append(time.perf_counter())
    return stamps, time.process_time() - c0


def run_interleaved(
    ds: mc.MultimodalDataset,
    root: Path,
    arrays: dict[str, np.ndarray],
    *,
    memory: int,
    bs: int,
    workers: int,
    pairs: int,
) -> dict[str, float]:
    """Warm mmcache epochs and bound epochs taken in turns (same noise for both).

    Returns the median per-pair ratio of epoch throughputs, and the ratio of the
    median batch times (the steady state, without what an epoch costs once: its
    first batch, the last short one); and the training process's CPU time per sample
    of a warm epoch (``time.process_time``, all its threads), which the load of other
    jobs on the machine moves far less than the wall times.
    """
    n = len(ds)
    rng = np.random.default_rng(1)
    ratios, mm_batches, np_batches, cpu = [], [], [], []
    with memory_cache(root, memory) as cache:
        loader = mc.DataLoader(
            ds, cache=cache, batch_size=bs, seed=0, num_workers=workers, persistent_workers=True
        )
        time_epochs(loader, 2)  # cold, then one warm epoch
        for e in range(2, 2 + pairs):
            t0 = time.perf_counter()
            np_batches += numpy_epoch(arrays, rng.permutation(n), bs)[:-1]
            bound = n / (time.perf_counter() - t0)
            stamps, seconds = stamped_epoch(loader, e)
            cpu.append(seconds / n)
            mm_batches += list(np.diff(stamps)[1:-1])
            ratios.append(n / (stamps[-1] - stamps[0]) / bound)
        loader.close()
    return {
        "epoch_ratio": statistics.median(ratios),
        "batch_ratio": statistics.median(np_batches) / statistics.median(mm_batches),
        "mmcache_batch_us": statistics.median(mm_batches) * 1e6,
        "numpy_batch_us": statistics.median(np_batches) * 1e6,
        "cpu_us_per_sample": statistics.median(cpu) * 1e6,
    }


def run_mmcache(
    ds: mc.MultimodalDataset,
    root: Path,
    *,
    memory: int,
    bs: int,
    workers: int,
    epochs: int,
    step: float = 0.0,
    policy: str = "value",
) -> dict[str, Any]:
    with memory_cache(root, memory, policy) as cache:
        loader = mc.DataLoader(
            ds,
            cache=cache,
            batch_size=bs,
            seed=0,
            num_workers=workers,
            persistent_workers=workers > 0,
        )
        times = time_epochs(loader, epochs, step)
        stats = loader.stats()
        del loader
    return {"times": times, "stats": stats}


def make_inputs(data: Path, n: int) -> tuple[Path, Any]:
    """The benchmark's data and tokenizer, generated once into ``data`` (seeded: any tree
    that generates them gets the same bytes)."""
    manifest = data / "data" / "manifest.jsonl"
    if not manifest.exists():
        manifest = Path(mc.synth.make_dataset(data / "data", n, seed=0))
    tok = mc.train_tokenizer(mc.synth.synth_captions(2000), vocab_size=2048)
    return manifest, tok


def make_dataset(data: Path, n: int) -> mc.MultimodalDataset:
    """The benchmark's dataset over :func:`make_inputs`: resize 256, crop 224, 32 tokens."""
    manifest, tok = make_inputs(data, n)
    pipe = mc.Pipeline(
        image=mc.ImageSpec(size=224, resize=256), text=mc.TextSpec(tok, max_length=32)
    )
    return mc.MultimodalDataset(manifest, pipeline=pipe)


def ratio_only(data: Path, n: int, bs: int, workers: int, pairs: int) -> dict[str, float]:
    """Just the interleaved warm-vs-bound measurement (what ``--compare`` runs per tree)."""
    ds = make_dataset(data, n)
    data_bytes = len(ds) * mc.codec.encoded_size(ds.produce(0))
    arrays = numpy_arrays(ds)
    root = Path(tempfile.mkdtemp(prefix="mmcache-bench-ratio-"))
    try:
        return run_interleaved(
            ds,
            root / "c",
            arrays,
            memory=int(data_bytes * 1.2),
            bs=bs,
            workers=workers,
            pairs=pairs,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def compare(ref: str, args: argparse.Namespace) -> None:
    """This tree against commit ``ref``, in turns (see the module docstring)."""
    compare_trees(
        ref,
        script=Path(__file__).resolve(),
        argv=[
            "--ratio-only",
            "--n",
            str(args.n),
            "--batch-size",
            str(args.batch_size),
            "--workers",
            str(args.workers),
            "--pairs",
            str(args.pairs),
        ],
        rounds=args.rounds,
        figures={
            "epoch_ratio": "warm/bound, epochs",
            "batch_ratio": "same, batches",
            "cpu_us_per_sample": "training-process CPU per sample, us",
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--compare", metavar="REF", help="interleave this tree with commit REF")
    ap.add_argument("--rounds", type=int, default=4, help="--compare: rounds per tree")
    ap.add_argument("--pairs", type=int, default=6, help="--compare: epoch pairs per round")
    ap.add_argument("--ratio-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--step", type=float, default=0.05, help="simulated training step, s")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/loader.md")
    args = ap.parse_args()
    if args.quick:
        args.n = 300
    if args.ratio_only:
        row = ratio_only(args.data, args.n, args.batch_size, args.workers, args.pairs)
        print(json.dumps(row))
        return
    if args.compare:
        compare(args.compare, args)
        return
    bs, w = args.batch_size, args.workers
    tmp = Path(tempfile.mkdtemp(prefix="mmcache-bench-loader-"))
    try:
        manifest = mc.synth.make_dataset(tmp / "data", args.n, seed=0)
        tok = mc.train_tokenizer(mc.synth.synth_captions(2000), vocab_size=2048)
        pipe = mc.Pipeline(
            image=mc.ImageSpec(size=224, resize=256), text=mc.TextSpec(tok, max_length=32)
        )
        ds = mc.MultimodalDataset(manifest, pipeline=pipe)
        n = len(ds)
        entry = mc.codec.encoded_size(ds.produce(0))
        data_bytes = n * entry
        rows: dict[str, dict[str, Any]] = {}

        print(f"{n} samples, {data_bytes / 2**20:.0f} MiB preprocessed, batch {bs}, workers {w}")
        # (a) torch over the uncached dataset: 2 epochs (both cold by construction).
        a = run_torch(ds, bs, w, 2)
        rows["a_torch_uncached"] = {"samples_per_s": n / statistics.median(a)}
        print("a", rows["a_torch_uncached"])
        # mmcache, everything fits: epoch 0 cold, 1-8 warm.
        full = run_mmcache(
            ds, tmp / "c-full", memory=int(data_bytes * 1.2), bs=bs, workers=w, epochs=9
        )
        st = full["stats"]
        rows["mmcache_cold"] = {"samples_per_s": n / full["times"][0]}
        rows["mmcache_warm"] = {
            "samples_per_s": n / statistics.median(full["times"][1:]),
            "hit_rate": st.epochs[-1].hit_rate,
            "epoch_ms": [round(t * 1e3, 2) for t in full["times"]],
        }
        print("mmcache", rows["mmcache_cold"], rows["mmcache_warm"])
        # mmcache at a 50% budget: steady state = median of epochs 1..3.
        half = run_mmcache(ds, tmp / "c-half", memory=data_bytes // 2, bs=bs, workers=w, epochs=4)
        steady = statistics.median(half["times"][1:])
        rows["mmcache_50pct"] = {
            "samples_per_s": n / steady,
            "epoch_time_vs_a": steady / statistics.median(a),
            "hit_rate": statistics.median(e.hit_rate for e in half["stats"].epochs[1:]),
        }
        print("50%", rows["mmcache_50pct"])
        # (b) the note's LRU at the same bytes (50% of N items), default workers.
        b = run_note(ds, bs, w, 3, capacity=n // 2)
        rows["b_note_lru_50pct"] = {"samples_per_s": n / statistics.median(b[1:])}
        print("b", rows["b_note_lru_50pct"])
        # (c) upper bound.
        arrays = numpy_arrays(ds)
        rows["c_numpy_bound"] = {"samples_per_s": run_numpy_bound(arrays, bs, 8)}
        print("c", rows["c_numpy_bound"])
        # warm epochs and bound epochs in turns: the ratio under the same noise.
        rows["interleaved"] = run_interleaved(
            ds, tmp / "c-inter", arrays, memory=int(data_bytes * 1.2), bs=bs, workers=w, pairs=10
        )
        del arrays
        print("interleaved", rows["interleaved"])
        # stall: warm epochs with a fixed simulated training step.
        stall = run_mmcache(
            ds,
            tmp / "c-stall",
            memory=int(data_bytes * 1.2),
            bs=bs,
            workers=w,
            epochs=2,
            step=args.step,
        )
        warm = stall["stats"].epochs[1]
        steps = warm.batches
        rows["stall"] = {
            "step_s": args.step,
            "stall_per_step_s": warm.stall_s / max(steps, 1),
            "stall_fraction_of_step": warm.stall_s / max(steps, 1) / args.step,
        }
        print("stall", rows["stall"])
        # memory: PSS of the loader's processes with 1, 2, 4 workers, warm epoch.
        mem: dict[int, dict[str, float]] = {}
        for workers in (1, 2, 4):
            root = tmp / f"c-mem{workers}"
            with memory_cache(root, int(data_bytes * 1.2)) as cache:
                loader = mc.DataLoader(
                    ds, cache=cache, batch_size=bs, num_workers=workers, persistent_workers=True
                )
                loader.set_epoch(0)
                for _ in loader:
                    pass
                loader.set_epoch(1)
                with PssMonitor() as mon:
                    for _ in loader:
                        pass
                seg = shm_bytes(mc.cache._memory_name(root.absolute()))
                mem[workers] = {"peak_pss_mib": mon.peak / 2**20, "shm_mib": seg / 2**20}
                del loader
        rows["memory"] = {str(k): v for k, v in mem.items()}
        print("memory", rows["memory"])

        a_rate = rows["a_torch_uncached"]["samples_per_s"]
        c_rate = rows["c_numpy_bound"]["samples_per_s"]
        warm_rate = rows["mmcache_warm"]["samples_per_s"]
        checks = [
            ("warm vs (c) numpy bound", warm_rate / c_rate, ">= 0.50"),
            (
                "  same, epochs interleaved (median of 10 pairs)",
                rows["interleaved"]["epoch_ratio"],
                "(reported)",
            ),
            (
                "  same, median batch time (steady state)",
                rows["interleaved"]["batch_ratio"],
                "(reported)",
            ),
            ("warm vs (a) uncached", warm_rate / a_rate, ">= 10"),
            ("cold vs (a) uncached", rows["mmcache_cold"]["samples_per_s"] / a_rate, ">= 0.95"),
            ("50% budget epoch time vs (a)", rows["mmcache_50pct"]["epoch_time_vs_a"], "<= 0.55"),
            ("50% budget hit rate", rows["mmcache_50pct"]["hit_rate"], "0.49-0.51"),
            (
                "(b) note LRU 50% vs (a)",
                rows["b_note_lru_50pct"]["samples_per_s"] / a_rate,
                "(reported)",
            ),
            ("warm stall / step", rows["stall"]["stall_fraction_of_step"], "< 0.05"),
        ]

        def verdict(value: float, target: str) -> str:
            if target.startswith(">="):
                return "PASS" if value >= float(target[2:]) else "MISS"
            if target.startswith("<="):
                return "PASS" if value <= float(target[2:]) else "MISS"
            if target.startswith("<"):
                return "PASS" if value < float(target[1:]) else "MISS"
            if "-" in target and not target.startswith("("):
                lo, hi = (float(x) for x in target.split("-"))
                return "PASS" if lo <= value <= hi else "MISS"
            return ""

        lines = [
            f"# Loader benchmark ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, mmcache {mc.__version__})",
            "",
            f"{n} synthetic COCO-sized samples ({data_bytes / 2**20:.0f} MiB preprocessed), "
            f"batch {bs}, {w} workers, resize 256 / crop 224, 32 tokens.",
            "",
            "| system | samples/s |",
            "|---|---:|",
        ]
        for name in (
            "a_torch_uncached",
            "b_note_lru_50pct",
            "c_numpy_bound",
            "mmcache_cold",
            "mmcache_warm",
            "mmcache_50pct",
        ):
            lines.append(f"| {name} | {rows[name]['samples_per_s']:,.0f} |")
        lines += ["", "| check | value | target | |", "|---|---:|---|---|"]
        for name, value, target in checks:
            lines.append(f"| {name} | {value:.3f} | {target} | {verdict(value, target)} |")
        lines += [
            "",
            "| workers | peak PSS of loader processes (MiB) | shared segment (MiB) |",
            "|---:|---:|---:|",
        ]
        for k, v in mem.items():
            lines.append(f"| {k} | {v['peak_pss_mib']:.0f} | {v['shm_mib']:.0f} |")
        report = "\n".join(lines)
        print()
        print(report)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report + "\n")
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
