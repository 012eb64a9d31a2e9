"""An HF image processor in ``__getitem__`` (LLaVA's pattern) against the same processor
cached by ``mmcache.hf_image_processor`` (issue 14). Not a test.

Side by side in one run, same synthetic COCO-sized images, batch 64, same workers:
(a) a torch DataLoader whose dataset opens each image and calls the processor
(``pixel_values``, float32) every epoch; (b) ``mmcache.DataLoader`` over the cached uint8
stage: a cold epoch, warm epochs with ``mmcache.normalize`` on the CPU per batch (what
(a) hands the model), and warm epochs with the normalisation left to the device (the
uint8 batch only). Ratios are of median epoch times measured in this run.

    .venv/bin/python benchmarks/hf_processor.py            # needs mmcache[hf]
    .venv/bin/python benchmarks/hf_processor.py --quick
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image

import mmcache as mc

torch.set_num_threads(1)


class Getitem(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """(a): the processor inside ``__getitem__``, every epoch."""

    def __init__(self, manifest: Path, processor: Any) -> None:
        self.root = manifest.parent
        self.paths = [json.loads(line)["image_path"] for line in manifest.open()]
        self.processor = processor

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        im = Image.open(self.root / self.paths[i]).convert("RGB")
        out: torch.Tensor = self.processor(im, return_tensors="pt")["pixel_values"][0]
        return out


def timed(it: Any, each: Any = None) -> float:
    t = time.perf_counter()
    for b in it:
        if each is not None:
            each(b)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3, help="warm epochs of each kind")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.n, args.epochs = 128, 2
    from transformers import CLIPImageProcessor

    tmp = Path(tempfile.mkdtemp(prefix="mmcache-bench-hf-"))
    try:
        manifest = mc.synth.make_dataset(tmp / "data", args.n, seed=0)
        processor = CLIPImageProcessor()
        kw: dict[str, Any] = {"batch_size": 64, "num_workers": args.workers}
        torch_loader = torch.utils.data.DataLoader(
            Getitem(manifest, processor), persistent_workers=args.workers > 0, **kw
        )
        a = statistics.median(timed(torch_loader) for _ in range(2))
        stage = mc.hf_image_processor(processor)
        ds = mc.MultimodalDataset(manifest, pipeline=mc.Pipeline(image=stage))
        with mc.Cache(tmp / "cache", memory="1GiB", temporary=True) as cache:
            loader = mc.DataLoader(ds, cache=cache, persistent_workers=args.workers > 0, **kw)
            loader.set_epoch(0)
            cold = timed(loader)

            def norm(b: dict[str, Any]) -> None:
                mc.normalize(b["image"], stage.mean, stage.std)

            warm_norm, warm = [], []
            for e in range(1, args.epochs + 1):
                loader.set_epoch(e)
                warm_norm.append(timed(loader, norm))
                loader.set_epoch(e)
                warm.append(timed(loader))
            hits = loader.stats().epochs[-1].hit_rate
            loader.close()
        rows = [
            ("(a) processor in __getitem__ (float32 pixel_values)", a),
            ("(b) mmcache, cold epoch", cold),
            ("(b) mmcache, warm, normalize on the CPU per batch", statistics.median(warm_norm)),
            ("(b) mmcache, warm, uint8 batch (normalise on the device)", statistics.median(warm)),
        ]
        print(f"\n{args.n} samples, batch 64, {args.workers} workers, CLIPImageProcessor()")
        print("| run | epoch s | vs (a) |\n|---|---:|---:|")
        for name, t in rows:
            print(f"| {name} | {t:.3f} | {a / t:.1f}x |")
        print(f"warm hit rate {hits:.2f}; target: warm >= 20x (a)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
