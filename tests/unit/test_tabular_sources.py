"""Parquet, HF dataset and COCO sources: the SampleSource contract and their bad inputs."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mmcache.errors import ManifestError, SampleError
from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.sources.coco import CocoSource, read_coco
from mmcache.sources.hfdataset import HFDatasetSource
from mmcache.sources.parquet import ParquetSource
from mmcache.synth import synth_captions
from mmcache.testing.source_contract import SourceContract
from mmcache.transforms import ImageSpec, TextSpec, train_tokenizer
from mmcache.transforms.pipeline import Pipeline

_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


@pytest.fixture(scope="module")
def pipeline() -> Pipeline:
    tok = train_tokenizer(synth_captions(200, seed=0), vocab_size=200)
    return Pipeline(image=ImageSpec(size=16), text=TextSpec(tok, max_length=8))


def jpeg(index: int, shade: int = 0) -> bytes:
    arr = np.zeros((30, 40, 3), dtype=np.uint8)
    arr[..., 0] = (index * 37 + shade) % 256
    arr[:10, :10, 1] = 200
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def parquet_table(ids: list[str], images: list[bytes | None], texts: list[str]) -> pa.Table:
    cells = [None if b is None else {"bytes": b, "path": None} for b in images]
    return pa.table(
        {
            "id": pa.array(ids, type=pa.string()),
            "image": pa.array(cells, type=_STRUCT),
            "text": pa.array(texts, type=pa.string()),
        }
    )


def bump(path: Path) -> None:
    """Move the mtime a second ahead (a rewrite within the mtime granularity stays seen)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


