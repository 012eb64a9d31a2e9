"""Different image files never share a cache key, even with equal ids, captions, sizes and mtimes.

Fixed-size formats (BMP, PPM, .npy), files extracted from archives with fixed
mtimes and class-name captions make ``(id, size, mtime, caption)`` collide;
the file's inode and ctime (from the same ``stat``) tell the files apart, in
every path that compares stamps: the keys, the batched key memo and the
warm-epoch check of the sweeper's stamp board.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.testing.identity_contract import produced_images, run_epoch, wrong_ids
from mmcache.transforms.pipeline import Pipeline

N = 8
MTIME_NS = 1_600_000_000_000_000_000  # as `tar x` restores it


def _write_bmp(path: Path, seed: int) -> None:
    """A 32 px BMP of random pixels: every such file has the same size (3,126 bytes)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="BMP")
    os.utime(path, ns=(MTIME_NS, MTIME_NS))


def _bmp_dataset(folder: Path, seed: int) -> Path:
    """N BMPs with ids 0000.. and class-name captions; returns the manifest."""
    (folder / "images").mkdir(parents=True)
    rows = []
    for i in range(N):
        _write_bmp(folder / "images" / f"{i:04d}.bmp", seed * 1000 + i)
        rows.append({"id": f"{i:04d}", "image_path": f"images/{i:04d}.bmp", "caption": "a cat"})
    manifest = folder / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


@pytest.mark.parametrize("workers", [0, 2])
def test_two_datasets_on_one_root_get_their_ownproduced_images(
    tmp_path: Path, small_pipeline: Pipeline, cache_root: Path, workers: int
) -> None:
    a = _bmp_dataset(tmp_path / "a", seed=1)
    b = _bmp_dataset(tmp_path / "b", seed=2)
    for manifest in (a, b, a):  # A, then B on the same root, then A again
        ds = MultimodalDataset(manifest, pipeline=small_pipeline)
        want = produced_images(ds)
        with Cache(cache_root, memory="16MiB", disk="64MiB") as cache:
            loader = DataLoader(ds, cache=cache, batch_size=3, seed=1, num_workers=workers)
            for epoch in (0, 1):  # the second one warm (swept, with workers)
                assert wrong_ids(run_epoch(loader, epoch), want) == [], (manifest, epoch)
            loader.close()


def test_a_record_pointed_at_another_file_of_the_same_size_and_mtime_gets_itsproduced_images(
    tmp_path: Path, small_pipeline: Pipeline, cache_root: Path
) -> None:
    manifest = _bmp_dataset(tmp_path / "a", seed=1)
    _write_bmp(tmp_path / "a" / "images" / "spare.bmp", seed=99)
    with Cache(cache_root, memory="16MiB", disk="64MiB") as cache:
        ds = MultimodalDataset(manifest, pipeline=small_pipeline)
        loader = DataLoader(ds, cache=cache, batch_size=4, num_workers=0)
        run_epoch(loader, 0)
        rows = [json.loads(line) for line in manifest.read_text().splitlines()]
        rows[0]["image_path"] = "images/spare.bmp"  # same id, caption, size and mtime
        edited = manifest.with_name("edited.jsonl")
        edited.write_text("".join(json.dumps(r) + "\n" for r in rows))
        ds2 = MultimodalDataset(edited, pipeline=small_pipeline)
        loader2 = DataLoader(ds2, cache=cache, batch_size=4, num_workers=0)
        assert wrong_ids(run_epoch(loader2, 0), produced_images(ds2)) == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_rewritten_with_its_size_and_mtime_restored_is_served_new(
    tmp_path: Path, small_pipeline: Pipeline, cache_root: Path, workers: int
) -> None:
    manifest = _bmp_dataset(tmp_path / "a", seed=1)
    ds = MultimodalDataset(manifest, pipeline=small_pipeline)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=3, seed=2, num_workers=workers)
        run_epoch(loader, 0)  # cold
        assert wrong_ids(run_epoch(loader, 1), produced_images(ds)) == []  # warm: swept
        path = tmp_path / "a" / "images" / "0003.bmp"
        before = path.stat()
        _write_bmp(path, seed=4242)  # other pixels, same size; mtime restored (touch -d)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert path.stat().st_size == before.st_size
        assert path.stat().st_mtime_ns == before.st_mtime_ns
        assert wrong_ids(run_epoch(loader, 2), produced_images(ds)) == []
        assert loader.stats().epochs[2].misses == 1
        loader.close()
