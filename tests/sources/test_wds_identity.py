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
import tarfile
from pathlib import Path

import pytest

from mmcache.cache import Cache
from mmcache.loader import DataLoader
from mmcache.sources.wds import WebDatasetSource
from mmcache.testing.identity_contract import (
    IdentityContract,
    noise_bmp,
    produced_images,
    run_epoch,
    wrong_ids,
)
from mmcache.transforms.pipeline import Pipeline

N = 8
MTIME_NS = 1_600_000_000_000_000_000  # as `tar x` restores it


def _shard(path: Path, seeds: list[int]) -> Path:
    """One shard of N samples ``000000..`` with captions "a cat"; mtime fixed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i, seed in enumerate(seeds):
            for name, data in ((f"{i:06d}.bmp", noise_bmp(seed)), (f"{i:06d}.txt", b"a cat")):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1_600_000_000
                tar.addfile(info, io.BytesIO(data))
    os.utime(path, ns=(MTIME_NS, MTIME_NS))
    return path


def _source(path: Path, pipeline: Pipeline, index_dir: Path) -> WebDatasetSource:
    return WebDatasetSource(path, pipeline=pipeline, image_exts=("bmp",), index_dir=index_dir)


class TestWebDatasetIdentity(IdentityContract):
    """G4: two datasets of equal names, sizes and mtimes; a rewrite with both restored."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path, small_pipeline: Pipeline) -> None:
        self.pipeline, self.index_dir = small_pipeline, tmp_path / "idx"

    def write_dataset(self, folder: Path, variant: int) -> Path:
        return _shard(folder / "00000.tar", [variant * 100 + i for i in range(N)])

    def open_source(self, location: Path) -> WebDatasetSource:
        return _source(location, self.pipeline, self.index_dir)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_rewritten_during_a_run_is_indexed_again_before_any_read(
    tmp_path: Path, small_pipeline: Pipeline, cache_root: Path, workers: int
) -> None:
    shard = _shard(tmp_path / "a" / "00000.tar", list(range(N)))
    src = _source(shard, small_pipeline, tmp_path / "idx")
    with Cache(cache_root, memory="64KiB", temporary=True) as cache:  # holds some
        loader = DataLoader(src, cache=cache, batch_size=4, seed=3, num_workers=workers)
        run_epoch(loader, 0)
        # the same keys and member sizes in reverse order, rewritten in place
        reordered = _shard(tmp_path / "reordered.tar", list(reversed(range(N)))).read_bytes()
        with open(shard, "r+b") as fh:  # the same inode: an open fd reads the new bytes
            fh.write(reordered)
        os.utime(shard, ns=(MTIME_NS, MTIME_NS))
        want = produced_images(_source(shard, small_pipeline, tmp_path / "idx2"))
        assert wrong_ids(run_epoch(loader, 1), want) == []
        loader.close()
