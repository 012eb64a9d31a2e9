"""Loose image files of a manifest as objects on a local S3 server (moto), read through
``FileSource`` over objects (it was ``RemoteFileSource``): the source contract, equality
with the local files, an overwritten object, a missing one."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError, SampleError
from mmcache.loader import DataLoader
from mmcache.sources.base import OnError
from mmcache.sources.blobs import RawTier
from mmcache.sources.blobs.prefetch import RemotePrefetch
from mmcache.sources.files import FileSource
from mmcache.synth import make_dataset
from mmcache.testing.hostile import HostileInputContract
from mmcache.testing.source_contract import SourceContract
from mmcache.transforms.pipeline import Pipeline
from support.s3 import S3Endpoint, moto_s3


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with moto_s3() as endpoint:
        yield endpoint


def upload_manifest(s3: S3Endpoint, manifest: Path, prefix: str) -> Path:
    """Upload the manifest's images under ``prefix``; return a manifest of their URLs."""
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    for row in rows:
        key = f"{prefix}/{row['image_path']}"
        s3.client.upload_file(str(manifest.parent / row["image_path"]), "data", key)
        row["image_path"] = f"s3://data/{key}"
    out = manifest.parent / f"remote-{prefix.replace('/', '-')}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


class TestRemoteFileContract(SourceContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path, small_pipeline: Pipeline, s3: S3Endpoint) -> None:
        self.root, self.pipeline, self.s3 = tmp_path, small_pipeline, s3
        self.prefix = f"contract/{tmp_path.name}"

    def make_source(
        self, n: int, *, on_error: OnError = "raise", bad: int | None = None
    ) -> FileSource:
        manifest = make_dataset(self.root / f"d{n}", n, seed=2)
        if bad is not None:
            (manifest.parent / "images" / f"{bad:06d}.jpg").write_bytes(b"not a jpeg")
        remote = upload_manifest(self.s3, manifest, f"{self.prefix}/{n}")
        return FileSource(
            remote,
            pipeline=self.pipeline,
            on_error=on_error,
            storage_options=self.s3.storage_options(),
            retries=1,
            state_dir=self.root,
        )

    def change_input(self, source: Any, index: int) -> None:
        url = source.records.image_path(index)
        other = make_dataset(self.root / "other", index + 1, seed=99)
        key = url.removeprefix("s3://data/")
        self.s3.client.upload_file(str(other.parent / "images" / f"{index:06d}.jpg"), "data", key)
        assert source.revalidate() == [url]


def test_s3_files_equal_local_files(s3, small_pipeline, tmp_path):
    manifest = make_dataset(tmp_path / "data", 12, seed=4)
    remote = FileSource(
        upload_manifest(s3, manifest, "eq"),
        pipeline=small_pipeline,
        storage_options=s3.storage_options(),
        raw=RawTier(tmp_path / "raw", budget="32MiB"),
    )
    local = MultimodalDataset(manifest, pipeline=small_pipeline)
    hooks = [RemotePrefetch(remote, threads=4)]
    a = list(DataLoader(remote, cache=None, batch_size=5, seed=1, hooks=hooks))
    b = list(DataLoader(local, cache=None, batch_size=5, seed=1))
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"]
        for name in ("image", "input_ids", "attention_mask"):
            assert bool((x[name] == y[name]).all()), name
    assert hooks[0].fetched > 0


def test_open_source_reads_a_manifest_of_urls_with_its_storage_options(
    s3, small_pipeline, tmp_path
):
    # open_source refused storage_options= for a manifest ("not a manifest of local
    # files"): a manifest of URLs needed RemoteFileSource. Now it opens the one FileSource.
    from mmcache.dataset import open_source
    from mmcache.sources.capabilities import Revalidating

    manifest = make_dataset(tmp_path / "data", 3, seed=4)
    remote = upload_manifest(s3, manifest, "opened")
    ds = open_source(remote, pipeline=small_pipeline, storage_options=s3.storage_options())
    local = MultimodalDataset(manifest, pipeline=small_pipeline)
    assert isinstance(ds, Revalidating) and ds.stamp_kind.name == "FIXED"
    assert bool((ds.produce(2)["image"] == local.produce(2)["image"]).all())


