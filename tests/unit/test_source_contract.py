"""FileSource and MultimodalDataset pass the SampleSource contract; the manifest reader registry."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

import mmcache.sources.readers as readers_module
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError, SampleError
from mmcache.sources import FileSource, RecordReject, RecordsBuilder, StampKind, register_reader
from mmcache.sources.base import OnError, SampleSource
from mmcache.sources.readers import read_manifest
from mmcache.sources.records import RecordReject as Reject
from mmcache.synth import synth_captions
from mmcache.testing.source_contract import SourceContract
from mmcache.transforms import ImageSpec, TextSpec, train_tokenizer
from mmcache.transforms.pipeline import Pipeline


@pytest.fixture(scope="module")
def pipeline() -> Pipeline:
    tok = train_tokenizer(synth_captions(200, seed=0), vocab_size=200)
    return Pipeline(image=ImageSpec(size=16), text=TextSpec(tok, max_length=8))


def _picture(index: int, shade: int = 0) -> Image.Image:
    arr = np.zeros((30, 40, 3), dtype=np.uint8)
    arr[..., 0] = (index * 37 + shade) % 256
    arr[:10, :10, 1] = 200
    return Image.fromarray(arr)


def write_manifest(root: Path, n: int, bad: int | None = None) -> Path:
    """``n`` records ``s0``...; images written once per folder (so stamps stay put);
    record ``bad`` names a file that does not exist."""
    images = root / "img"
    images.mkdir(exist_ok=True)
    lines = []
    for i in range(n):
        path = images / f"s{i}.png"
        if not path.exists():
            _picture(i).save(path)
        name = f"img/s{i}.png" if i != bad else "img/missing.png"
        lines.append(json.dumps({"id": f"s{i}", "image_path": name, "caption": f"caption {i}"}))
    manifest = root / f"m-{n}-{bad}.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def rewrite_image(root: Path, index: int) -> None:
    path = root / "img" / f"s{index}.png"
    st = path.stat()
    _picture(index, shade=99).save(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


class TestFileSourceContract(SourceContract):
    __test__ = True
    content_stamp = False

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path, pipeline: Pipeline) -> None:
        self.root = tmp_path
        self.pipeline = pipeline

    def make_source(
        self, n: int, *, on_error: OnError = "raise", bad: int | None = None
    ) -> SampleSource:
        return FileSource(
            write_manifest(self.root, n, bad),
            pipeline=self.pipeline,
            on_error=on_error,
            content_stamp=self.content_stamp,
        )

    def change_input(self, source: SampleSource, index: int) -> None:
        rewrite_image(self.root, index)

    def test_stamp_kind_follows_content_stamp(self) -> None:
        source = self.make_source(3)
        assert isinstance(source, FileSource)
        expected = StampKind.CONTENT if self.content_stamp else StampKind.FILE
        assert source.stamp_kind is expected

    def test_rejects_of_a_pickled_copy_are_listed_here(self) -> None:
        source = self.make_source(4, on_error="skip", bad=1)
        assert isinstance(source, FileSource)
        worker = pickle.loads(pickle.dumps(source))
        with pytest.raises(SampleError) as info:
            worker.produce(1)
        worker.record_reject(info.value)
        rejects = source.rejects()
        assert [(r.sample_id, r.reason) for r in rejects] == [("s1", "file not found")]
        assert rejects[0].path is not None and rejects[0].path.endswith("missing.png")


class TestFileSourceContentStampContract(TestFileSourceContract):
    content_stamp = True


class TestMultimodalDatasetContract(TestFileSourceContract):
    def make_source(
        self, n: int, *, on_error: OnError = "raise", bad: int | None = None
    ) -> SampleSource:
        return MultimodalDataset(
            write_manifest(self.root, n, bad),
            pipeline=self.pipeline,
            on_error=on_error,
            content_stamp=self.content_stamp,
        )

    def test_stamps_are_the_stat_fields(self) -> None:
        ds = self.make_source(4)
        assert ds.stamps([1]).shape == (1, 4)  # keys.stat_fields: 4 fields

    def test_getitem_skips_under_skip(self) -> None:
        ds = self.make_source(4, on_error="skip", bad=2)
        assert isinstance(ds, MultimodalDataset)
        assert ds[2] is None and ds[1] is not None
        assert [r.sample_id for r in ds.rejects()] == ["s2"]


def test_file_source_takes_any_record_processor(tmp_path: Path) -> None:
    class Lengths:
        def fingerprint(self) -> str:
            return "lengths-v1"

        def process(
            self, image_path: str | None, text: str | None, *, sample_id: str
        ) -> dict[str, np.ndarray]:
            return {"length": np.array([len(text or "")], dtype=np.int64)}

    source = FileSource(write_manifest(tmp_path, 3), pipeline=Lengths())
    assert source.produce(2)["length"].tolist() == [len("caption 2")]
    assert source.fingerprint() == "lengths-v1"
    with pytest.raises(ConfigError):
        FileSource(write_manifest(tmp_path, 3), pipeline="resize")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        FileSource(write_manifest(tmp_path, 3), pipeline=Lengths(), on_error="ignore")  # type: ignore[arg-type]


def test_the_two_rejects_have_two_names() -> None:
    assert Reject is RecordReject
    from mmcache.dataset import Reject as SampleReject

    assert SampleReject is not RecordReject
    assert SampleReject.__name__ == "Reject" and RecordReject.__name__ == "RecordReject"


# --------------------------------------------------------------------------------------------
# the manifest reader registry
# --------------------------------------------------------------------------------------------


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers registered by a test are gone after it."""
    monkeypatch.setattr(readers_module, "_READERS", dict(readers_module._READERS))


def _read_tsv(f: Any, builder: RecordsBuilder) -> None:
    for lineno, raw in enumerate(f, 1):
        fields = raw.decode("utf-8").rstrip("\n").split("\t")
        if len(fields) != 3:
            builder.reject(f"expected 3 tab-separated fields, got {len(fields)}", lineno)
            continue
        builder.add(lineno, fields[0], fields[2], fields[1])


def test_a_registered_reader_reads_its_format(tmp_path: Path, registry: None) -> None:
    register_reader("tsv", _read_tsv, unit="row")
    path = tmp_path / "m.tsv"
    path.write_text("a\timg/a.png\ta cat\nb\timg/b.png\ta dog\nbroken\na\timg/c.png\tagain\n")
    records = read_manifest(path, format="tsv", on_error="skip")
    assert records.format == "tsv" and len(records) == 2
    assert records.image_path(1) == str(tmp_path / "img" / "b.png")
    assert [(r.line, r.reason) for r in records.rejects] == [
        (3, "expected 3 tab-separated fields, got 1"),
        (4, "duplicate id (first seen at row 1)"),
    ]
    assert "tsv" in readers_module.reader_names()


def test_register_reader_refuses_duplicates_and_bad_names(registry: None) -> None:
    for name in ("jsonl", "llava", "auto", ""):
        with pytest.raises(ConfigError):
            register_reader(name, _read_tsv)
    with pytest.raises(ConfigError):
        register_reader("tsv", "not callable")  # type: ignore[arg-type]


def test_unknown_format_names_the_registered_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"format must be one of \('auto', 'jsonl', 'llava'\)"):
        read_manifest(tmp_path / "m.jsonl", format="csv")
