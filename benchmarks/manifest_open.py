"""A JSONL manifest of 10^6 records: its open (first, later) and a new process's first batch.

What issue 41's JSONL targets measure, without a full epoch at 10^6 (tens of minutes): the
manifest's rows point at 1,000 real 32x32 JPEGs (row ``i`` at image ``i % 1000``; the ids
are distinct, so every row is its own sample), each phase in a fresh process:

- ``open``: ``MultimodalDataset(manifest)`` the first time (no column file: the manifest
  is parsed), then twice more (a later start), with the training process's USS and heap
  (``Anonymous``) growth per record from before the open;
- ``batch``: a new process's open, ``Cache``, ``DataLoader`` (2 workers, batch 256,
  shuffled) and its first batch, twice: over an empty cache (the batch produced), then in
  another new process over the cache the first one filled for that batch (served from it:
  what a restarted job waits for before its first step).

    PYTHONPATH=src python benchmarks/manifest_open.py [--n 1000000] [--work DIR]

Run it against the code before a change with that code first on ``PYTHONPATH`` (``git
archive``); the figures are printed as a markdown table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scale import delta, meminfo, snap  # noqa: E402

_IMAGES = 1000


def make_data(work: Path, n: int) -> Path:
    """``work/m-<n>.jsonl`` over ``work/images`` (made once, reused)."""
    manifest = work / f"m-{n}.jsonl"
    if manifest.exists():
        return manifest
    import numpy as np
    from PIL import Image

    images = work / "images"
    images.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for k in range(_IMAGES):
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        (images / f"{k:04d}.jpg").write_bytes(buf.getvalue())
    words = ["a", "small", "red", "cat", "sitting", "on", "the", "green", "mat", "near", "door"]
    tmp = manifest.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(n):
            caption = " ".join(words[(i + j) % len(words)] for j in range(18))
            row = {"id": f"s{i:08d}", "image_path": f"images/{i % _IMAGES:04d}.jpg"}
            f.write(json.dumps({**row, "caption": caption}) + "\n")
    os.replace(tmp, manifest)
    return manifest


def tokenizer(work: Path) -> Path:
    path = work / "tokenizer.json"
    if not path.exists():
        from mmcache.synth import synth_captions
        from mmcache.transforms import train_tokenizer

        train_tokenizer(synth_captions(500, seed=0), vocab_size=512).save(str(path))
    return path


def phase_open(args: argparse.Namespace) -> dict[str, Any]:
    import mmcache as mc

    pipe = mc.Pipeline(image=mc.ImageSpec(size=16), text=mc.TextSpec(args.tok, max_length=16))
    out: dict[str, Any] = {"before": meminfo(os.getpid()), "opens": []}
    kept = []
    for _ in range(3):
        src, t = _timed(lambda: mc.MultimodalDataset(args.manifest, pipeline=pipe))
        out["opens"].append(t)
        kept.append(src)  # held: the memory after is of all three
        out.setdefault("after_first", meminfo(os.getpid()))
    out["after"] = meminfo(os.getpid())
    return out


def phase_batch(args: argparse.Namespace) -> dict[str, Any]:
    import mmcache as mc

    pipe = mc.Pipeline(image=mc.ImageSpec(size=16), text=mc.TextSpec(args.tok, max_length=16))
    before = meminfo(os.getpid())
    a = snap()
    src = mc.MultimodalDataset(args.manifest, pipeline=pipe)
    opened = delta(a, snap())
    cache = mc.Cache(args.root, memory=256 << 20, disk=1 << 30)
    loader = mc.DataLoader(
        src, cache=cache, batch_size=256, shuffle=True, seed=0, num_workers=2,
        persistent_workers=True,
    )  # fmt: skip
    loader.set_epoch(0)
    batch = next(iter(loader))
    first = delta(a, snap())
    after = meminfo(os.getpid())
    n = len(batch["id"])
    loader.close()
    cache.close()
    return {"open": opened, "first_batch": first, "batch": n, "before": before, "after": after}


def _timed(fn: Any) -> tuple[Any, dict[str, float]]:
    a = snap()
    value = fn()
    return value, delta(a, snap())


def run(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    out = Path(args.work) / "phase.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--phase", phase, "--n", str(args.n), "--work", args.work]
    print(f"== {phase} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
    subprocess.run([*cmd, "--result", str(out)], check=True)
    got: dict[str, Any] = json.loads(out.read_text())
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--work", default=str(HERE / "results" / "manifest_open"))
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    args.manifest = make_data(work, args.n)
    args.tok = tokenizer(work)
    args.root = work / "root"
    os.environ["MMCACHE_IDENTITY_DIR"] = str(work / "ident")
    os.environ["MMCACHE_COLUMNS_DIR"] = str(work / "columns")
    if args.phase:
        import torch  # noqa: F401

        import mmcache  # noqa: F401

        result = phase_open(args) if args.phase == "open" else phase_batch(args)
        Path(args.result).write_text(json.dumps(result, default=str))
        return
    import mmcache as mc

    for gone in (work / "columns", work / "ident"):
        shutil.rmtree(gone, ignore_errors=True)
    if args.root.exists():
        cache = mc.Cache(args.root)
        if cache.memory is not None:
            cache.memory.unlink()
        cache.close()
        shutil.rmtree(args.root)
    opens = run(args, "open")
    cold = run(args, "batch")
    warm = run(args, "batch")
    n = args.n

    def grown(r: dict[str, Any], after: str, what: str) -> str:
        return f"{(r[after][what] - r['before'][what]) / n:,.0f}"

    first, later = opens["opens"][0], opens["opens"][1:]
    rows = [
        ("open, first time (s wall / s CPU)", f"{first['wall']:.2f} / {first['cpu']:.2f}"),
        (
            "open, later start (s wall / s CPU, two)",
            " ; ".join(f"{t['wall']:.2f} / {t['cpu']:.2f}" for t in later),
        ),
        (
            "training process USS / heap growth after the first open (B/record)",
            f"{grown(opens, 'after_first', 'uss')} / {grown(opens, 'after_first', 'anonymous')}",
        ),
        (
            "same after three opens held (B/record)",
            f"{grown(opens, 'after', 'uss')} / {grown(opens, 'after', 'anonymous')}",
        ),
        (
            "new process: first batch, empty cache (s wall / s CPU; open wall)",
            f"{cold['first_batch']['wall']:.2f} / {cold['first_batch']['cpu']:.2f};"
            f" {cold['open']['wall']:.2f}",
        ),
        (
            "new process: first batch, cached (s wall / s CPU; open wall)",
            f"{warm['first_batch']['wall']:.2f} / {warm['first_batch']['cpu']:.2f};"
            f" {warm['open']['wall']:.2f}",
        ),
        (
            "new process (cached): USS / heap growth at its first batch (B/record)",
            f"{grown(warm, 'after', 'uss')} / {grown(warm, 'after', 'anonymous')}",
        ),
    ]
    head = f"JSONL manifest of {n:,} records; load average {os.getloadavg()[0]:.1f}"
    print(head + "\n\n| measure | value |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