def test_an_overwritten_image_is_fetched_again(s3, small_pipeline, tmp_path, cache_root):
    manifest = make_dataset(tmp_path / "data", 6, seed=4)
    remote_manifest = upload_manifest(s3, manifest, "ow")
    src = FileSource(
        remote_manifest,
        pipeline=small_pipeline,
        storage_options=s3.storage_options(),
        raw=RawTier(tmp_path / "raw", budget="32MiB"),
        state_dir=tmp_path,
    )
    cache = Cache(cache_root, memory="32MiB", disk="32MiB")
    try:
        loader = DataLoader(
            src, cache=cache, batch_size=3, shuffle=False, hooks=[RemotePrefetch(src)]
        )
        list(loader)
        list(loader)
        other = make_dataset(tmp_path / "other", 6, seed=8)
        s3.client.upload_file(
            str(other.parent / "images" / "000002.jpg"), "data", "ow/images/000002.jpg"
        )
        got = [row for b in loader for row in b["image"]]
        fresh = MultimodalDataset(other, pipeline=small_pipeline).produce(2)["image"]
        np.testing.assert_array_equal(got[2].numpy(), fresh)
        old = MultimodalDataset(manifest, pipeline=small_pipeline)
        np.testing.assert_array_equal(got[1].numpy(), old.produce(1)["image"])
    finally:
        cache.close()


def test_a_missing_object_under_raise_and_skip(s3, small_pipeline, tmp_path):
    manifest = make_dataset(tmp_path / "data", 6, seed=4)
    remote_manifest = upload_manifest(s3, manifest, "gone")
    s3.client.delete_object(Bucket="data", Key="gone/images/000004.jpg")
    url = "s3://data/gone/images/000004.jpg"
    kw: dict[str, Any] = {"pipeline": small_pipeline, "storage_options": s3.storage_options()}
    strict = FileSource(remote_manifest, **kw)
    with pytest.raises(SampleError, match="HTTP 404") as info:
        strict.produce(4)
    assert info.value.path == url and url in str(info.value)
    skip = FileSource(remote_manifest, on_error="skip", **kw)
    ids = [s for b in DataLoader(skip, cache=None, batch_size=4, shuffle=False) for s in b["id"]]
    assert ids == ["000000", "000001", "000002", "000003", "000005"]
    assert [(r.sample_id, r.path) for r in skip.rejects()] == [("000004", url)]


def test_a_manifest_of_local_paths_and_urls_is_refused(s3, small_pipeline, tmp_path):
    # RemoteFileSource refused local paths; the one FileSource reads either, not both.
    manifest = make_dataset(tmp_path / "data", 2, seed=4)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    rows[1]["image_path"] = "s3://data/elsewhere/1.jpg"
    mixed = tmp_path / "data" / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=r"names local files .* and URLs .*s3://data/elsewhere"):
        FileSource(mixed, pipeline=small_pipeline, storage_options=s3.storage_options())


class TestRemoteFileHostile(HostileInputContract):
    """An object over ``ImageSpec.max_bytes`` is refused from the size its listing gave,
    never fetched (issue 23 item 7)."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path, s3: S3Endpoint) -> None:
        self.root, self.s3 = tmp_path, s3

    def make_hostile_source(
        self, images: Sequence[bytes], *, pipeline: Any, on_error: OnError
    ) -> FileSource:
        rows = []
        for i, data in enumerate(images):
            key = f"hostile/{self.root.name}/{i}.img"
            self.s3.client.put_object(Bucket="data", Key=key, Body=data)
            rows.append({"id": f"s{i}", "image_path": f"s3://data/{key}", "caption": "c"})
        manifest = self.root / "remote.jsonl"
        manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return FileSource(
            manifest,
            pipeline=pipeline,
            on_error=on_error,
            storage_options=self.s3.storage_options(),
            retries=1,
            state_dir=self.root,
        )
