"""Tables that name their images by path, and COCO's duplicate image ids (G7, G8, recipe 3).

- a Parquet image cell holding only a path (the HF ``Image`` struct, ``bytes`` null) is keyed
  by that file: a rewrite of the image is served new (G7);
- an HF dataset whose ``Image()`` column holds paths (``cast_column`` from paths), with an
  image rewritten in place, is served new (newcomer recipe 3: hit rate 1.00, old pixels);
- a COCO file with two ``images`` entries of one id is a ManifestError naming both (G8);
- Parquet and HF sources pass the identity contract.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmcache.errors import ManifestError
from mmcache.sources.coco import read_coco
from mmcache.sources.hfdataset import HFDatasetSource
from mmcache.sources.parquet import ParquetSource
from mmcache.testing.identity_contract import IdentityContract
from mmcache.transforms.pipeline import Pipeline

N = 6
MTIME_NS = 1_600_000_000_000_000_000
_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
COLUMNS = {"id": "id", "image": "image", "text": "text"}


def _bmp(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="BMP")
    return buf.getvalue()


def _write_images(folder: Path, variant: int) -> list[str]:
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(N):
        path = folder / "images" / f"{i:04d}.bmp"
        path.write_bytes(_bmp(variant * 100 + i))
        os.utime(path, ns=(MTIME_NS, MTIME_NS))
        names.append(f"images/{i:04d}.bmp")
    return names


def _path_table(names: list[str]) -> pa.Table:
    cells = [{"bytes": None, "path": name} for name in names]
    return pa.table(
        {
            "id": pa.array([f"{i:04d}" for i in range(N)]),
            "image": pa.array(cells, type=_STRUCT),
            "text": pa.array(["a cat"] * N),
        }
    )


def _rewrite_restoring(path: Path, data: bytes) -> None:
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


class TestParquetIdentity(IdentityContract):
    """Embedded bytes: the Parquet file's bytes are the identity."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, small_pipeline: Pipeline) -> None:
        self.pipeline = small_pipeline

    def write_dataset(self, folder: Path, variant: int) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        cells = [{"bytes": _bmp(variant * 100 + i), "path": None} for i in range(N)]
        table = pa.table(
            {
                "id": pa.array([f"{i:04d}" for i in range(N)]),
                "image": pa.array(cells, type=_STRUCT),
                "text": pa.array(["a cat"] * N),
            }
        )
        out = folder / "data.parquet"
        pq.write_table(table, out, compression="none")
        os.utime(out, ns=(MTIME_NS, MTIME_NS))
        return out

    def open_source(self, location: Path) -> ParquetSource:
        return ParquetSource(location, pipeline=self.pipeline, columns=COLUMNS)


class TestParquetOfPathsIdentity(TestParquetIdentity):
    """Path-only cells: the named files' bytes are the identity (G7)."""

    def write_dataset(self, folder: Path, variant: int) -> Path:
        names = _write_images(folder, variant)
        out = folder / "data.parquet"
        pq.write_table(_path_table(names), out)
        os.utime(out, ns=(MTIME_NS, MTIME_NS))
        return out


def test_a_parquet_image_given_by_path_is_served_new_after_a_rewrite(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    names = _write_images(tmp_path, 0)
    pq.write_table(_path_table(names), tmp_path / "data.parquet")
    src = ParquetSource(tmp_path / "data.parquet", pipeline=small_pipeline, columns=COLUMNS)
    before = src.key_rows(np.arange(N)).copy()
    _rewrite_restoring(tmp_path / names[1], _bmp(999))
    after = src.key_rows(np.arange(N))
    assert after[1].tobytes() != before[1].tobytes()
    np.testing.assert_array_equal(np.delete(after, 1, axis=0), np.delete(before, 1, axis=0))
    assert src.key(1) == after[1].tobytes()


def test_an_hf_image_column_of_paths_is_served_new_after_a_rewrite(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    datasets = pytest.importorskip("datasets")
    names = _write_images(tmp_path, 0)
    ds = datasets.Dataset.from_dict(
        {
            "id": [f"{i:04d}" for i in range(N)],
            "image": [str(tmp_path / n) for n in names],
            "text": ["a cat"] * N,
        }
    ).cast_column("image", datasets.Image())  # held as paths (save_to_disk would embed)
    loaded = ds
    src = HFDatasetSource(loaded, pipeline=small_pipeline, columns=COLUMNS)
    before = src.key_rows(np.arange(N)).copy()
    _rewrite_restoring(tmp_path / names[2], _bmp(999))
    after = src.key_rows(np.arange(N))
    assert after[2].tobytes() != before[2].tobytes()
    np.testing.assert_array_equal(np.delete(after, 2, axis=0), np.delete(before, 2, axis=0))
    # a shuffled view (an indices mapping) keys each row by its own file
    shuffled = HFDatasetSource(loaded.shuffle(seed=3), pipeline=small_pipeline, columns=COLUMNS)
    first = dict(zip(shuffled.ids(range(N)), shuffled.key_rows(np.arange(N)).copy(), strict=True))
    _rewrite_restoring(tmp_path / names[4], _bmp(998))
    now = dict(zip(shuffled.ids(range(N)), shuffled.key_rows(np.arange(N)), strict=True))
    assert [s for s in first if first[s].tobytes() != now[s].tobytes()] == ["0004"]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_coco_duplicate_image_ids_name_both_entries(tmp_path: Path, on_error: str) -> None:
    for name in ("1.jpg", "3.jpg"):
        (tmp_path / name).write_bytes(b"x")
    doc = {
        "images": [{"id": 1, "file_name": "1.jpg"}, {"id": 1, "file_name": "3.jpg"}],
        "annotations": [{"id": 101, "image_id": 1, "caption": "cap 1"}],
    }
    path = tmp_path / "captions.json"
    path.write_text(json.dumps(doc))
    for per in ("caption", "image"):
        with pytest.raises(ManifestError) as info:
            read_coco(path, per=per, on_error=on_error)  # type: ignore[arg-type]
        message = str(info.value)
        assert "images[0]" in message and "images[1]" in message
        assert "1.jpg" in message and "3.jpg" in message
