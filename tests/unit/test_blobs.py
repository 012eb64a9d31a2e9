"""The blobs layer (``mmcache.sources.blobs``): one door to object stores, and the local
files a FileSource reads through the same protocol."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from mmcache.errors import ConfigError, SampleError
from mmcache.sources.base import StampKind
from mmcache.sources.blobs.base import Blobs
from mmcache.sources.blobs.local import LocalFiles
from mmcache.sources.files import FileSource
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline

SRC = Path(__file__).resolve().parents[2] / "src" / "mmcache"


def test_fsspec_is_imported_only_under_blobs() -> None:
    # Issue 38: three doors to object storage (remote files, remote videos, and Parquet's
    # own fsspec door without the retry policy or the breaker) became one.
    pattern = re.compile(r"^\s*(import fsspec|from fsspec\b)", re.MULTILINE)
    outside = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if "sources/blobs/" not in path.as_posix() and pattern.search(path.read_text())
    ]
    assert outside == []


def test_a_manifest_of_paths_reads_local_files_and_claims_no_remote_capability(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    source = FileSource(make_dataset(tmp_path, 3, seed=1), pipeline=small_pipeline)
    assert isinstance(source.blobs, LocalFiles) and isinstance(source.blobs, Blobs)
    assert source.stamp_kind is StampKind.FILE
    for member in ("remote", "raw", "shared_stamps", "fetches_ahead"):
        assert not hasattr(source, member), member
    assert source.revalidate() == [] and source.remote_span(0) is None
    with pytest.raises(ConfigError, match="reads local files: there is nothing to fetch"):
        source.fetch("s3://b/k", "ETag=x", 0, 1, sample_id="0")


def test_local_reads_are_bounded_before_a_byte_is_read(tmp_path: Path) -> None:
    files = LocalFiles()
    path = tmp_path / "x.bin"
    path.write_bytes(b"a" * 100)
    assert files.read(str(path), sample_id="s", max_bytes=100) == b"a" * 100
    with pytest.raises(SampleError, match="100 bytes, over the limit of 99") as info:
        files.read(str(path), sample_id="s", max_bytes=99)
    assert info.value.sample_id == "s" and info.value.path == str(path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(SampleError, match="cannot open it"):  # never blocks on a FIFO
        files.read(str(fifo), sample_id="s")


def test_local_group_stamps_change_with_any_file(tmp_path: Path) -> None:
    files = LocalFiles()
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"1")
    b.write_bytes(b"22")
    before = files.group_stamp([str(a), str(b)])
    assert before[0] == 3 and before[3] == 2
    os.utime(b, ns=(1, 1))
    assert not np.array_equal(files.group_stamp([str(a), str(b)]), before)
    assert (files.group_stamp([str(a), str(tmp_path / "gone")]) == -2).all()
    assert files.group_identity([]) == "none"
    assert files.group_identity([str(a)]) == files.identity(str(a))
