"""Preprocessing throughput: the design note's per-item pattern vs ``mmcache.Pipeline``.

Both run in this one process (no DataLoader, no cache): this measures only the cost
of turning a record into a training sample, the work a cache miss pays.

* **note**: ``Image.open(path).convert("RGB")``, resize of the full image so the
  shorter side is 256 (bicubic), centre crop 224, float32 ``[3,224,224]`` / 255
  (torchvision's ``ToTensor``), tokenization to 32 ids, items from a list of dicts.
* **ours**: ``Pipeline.process`` (crop box folded into the resize, reduced-size JPEG
  decode when the source is >= 2x the target, uint8 output), wrapped as tensors
  like ``MultimodalDataset`` does.

Sources: synthetic COCO-sized JPEGs (480-640 px) and large ones (1,000-2,000 px),
generated in a temporary folder. The two runs alternate for ``--rounds`` rounds and
the medians are reported, so a noisy machine hurts both alike. Torch runs with one
intra-op thread, as it does in every DataLoader worker.

    .venv/bin/python benchmarks/pipeline.py            # ~30 s on 2 cores
    .venv/bin/python benchmarks/pipeline.py --n 1000 --large-n 300 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer

from mmcache.synth import make_dataset, synth_captions
from mmcache.transforms import ImageSpec, TextSpec, train_tokenizer
from mmcache.transforms.pipeline import Pipeline


class NoteDataset:
    """The design note's dataset, minus its cache: a list of dicts, PIL, ToTensor."""

    def __init__(self, records: list[dict[str, str]], tokenizer: Tokenizer) -> None:
        self.records = records
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.enable_truncation(32)
        self.tokenizer.enable_padding(length=32, pad_id=0, pad_token="[PAD]")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        rec = self.records[index]
        img = Image.open(rec["image_path"]).convert("RGB")
        w, h = img.size
        if w <= h:
            nw, nh = 256, int(256 * h / w)
        else:
            nw, nh = int(256 * w / h), 256
        img = img.resize((nw, nh), Image.Resampling.BICUBIC)
        left, top = round((nw - 224) / 2.0), round((nh - 224) / 2.0)
        img = img.crop((left, top, left + 224, top + 224))
        # torchvision.transforms.ToTensor
        pixels = torch.from_numpy(np.array(img, copy=True)).view(224, 224, 3)
        image = pixels.permute(2, 0, 1).contiguous().float().div(255)
        enc = self.tokenizer.encode(rec["caption"])
        return {
            "id": rec["id"],
            "image": image,
            "input_ids": torch.tensor(enc.ids),
            "attention_mask": torch.tensor(enc.attention_mask),
        }


class OursDataset:
    """``Pipeline.process`` over the same records, tensors wrapped without copies."""

    def __init__(self, records: list[dict[str, str]], pipeline: Pipeline) -> None:
        self.records = records
        self.pipeline = pipeline

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        rec = self.records[index]
        sample = self.pipeline.process(rec["image_path"], rec["caption"], sample_id=rec["id"])
        item: dict[str, Any] = {"id": rec["id"]}
        item.update((name, torch.from_numpy(arr)) for name, arr in sample.items())
        return item


def load_records(manifest: Path) -> list[dict[str, str]]:
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    for row in rows:
        row["image_path"] = str(manifest.parent / row["image_path"])
        row["bytes"] = str(Path(row["image_path"]).stat().st_size)
    return rows


def mean_kb(records: list[dict[str, str]]) -> float:
    return float(np.mean([int(r["bytes"]) for r in records])) / 1000 if records else 0.0


def epoch_seconds(dataset: NoteDataset | OursDataset) -> tuple[float, float]:
    """Wall and CPU seconds to produce every item once."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(len(dataset)):
        dataset[i]
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(name: str, note: NoteDataset, ours: OursDataset, rounds: int) -> dict[str, float]:
    runs: dict[str, list[tuple[float, float]]] = {"note": [], "ours": []}
    epoch_seconds(note)  # warm-up: page cache, Pillow plugins, allocator
    epoch_seconds(ours)
    for r in range(rounds):
        order: list[tuple[str, Callable[[], tuple[float, float]]]] = [
            ("note", lambda: epoch_seconds(note)),
            ("ours", lambda: epoch_seconds(ours)),
        ]
        if r % 2:
            order.reverse()  # alternate who goes first
        for label, run in order:
            runs[label].append(run())
    n = len(note)
    note_wall = statistics.median(w for w, _ in runs["note"])
    ours_wall = statistics.median(w for w, _ in runs["ours"])
    note_cpu = statistics.median(c for _, c in runs["note"])
    ours_cpu = statistics.median(c for _, c in runs["ours"])
    print(
        f"{name:<22} {n:>5} {n / note_wall:>10.0f} {n / ours_wall:>10.0f} "
        f"{note_wall / ours_wall:>8.2f}x {1000 * note_cpu / n:>9.2f} {1000 * ours_cpu / n:>9.2f}"
    )
    return {"note_per_s": n / note_wall, "ours_per_s": n / ours_wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="COCO-sized images (480-640 px)")
    parser.add_argument("--large-n", type=int, default=100, help="large images (1-2k px)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; medians")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # One intra-op thread, as in every DataLoader worker (torch sets it there): the
    # note's float conversion would otherwise spin OpenMP threads against the decode.
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="mmcache-bench-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        coco = load_records(make_dataset(root / "coco", args.n, seed=args.seed))
        t1 = time.perf_counter()
        large = load_records(
            make_dataset(root / "large", args.large_n, seed=args.seed + 1, large=True)
        )
        t2 = time.perf_counter()
        print(
            f"synthetic data: {args.n} COCO-sized JPEGs (mean {mean_kb(coco):.0f} KB) "
            f"in {t1 - t0:.1f} s, {args.large_n} large (mean {mean_kb(large):.0f} KB) "
            f"in {t2 - t1:.1f} s"
        )
        tokenizer = train_tokenizer(synth_captions(2000, seed=args.seed), vocab_size=4096)
        pipeline = Pipeline(image=ImageSpec(size=224, resize=256), text=TextSpec(tokenizer, 32))
        exact = Pipeline(
            image=ImageSpec(size=224, resize=256, draft=False), text=TextSpec(tokenizer, 32)
        )
        print(
            f"output per sample: note {3 * 224 * 224 * 4:,} B float32, "
            f"ours {3 * 224 * 224:,} B uint8"
        )
        print(f"medians of {args.rounds} alternating rounds; samples/s, CPU ms per sample")
        print(
            f"{'source':<22} {'n':>5} {'note/s':>10} {'ours/s':>10} {'ours/note':>9} "
            f"{'note ms':>9} {'ours ms':>9}"
        )
        for name, records in (("COCO-sized", coco), ("large (1-2k px)", large)):
            if records:
                compare(
                    name,
                    NoteDataset(records, tokenizer),
                    OursDataset(records, pipeline),
                    args.rounds,
                )
        for name, records in (("COCO-sized, draft=False", coco), ("large, draft=False", large)):
            if records:
                compare(
                    name, NoteDataset(records, tokenizer), OursDataset(records, exact), args.rounds
                )


if __name__ == "__main__":
    main()
