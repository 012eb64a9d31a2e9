"""Warm epochs of the default cache (memory + disk tiers) against a memory-only cache.

With memory large enough for the data, a warm epoch of ``Cache(root)`` (a memory tier
and a disk tier) serves every sample from memory, as a memory-only cache does; what it
may still pay is the machinery for the disk tier (the read-ahead of a guessed epoch,
the tiered gather). Both loaders are built and warmed first, then their epochs run in
turns (the order alternating), so both see the same noise. Prints each loader's median
warm epoch, its training-process CPU per sample, the tiers that served the last epoch,
and the ratio of the two epochs (1.00: the disk tier costs a warm epoch nothing).

    .venv/bin/python benchmarks/tiers_warm.py [--n 1500] [--epochs 12]

To compare with another commit, run it again with that commit's ``src`` first on
``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import mmcache as mc
from mmcache.cache import Cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=1500, help="samples")
    ap.add_argument("--epochs", type=int, default=12, help="warm epochs per loader")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="mmcache-bench-tiers-"))
    loaders: dict[str, mc.DataLoader] = {}
    try:
        manifest = mc.synth.make_dataset(tmp / "data", args.n, seed=0)
        tok = mc.train_tokenizer(mc.synth.synth_captions(500), vocab_size=512)
        pipe = mc.Pipeline(
            image=mc.ImageSpec(size=224, resize=256), text=mc.TextSpec(tok, max_length=32)
        )
        ds = mc.MultimodalDataset(manifest, pipeline=pipe)
        memory = 2 * args.n * 160_000  # room for every entry
        setups = (
            ("memory only", "c-memory", None),
            ("memory + disk (the default)", "c-both", "4GiB"),
        )
        for name, root, disk in setups:
            cache = Cache(tmp / root, memory=memory, disk=disk, temporary=True)
            loader = mc.DataLoader(
                ds,
                cache=cache,
                batch_size=64,
                shuffle=True,
                seed=0,
                num_workers=2,
                persistent_workers=True,
            )
            for e in range(2):  # cold, then a first warm epoch
                loader.set_epoch(e)
                for _ in loader:
                    pass
            loaders[name] = loader
        wall: dict[str, list[float]] = {k: [] for k in loaders}
        cpu: dict[str, list[float]] = {k: [] for k in loaders}
        names = list(loaders)
        for e in range(2, 2 + args.epochs):
            for name in names if e % 2 else names[::-1]:
                loader = loaders[name]
                loader.set_epoch(e)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in loader:
                    pass
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        print(f"{args.n} samples, batch 64, 2 workers, {args.epochs} warm epochs each, in turns")
        print()
        print(
            "| cache | warm epoch, ms (median) | training-process CPU per sample, us | served by |"
        )
        print("|---|---:|---:|---|")
        for name, loader in loaders.items():
            tiers = loader.stats().epochs[-1].tier_hits
            print(
                f"| {name} | {statistics.median(wall[name]) * 1e3:.1f} "
                f"| {statistics.median(cpu[name]) / args.n * 1e6:.1f} | {tiers} |"
            )
        a, b = (statistics.median(wall[k]) for k in names)
        print()
        print(f"memory + disk / memory only, warm epoch: {b / a:.2f}")
    finally:
        for loader in loaders.values():
            loader.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
