"""``FileSource`` passes the identity contract (issue 24): on the local moto S3
server, with multipart uploads, and on an HTTP server that gives no ETag.

The identity of an object's bytes is its S3 ETag (S3 computes it from the bytes) or, where
the server gives no ETag, the digest of the fetched bytes; the key holds that identity and
not the object's URL (:func:`mmcache.sources.blobs.objects.byte_identity`). So objects with
the same relative names and sizes but other bytes share no entry, a same-size rewrite is
fresh, a copy of the objects under another bucket or prefix has the same keys, and a
flipped byte of the raw-bytes tier is never served.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.sources.blobs import RawTier
from mmcache.sources.blobs.objects import byte_identity
from mmcache.sources.files import FileSource
from mmcache.testing.identity_contract import IdentityContract, noise_bmp
from mmcache.testing.store_contract import flip_in_files
from mmcache.transforms.pipeline import Pipeline
from support.s3 import S3Endpoint, moto_s3

N = 6
COPIES = "copies"  # the second bucket the remote ``cp -a`` copies into


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with moto_s3() as endpoint:
        endpoint.client.create_bucket(Bucket=COPIES)
        yield endpoint


def _names() -> list[str]:
    return [f"images/{i:04d}.bmp" for i in range(N)]


def _write_manifest(folder: Path, urls: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"{i:04d}", "image_path": u, "caption": "a cat"} for i, u in enumerate(urls)]
    out = folder / "remote.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


class RemoteIdentity(IdentityContract):
    """The contract over objects: a dataset is ``N`` objects under a prefix of its own
    (from the test's folder) and a local manifest of their URLs; each source keeps its
    raw-bytes tier, whose values :meth:`flip_source_tiers` damages."""

    def put(self, prefix: str, name: str, data: bytes) -> None:
        raise NotImplementedError

    def url(self, prefix: str, name: str, *, copy: bool = False) -> str:
        raise NotImplementedError

    def copy_object(self, prefix: str, name: str, to: str) -> None:
        raise NotImplementedError

    def storage_options(self) -> dict[str, Any] | None:
        return None

    @staticmethod
    def prefix(folder: Path) -> str:
        return f"{folder.parent.parent.name}/{folder.name}"  # unique per test and dataset

    def write_dataset(self, folder: Path, variant: int) -> Path:
        prefix = self.prefix(folder)
        for i, name in enumerate(_names()):
            self.put(prefix, name, noise_bmp(variant * 100 + i))
        return _write_manifest(folder, [self.url(prefix, n) for n in _names()])

    def copy_dataset(self, folder: Path, copy: Path, location: Path) -> Path:
        for name in _names():
            self.copy_object(self.prefix(folder), name, self.prefix(copy))
        return _write_manifest(copy, [self.url(self.prefix(copy), n, copy=True) for n in _names()])

    def open_source(self, location: Path) -> FileSource:
        self.opened = getattr(self, "opened", 0) + 1
        raw = RawTier(location.parent / f"raw-{self.opened}", budget="8MiB")
        return FileSource(
            location,
            pipeline=self.pipeline,
            storage_options=self.storage_options(),
            raw=raw,
            retries=1,
            state_dir=location.parent / f"state-{self.opened}",
        )

    def flip_source_tiers(self, source: Any) -> int:
        raw, objects = source.raw, source.blobs  # the objects' stamps are the blobs'
        flipped = 0
        for u, url in enumerate(objects.urls):
            size = int(objects.object_sizes[u])
            held = raw.get(url, objects.object_stamps[u], 0, size)
            assert held is not None, f"{url} is not in the raw tier"
            flip_in_files([str(Path(raw.path) / "data.mdb")], held[size // 2 - 32 : size // 2 + 32])
            assert raw.get(url, objects.object_stamps[u], 0, size) is None  # checked on read
            flipped += 1
        return flipped


class TestS3Identity(RemoteIdentity):
    """Single-part uploads: the ETag is the MD5 of the bytes."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, small_pipeline: Pipeline, s3: S3Endpoint) -> None:
        self.pipeline, self.s3 = small_pipeline, s3

    def storage_options(self) -> dict[str, Any]:
        return self.s3.storage_options()

    def put(self, prefix: str, name: str, data: bytes) -> None:
        self.s3.client.put_object(Bucket="data", Key=f"{prefix}/{name}", Body=data)

    def url(self, prefix: str, name: str, *, copy: bool = False) -> str:
        return f"s3://{COPIES if copy else 'data'}/{prefix}/{name}"

    def copy_object(self, prefix: str, name: str, to: str) -> None:
        source = {"Bucket": "data", "Key": f"{prefix}/{name}"}
        self.s3.client.copy_object(Bucket=COPIES, Key=f"{to}/{name}", CopySource=source)


class TestS3MultipartIdentity(TestS3Identity):
    """Multipart uploads (two parts): the ETag is the MD5 of the parts' MD5s, ``-2``."""

    copy_skip_reason = (
        "a multipart ETag depends on the part sizes, and S3 computes a copy's ETag anew "
        "(CopyObject: the MD5 of the whole object): equal bytes get other keys, a miss, "
        "never wrong data"
    )

    @pytest.fixture(autouse=True)
    def _small_parts(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr("moto.s3.models.S3_UPLOAD_PART_MIN_SIZE", 256)  # S3's is 5 MiB

    def put(self, prefix: str, name: str, data: bytes) -> None:
        client, key = self.s3.client, f"{prefix}/{name}"
        upload = client.create_multipart_upload(Bucket="data", Key=key)["UploadId"]
        parts = []
        for number, part in enumerate((data[:2048], data[2048:]), start=1):
            got = client.upload_part(
                Bucket="data", Key=key, UploadId=upload, PartNumber=number, Body=part
            )
            parts.append({"ETag": got["ETag"], "PartNumber": number})
        client.complete_multipart_upload(
            Bucket="data", Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
        )
        etag = client.head_object(Bucket="data", Key=key)["ETag"].strip('"')
        assert etag.endswith("-2"), etag


class TestNoEtagIdentity(RemoteIdentity):
    """A server without ETag: each object is stamped by the digest of its bytes."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, small_pipeline: Pipeline, served: tuple[Path, str]) -> None:
        self.pipeline = small_pipeline
        self.www, self.base = served

    def put(self, prefix: str, name: str, data: bytes) -> None:
        path = self.www / prefix / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def url(self, prefix: str, name: str, *, copy: bool = False) -> str:
        return f"{self.base}/{prefix}/{name}"

    def copy_object(self, prefix: str, name: str, to: str) -> None:
        (self.www / to / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.www / prefix / name, self.www / to / name)


def test_a_server_without_etag_warns_once_naming_an_object(
    served: tuple[Path, str], tmp_path: Path, small_pipeline: Pipeline, caplog: Any
) -> None:
    www, base = served
    (www / "images").mkdir()
    for i, name in enumerate(_names()):
        (www / name).write_bytes(noise_bmp(i))
    manifest = _write_manifest(tmp_path / "m", [f"{base}/{n}" for n in _names()])
    with caplog.at_level(logging.WARNING):
        source = FileSource(manifest, pipeline=small_pipeline, state_dir=tmp_path)
        source.key_rows(np.arange(N))
        source.revalidate()
    warned = [r.getMessage() for r in caplog.records if "has no ETag" in r.getMessage()]
    assert len(warned) == 1 and f"{base}/images/0000.bmp" in warned[0]


@pytest.mark.parametrize(
    ("url", "stamp", "identity"),
    [
        ("s3://b/k", "ETag=" + "0123456789abcdef" * 2, "s3-etag:" + "0123456789abcdef" * 2),
        (
            "s3://b/k",
            "ETag=" + "0123456789abcdef" * 2 + "-12",
            "s3-etag:" + "0123456789abcdef" * 2 + "-12",
        ),
        ("https://h/k", "xxh3:" + "ab" * 16, "xxh3:" + "ab" * 16),
        # An HTTP ETag may come from inode, size and mtime (nginx: "5f3e1a2b-1f4"), even
        # when it looks like an MD5: it names a version of this object only.
        ("https://h/k", "etag=" + "0123456789abcdef" * 2, None),
        ("https://h/k", "etag=5f3e1a2b-1f4", None),
        ("gs://b/k", "etag=CKih16GjycICEAE=", None),
        ("s3://b/k", "VersionId=3HL4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY", None),
        ("s3://b/k", None, None),
    ],
)
def test_which_stamps_are_an_identity_of_the_bytes(
    url: str, stamp: str | None, identity: str | None
) -> None:
    assert byte_identity(url, stamp) == identity
