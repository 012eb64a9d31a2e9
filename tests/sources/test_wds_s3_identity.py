"""Remote WebDataset shards pass the identity contract (issue 24): shards on the local
moto S3 server read through ``s3://``, and on an HTTP server that gives no ETag, each with a
raw-bytes tier.

A remote shard's identity is its ETag (S3's MD5 of the bytes for a single-part upload) or,
where the server gives none, the digest of its bytes (G6); never its URL: shards with the
same names, member sizes and mtimes but other pixels share no entry, a same-size rewrite is
fresh, a copy of the shard under another bucket or folder has the same keys, and a flipped
byte of the raw-bytes tier is never served.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest
import test_remote_identity as remote_identity  # its S3 fixture, multipart upload (same folder)

from mmcache.sources.blobs import RawTier
from mmcache.sources.wds import WebDatasetSource
from mmcache.testing.identity_contract import IdentityContract, flip_raw_spans, noise_bmp
from mmcache.transforms.pipeline import Pipeline
from support.s3 import S3Endpoint

N = 8
MTIME_NS = 1_600_000_000_000_000_000
SHARD = "00000.tar"
# The moto server with a second bucket for the remote ``cp -a`` copies (module-scoped),
# as FileSource's identity test has it.
COPIES = remote_identity.COPIES
s3 = remote_identity.s3


def _shard(seeds: list[int]) -> bytes:
    """One shard of samples ``000000..`` (BMP members, captions "a cat"), member mtimes
    fixed: every seed list gives the same member names and sizes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, seed in enumerate(seeds):
            for name, data in ((f"{i:06d}.bmp", noise_bmp(seed)), (f"{i:06d}.txt", b"a cat")):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1_600_000_000
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _listing(folder: Path, url: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "shards.txt"
    out.write_text(url + "\n")
    return out


class RemoteWebDatasetIdentity(IdentityContract):
    """A dataset is one shard under a prefix of its own (from the test's folder) and a
    local file naming its URL; each source keeps its raw-bytes tier and member index."""

    pipeline: Pipeline
    storage_options: dict[str, Any] | None = None

    def put(self, key: str, body: bytes) -> str:
        """Store ``body`` as ``key``; its URL."""
        raise NotImplementedError

    def copy(self, key: str, to: str) -> str:
        """Copy object ``key`` to ``to`` (elsewhere: another bucket or folder); its URL."""
        raise NotImplementedError

    prefix = staticmethod(remote_identity.RemoteIdentity.prefix)  # unique per test, dataset

    def write_dataset(self, folder: Path, variant: int) -> Path:
        body = _shard([variant * 100 + i for i in range(N)])
        return _listing(folder, self.put(f"{self.prefix(folder)}/{SHARD}", body))

    def copy_dataset(self, folder: Path, copy: Path, location: Path) -> Path:
        key, to = f"{self.prefix(folder)}/{SHARD}", f"{self.prefix(copy)}/{SHARD}"
        return _listing(copy, self.copy(key, to))

    def open_source(self, location: Path) -> WebDatasetSource:
        self.opened = getattr(self, "opened", 0) + 1
        return WebDatasetSource(
            location.read_text().split(),
            pipeline=self.pipeline,
            image_exts=("bmp",),
            storage_options=self.storage_options,
            raw=RawTier(location.parent / f"raw-{self.opened}", budget="8MiB"),
            retries=1,
            index_dir=location.parent / f"idx-{self.opened}",
        )

    def flip_source_tiers(self, source: Any) -> int:
        spans = [source.remote_span(i) for i in range(len(source))]
        assert None not in spans, "a sample has no remote span"
        return flip_raw_spans(source.raw, spans)


class TestS3WebDatasetIdentity(RemoteWebDatasetIdentity):
    """Single-part uploads: the ETag is the MD5 of the shard's bytes."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, small_pipeline: Pipeline, s3: S3Endpoint) -> None:
        self.pipeline, self.s3 = small_pipeline, s3
        self.storage_options = s3.storage_options()

    def put(self, key: str, body: bytes) -> str:
        self.s3.client.put_object(Bucket="data", Key=key, Body=body)
        return f"s3://data/{key}"

    def copy(self, key: str, to: str) -> str:
        source = {"Bucket": "data", "Key": key}
        self.s3.client.copy_object(Bucket=COPIES, Key=to, CopySource=source)
        return f"s3://{COPIES}/{to}"


class TestNoEtagWebDatasetIdentity(RemoteWebDatasetIdentity):
    """A server without ETag (Last-Modified only): a shard is stamped by the digest of
    its bytes; a rewrite restores the file's size and mtime, so Last-Modified too."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, small_pipeline: Pipeline, served: tuple[Path, str]) -> None:
        self.pipeline = small_pipeline
        self.www, self.base = served

    def put(self, key: str, body: bytes) -> str:
        path = self.www / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        os.utime(path, ns=(MTIME_NS, MTIME_NS))
        return f"{self.base}/{key}"

    def copy(self, key: str, to: str) -> str:
        (self.www / to).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.www / key, self.www / to)
        return f"{self.base}/{to}"


class TestS3MultipartWebDatasetIdentity(TestS3WebDatasetIdentity):
    """Multipart uploads (two parts): the ETag is the MD5 of the parts' MD5s, ``-2``."""

    # As for FileSource's multipart objects: why a copy gets other keys, and the
    # small parts (moto's minimum lowered) that make a shard of a few KiB two parts.
    copy_skip_reason = remote_identity.TestS3MultipartIdentity.copy_skip_reason
    _small_parts = remote_identity.TestS3MultipartIdentity._small_parts

    def put(self, key: str, body: bytes) -> str:
        prefix, name = key.rsplit("/", 1)  # the same two-part upload as FileSource's
        remote_identity.TestS3MultipartIdentity.put(self, prefix, name, body)  # type: ignore[arg-type]
        return f"s3://data/{key}"
