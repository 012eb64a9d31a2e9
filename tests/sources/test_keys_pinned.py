"""The keys of fixed inputs are pinned: moving a source onto the chassis
(:class:`~mmcache.sources.chassis.BaseSource`) must not change one key, since a changed
key makes every cache built before cold (and, across versions on one cluster, refused).

The inputs are built here byte for byte (random-but-seeded BMPs, fixed mtimes, a pipeline
whose fingerprint is a constant), so a key is a function of the code alone. The pinned
values were computed with the code before the chassis carried these sources.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmcache.sources.files import FileSource
from mmcache.sources.parquet import ParquetSource
from mmcache.sources.wds import WebDatasetSource
from mmcache.testing.identity_contract import noise_bmp
from mmcache.transforms.pipeline import Pipeline
from support.s3 import S3Endpoint, moto_s3

MTIME_NS = 1_600_000_000_000_000_000
_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


class PinnedPipeline(Pipeline):
    """The small pipeline with a constant fingerprint: keys depend on the code only."""

    def fingerprint(self) -> str:
        return "pinned-fingerprint"


@pytest.fixture
def pipeline(tokenizer_json: Path) -> Pipeline:
    from mmcache.transforms import ImageSpec, TextSpec

    return PinnedPipeline(image=ImageSpec(size=32), text=TextSpec(tokenizer_json, max_length=8))


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with moto_s3() as endpoint:
        yield endpoint


def _bmp8(seed: int) -> bytes:
    return noise_bmp(seed, 8)


def _fixed(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, ns=(MTIME_NS, MTIME_NS))
    return path


def _manifest(root: Path) -> Path:
    """Two images, a missing image, then one image named twice."""
    rows = [
        {"id": "a", "image_path": "img/a.bmp", "caption": "a red cat"},
        {"id": "b", "image_path": "img/b.bmp", "caption": "a blue dog"},
        {"id": "m", "image_path": "img/missing.bmp", "caption": "gone"},
        {"id": "a2", "image_path": "img/a.bmp", "caption": "a red cat"},
    ]
    _fixed(root / "img" / "a.bmp", _bmp8(1))
    _fixed(root / "img" / "b.bmp", _bmp8(2))
    return _fixed(root / "m.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())


def _shards(root: Path) -> list[Path]:
    out = []
    for s in range(2):
        path = root / f"shard-{s}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(3):
                for name, data in (
                    (f"{s}{i:05d}.bmp", _bmp8(10 * s + i)),
                    (f"{s}{i:05d}.txt", b"x"),
                ):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime = len(data), 1_600_000_000
                    tar.addfile(info, io.BytesIO(data))
        os.utime(path, ns=(MTIME_NS, MTIME_NS))
        out.append(path)
    return out


def _parquet(root: Path) -> Path:
    """Embedded bytes in rows 0-1, a path cell in row 2."""
    _fixed(root / "img" / "p.bmp", _bmp8(7))
    cells = [{"bytes": _bmp8(5), "path": None}, {"bytes": _bmp8(6), "path": None}]
    cells.append({"bytes": None, "path": "img/p.bmp"})
    table = pa.table(
        {
            "id": pa.array(["r0", "r1", "r2"]),
            "image": pa.array(cells, type=_STRUCT),
            "text": pa.array(["one", "two", "three"]),
        }
    )
    out = root / "t.parquet"
    pq.write_table(table, out, compression="none")
    os.utime(out, ns=(MTIME_NS, MTIME_NS))
    return out


def _hex(source: object) -> list[str]:
    n = len(source)  # type: ignore[arg-type]
    rows = source.key_rows(np.arange(n))  # type: ignore[attr-defined]
    one = [source.key(i).hex() for i in range(n)]  # type: ignore[attr-defined]
    assert [bytes(r).hex() for r in rows] == one  # key() and key_rows() agree
    return one


PINNED: dict[str, list[str]] = {
    "files": [
        "ebdd93ada756fc1187370914c2f7413a",
        "9351eb64a28d88b471d033a38b93ce00",
        "ab05383aaf292fc8ea8e561ee80a883b",
        "27cede0c67b923e6ad9a44ccb6719195",
    ],
    "shards": [
        "aadd2869477cc7a161dd3b3185f3337d",
        "5b1ad695c7cf3cd499328c7236288b60",
        "e1249e082d37f99b06a823c784bab9e8",
        "7b3f74ce929f956ca14af98989e738d1",
        "5db2b178c5a7090bc1b0917f0cd7ed2c",
        "9f40fb7b727f0b5df73b88dbfd041819",
    ],
    "parquet": [
        "613c9eb80b9faac8cc0537b58695f6dc",
        "c5693916cc4e362271a24dd86733ee47",
        "4026bd76da381e1b9c587702c4049f2a",
    ],
    # Moved on purpose in session 9 (issue 24, the remote identity contract): the keys of
    # S3 objects held the object's URL, so the same objects copied under another bucket or
    # prefix (the remote ``cp -a``) had other keys. They now hold the identity of the
    # bytes, the S3 ETag (computed from them), and not where they are
    # (``remote.fs.byte_identity``). Main's values were adeb3aff..., 07c92a74..., 3edeebfb....
    "remote": [
        "d3d0a0ca3607c969b5b14d9564680128",
        "e70ecabe29de7bbbaf4c50ccf4d95310",
        "580df27109f3635b27ad9e1d5ca35652",
    ],
    # Moved on purpose in session 14 (issue 38, one door to object stores): a remote
    # Parquet row's key held its file's stamp with the URL in it, so the same file under
    # another bucket or prefix had other keys, where a remote image's key holds the
    # object's identity. It now holds the file's identity as remote images do
    # (``blobs.objects.object_identity``: the S3 ETag, computed from the bytes).
    "remote-parquet": [
        "8b42bd299ac181a36d0c07a34b973471",
        "d751d1383c3d1d2791926a275ee1d1d4",
        "a11dc2d61224a062877ad39ba8ef3ced",
    ],
}


def test_loose_file_keys_are_unchanged(tmp_path: Path, pipeline: Pipeline) -> None:
    manifest = _manifest(tmp_path)
    got = _hex(FileSource(manifest, pipeline=pipeline))
    assert got == PINNED["files"]
    assert _hex(FileSource(manifest, pipeline=pipeline, content_stamp=True)) == got


def test_shard_keys_are_unchanged(tmp_path: Path, pipeline: Pipeline) -> None:
    source = WebDatasetSource(
        [str(p) for p in _shards(tmp_path)],
        pipeline=pipeline,
        image_exts=("bmp",),
        index_dir=tmp_path / "index",
    )
    assert _hex(source) == PINNED["shards"]


def test_parquet_keys_are_unchanged(tmp_path: Path, pipeline: Pipeline) -> None:
    source = ParquetSource(
        _parquet(tmp_path),
        pipeline=pipeline,
        columns={"id": "id", "image": "image", "text": "text"},
    )
    assert _hex(source) == PINNED["parquet"]


@pytest.mark.parametrize("prefix", ["pinned", "elsewhere/copy"])
def test_remote_object_keys_are_unchanged(
    tmp_path: Path, pipeline: Pipeline, s3: S3Endpoint, prefix: str
) -> None:
    """The same objects under another prefix have the same pinned keys."""
    rows = []
    for i in range(3):
        s3.client.put_object(Bucket="data", Key=f"{prefix}/{i}.bmp", Body=_bmp8(20 + i))
        url = f"s3://data/{prefix}/{i}.bmp"
        rows.append({"id": f"o{i}", "image_path": url, "caption": "c"})
    manifest = tmp_path / "remote.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = FileSource(
        manifest, pipeline=pipeline, storage_options=s3.storage_options(), state_dir=tmp_path
    )
    assert _hex(source) == PINNED["remote"]


@pytest.mark.parametrize("prefix", ["pinned", "elsewhere/copy"])
def test_remote_parquet_keys_hold_the_file_identity(
    tmp_path: Path, pipeline: Pipeline, s3: S3Endpoint, prefix: str
) -> None:
    """The same Parquet file under another prefix has the same pinned row keys."""
    body = _parquet(tmp_path).read_bytes()
    s3.client.put_object(Bucket="data", Key=f"{prefix}/t.parquet", Body=body)
    source = ParquetSource(
        f"s3://data/{prefix}/t.parquet",
        pipeline=pipeline,
        columns={"id": "id", "image": "image", "text": "text"},
        storage_options=s3.storage_options(),
    )
    assert _hex(source) == PINNED["remote-parquet"]
