"""Augmentation benchmark (issue 14): random crops after the cache vs. the uncached recipe.

One run, the same COCO-sized synthetic JPEGs (``mmcache.synth.make_dataset``), the
same batch size, workers and seed, side by side:

(a) the OpenCLIP-style uncached pipeline through a torch DataLoader: PIL decode, a
    RandomResizedCrop(224, scale=(0.9, 1.0)) on the PIL image (torchvision's
    parameter sampling, written here with ``random`` and PIL: no torchvision), a
    random horizontal flip, to a uint8 tensor; persistent workers, as OpenCLIP;
(b) mmcache: ``ImageSpec(size=256)`` (shorter side 256, centre crop) cached, and
    ``augment=Compose([RandomResizedCrop(224, scale=(0.9, 1.0)), RandomHorizontalFlip()])``
    after the cache, on the CPU (or ``--device cuda``); its warm epoch (median of the
    warm epochs) against (a)'s median epoch, and the CPU seconds per sample it costs
    the training process (``time.process_time``: both assembling threads; workers
    and the stat prefetcher are other processes);
(c) for scale: (b)'s warm epoch without the augment;
(o) when open_clip is importable (the reference venv, ``make ref-env``): open_clip's own
    ``image_transform(224, is_train=True)`` (its ``preprocess_train``: bicubic RRC, no
    flip, ToTensor + Normalize) in ``__getitem__``, and (o') its split by
    ``mmcache.augment.from_torchvision``: the whole image cached at 273 px, the same
    crop distribution after the cache, normalised in the training process.

torch runs with one intra-op thread in the training process (as benchmarks/loader.py).
Every figure is measured in this run; nothing here is a pass/fail time.

    .venv/bin/python benchmarks/augment.py                 # ~2-4 min on 2 cores
    .venv/bin/python benchmarks/augment.py --quick         # smoke run
    .venv/bin/python benchmarks/augment.py --device cuda   # augment on the GPU
    .venv-ref/bin/python benchmarks/augment.py             # with open_clip's own rows
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from PIL import Image

import mmcache as mc
from mmcache.augment import Compose, RandomHorizontalFlip, RandomResizedCrop
from mmcache.cache import Cache
from mmcache.loader import Augment
from mmcache.synth import make_dataset

torch.set_num_threads(1)

SIZE = 224
SCALE = (0.9, 1.0)
RATIO = (3 / 4, 4 / 3)


# -- (a) the OpenCLIP-style uncached recipe ---------------------------------------------
def _rrc_params(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, with Python's random: (top, left, h, w)."""
    area = width * height
    lo, hi = math.log(RATIO[0]), math.log(RATIO[1])
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(lo, hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(RATIO):
        w, h = width, round(width / min(RATIO))
    elif in_ratio > max(RATIO):
        h, w = height, round(height * max(RATIO))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class OpenClipStyle(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``__getitem__`` decodes, random-resized-crops and flips one image with PIL."""

    def __init__(self, paths: list[str], seed: int) -> None:
        self.paths = paths
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        rng = random.Random(hash((self.seed, self.epoch, i)))
        with Image.open(self.paths[i]) as f:
            im = f.convert("RGB")
            top, left, h, w = _rrc_params(im.width, im.height, rng)
            out = im.resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            out = out.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(out).transpose(2, 0, 1).copy())


class OpenClipOwn(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``__getitem__`` runs open_clip's own ``preprocess_train`` on one decoded image."""

    def __init__(self, paths: list[str], preprocess: Any) -> None:
        self.paths, self.preprocess, self.epoch = paths, preprocess, 0

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        with Image.open(self.paths[i]) as f:
            return self.preprocess(f)  # type: ignore[no-any-return]


def open_clip_train() -> Any | None:
    """open_clip's ``preprocess_train`` for 224 px, or None when open_clip is not here."""
    try:
        from open_clip.transform import image_transform
    except Exception:  # not installed, or torchvision beside another torch build
        return None
    return image_transform(SIZE, is_train=True)


def run_uncached(paths: list[str], args: argparse.Namespace, ds: Any = None) -> list[float]:
    ds = OpenClipStyle(paths, seed=0) if ds is None else ds
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )
    times = []
    for epoch in range(args.epochs):
        ds.epoch = epoch  # persistent workers hold a copy: only the first epoch's matters
        t0 = time.perf_counter()
        for batch in loader:
            assert batch.shape[1:] == (3, SIZE, SIZE)
        times.append(time.perf_counter() - t0)
    del loader
    return times


# -- (b) mmcache: cached ImageSpec(size=256), augment after the cache --------------------
def _sync(device: str | None) -> None:
    if device is not None and device.startswith("cuda"):
        torch.cuda.synchronize()


def _all_cpu_s() -> float:
    """CPU seconds of this process and every child alive now (workers, crop processes,
    the stat prefetcher): on 2 cores the warm augmented epoch's wall time follows it."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += sum(child.cpu_times()[:2])
    return total


def run_cached(
    ds: mc.MultimodalDataset, root: Path, args: argparse.Namespace, *, augment: Any
) -> dict[str, Any]:
    device = args.device if augment is not None else None
    with Cache(root, memory=args.memory, temporary=True) as cache:
        loader = mc.DataLoader(
            ds,
            cache=cache,
            batch_size=args.batch_size,
            seed=0,
            num_workers=args.workers,
            persistent_workers=True,
            augment=Augment(augment, device=device) if augment is not None else None,
        )
        cold = 0.0
        warm, cpu, every = [], [], []
        for epoch in range(args.epochs + 1):
            loader.set_epoch(epoch)
            a0, c0, t0 = _all_cpu_s(), time.process_time(), time.perf_counter()
            for batch in loader:
                image = batch["image"]
            _sync(device)
            seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
            if epoch == 0:
                cold = seconds
            else:
                warm.append(seconds)
                cpu.append(cpu_s)
                every.append(_all_cpu_s() - a0)
        shape = tuple(image.shape)
        hits = loader.stats().epochs[-1].hit_rate
        loader.close()
    return {
        "cold": cold,
        "warm": warm,
        "cpu": cpu,
        "all_cpu": every,
        "shape": shape,
        "hit_rate": hits,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=4, help="epochs of (a); warm epochs of (b)")
    ap.add_argument("--device", default=None, help="where (b)'s augment runs (cuda); default CPU")
    ap.add_argument("--memory", default="1GiB", help="the cache's memory tier")
    ap.add_argument("--quick", action="store_true", help="256 samples, 2 epochs")
    ap.add_argument("--out", default="benchmarks/results/augment.md")
    ap.add_argument("--data", default=None, help="folder for the JPEGs (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.n, args.epochs = min(args.n, 256), 2
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    tmp = Path(tempfile.mkdtemp(prefix="mmcache-augment-bench-"))
    try:
        data = Path(args.data) if args.data else tmp / "data"
        manifest = make_dataset(data, args.n, seed=0)
        ds = mc.MultimodalDataset(manifest, pipeline=mc.Pipeline(image=mc.ImageSpec(size=256)))
        interleaved = mc.MultimodalDataset(
            manifest, pipeline=mc.Pipeline(image=mc.ImageSpec(size=256, channels_last=True))
        )
        paths = [str(ds.records.image_path(i)) for i in range(len(ds))]
        aug = Compose([RandomResizedCrop(SIZE, scale=SCALE), RandomHorizontalFlip()])
        a = run_uncached(paths, args)
        b = run_cached(ds, tmp / "cache-b", args, augment=aug)
        bl = run_cached(interleaved, tmp / "cache-bl", args, augment=aug)
        c = run_cached(ds, tmp / "cache-c", args, augment=None)
        preprocess = open_clip_train()
        if preprocess is not None:
            from mmcache.augment import from_torchvision

            o = run_uncached(paths, args, OpenClipOwn(paths, preprocess))
            stage, split = from_torchvision(preprocess)
            faithful = mc.MultimodalDataset(manifest, pipeline=mc.Pipeline(image=stage))
            op = run_cached(faithful, tmp / "cache-o", args, augment=split)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = args.n
    a_s, b_s, c_s = statistics.median(a), statistics.median(b["warm"]), statistics.median(c["warm"])
    bl_s = statistics.median(bl["warm"])
    cpu_b = statistics.median(b["cpu"]) / n
    cpu_bl = statistics.median(bl["cpu"]) / n
    cpu_c = statistics.median(c["cpu"]) / n
    where = args.device or "cpu"
    rows = [
        ("(a) OpenCLIP-style, uncached (PIL decode + RRC + flip)", a_s, None, "-"),
        (f"(b) mmcache warm, ImageSpec(256) + augment on {where}", b_s, cpu_b, f"{a_s / b_s:.1f}x"),
        (
            f"(b') as (b), ImageSpec(256, channels_last=True), augment on {where}",
            bl_s,
            cpu_bl,
            f"{a_s / bl_s:.1f}x",
        ),
        ("(b) mmcache cold epoch (same loader)", b["cold"], None, f"{a_s / b['cold']:.2f}x"),
        ("(c) mmcache warm, no augment (256 px centre crops)", c_s, cpu_c, f"{a_s / c_s:.1f}x"),
    ]
    if preprocess is not None:
        o_s, op_s = statistics.median(o), statistics.median(op["warm"])
        rows += [
            ("(o) open_clip's own preprocess_train, uncached", o_s, None, f"{a_s / o_s:.1f}x"),
            (
                f"(o') from_torchvision(preprocess_train) warm, augment on {where}",
                op_s,
                statistics.median(op["cpu"]) / n,
                f"{a_s / op_s:.1f}x; {o_s / op_s:.1f}x vs (o)",
            ),
            ("(o') cold epoch", op["cold"], None, f"{o_s / op['cold']:.2f}x vs (o)"),
        ]
    lines = [
        f"n={n} COCO-sized synthetic JPEGs, batch {args.batch_size}, {args.workers} workers, "
        f"{args.epochs} epochs (median), augment device: {where}; (b) batches {b['shape']}, "
        f"warm hit rate {b['hit_rate']:.2f}",
        "",
        "| pipeline | epoch s | samples/s | train-process CPU s/sample | vs (a) |",
        "|---|---|---|---|---|",
    ]
    for name, sec, cpu, ratio in rows:
        cpu_txt = f"{cpu * 1e3:.3f} ms" if cpu is not None else "-"
        lines.append(f"| {name} | {sec:.2f} | {n / sec:.0f} | {cpu_txt} | {ratio} |")
    every = {
        k: statistics.median(r["all_cpu"]) / n * 1e3 for k, r in (("b", b), ("b'", bl), ("c", c))
    }
    lines.append("")
    lines.append(
        "CPU per warm sample in all processes (training process, workers, crop processes): "
        + ", ".join(f"({k}) {v:.3f} ms" for k, v in every.items())
    )
    lines.append(
        f"warm epoch ratio (b)/(a): {a_s / b_s:.1f}x, (b')/(a): {a_s / bl_s:.1f}x "
        "(target >= 8x on the CPU, >= 30x on a GPU)"
    )
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
