"""WebDataset shards on a local Google Cloud Storage server (gcp-storage-emulator on
127.0.0.1), read through ``gs://`` with gcsfs: the same batches as the local shards,
a warm epoch with the server stopped, and an overwritten object never served stale."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.cache import Cache
from mmcache.loader import DataLoader
from mmcache.sources.blobs import RawTier
from mmcache.sources.blobs.prefetch import RemotePrefetch
from mmcache.sources.wds import WebDatasetSource, write_shards
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline
from support.gcs import GcsEndpoint, gcs_emulator  # before gcsfs: see its docstring

pytest.importorskip("gcsfs", reason="needs pip install 'mmcache[gcs,gcs-server]'")
pytest.importorskip("gcp_storage_emulator", reason="needs pip install 'mmcache[gcs-server]'")

N, PER_SHARD = 16, 8


@pytest.fixture
def gcs() -> Iterator[GcsEndpoint]:
    with gcs_emulator() as endpoint:
        yield endpoint


@pytest.fixture
def local_shards(tmp_path: Path) -> list[Path]:
    manifest = make_dataset(tmp_path / "data", N, seed=7)
    return write_shards(manifest, tmp_path / "shards", per_shard=PER_SHARD)


def source(urls: Any, pipe: Pipeline, gcs: GcsEndpoint, tmp: Path, **kw: Any) -> WebDatasetSource:
    kw.setdefault("retries", 0)  # gcsfs retries each request 6 times (~31 s) on its own
    return WebDatasetSource(
        urls, pipeline=pipe, storage_options=gcs.storage_options(), index_dir=tmp / "idx", **kw
    )


def assert_same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"]
        for name in ("image", "input_ids", "attention_mask"):
            assert bool((x[name] == y[name]).all()), name


def test_gcs_batches_equal_local_and_survive_an_outage(
    gcs, local_shards, small_pipeline, tmp_path, cache_root
):
    urls = [gcs.upload(p, f"wds/{p.name}") for p in local_shards]
    local = WebDatasetSource(local_shards, pipeline=small_pipeline, index_dir=False)
    raw = RawTier(tmp_path / "raw", budget="64MiB")
    remote = source(urls, small_pipeline, gcs, tmp_path, raw=raw)
    assert remote.ids(range(N)) == local.ids(range(N))
    expected = list(DataLoader(local, cache=None, batch_size=4, shuffle=True, seed=3))
    cache = Cache(cache_root, memory="64MiB")
    loader = DataLoader(
        remote, cache=cache, batch_size=4, shuffle=True, seed=3, hooks=[RemotePrefetch(remote)]
    )
    assert_same(list(loader), expected)
    gcs.stop()  # the store goes away: what is cached is still served, identically
    loader.set_epoch(0)
    assert_same(list(loader), expected)


def test_an_overwritten_gcs_object_is_fetched_again(gcs, local_shards, small_pipeline, tmp_path):
    urls = [gcs.upload(p, f"wds/{p.name}") for p in local_shards]
    raw = RawTier(tmp_path / "raw", budget="64MiB")
    src = source(urls, small_pipeline, gcs, tmp_path, raw=raw)
    loader = DataLoader(src, cache=None, batch_size=4, shuffle=False, hooks=[RemotePrefetch(src)])
    list(loader)  # the raw tier now holds every member's bytes
    other = make_dataset(tmp_path / "other", N, seed=13)
    new = write_shards(other, tmp_path / "new", per_shard=PER_SHARD)
    gcs.upload(new[0], "wds/00000.tar")  # a new generation under the same name
    got = list(loader)  # the hook revalidates before the epoch
    fresh = WebDatasetSource(new[0], pipeline=small_pipeline, index_dir=False)
    for j in range(PER_SHARD):
        np.testing.assert_array_equal(got[j // 4]["image"][j % 4], fresh.produce(j)["image"])
    old = WebDatasetSource(local_shards[0], pipeline=small_pipeline, index_dir=False)
    assert not (got[0]["image"][0] == old.produce(0)["image"]).all()
