"""Hostile inputs (issue 23 items 6-8, 10): the hostile-input contract for loose-file
sources (WebDataset and Parquet run it in their source contracts:
``tests/sources/test_wds_source.py``, ``tests/unit/test_tabular_sources.py``); tar headers
that lie; mistyped Parquet image columns;
compact disk entries that would expand a thousandfold. (Items 9 and 14, chat:
``tests/unit/test_chat_hostile.py``.)"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.errors import ManifestError, SampleError
from mmcache.sources.base import OnError, SampleSource
from mmcache.sources.wds import WebDatasetSource
from mmcache.testing.hostile import (
    HOSTILE_AT,
    HOSTILE_SHARDS,
    HostileInputContract,
    hostile_shard,
    peak_allocation,
    small_jpeg,
    tar_member,
)

pytestmark = pytest.mark.timeout(120)  # a hostile header must never hang: fail instead


def _image_pipeline(max_bytes: int = 1 << 20) -> Any:
    from mmcache.transforms import ImageSpec
    from mmcache.transforms.pipeline import Pipeline

    return Pipeline(image=ImageSpec(size=16, max_bytes=max_bytes), text=None)


# -- the contract, for loose files --------------------------------------------------------


class TestLooseFilesHostile(HostileInputContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path) -> None:
        self.root = tmp_path

    def make_hostile_source(
        self, images: Sequence[bytes], *, pipeline: Any, on_error: OnError
    ) -> SampleSource:
        from mmcache.dataset import MultimodalDataset

        lines = []
        for i, data in enumerate(images):
            (self.root / f"{i}.img").write_bytes(data)
            lines.append(
                json.dumps({"id": f"s{i}", "image_path": f"{i}.img", "caption": "a caption"})
            )
        manifest = self.root / "m.jsonl"
        manifest.write_text("\n".join(lines) + "\n")
        return MultimodalDataset(manifest, pipeline=pipeline, on_error=on_error)


# -- tar headers that lie (item 6) ----------------------------------------------------------


def _shards(tmp_path: Path, hostile: bytes) -> list[Path]:
    good = tmp_path / "a.tar"
    good.write_bytes(tar_member("100000.jpg", small_jpeg(5)) + b"\0" * 1024)
    bad = tmp_path / "b.tar"
    bad.write_bytes(hostile)
    return [good, bad]


@pytest.mark.parametrize("case", sorted(HOSTILE_SHARDS))
def test_hostile_tar_header_is_a_clear_error_never_a_hang_or_allocation(
    tmp_path: Path, case: str
) -> None:
    shards = _shards(tmp_path, hostile_shard(case))
    kw: dict[str, Any] = {"pipeline": _image_pipeline(), "index_dir": tmp_path / "idx"}
    peak, _, error = peak_allocation(lambda: WebDatasetSource(shards, **kw))
    assert isinstance(error, ManifestError), error
    assert str(shards[1]) in str(error) and f"byte {HOSTILE_AT}" in str(error)
    assert peak < 16 << 20, f"{peak} bytes allocated to refuse the shard"
    skip = WebDatasetSource(shards, on_error="skip", **kw)
    assert skip.ids(range(len(skip))) == ["100000"]  # the good shard is served
    (listed,) = skip.rejects()
    assert str(listed.path).startswith(str(shards[1])) and "damaged tar header" in listed.reason


def test_all_zero_shard_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shards = _shards(tmp_path, b"\0" * 10240)
    with caplog.at_level(logging.WARNING):
        src = WebDatasetSource(shards, pipeline=_image_pipeline(), index_dir=False)
    assert len(src) == 1
    assert any(
        "holds no members" in r.getMessage() and "b.tar" in r.getMessage() for r in caplog.records
    )


def test_repeated_member_is_listed_and_never_served(tmp_path: Path) -> None:
    body = (
        tar_member("000001.jpg", small_jpeg(1))
        + tar_member("000002.jpg", small_jpeg(2))
        + tar_member("000001.jpg", small_jpeg(3))
    )
    shard = tmp_path / "s.tar"
    shard.write_bytes(body + b"\0" * 1024)
    with pytest.raises(ManifestError, match=r"repeated within the shard.*000001\.jpg"):
        WebDatasetSource(shard, pipeline=_image_pipeline(), index_dir=False)
    skip = WebDatasetSource(shard, pipeline=_image_pipeline(), index_dir=False, on_error="skip")
    assert skip.ids(range(len(skip))) == ["000002"]
    assert [r.sample_id for r in skip.rejects()] == ["000001"]


def test_member_over_max_bytes_is_never_fetched_by_the_prefetcher(tmp_path: Path) -> None:
    body = tar_member("000001.jpg", small_jpeg(1)) + tar_member("000002.jpg", b"\0" * 300_000)
    shard = tmp_path / "s.tar"
    shard.write_bytes(body + b"\0" * 1024)
    src = WebDatasetSource(shard, pipeline=_image_pipeline(100_000), index_dir=False)
    assert src._within_limit(slice(None)).tolist() == [True, False]


# -- Parquet image columns of the wrong type (item 8) ---------------------------------------


@pytest.mark.parametrize(
    "column",
    ["int64", "list", "struct without bytes", "string"],
)
def test_mistyped_parquet_image_column_is_a_clear_error(tmp_path: Path, column: str) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from mmcache.sources.parquet import ParquetSource

    values: dict[str, Any] = {
        "int64": pa.array([4_000_000_000, 5], type=pa.int64()),
        "list": pa.array([[1, 2], [3]]),
        "struct without bytes": pa.array([{"path": "a.jpg", "n": 1}, {"path": "b", "n": 2}]),
        "string": pa.array(["abc", "def"]),
    }
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": values[column], "text": ["a", "b"]}), path)
    with pytest.raises(ManifestError) as info:
        ParquetSource(path, pipeline=_image_pipeline())
    assert str(path) in str(info.value) and "image column 'image'" in str(info.value)
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"image": [small_jpeg(1)], "text": ["c"]}), good)
    skip = ParquetSource([good, path], pipeline=_image_pipeline(), on_error="skip")
    assert len(skip) == 1 and skip.produce(0)
    (listed,) = skip.rejects()
    assert listed.path == str(path) and "image column 'image'" in listed.reason


def test_hf_dataset_image_column_of_wrong_type(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from mmcache.sources.hfdataset import HFDatasetSource

    ds = datasets.Dataset.from_dict({"image": [1, 2], "text": ["a", "b"]})
    with pytest.raises(ManifestError, match="image column 'image' holds type int64"):
        HFDatasetSource(ds, pipeline=_image_pipeline())


def test_oversized_parquet_cell_is_refused_from_its_size(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    from mmcache.sources.cells import image_cell

    cell = pa.array([b"\0" * 200_000], type=pa.large_binary())[0]
    with pytest.raises(SampleError, match="200000 bytes, over the limit of 1000"):
        image_cell(cell, "", limit=1000, sample_id="r0", where="t.parquet row 0")


# -- compact disk entries that lie about their size (item 10) -------------------------------


def _formed_store(tmp_path: Path, form: str) -> Any:
    pytest.importorskip("zstandard")
    from mmcache.codec.compact import parse_disk_form
    from mmcache.stores.disk.formed import FormedDiskStore

    return FormedDiskStore(
        tmp_path / form.replace(":", "-"), form=parse_disk_form(form), capacity="4MiB"
    )


def _crafted_zstd(nbytes: int) -> bytes:
    """A valid zstd-form entry (checksum included) of a raw entry of ``nbytes``."""
    from mmcache import codec
    from mmcache.codec.compact import parse_disk_form

    raw = codec.encode({"image": np.zeros(nbytes, dtype=np.uint8)}, ctime=1.0, cost=1.0)
    return parse_disk_form("zstd").pack(raw)


def _crafted_jpeg(height: int, width: int) -> bytes:
    """A valid jpeg-form entry whose JPEG's header declares ``height`` x ``width``."""
    from mmcache import codec

    jpg = bytearray(small_jpeg(0, size=16))
    sof = jpg.find(b"\xff\xc0")
    jpg[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    body = {"\x00jpeg:image": np.frombuffer(bytes(jpg), dtype=np.uint8)}
    return codec.encode(body, ctime=1.0, cost=1.0)


def _layout_targets(n: int = 1) -> tuple[list[tuple[int, int, np.ndarray]], int]:
    """The gather targets of a batch of small entries (one uint8 [3, 16, 16] field)."""
    from mmcache import codec

    raw = codec.encode({"image": np.zeros((3, 16, 16), dtype=np.uint8)}, ctime=1.0, cost=1.0)
    return [(0, len(raw), np.zeros((n, len(raw)), dtype=np.uint8))], len(raw)


@pytest.mark.parametrize("form", ["zstd", "jpeg:90"])
def test_compact_entry_declaring_a_huge_size_is_damaged_not_allocated(
    tmp_path: Path, form: str
) -> None:
    store = _formed_store(tmp_path, form)
    huge = 256 << 20
    stored = _crafted_zstd(huge) if form == "zstd" else _crafted_jpeg(12000, 12000)
    assert len(stored) < 64 << 10  # a small record that would expand a thousandfold
    key = b"k" * 16
    from mmcache.stores.disk import DiskStore

    DiskStore.put_many(store, [(key, stored, 1.0, 1.0)])  # as a crafted file would hold it
    from mmcache import codec

    store.enable_gather(codec.checksum_matches)
    targets, _ = _layout_targets()
    peak, found, error = peak_allocation(
        lambda: store.gather_rows([key], np.zeros(1, dtype=np.int64), targets)
    )
    assert error is None and found.tolist() == [False]
    assert peak < 16 << 20, f"{peak} bytes allocated for a {len(stored)}-byte entry"
    assert store.get(key) is None  # discarded as damaged: produced again
    DiskStore.put_many(store, [(key, stored, 1.0, 1.0)])
    peak, value, error = peak_allocation(lambda: store.get(key))
    assert error is None and value is None and peak < 16 << 20
    store.close()


def test_compact_entries_of_the_layout_still_gather(tmp_path: Path) -> None:
    from mmcache import codec

    store = _formed_store(tmp_path, "zstd")
    raw = codec.encode({"image": np.full((3, 16, 16), 7, dtype=np.uint8)}, ctime=1.0, cost=1.0)
    store.put_many([(b"k" * 16, raw, 1.0, 1.0)])
    store.enable_gather(codec.checksum_matches)
    targets, _ = _layout_targets()
    found = store.gather_rows([b"k" * 16], np.zeros(1, dtype=np.int64), targets)
    assert found.tolist() == [True] and bytes(targets[0][2][0]) == raw
    assert store.get(b"k" * 16) == raw
    store.close()
