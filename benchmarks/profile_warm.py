"""Where a warm epoch's time goes in the training process (not a test).

Builds ``--n`` synthetic COCO-sized samples (as ``benchmarks/loader.py``), fills a
memory tier with one cold epoch, then times warm epochs against a numpy gather of
the same bytes and prints the top functions of a cProfile of further warm epochs
(the training process's main thread), plus the cost per sample of the per-epoch
file check (``stamps``).

    .venv/bin/python benchmarks/profile_warm.py --workers 2
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import mmcache as mc

torch.set_num_threads(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=1500)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mmcache-prof-"))
    try:
        manifest = mc.synth.make_dataset(tmp / "data", args.n, seed=0)
        tok = mc.train_tokenizer(mc.synth.synth_captions(2000), vocab_size=2048)
        pipe = mc.Pipeline(
            image=mc.ImageSpec(size=224, resize=256), text=mc.TextSpec(tok, max_length=32)
        )
        ds = mc.MultimodalDataset(manifest, pipeline=pipe)
        with mc.Cache(tmp / "c", memory="400MiB", temporary=True) as cache:
            loader = mc.DataLoader(
                ds,
                cache=cache,
                batch_size=64,
                num_workers=args.workers,
                persistent_workers=args.workers > 0,
            )

            def epoch(e: int) -> float:
                loader.set_epoch(e)
                t = time.perf_counter()
                for _ in loader:
                    pass
                return time.perf_counter() - t

            epoch(0)
            warm = [epoch(e) for e in range(1, 6)]
            images = np.random.randint(0, 255, (args.n, 3 * 224 * 224), dtype=np.uint8)
            out = np.empty((64, images.shape[1]), dtype=np.uint8)

            def bound() -> float:
                perm = np.random.permutation(args.n)
                t = time.perf_counter()
                for i in range(0, args.n, 64):
                    j = perm[i : i + 64]
                    np.take(images, j, axis=0, out=out[: len(j)], mode="clip")
                return time.perf_counter() - t

            b = [bound() for _ in range(5)]
            print(
                f"warm epoch {statistics.median(warm) * 1e3:.1f} ms, numpy bound "
                f"{statistics.median(b) * 1e3:.1f} ms, ratio "
                f"{statistics.median(b) / statistics.median(warm):.3f}"
            )
            idx = np.random.permutation(args.n)
            ds.stamps(idx)
            st = []
            for _ in range(11):
                t = time.perf_counter()
                ds.stamps(idx)
                st.append(time.perf_counter() - t)
            print(f"file check: {statistics.median(st) / args.n * 1e6:.2f} us per sample")
            prof = cProfile.Profile()
            prof.enable()
            for e in range(6, 11):
                epoch(e)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
            loader.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
