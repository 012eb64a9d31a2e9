"""The tabular sources through MultimodalDataset, mmcache.DataLoader, a cache and the CLI:
the same data as loose files + JSONL, Parquet, an HF dataset and COCO gives the same batches."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import mmcache as mc
from mmcache.cache import Cache
from mmcache.cli import main
from mmcache.dataset import MultimodalDataset, open_source
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader
from mmcache.sources.base import SampleSource
from mmcache.sources.coco import CocoSource
from mmcache.sources.hfdataset import HFDatasetSource
from mmcache.sources.open import register_source_format, sniff_format, source_format_names
from mmcache.sources.parquet import ParquetSource
from mmcache.synth import make_dataset
from mmcache.testing.tabular import write_coco, write_hf_dataset, write_parquet
from mmcache.transforms.pipeline import Pipeline

N = 20


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tabular")
    manifest = make_dataset(root / "loose", N, seed=4)
    write_parquet(manifest, root / "pq", files=2, row_group_size=4)
    write_hf_dataset(manifest, root / "hf")
    write_coco(manifest, root / "loose" / "captions.json")
    return {
        "jsonl": manifest,
        "parquet": root / "pq",
        "hf": root / "hf",
        "coco": root / "loose" / "captions.json",
    }


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Bitwise equal batches (the cache keys differ between sources: not compared)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"]
        for name in ("image", "input_ids", "attention_mask"):
            assert x[name].dtype == y[name].dtype and torch.equal(x[name], y[name]), name


def test_paths_are_sniffed(data: dict[str, Path]) -> None:
    assert sniff_format(data["jsonl"]) == "jsonl"
    assert sniff_format(data["parquet"]) == "parquet"  # a folder of *.parquet
    assert sniff_format(data["parquet"] / "part-00000.parquet") == "parquet"
    assert sniff_format(str(data["parquet"] / "*.parquet")) == "parquet"
    assert sniff_format("s3://bucket/train-0.parquet") == "parquet"
    assert sniff_format(data["hf"]) == "hf"
    assert sniff_format(data["coco"]) == "coco"
    assert source_format_names()[:3] == ["parquet", "hf", "coco"]


@pytest.mark.parametrize("fmt", ["parquet", "hf", "coco"])
def test_every_source_gives_the_loose_files_batches_cold_and_warm(
    data: dict[str, Path], small_pipeline: Pipeline, tmp_path: Path, fmt: str
) -> None:
    reference = MultimodalDataset(data["jsonl"], pipeline=small_pipeline)
    assert type(reference) is MultimodalDataset  # the JSONL path is unchanged
    ref_loader = DataLoader(reference, cache=None, batch_size=6, seed=3)
    expected = [_epoch(ref_loader, 0), _epoch(ref_loader, 1)]
    columns = {"id": "id"} if fmt in ("parquet", "hf") else None
    ds = open_source(data[fmt], pipeline=small_pipeline, columns=columns)
    assert len(ds) == N and ds.ids(range(N)) == reference.ids(range(N))
    with Cache(tmp_path / "cache", memory="32MiB", disk=None, temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=6, seed=3, num_workers=0)
        _same(_epoch(loader, 0), expected[0])  # cold
        _same(_epoch(loader, 1), expected[1])  # warm
        stats = loader.stats()
        assert stats.epochs[0].misses == N and stats.epochs[1].hits == N


def test_a_rewritten_parquet_file_is_never_served_stale(
    data: dict[str, Path], small_pipeline: Pipeline, tmp_path: Path
) -> None:
    folder = tmp_path / "pq"
    paths = write_parquet(data["jsonl"], folder, files=2, row_group_size=4)
    ds = open_source(folder, pipeline=small_pipeline, columns={"id": "id"})
    assert isinstance(ds, ParquetSource) and isinstance(ds, torch.utils.data.Dataset)
    with Cache(tmp_path / "cache", memory="32MiB", disk=None, temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=5, seed=1, num_workers=2)
        _epoch(loader, 0)
        _epoch(loader, 1)  # warm: served from the cache
        # rewrite the first file with its images mirrored (same ids, same row count)
        table = pq.read_table(paths[0])
        rows = table.to_pylist()
        import io

        from PIL import Image

        for row in rows:
            im = Image.open(io.BytesIO(row["image"]["bytes"])).transpose(Image.FLIP_LEFT_RIGHT)
            buf = io.BytesIO()
            im.save(buf, "JPEG", quality=90)
            row["image"]["bytes"] = buf.getvalue()
        pq.write_table(type(table).from_pylist(rows, schema=table.schema), paths[0])
        st = paths[0].stat()
        os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        got = _epoch(loader, 2)
        fresh = open_source(folder, pipeline=small_pipeline, columns={"id": "id"})
        expected = _epoch(DataLoader(fresh, cache=None, batch_size=5, seed=1), 2)
        _same(got, expected)
        e2 = loader.stats().epochs[2]
        assert e2.misses == len(rows) and e2.hits == N - len(rows)


def test_hf_dataset_in_two_spawned_workers(
    data: dict[str, Path], small_pipeline: Pipeline, tmp_path: Path
) -> None:
    import datasets

    hf = datasets.load_from_disk(str(data["hf"]))
    ds = open_source(hf, pipeline=small_pipeline, columns={"id": "id"})  # a Dataset object
    assert isinstance(ds, HFDatasetSource)
    expected = _epoch(DataLoader(ds, cache=None, batch_size=6, seed=2), 0)
    with Cache(tmp_path / "cache", memory="32MiB", disk=None, temporary=True) as cache:
        loader = DataLoader(
            ds, cache=cache, batch_size=6, seed=2, num_workers=2, multiprocessing_context="spawn"
        )
        _same(_epoch(loader, 0), expected)
        assert loader.stats().epochs[0].misses == N


def test_source_objects_and_explicit_formats(
    data: dict[str, Path], small_pipeline: Pipeline
) -> None:
    coco = CocoSource(data["coco"], pipeline=small_pipeline, per="image")
    ds = open_source(coco)  # the source's own pipeline
    assert ds is coco and len(ds) == N
    assert ds[0] is not None and ds[0]["id"] == "0"
    other = Pipeline(image=mc.ImageSpec(size=8))
    with pytest.raises(ConfigError, match="another pipeline"):
        open_source(coco, pipeline=other)
    named = MultimodalDataset(data["coco"], pipeline=small_pipeline, format="coco")
    assert type(named) is MultimodalDataset and named.records.format == "coco"
    with pytest.raises(ConfigError, match="format must be"):
        MultimodalDataset(data["jsonl"], pipeline=small_pipeline, format="nope")
    with pytest.raises(ConfigError, match="columns="):
        open_source(data["jsonl"], pipeline=small_pipeline, columns={"id": "id"})
    with pytest.raises(ConfigError):
        MultimodalDataset(42, pipeline=small_pipeline)
    with pytest.raises(ConfigError, match=r"use mmcache\.open_source"):
        MultimodalDataset(coco, pipeline=small_pipeline)  # a source object: open_source's
    assert isinstance(ds, SampleSource)
    again = __import__("pickle").loads(__import__("pickle").dumps(ds))
    assert isinstance(again, CocoSource) and again.ids([0, 1]) == ds.ids([0, 1])


def test_a_registered_format_is_sniffed_and_opened(
    data: dict[str, Path], small_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mmcache.sources.open as open_module

    monkeypatch.setattr(open_module, "_FORMATS", dict(open_module._FORMATS))
    made: list[str] = []

    def factory(location: str, options: open_module.OpenOptions) -> SampleSource:
        made.append(location)
        return ParquetSource(data["parquet"], pipeline=options.pipeline, columns=options.columns)

    register_source_format("toy", lambda loc, head: loc.endswith(".toy"), factory)
    with pytest.raises(ConfigError, match="already registered"):
        register_source_format("toy", lambda loc, head: False, factory)
    ds = open_source("x.toy", pipeline=small_pipeline, columns={"id": "id"})
    assert made == ["x.toy"] and len(ds) == N


@pytest.mark.parametrize("fmt", ["parquet", "coco"])
def test_cli_warm_and_bench_take_parquet_and_coco(
    data: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    location = str(data[fmt])
    args = ["--workers", "0", "--size", "32", "--json"]
    capsys.readouterr()
    assert main(["warm", location, "--cache", str(tmp_path / "c"), "--disk", "64MiB", *args]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total"] == N and report["admitted"] == N
    bench = ["bench", location, "--budget", "100%", "--epochs", "2", "--batch-size", "5"]
    assert main([*bench, "--no-baseline", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["samples"] == N and out["epochs"][1]["hit_rate"] == 1.0
    if fmt == "coco":  # the image root named on the command line
        root = str(data["coco"].parent)
        warm = ["warm", location, "--cache", str(tmp_path / "c3"), "--image-root", root, *args]
        assert main(warm) == 0 and json.loads(capsys.readouterr().out)["admitted"] == N
        missing = [
            "warm",
            location,
            "--cache",
            str(tmp_path / "c4"),
            "--image-root",
            "/nonexistent",
        ]
        assert main([*missing, *args]) == 0
        assert json.loads(capsys.readouterr().out)["admitted"] == 0  # every file missing
    if fmt == "parquet":  # columns named on the command line: ids from the id column
        cache = str(tmp_path / "c2")
        named = ["warm", location, "--cache", cache, "--columns", "id=id,text=text", *args]
        assert main([*named, "--format", "parquet"]) == 0
        assert json.loads(capsys.readouterr().out)["admitted"] == N
        assert main(["warm", location, "--cache", cache, "--columns", "id", *args]) != 0
        assert "--columns takes role=name" in capsys.readouterr().err


def test_image_only_parquet(data: dict[str, Path], tmp_path: Path) -> None:
    pipe = Pipeline(image=mc.ImageSpec(size=16))
    ds = open_source(data["parquet"], pipeline=pipe, columns={"text": None})
    assert set(ds[3] or {}) == {"id", "image"}
    assert np.asarray(ds[3]["image"]).shape == (3, 16, 16)  # type: ignore[index]
