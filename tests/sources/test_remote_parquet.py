"""Parquet on a local S3 server (moto on 127.0.0.1) rewritten during a run: the next
epoch serves the new rows, in the training process and in workers (the new user's R4:
the old image was served for the rest of the run, hit rate 1.00)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import mmcache as mc
from mmcache.cache import Cache
from mmcache.errors import SampleError
from mmcache.loader import DataLoader
from mmcache.sources.blobs.prefetch import RemotePrefetch
from mmcache.sources.capabilities import Revalidating, SharesStamps
from mmcache.sources.parquet import ParquetSource
from mmcache.transforms.pipeline import Pipeline
from support.s3 import S3Endpoint, moto_s3

N = 12
URL = "s3://data/t/train.parquet"
COLUMNS = {"id": "key", "image": "jpg", "text": "caption"}


@pytest.fixture
def s3() -> Iterator[S3Endpoint]:
    with moto_s3() as endpoint:
        yield endpoint


def jpeg(index: int, shade: int) -> bytes:
    arr = np.zeros((40, 48, 3), dtype=np.uint8)
    arr[..., 0] = (index * 37 + shade) % 256
    arr[..., 2] = shade
    arr[: 8 + index, :12, 1] = 200
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def write_table(path: Path, shade: int) -> Path:
    """What webdataset-to-Parquet converters write: key, caption, jpg bytes (groups of 4)."""
    table = pa.table(
        {
            "key": [f"{i:04d}" for i in range(N)],
            "caption": [f"a cat number {i} in shade {shade}" for i in range(N)],
            "jpg": pa.array([jpeg(i, shade) for i in range(N)], type=pa.binary()),
        }
    )
    pq.write_table(table, path, row_group_size=4)
    return path


def upload(s3: S3Endpoint, path: Path) -> None:
    s3.client.upload_file(str(path), "data", "t/train.parquet")


def images_by_id(batches: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    return {sid: b["image"][i].numpy() for b in batches for i, sid in enumerate(b["id"])}


def expected(path: Path, pipe: Pipeline) -> dict[str, np.ndarray]:
    local = ParquetSource(path, pipeline=pipe, columns=COLUMNS)
    return {local.sample_id(i): local.produce(i)["image"] for i in range(len(local))}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_parquet_on_s3_rewritten_between_epochs_serves_the_new_rows(
    num_workers, s3, small_pipeline, tmp_path, cache_root
):
    # 2 persistent workers: their copies take the new stamps through the state file
    old, new = write_table(tmp_path / "v1.parquet", 0), write_table(tmp_path / "v2.parquet", 90)
    upload(s3, old)
    ds = mc.open_source(
        URL, pipeline=small_pipeline, columns=COLUMNS, storage_options=s3.storage_options()
    )
    assert isinstance(ds, Revalidating) and isinstance(ds, SharesStamps)
    cache = Cache(cache_root, memory="64MiB", disk=None, temporary=True)
    try:
        loader = DataLoader(
            ds,
            cache=cache,
            batch_size=4,
            shuffle=True,
            seed=1,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            hooks=[RemotePrefetch(ds)],
        )
        want_old, want_new = expected(old, small_pipeline), expected(new, small_pipeline)
        assert not any(np.array_equal(want_old[k], want_new[k]) for k in want_old)
        for _ in range(2):  # cold, then warm from the cache
            got = images_by_id(list(loader))
            assert got.keys() == want_old.keys()
            for sid, image in got.items():
                np.testing.assert_array_equal(image, want_old[sid])
        upload(s3, new)  # rewritten in place during the run (a new ETag)
        for _ in range(2):  # the next epoch reads the new rows, then serves them warm
            got = images_by_id(list(loader))
            assert got.keys() == want_new.keys()
            for sid, image in got.items():
                np.testing.assert_array_equal(image, want_new[sid], err_msg=sid)
        assert ds.rejects() == []
        loader.close()
    finally:
        cache.close()


def test_revalidating_unchanged_parquet_on_s3_keeps_every_key(s3, small_pipeline, tmp_path):
    upload(s3, write_table(tmp_path / "v1.parquet", 0))
    src = ParquetSource(
        URL, pipeline=small_pipeline, columns=COLUMNS, storage_options=s3.storage_options()
    )
    before, version = src.key_rows(range(N)), src.remote_version()
    for _ in range(2):
        assert src.revalidate() == []
    assert src.remote_version() == version
    np.testing.assert_array_equal(src.key_rows(range(N)), before)
    # a copy in another process takes what this one revalidated (through a state file)
    import pickle

    copy = pickle.loads(pickle.dumps(src))
    upload(s3, write_table(tmp_path / "v2.parquet", 90))
    assert src.revalidate() == [URL]
    changed = src.key_rows(range(N))
    assert not (changed == before).all(axis=1).any()
    np.testing.assert_array_equal(copy.key_rows(range(N)), changed)
    want = expected(tmp_path / "v2.parquet", small_pipeline)
    np.testing.assert_array_equal(copy.produce(3)["image"], want["0003"])


def test_a_parquet_file_removed_from_s3_is_refused_at_the_next_epoch(s3, small_pipeline, tmp_path):
    upload(s3, write_table(tmp_path / "v1.parquet", 0))
    src = ParquetSource(
        URL, pipeline=small_pipeline, columns=COLUMNS, storage_options=s3.storage_options()
    )
    assert src.produce(0)["image"].size  # read (and its row group kept) before
    s3.client.delete_object(Bucket="data", Key="t/train.parquet")
    assert src.revalidate() == [URL]
    with pytest.raises(SampleError, match="gone"):
        src.produce(0)