# -- Parquet ------------------------------------------------------------------------------
class TestParquetContract(SourceContract):
    """One row per file: a changed input (a rewritten file) changes one sample's stamp."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path, pipeline: Pipeline) -> None:
        self.root, self.pipeline = tmp_path, pipeline

    def make_source(
        self, n: int, *, on_error: OnError = "raise", bad: int | None = None
    ) -> SampleSource:
        folder = self.root / f"pq-{n}-{bad}"
        if not folder.exists():
            folder.mkdir()
            for i in range(n):
                image = None if i == bad else jpeg(i)
                table = parquet_table([f"s{i}"], [image], [f"caption {i}"])
                pq.write_table(table, folder / f"{i:03d}.parquet")
        return ParquetSource(
            str(folder / "*.parquet"),
            pipeline=self.pipeline,
            columns={"id": "id"},
            on_error=on_error,
        )

    def change_input(self, source: SampleSource, index: int) -> None:
        assert isinstance(source, ParquetSource)
        path = Path(source.files[index])
        pq.write_table(parquet_table([f"s{index}"], [jpeg(index, 99)], [f"caption {index}"]), path)
        bump(path)

    def make_hostile_source(
        self, images: Sequence[bytes], *, pipeline: Any, on_error: OnError
    ) -> SampleSource:
        table = pa.table({"image": pa.array(list(images), type=pa.binary())})
        pq.write_table(table, self.root / "hostile.parquet")
        return ParquetSource(
            self.root / "hostile.parquet",
            pipeline=pipeline,
            on_error=on_error,
            columns={"text": None},
        )


def _rows_file(root: Path, n: int, *, row_group_size: int = 4, bad: int | None = None) -> Path:
    path = root / f"rows-{n}-{bad}.parquet"
    images: list[bytes | None] = [None if i == bad else jpeg(i) for i in range(n)]
    table = parquet_table([f"s{i}" for i in range(n)], images, [f"caption {i}" for i in range(n)])
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def test_parquet_reads_row_groups_in_place(tmp_path: Path, pipeline: Pipeline) -> None:
    path = _rows_file(tmp_path, 10, row_group_size=3)
    src = ParquetSource(path, pipeline=pipeline, columns={"id": "id"})
    assert len(src) == 10 and src.ids([0, 9]) == ["s0", "s9"]
    assert src.stamp_kind is StampKind.FILE
    # every row of every group decodes as its bytes do
    ref = ParquetSource(path, pipeline=pipeline, columns={"id": "id"}, row_group_memory=0)
    for i in (9, 0, 4, 3, 8):
        a, b = src.produce(i), ref.produce(i)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert src.produce(5)["image"].shape == (3, 16, 16)
    # the default id is the row position, the binary layout works too
    table = pa.table({"jpg": pa.array([jpeg(0), jpeg(1)]), "txt": ["a", "b"]})
    pq.write_table(table, tmp_path / "plain.parquet")
    plain = ParquetSource(tmp_path / "plain.parquet", pipeline=pipeline,
                          columns={"image": "jpg", "text": "txt"})  # fmt: skip
    assert plain.ids([0, 1]) == ["0", "1"]
    assert np.array_equal(plain.produce(1)["image"], src.produce(1)["image"])


def test_parquet_row_group_memo_reads_each_group_once(tmp_path: Path, pipeline: Pipeline) -> None:
    path = _rows_file(tmp_path, 12, row_group_size=6)
    src = ParquetSource(path, pipeline=pipeline, columns={"id": "id"})
    reads: list[int] = []
    reader = src._reader(0)
    original = reader.pf.read_row_group

    def counting(g: int, **kw: object) -> pa.Table:
        reads.append(g)
        return original(g, **kw)

    reader.pf.read_row_group = counting
    for i in [5, 0, 3, 1, 11, 6, 8, 7]:  # shuffled within each group
        src.produce(i)
    assert reads == [0, 1], "each row group should be read once while its rows are read"


def test_parquet_null_image_under_raise_and_skip(tmp_path: Path, pipeline: Pipeline) -> None:
    path = _rows_file(tmp_path, 6, bad=2)
    src = ParquetSource(path, pipeline=pipeline, columns={"id": "id"})
    with pytest.raises(SampleError) as info:
        src.produce(2)
    err = info.value
    assert err.sample_id == "s2" and str(path) in str(err) and "row 2" in str(err)
    assert "null" in err.reason
    skip = ParquetSource(path, pipeline=pipeline, columns={"id": "id"}, on_error="skip")
    with pytest.raises(SampleError) as info:
        skip.produce(2)
    skip.record_reject(info.value)  # what the loader / dataset does under skip
    assert [r.sample_id for r in skip.rejects()] == ["s2"]


def test_parquet_corrupt_footer_under_raise_and_skip(tmp_path: Path, pipeline: Pipeline) -> None:
    good = _rows_file(tmp_path, 4)
    bad = tmp_path / "rows-zbad.parquet"
    data = good.read_bytes()
    bad.write_bytes(data[:-12] + b"\0" * 8 + data[-4:])  # footer length and magic broken
    with pytest.raises(ManifestError) as info:
        ParquetSource(str(tmp_path / "rows-*.parquet"), pipeline=pipeline, columns={"id": "id"})
    assert info.value.path == str(bad) and "Parquet" in info.value.reason
    skip = ParquetSource(
        str(tmp_path / "rows-*.parquet"), pipeline=pipeline, columns={"id": "id"}, on_error="skip"
    )
    assert len(skip) == 4  # the good file's rows
    rejects = skip.rejects()
    assert len(rejects) == 1 and rejects[0].path == str(bad)
    with pytest.raises(ManifestError):
        ParquetSource(bad, pipeline=pipeline, on_error="skip")  # nothing readable at all


def test_parquet_missing_column_and_duplicate_id(tmp_path: Path, pipeline: Pipeline) -> None:
    path = _rows_file(tmp_path, 3)
    with pytest.raises(ManifestError, match="no text column 'caption'"):
        ParquetSource(path, pipeline=pipeline, columns={"text": "caption"})
    dup = tmp_path / "dup.parquet"
    pq.write_table(parquet_table(["a", "b", "a"], [jpeg(0)] * 3, ["x"] * 3), dup)
    with pytest.raises(ManifestError, match="duplicate id") as info:
        ParquetSource(dup, pipeline=pipeline, columns={"id": "id"})
    assert info.value.line == 2 and info.value.sample_id == "a"
    # both entries named, in the words every source uses (sources/ids.py)
    assert f"duplicate id (first seen at {dup} row 0)" in str(info.value)


def test_parquet_rewritten_file_is_read_again(tmp_path: Path, pipeline: Pipeline) -> None:
    path = _rows_file(tmp_path, 6, row_group_size=2)
    src = ParquetSource(path, pipeline=pipeline, columns={"id": "id"})
    before_keys = src.key_rows(range(6)).copy()
    before = src.produce(3)["image"]
    images: list[bytes | None] = [jpeg(i, 50) for i in range(6)]
    pq.write_table(
        parquet_table([f"s{i}" for i in range(6)], images, [f"caption {i}" for i in range(6)]),
        path,
        row_group_size=3,  # another layout of row groups
    )
    bump(path)
    after_keys = src.key_rows(range(6))
    assert not (after_keys == before_keys).all(axis=1).any(), "a rewritten file kept a key"
    after = src.produce(3)["image"]  # the worker opens the file again
    expected = ParquetSource(path, pipeline=pipeline, columns={"id": "id"}).produce(3)["image"]
    assert np.array_equal(after, expected) and not np.array_equal(after, before)
    # a rewrite that moves ids is refused, not served under the old id
    pq.write_table(parquet_table(["s5", "s4", "s3", "s2", "s1", "s0"], images, ["c"] * 6), path)
    bump(path)
    with pytest.raises(SampleError, match="id is now 's2'"):
        src.produce(3)


# -- HF datasets --------------------------------------------------------------------------
def save_hf(folder: Path, n: int, bad: int | None = None) -> Path:
    import datasets

    if not folder.exists():
        features = datasets.Features(
            {"id": datasets.Value("string"), "image": datasets.Image(),
             "text": datasets.Value("string")}
        )  # fmt: skip
        cells = [None if i == bad else {"bytes": jpeg(i), "path": None} for i in range(n)]
        ds = datasets.Dataset.from_dict(
            {"id": [f"s{i}" for i in range(n)], "image": cells,
             "text": [f"caption {i}" for i in range(n)]},
            features=features,
        )  # fmt: skip
        ds.save_to_disk(str(folder))
    return folder


class TestHFDatasetContract(SourceContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path, pipeline: Pipeline) -> None:
        self.root, self.pipeline = tmp_path, pipeline

    def make_source(
        self, n: int, *, on_error: OnError = "raise", bad: int | None = None
    ) -> SampleSource:
        import datasets

        ds = datasets.load_from_disk(str(save_hf(self.root / f"hf-{n}-{bad}", n, bad)))
        return HFDatasetSource(ds, pipeline=self.pipeline, columns={"id": "id"}, on_error=on_error)

    def test_changed_input_changes_only_its_key(self) -> None:
        # A Dataset is immutable: a changed one is a new object with a new fingerprint,
        # so every key is new (rows are keyed by fingerprint + row): none is the old one.
        source = self._source()
        assert isinstance(source, HFDatasetSource)
        changed = source.dataset.map(
            lambda row, i: {"text": row["text"] + "!" if i == 2 else row["text"]},
            with_indices=True,
        )
        other = HFDatasetSource(changed, pipeline=self.pipeline, columns={"id": "id"})
        before, after = source.key_rows(range(6)), other.key_rows(range(6))
        assert not (before == after).all(axis=1).any()
        assert other.read_row(2)[2] == "caption 2!" and source.read_row(2)[2] == "caption 2"


def test_hf_reads_arrow_not_decoded_rows(tmp_path: Path, pipeline: Pipeline) -> None:
    import datasets

    ds = datasets.load_from_disk(str(save_hf(tmp_path / "hf", 5)))
    src = HFDatasetSource(ds, pipeline=pipeline, columns={"id": "id"})
    # the row through its Arrow bytes equals the same JPEG decoded from bytes by Parquet
    path = _rows_file(tmp_path, 5)
    ref = ParquetSource(path, pipeline=pipeline, columns={"id": "id"})
    for i in range(5):
        assert np.array_equal(src.produce(i)["image"], ref.produce(i)["image"])
    assert len(__import__("pickle").dumps(src)) < 20_000  # paths, not the table


def test_hf_null_image_under_raise_and_skip(tmp_path: Path, pipeline: Pipeline) -> None:
    import datasets

    ds = datasets.load_from_disk(str(save_hf(tmp_path / "hf", 5, bad=1)))
    for on_error in ("raise", "skip"):
        src = HFDatasetSource(ds, pipeline=pipeline, columns={"id": "id"}, on_error=on_error)
        with pytest.raises(SampleError) as info:
            src.produce(1)
        assert info.value.sample_id == "s1" and "row 1" in str(info.value)
        src.record_reject(info.value)
        assert [r.sample_id for r in src.rejects()] == ["s1"]


# -- COCO ---------------------------------------------------------------------------------
def write_coco_files(root: Path, n: int, *, missing_file: int | None = None) -> Path:
    images_dir = root / "images"
    images_dir.mkdir(exist_ok=True)
    images, annotations = [], []
    for i in range(n):
        path = images_dir / f"{i:03d}.jpg"
        if not path.exists():
            path.write_bytes(jpeg(i))
        name = f"{i:03d}.jpg" if i != missing_file else "gone.jpg"
        images.append({"id": 100 + i, "file_name": name})
        annotations.append({"id": i, "image_id": 100 + i, "caption": f"caption {i}"})
    out = root / f"captions-{n}-{missing_file}.json"
    out.write_text(json.dumps({"images": images, "annotations": annotations}))
    return out


class TestCocoContract(SourceContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path, pipeline: Pipeline) -> None:
        self.root, self.pipeline = tmp_path, pipeline

    def make_source(
        self, n: int, *, on_error: OnError = "raise", bad: int | None = None
    ) -> SampleSource:
        captions = write_coco_files(self.root, n, missing_file=bad)
        return CocoSource(captions, self.root / "images", pipeline=self.pipeline, on_error=on_error)

    def change_input(self, source: SampleSource, index: int) -> None:
        path = self.root / "images" / f"{index:03d}.jpg"
        path.write_bytes(jpeg(index, 99))
        bump(path)


def test_coco_per_caption_and_per_image(tmp_path: Path, pipeline: Pipeline) -> None:
    (tmp_path / "img").mkdir()
    for i in range(2):
        (tmp_path / "img" / f"{i}.jpg").write_bytes(jpeg(i))
    doc = {
        "images": [{"id": 7, "file_name": "0.jpg"}, {"id": 8, "file_name": "1.jpg"}],
        "annotations": [
            {"id": 1, "image_id": 8, "caption": "b one"},
            {"id": 2, "image_id": 7, "caption": "a one"},
            {"id": 3, "image_id": 8, "caption": "b two"},
        ],
    }
    path = tmp_path / "captions.json"
    path.write_text(json.dumps(doc))
    per_caption = CocoSource(path, tmp_path / "img", pipeline=pipeline)
    assert per_caption.ids([0, 1, 2]) == ["1", "2", "3"]
    assert per_caption.records.text(2) == "b two"
    assert per_caption.records.image_path(0) == str(tmp_path / "img" / "1.jpg")
    per_image = CocoSource(path, tmp_path / "img", pipeline=pipeline, per="image")
    assert per_image.ids([0, 1]) == ["7", "8"]
    assert per_image.records.text(1) == "b one\nb two"
    assert per_image.produce(1)["image"].shape == (3, 16, 16)


def test_coco_annotation_of_a_missing_image_id(tmp_path: Path, pipeline: Pipeline) -> None:
    path = write_coco_files(tmp_path, 3)
    doc = json.loads(path.read_text())
    doc["annotations"].append({"id": 99, "image_id": 555, "caption": "orphan"})
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError) as info:
        read_coco(path, image_root=tmp_path / "images")
    err = info.value
    assert err.path == str(path) and err.line == 4 and err.sample_id == "99"
    assert "image_id 555" in err.reason and "annotations[3]" in err.reason
    src = CocoSource(path, tmp_path / "images", pipeline=pipeline, on_error="skip")
    assert len(src) == 3
    rejects = src.rejects()
    assert [r.sample_id for r in rejects] == ["99"] and "image_id 555" in rejects[0].reason


def test_coco_missing_image_file_names_it(tmp_path: Path, pipeline: Pipeline) -> None:
    path = write_coco_files(tmp_path, 3, missing_file=1)
    src = CocoSource(path, tmp_path / "images", pipeline=pipeline)
    with pytest.raises(SampleError) as info:
        src.produce(1)
    assert info.value.path == str(tmp_path / "images" / "gone.jpg")


def test_coco_not_a_coco_file(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    with pytest.raises(ManifestError, match="not a COCO file"):
        read_coco(path)


def test_parquet_through_an_fsspec_url(tmp_path: Path, pipeline: Pipeline) -> None:
    import fsspec

    local = _rows_file(tmp_path, 6, row_group_size=2)
    fs = fsspec.filesystem("memory")
    for k in range(2):
        fs.pipe(f"/tabular-test/part-{k}.parquet", local.read_bytes())
    try:
        one = ParquetSource("memory://tabular-test/part-0.parquet", pipeline=pipeline)
        assert one.stamp_kind is StampKind.FIXED and len(one) == 6
        ref = ParquetSource(local, pipeline=pipeline)
        assert np.array_equal(one.produce(4)["image"], ref.produce(4)["image"])
        both = ParquetSource("memory://tabular-test/part-*.parquet", pipeline=pipeline)
        assert len(both) == 12 and both.files[1].endswith("part-1.parquet")
        keys = both.key_rows(range(12))
        assert len({k.tobytes() for k in keys}) == 12  # the same rows in two files differ
        np.testing.assert_array_equal(both.stamps([0, 6])[:, 3] != 0, [True, True])
    finally:
        fs.rm("/tabular-test", recursive=True)


def test_hf_shuffled_dataset_reads_its_own_rows(tmp_path: Path, pipeline: Pipeline) -> None:
    import datasets

    ds = datasets.load_from_disk(str(save_hf(tmp_path / "hf", 6)))
    plain = HFDatasetSource(ds, pipeline=pipeline, columns={"id": "id"})
    shuffled = HFDatasetSource(ds.shuffle(seed=1), pipeline=pipeline, columns={"id": "id"})
    order = ds.shuffle(seed=1)["id"]
    assert shuffled.ids(range(6)) == order != plain.ids(range(6))
    for i, sid in enumerate(order):
        j = plain.ids(range(6)).index(sid)
        assert np.array_equal(shuffled.produce(i)["image"], plain.produce(j)["image"])
    assert shuffled.key(0) != plain.key(plain.ids(range(6)).index(order[0]))  # new fingerprint


def test_coco_skip_through_multimodal_dataset(tmp_path: Path, pipeline: Pipeline) -> None:
    from mmcache.dataset import MultimodalDataset

    path = write_coco_files(tmp_path, 3)
    doc = json.loads(path.read_text())
    doc["annotations"].insert(1, {"id": 99, "image_id": 555, "caption": "orphan"})
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="image_id 555"):
        MultimodalDataset(path, pipeline=pipeline, image_root=tmp_path / "images")
    ds = MultimodalDataset(path, pipeline=pipeline, image_root=tmp_path / "images", on_error="skip")
    assert ds.ids(range(3)) == ["0", "1", "2"]
    assert [r.sample_id for r in ds.rejects()] == ["99"]
