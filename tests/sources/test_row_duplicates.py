"""Repeated ids in Parquet files and HF datasets (issue 24): under ``on_error="raise"`` a
ManifestError naming both rows; under ``"skip"`` the first row of each id is served, every
later one is left out, counted and listed in ``rejects()`` naming both rows, and each
sample index maps to its own row (ids, stamps, keys and pixels). Main raised under both.
COCO keeps raising under both (``test_table_identity.py``): its captions refer to the
image id, so either image could be the one they describe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmcache.cache import Cache
from mmcache.errors import ManifestError
from mmcache.loader import DataLoader
from mmcache.sources.hfdataset import HFDatasetSource
from mmcache.sources.parquet import ParquetSource
from mmcache.testing.identity_contract import noise_bmp, produced_images, run_epoch, wrong_ids
from mmcache.transforms.pipeline import Pipeline

COLUMNS = {"id": "id", "image": "image", "text": "text"}
_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _table(ids: list[str], seeds: list[int]) -> pa.Table:
    cells = [{"bytes": noise_bmp(s), "path": None} for s in seeds]
    return pa.table(
        {
            "id": pa.array(ids),
            "image": pa.array(cells, type=_STRUCT),
            "text": pa.array([f"caption {s}" for s in seeds]),
        }
    )


#: Two files; "a" repeats in the first file, "b" across the files. Seeds mark each row.
FILES = [(["a", "b", "a"], [0, 1, 2]), (["c", "b", "d"], [3, 4, 5])]
KEPT = (["a", "b", "c", "d"], [0, 1, 3, 5])  # the first row of each id, in order


def _write(folder: Path, files: list[tuple[list[str], list[int]]]) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for n, (ids, seeds) in enumerate(files):
        path = folder / f"part-{n}.parquet"
        pq.write_table(_table(ids, seeds), path, row_group_size=2)
        out.append(str(path))
    return out


def _same_samples(got: Any, want: Any) -> None:
    """``got`` serves ``want``'s samples at the same indices: ids, pixels and texts."""
    assert len(got) == len(want) and got.ids(np.arange(len(got))) == want.ids(np.arange(len(want)))
    for i in range(len(want)):
        a, b = got.produce(i), want.produce(i)
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{i} {name}")


def test_parquet_repeated_ids_raise_naming_both_rows(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    files = _write(tmp_path, FILES)
    with pytest.raises(ManifestError) as info:
        ParquetSource(files, pipeline=small_pipeline, columns=COLUMNS)
    assert info.value.path == files[0] and info.value.line == 2 and info.value.sample_id == "a"
    assert f"duplicate id (first seen at {files[0]} row 0)" in str(info.value)


def test_parquet_repeated_ids_under_skip_keep_the_first_row(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    files = _write(tmp_path / "dup", FILES)
    src = ParquetSource(files, pipeline=small_pipeline, columns=COLUMNS, on_error="skip")
    assert len(src) == 4 and src.ids(np.arange(4)) == KEPT[0]
    assert [(r.sample_id, r.path, r.reason) for r in src.rejects()] == [
        ("a", f"{files[0]} row 2", f"duplicate id (first seen at {files[0]} row 0)"),
        ("b", f"{files[1]} row 1", f"duplicate id (first seen at {files[0]} row 1)"),
    ]
    # Every index is its row: what one file of the kept rows alone serves.
    (tmp_path / "kept").mkdir()
    pq.write_table(_table(*KEPT), tmp_path / "kept" / "k.parquet")
    alone = ParquetSource(tmp_path / "kept" / "k.parquet", pipeline=small_pipeline, columns=COLUMNS)
    _same_samples(src, alone)
    assert src.stamp_string(3, src.stamps([3])[0]).endswith(":2")  # "d": row 2 of file 1
    # Through a cache and a loader: each id its own pixels, over two epochs.
    want = produced_images(alone)
    with Cache(tmp_path / "cache", memory="16MiB", disk="64MiB", temporary=True) as cache:
        loader = DataLoader(src, cache=cache, batch_size=3, seed=1, num_workers=2)
        try:
            assert [wrong_ids(run_epoch(loader, e), want) for e in (0, 1)] == [[], []]
        finally:
            loader.close()


def test_parquet_without_repeated_ids_has_no_row_map(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    files = _write(tmp_path, [(["a", "b"], [0, 1]), (["c"], [2])])
    plain = ParquetSource(files, pipeline=small_pipeline, columns=COLUMNS)
    skip = ParquetSource(files, pipeline=small_pipeline, columns=COLUMNS, on_error="skip")
    assert plain._rows is None and skip._rows is None and skip.rejects() == []
    assert plain.ids_digest() == skip.ids_digest()
    np.testing.assert_array_equal(plain.key_rows(np.arange(3)), skip.key_rows(np.arange(3)))


def _hf(ids: list[str], seeds: list[int]) -> Any:
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "image": datasets.Image(),
            "text": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_dict(
        {
            "id": ids,
            "image": [{"bytes": noise_bmp(s), "path": None} for s in seeds],
            "text": [f"caption {s}" for s in seeds],
        },
        features=features,
    )


def test_hf_repeated_ids_raise_naming_both_rows(small_pipeline: Pipeline) -> None:
    ds = _hf(["a", "b", "a", "c"], [0, 1, 2, 3])
    with pytest.raises(ManifestError) as info:
        HFDatasetSource(ds, pipeline=small_pipeline, columns=COLUMNS)
    where = f"<dataset {ds._fingerprint}>"
    assert info.value.path == where and info.value.line == 2 and info.value.sample_id == "a"
    assert f"duplicate id (first seen at {where} row 0)" in str(info.value)


def test_hf_repeated_ids_under_skip_keep_the_first_row(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    ds = _hf(["a", "b", "a", "c", "b", "d"], [0, 1, 2, 3, 4, 5])
    src = HFDatasetSource(ds, pipeline=small_pipeline, columns=COLUMNS, on_error="skip")
    where = f"<dataset {ds._fingerprint}>"
    assert len(src) == 4 and src.ids(np.arange(4)) == KEPT[0]
    assert [(r.sample_id, r.path, r.reason) for r in src.rejects()] == [
        ("a", f"{where} row 2", f"duplicate id (first seen at {where} row 0)"),
        ("b", f"{where} row 4", f"duplicate id (first seen at {where} row 1)"),
    ]
    assert src.stamps([3])[0, 1] == 5 and src.stamp_string(3, src.stamps([3])[0]).endswith(":5")
    alone = HFDatasetSource(_hf(*KEPT), pipeline=small_pipeline, columns=COLUMNS)
    _same_samples(src, alone)
    want = produced_images(alone)
    with Cache(tmp_path / "cache", memory="16MiB", disk="64MiB", temporary=True) as cache:
        loader = DataLoader(src, cache=cache, batch_size=3, seed=1, num_workers=0)
        try:
            assert [wrong_ids(run_epoch(loader, e), want) for e in (0, 1)] == [[], []]
        finally:
            loader.close()


def test_an_id_seen_three_times_lists_both_later_rows(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    """Each left-out row is its own entry of ``rejects()``, though they share one id."""
    files = _write(tmp_path / "dup", [(["a", "a", "b", "a"], [0, 1, 2, 3])])
    src = ParquetSource(files, pipeline=small_pipeline, columns=COLUMNS, on_error="skip")
    assert len(src) == 2
    assert [(r.sample_id, r.path) for r in src.rejects()] == [
        ("a", f"{files[0]} row 1"),
        ("a", f"{files[0]} row 3"),
    ]
