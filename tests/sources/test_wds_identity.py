"""WebDataset shards keep the identity promises (G4, G5 of the turn-3 attack).

- two datasets whose shards hold the same keys and member sizes (BMP members) with equal
  mtimes but other pixels, on one cache root, each get their own pixels (G4a);
- a shard rewritten with its size and mtime restored is served new (G4b);
- a shard rewritten in place during a run (members in reverse order, same sizes) is indexed
  again before any read at the old offsets: no miss gets another sample's pixels (G5);
- a ``cp -a`` copy of the shards elsewhere has the same keys (G17's precondition).
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mmcache.cache import Cache
from mmcache.loader import DataLoader
from mmcache.pipeline import Pipeline
from mmcache.sources.wds import WebDatasetSource

N = 8
MTIME_NS = 1_600_000_000_000_000_000  # as `tar x` restores it


def _bmp(seed: int) -> bytes:
    """A 32 px BMP of random pixels: every such member has the same size."""
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="BMP")
    return buf.getvalue()


def _shard(path: Path, seeds: list[int]) -> Path:
    """One shard of N samples ``000000..`` with captions "a cat"; mtime fixed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i, seed in enumerate(seeds):
            for name, data in ((f"{i:06d}.bmp", _bmp(seed)), (f"{i:06d}.txt", b"a cat")):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1_600_000_000
                tar.addfile(info, io.BytesIO(data))
    os.utime(path, ns=(MTIME_NS, MTIME_NS))
    return path


def _source(path: Path, pipeline: Pipeline, index_dir: Path) -> WebDatasetSource:
    return WebDatasetSource(path, pipeline=pipeline, image_exts=("bmp",), index_dir=index_dir)


def _pixels(src: WebDatasetSource) -> dict[str, torch.Tensor]:
    return {src.sample_id(i): torch.from_numpy(src.produce(i)["image"]) for i in range(len(src))}


def _wrong(batches: list[dict[str, Any]], want: dict[str, torch.Tensor]) -> list[str]:
    return [
        sid
        for b in batches
        for sid, image in zip(b["id"], b["image"], strict=True)
        if not torch.equal(image, want[sid])
    ]


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def test_two_datasets_of_equal_names_sizes_and_mtimes_get_their_own_pixels(
    tmp_path: Path, small_pipeline: Pipeline, cache_root: Path
) -> None:
    a = _shard(tmp_path / "a" / "00000.tar", list(range(N)))
    b = _shard(tmp_path / "b" / "00000.tar", list(range(100, 100 + N)))
    assert a.stat().st_size == b.stat().st_size
    for shard in (a, b, a):
        src = _source(shard, small_pipeline, tmp_path / "idx")
        want = _pixels(src)
        with Cache(cache_root, memory="16MiB", disk="64MiB") as cache:
            loader = DataLoader(src, cache=cache, batch_size=3, seed=1, num_workers=0)
            for epoch in (0, 1):
                assert _wrong(_epoch(loader, epoch), want) == [], (shard, epoch)
            loader.close()


def test_a_shard_rewritten_with_size_and_mtime_restored_is_served_new(
    tmp_path: Path, small_pipeline: Pipeline, cache_root: Path
) -> None:
    shard = _shard(tmp_path / "a" / "00000.tar", list(range(N)))
    with Cache(cache_root, memory="16MiB", disk="64MiB") as cache:
        src = _source(shard, small_pipeline, tmp_path / "idx")
        loader = DataLoader(src, cache=cache, batch_size=4, num_workers=0)
        _epoch(loader, 0)
        loader.close()
        _shard(shard, [s + 50 for s in range(N)])  # other pixels; size and mtime the same
        again = _source(shard, small_pipeline, tmp_path / "idx")
        loader = DataLoader(again, cache=cache, batch_size=4, num_workers=0)
        assert _wrong(_epoch(loader, 0), _pixels(again)) == []
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_rewritten_during_a_run_is_indexed_again_before_any_read(
    tmp_path: Path, small_pipeline: Pipeline, cache_root: Path, workers: int
) -> None:
    shard = _shard(tmp_path / "a" / "00000.tar", list(range(N)))
    src = _source(shard, small_pipeline, tmp_path / "idx")
    with Cache(cache_root, memory="64KiB", temporary=True) as cache:  # holds some
        loader = DataLoader(src, cache=cache, batch_size=4, seed=3, num_workers=workers)
        _epoch(loader, 0)
        # the same keys and member sizes in reverse order, rewritten in place
        reordered = _shard(tmp_path / "reordered.tar", list(reversed(range(N)))).read_bytes()
        with open(shard, "r+b") as fh:  # the same inode: an open fd reads the new bytes
            fh.write(reordered)
        os.utime(shard, ns=(MTIME_NS, MTIME_NS))
        want = _pixels(_source(shard, small_pipeline, tmp_path / "idx2"))
        assert _wrong(_epoch(loader, 1), want) == []
        loader.close()


def test_a_cp_a_copy_of_the_shards_has_the_same_keys(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    shard = _shard(tmp_path / "node-a" / "00000.tar", list(range(N)))
    shutil.copytree(shard.parent, tmp_path / "node-b", copy_function=shutil.copy2)
    a = _source(shard, small_pipeline, tmp_path / "idx-a")
    b = _source(tmp_path / "node-b" / "00000.tar", small_pipeline, tmp_path / "idx-b")
    np.testing.assert_array_equal(a.key_rows(range(N)), b.key_rows(range(N)))
    assert [a.key(i) for i in range(N)] == [b.key(i) for i in range(N)]
