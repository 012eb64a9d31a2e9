"""Tiny-sample datasets for ``benchmarks/scale.py``: loose files + JSONL, Parquet, WebDataset.

Each sample is a 32x32 JPEG (one of 64 base images made unique by a JPEG COM segment holding
the sample's index, so every file's bytes and digest differ; ~0.7-0.9 KB) and a caption (one
of 997 synthetic ones, ~100 characters): bytes small enough that the control plane, not the
data, is what is measured. The layouts are the scale study's (``research/scale-turn4.md``):

- ``jsonl``: ``DIR/images/<i // 10000:04d>/<i:08d>.jpg`` and ``DIR/manifest.jsonl``;
- ``parquet``: ``DIR/part-*.parquet``, 250k rows a file in 1000-row row groups, columns
  ``id``, ``image`` (binary) and ``text``;
- ``wds``: ``DIR/<shard:05d>.tar``, 10k samples a shard, members ``<key>.jpg``, ``.txt`` and
  ``.json`` (the img2dataset layout, ``width``/``height`` in the ``.json``).

A dataset is made once and reused: :func:`ensure` writes a ``.done`` marker last, so a run
cut short is made again rather than measured half-written.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["KINDS", "ensure", "tokenizer"]

KINDS = ("jsonl", "parquet", "wds")
_PARQUET_ROWS = 250_000
_SHARD_SAMPLES = 10_000
_DIR_FILES = 10_000


def _base_jpegs(k: int = 64, side: int = 32) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(k):
        pixels = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        image = Image.fromarray(pixels).resize((side, side), Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _jpeg_maker() -> Callable[[int], bytes]:
    bases = _base_jpegs()

    def jpeg(i: int) -> bytes:
        # SOI, then a COM segment (FF FE, its length counting itself) holding the index
        base = bases[i % len(bases)]
        payload = b"mmcache-scale %012d" % i
        return base[:2] + b"\xff\xfe" + (len(payload) + 2).to_bytes(2, "big") + payload + base[2:]

    return jpeg


def _captions() -> list[str]:
    from mmcache.synth import synth_captions

    return synth_captions(997, seed=1)


def _write_jsonl(out: Path, n: int) -> None:
    jpeg, caps = _jpeg_maker(), _captions()
    with open(out / "manifest.jsonl", "w", encoding="utf-8") as manifest:
        for i in range(n):
            folder = out / "images" / f"{i // _DIR_FILES:04d}"
            if i % _DIR_FILES == 0:
                folder.mkdir(parents=True, exist_ok=True)
            rel = f"images/{i // _DIR_FILES:04d}/{i:08d}.jpg"
            (out / rel).write_bytes(jpeg(i))
            record = {"id": f"{i:08d}", "image_path": rel, "caption": caps[i % len(caps)]}
            manifest.write(json.dumps(record) + "\n")


def _write_parquet(out: Path, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jpeg, caps = _jpeg_maker(), _captions()
    for k, start in enumerate(range(0, n, _PARQUET_ROWS)):
        rows = range(start, min(n, start + _PARQUET_ROWS))
        table = pa.table(
            {
                "id": pa.array([f"{i:08d}" for i in rows], type=pa.string()),
                "image": pa.array([jpeg(i) for i in rows], type=pa.binary()),
                "text": pa.array([caps[i % len(caps)] for i in rows], type=pa.string()),
            }
        )
        pq.write_table(table, out / f"part-{k:05d}.parquet", row_group_size=1000)


def _write_wds(out: Path, n: int) -> None:
    jpeg, caps = _jpeg_maker(), _captions()
    for s, start in enumerate(range(0, n, _SHARD_SAMPLES)):
        with tarfile.open(out / f"{s:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(start, min(n, start + _SHARD_SAMPLES)):
                key = f"{i:08d}"
                meta = json.dumps({"key": key, "width": 32, "height": 32}).encode()
                caption = caps[i % len(caps)].encode()
                for ext, data in (("jpg", jpeg(i)), ("txt", caption), ("json", meta)):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    info.mtime = 1_700_000_000
                    info.mode = 0o644
                    tar.addfile(info, io.BytesIO(data))


_WRITERS: dict[str, Callable[[Path, int], None]] = {
    "jsonl": _write_jsonl,
    "parquet": _write_parquet,
    "wds": _write_wds,
}


def ensure(data: Path, kind: str, n: int) -> Path:
    """The folder of the ``kind`` dataset of ``n`` samples under ``data``, made if missing."""
    out = data / f"{kind}-{n}"
    if (out / ".done").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _WRITERS[kind](out, n)
    (out / ".done").write_text("ok\n")
    return out


def tokenizer(data: Path) -> Path:
    """A small BPE tokenizer (vocab 512) trained on synthetic captions, made once."""
    path = data / "tokenizer.json"
    if not path.exists():
        import mmcache as mc
        from mmcache.synth import synth_captions

        data.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        mc.train_tokenizer(synth_captions(500), vocab_size=512).save(str(tmp))
        os.replace(tmp, path)
    return path
