"""``HFDatasetSource`` passes the identity contract (issue 24).

- an ``Image()`` column of embedded bytes, saved with ``save_to_disk`` and opened with
  ``load_from_disk``: the identity is the dataset's fingerprint (``state.json``, which
  ``datasets`` derives from the table's content and every transform), so a copy of the
  folder has the same keys and other bytes get another fingerprint;
- an ``Image()`` column of paths (``cast_column`` from paths): each row is stamped by its
  image file, as loose files are, next to the dataset's fingerprint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from mmcache.sources.hfdataset import HFDatasetSource
from mmcache.testing.identity_contract import IdentityContract, noise_bmp
from mmcache.transforms.pipeline import Pipeline

datasets = pytest.importorskip("datasets")

N = 6
MTIME_NS = 1_600_000_000_000_000_000
COLUMNS = {"id": "id", "image": "image", "text": "text"}


def _restore_mtimes(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            os.utime(path, ns=(MTIME_NS, MTIME_NS))


def _dataset(images: list[Any]) -> Any:
    ds = datasets.Dataset.from_dict(
        {"id": [f"{i:04d}" for i in range(N)], "image": images, "text": ["a cat"] * N}
    )
    return ds.cast_column("image", datasets.Image())


class TestHFBytesIdentity(IdentityContract):
    """Embedded image bytes in a ``save_to_disk`` folder."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, small_pipeline: Pipeline) -> None:
        self.pipeline = small_pipeline

    def write_dataset(self, folder: Path, variant: int) -> Path:
        cells = [{"bytes": noise_bmp(variant * 100 + i), "path": None} for i in range(N)]
        out = folder / "hf"
        _dataset(cells).save_to_disk(str(out))
        _restore_mtimes(out)
        return out

    def open_source(self, location: Path) -> HFDatasetSource:
        ds = datasets.load_from_disk(str(location))
        return HFDatasetSource(ds, pipeline=self.pipeline, columns=COLUMNS)


class TestHFPathsIdentity(TestHFBytesIdentity):
    """An ``Image()`` column of paths to loose files (what ``save_to_disk`` would embed,
    so the dataset is made from the folder's files on open, as a training script does)."""

    copy_skip_reason = (
        "the dataset's fingerprint is datasets' hash of its table, which holds the "
        "absolute image paths: a copy elsewhere is another dataset with other keys (a "
        "miss, never wrong data); node-local copies at one path on every node keep them"
    )

    def write_dataset(self, folder: Path, variant: int) -> Path:
        (folder / "images").mkdir(parents=True, exist_ok=True)
        for i in range(N):
            (folder / "images" / f"{i:04d}.bmp").write_bytes(noise_bmp(variant * 100 + i))
        _restore_mtimes(folder)
        return folder

    def open_source(self, location: Path) -> HFDatasetSource:
        paths = [str(location / "images" / f"{i:04d}.bmp") for i in range(N)]
        return HFDatasetSource(_dataset(paths), pipeline=self.pipeline, columns=COLUMNS)


class TestHFArrowFileIdentity(TestHFBytesIdentity):
    """An Arrow file opened with ``Dataset.from_file`` (no ``state.json``): ``datasets``
    fingerprints it by its path and mtime only, so the key holds the file's identity too
    (a same-size rewrite with its mtime restored was served stale before)."""

    copy_skip_reason = (
        "datasets fingerprints a Dataset.from_file dataset by the file's absolute path and "
        "mtime: a copy elsewhere is another dataset with other keys (a miss, never wrong "
        "data); load_from_disk copies keep their keys (TestHFBytesIdentity)"
    )

    def write_dataset(self, folder: Path, variant: int) -> Path:
        saved = super().write_dataset(folder / "saved", variant)
        out = folder / "data.arrow"
        out.write_bytes(next(saved.glob("*.arrow")).read_bytes())
        os.utime(out, ns=(MTIME_NS, MTIME_NS))
        return out

    def open_source(self, location: Path) -> HFDatasetSource:
        ds = datasets.Dataset.from_file(str(location))
        return HFDatasetSource(ds, pipeline=self.pipeline, columns=COLUMNS)
