"""WebDataset shards on a real (local) S3 server: moto's ThreadedMotoServer on 127.0.0.1,
read through ``s3://`` and fsspec with a raw-bytes tier, revalidation and prefetch."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache.cache import Cache
from mmcache.errors import ConfigError, ManifestError, SampleError
from mmcache.loader import DataLoader
from mmcache.sources.blobs import RawTier, Remote, RemoteError
from mmcache.sources.blobs.prefetch import RemotePrefetch
from mmcache.sources.wds import WebDatasetSource, write_shards
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline
from support.s3 import DelayProxy, S3Endpoint, moto_s3

N, PER_SHARD = 24, 8


@pytest.fixture
def s3() -> Iterator[S3Endpoint]:
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def local_shards(tmp_path: Path) -> list[Path]:
    manifest = make_dataset(tmp_path / "data", N, seed=5)
    return write_shards(manifest, tmp_path / "shards", per_shard=PER_SHARD)


def upload(s3: S3Endpoint, shards: list[Path], prefix: str = "wds") -> list[str]:
    for path in shards:
        s3.client.upload_file(str(path), "data", f"{prefix}/{path.name}")
    return [f"s3://data/{prefix}/{p.name}" for p in shards]


def batches(src: WebDatasetSource, cache: Cache | None = None, **kw: Any) -> list[dict[str, Any]]:
    loader = DataLoader(src, cache=cache, batch_size=5, shuffle=True, seed=2, **kw)
    return list(loader)


def assert_same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"]
        for name in ("image", "input_ids", "attention_mask"):
            assert bool((x[name] == y[name]).all()), name


def source(urls: Any, pipe: Pipeline, s3: S3Endpoint, tmp: Path, **kw: Any) -> WebDatasetSource:
    kw.setdefault("retries", 1)
    return WebDatasetSource(
        urls, pipeline=pipe, storage_options=s3.storage_options(), index_dir=tmp / "idx", **kw
    )


def test_s3_batches_equal_local(s3, local_shards, small_pipeline, tmp_path):
    urls = upload(s3, local_shards)
    remote = source(urls, small_pipeline, s3, tmp_path)
    local = WebDatasetSource(local_shards, pipeline=small_pipeline, index_dir=False)
    assert remote.ids(range(N)) == local.ids(range(N))
    np.testing.assert_array_equal(remote.image_sizes(range(N)), local.image_sizes(range(N)))
    assert_same(batches(remote), batches(local))
    # a brace pattern of URLs names the same shards
    pattern = "s3://data/wds/{00000..00002}.tar"
    assert source(pattern, small_pipeline, s3, tmp_path).locations == urls


def test_the_raw_tier_serves_a_warm_epoch_with_the_server_stopped(
    s3, local_shards, small_pipeline, tmp_path, caplog
):
    urls = upload(s3, local_shards)
    raw = RawTier(tmp_path / "raw", budget="64MiB")
    src = source(urls, small_pipeline, s3, tmp_path, raw=raw, on_error="skip")
    hook = RemotePrefetch(src, threads=4)
    loader = DataLoader(src, cache=None, batch_size=5, shuffle=True, seed=2, hooks=[hook])
    first = list(loader)
    assert raw.nbytes() > 0
    # one sample's bytes leave the raw tier: it is the one miss of the next epoch
    url, stamp, start, end = src.remote_span(3) or ("", "", 0, 0)
    assert raw.store.delete(raw.key(url, stamp, start, end))
    s3.stop()
    loader.set_epoch(0)  # the same order again
    with caplog.at_level(logging.WARNING):
        second = list(loader)
    warnings = [r for r in caplog.records if "cannot revalidate" in r.getMessage()]
    assert len(warnings) == 1  # one per epoch, not one per object
    missing = src.sample_id(3)
    assert_same([_without(b, missing) for b in first], second)
    (rej,) = [r for r in src.rejects() if r.sample_id == missing]
    assert rej.path == url and url in rej.reason
    with pytest.raises(SampleError, match="cannot fetch s3://data/wds/") as info:
        src.produce(3)
    assert info.value.path == url


def _without(batch: dict[str, Any], sample_id: str) -> dict[str, Any]:
    keep = [i for i, s in enumerate(batch["id"]) if s != sample_id]
    return {
        k: v[keep] if isinstance(v, torch.Tensor) else [v[i] for i in keep]
        for k, v in batch.items()
    }


def test_an_overwritten_object_is_fetched_again(
    s3, local_shards, small_pipeline, tmp_path, cache_root
):
    urls = upload(s3, local_shards)
    raw = RawTier(tmp_path / "raw", budget="64MiB")
    src = source(urls, small_pipeline, s3, tmp_path, raw=raw)
    cache = Cache(cache_root, memory="64MiB", disk="64MiB")
    try:
        loader = DataLoader(
            src, cache=cache, batch_size=5, shuffle=False, hooks=[RemotePrefetch(src)]
        )
        list(loader)
        list(loader)  # warm: served by the cache
        keys_before = src.key_rows(range(N)).copy()
        # shard 0 replaced on the server by other images under the same keys
        other = make_dataset(tmp_path / "other", N, seed=11)
        new = write_shards(other, tmp_path / "new", per_shard=PER_SHARD)
        s3.client.upload_file(str(new[0]), "data", "wds/00000.tar")
        got = list(loader)  # the hook revalidates before the epoch
        keys_after = src.key_rows(range(N))
        assert not (keys_after[:PER_SHARD] == keys_before[:PER_SHARD]).all(axis=1).any()
        np.testing.assert_array_equal(keys_after[PER_SHARD:], keys_before[PER_SHARD:])
        fresh = WebDatasetSource(new[0], pipeline=small_pipeline, index_dir=False)
        for j in range(PER_SHARD):
            np.testing.assert_array_equal(got[j // 5]["image"][j % 5], fresh.produce(j)["image"])
    finally:
        cache.close()


def test_a_404_under_raise_and_skip(s3, local_shards, small_pipeline, tmp_path):
    urls = upload(s3, local_shards)
    with pytest.raises(ManifestError, match=r"s3://data/wds/nope\.tar") as info:
        source([*urls, "s3://data/wds/nope.tar"], small_pipeline, s3, tmp_path)
    assert "404" in str(info.value)
    strict = source(urls, small_pipeline, s3, tmp_path)
    skip = source(urls, small_pipeline, s3, tmp_path, on_error="skip")
    s3.client.delete_object(Bucket="data", Key="wds/00001.tar")
    with pytest.raises(SampleError, match=r"HTTP 404") as err:
        strict.produce(PER_SHARD)
    assert err.value.path == urls[1] and urls[1] in str(err.value)
    got = [sid for b in batches(skip) for sid in b["id"]]
    assert sorted(got) == sorted(skip.ids([*range(PER_SHARD), *range(2 * PER_SHARD, N)]))
    rejected = {r.sample_id for r in skip.rejects()}
    assert rejected == set(skip.ids(range(PER_SHARD, 2 * PER_SHARD)))


def test_prefetch_hides_latency(s3, local_shards, small_pipeline, tmp_path):
    urls = upload(s3, local_shards)
    port = int(s3.url.rsplit(":", 1)[1])
    with DelayProxy("127.0.0.1", port, delay=0.1) as proxy:
        options = s3.storage_options(proxy.url)

        def cold(name: str, prefetch: bool) -> float:
            raw = RawTier(tmp_path / name, budget="64MiB")
            src = WebDatasetSource(
                urls,
                pipeline=small_pipeline,
                storage_options=options,
                index_dir=tmp_path / "idx",
                raw=raw,
            )
            hooks = [RemotePrefetch(src, threads=16)] if prefetch else []
            loader = DataLoader(src, cache=None, batch_size=4, shuffle=True, hooks=hooks)
            t0 = time.perf_counter()
            n = sum(len(b["id"]) for b in loader)
            elapsed = time.perf_counter() - t0
            assert n == N
            if prefetch:
                assert hooks[0].fetched > N // 2  # the prefetcher did the fetching
            return elapsed

        cold("warmup", False)  # the indexes and the connections
        # N round trips of >= 100 ms one after another against 16 at a time (the in-process
        # moto server's own time per request is the same in both). Up to three pairs, each
        # side by side: on a loaded machine moto's own CPU time can fill one pair's gap (the
        # whole suite once measured 0.56); the bound is the same for every pair.
        pairs = []
        for attempt in range(3):
            sequential = cold(f"seq{attempt}", False)
            ahead = cold(f"ahead{attempt}", True)
            assert sequential >= N * 0.1
            pairs.append((ahead, sequential))
            if ahead < 0.5 * sequential:
                break
    assert any(ahead < 0.5 * sequential for ahead, sequential in pairs), pairs


def test_retries_transient_errors_but_not_permanent_ones():
    slept: list[float] = []
    remote = Remote({}, retries=3, backoff=0.1, sleep=slept.append)
    calls = {"n": 0}

    class Throttled(OSError):
        status = 503

    def flaky() -> bytes:
        calls["n"] += 1
        if calls["n"] < 3:
            raise Throttled("SlowDown")
        return b"ok"

    assert remote.call("s3://b/k", flaky) == b"ok" and slept == [0.1, 0.2]

    def denied() -> bytes:
        calls["n"] += 1
        raise PermissionError("Access Denied")

    calls["n"] = 0
    with pytest.raises(RemoteError) as info:
        remote.call("s3://b/k", denied)
    assert calls["n"] == 1 and info.value.status == 403 and info.value.permanent

    class ConnectTimeoutError(TimeoutError):  # botocore's name for it
        pass

    def down() -> bytes:
        calls["n"] += 1
        raise ConnectTimeoutError("connect timed out")

    calls["n"] = 0
    with pytest.raises(RemoteError) as info:
        remote.call("s3://b/k", down)
    # three tries in a row that cannot connect open the circuit breaker: no 4th try (a
    # read timeout of one object is that object's: test_remote_policy.py, H6)
    assert calls["n"] == 3 and not info.value.permanent and info.value.status is None
    assert info.value.kind == "timeout" and remote.unreachable
    with pytest.raises(RemoteError) as info:
        remote.call("s3://b/k", down)
    assert calls["n"] == 3 and info.value.kind == "circuit-open"


def test_prefetch_needs_a_raw_tier(s3, local_shards, small_pipeline, tmp_path):
    src = source(upload(s3, local_shards), small_pipeline, s3, tmp_path)
    with pytest.raises(ConfigError, match="raw tier"):
        RemotePrefetch(src)


def test_the_raw_tier_keeps_its_budget_and_keys_by_version(tmp_path):
    raw = RawTier(tmp_path / "raw", budget="256KiB")
    blob = bytes(range(256)) * 256  # 64 KiB
    for i in range(10):
        assert raw.put(f"s3://b/{i}.tar", "ETag=a", 0, len(blob), blob)
    assert raw.nbytes() <= 256 * 1024
    assert raw.get("s3://b/9.tar", "ETag=a", 0, len(blob)) == blob  # the newest stay (lru)
    assert raw.get("s3://b/0.tar", "ETag=a", 0, len(blob)) is None
    # another version, or another range, of the same object is another entry
    assert raw.get("s3://b/9.tar", "ETag=b", 0, len(blob)) is None
    assert raw.get("s3://b/9.tar", "ETag=a", 1, len(blob)) is None
    raw.close()


def test_a_miss_waits_for_a_running_prefetcher_instead_of_fetching_twice(tmp_path):
    import threading

    from mmcache.sources.blobs.raw import fetch_bytes

    url = "s3://b/00000.tar"
    gets: list[tuple[int, int]] = []

    class Counting(Remote):
        def read(self, url: str, start: int, end: int) -> bytes:
            gets.append((start, end))
            return b"xyz"

    raw = RawTier(tmp_path / "raw", budget="1MiB")
    raw.heartbeat()  # a prefetcher runs and puts the bytes a little later
    threading.Timer(0.05, lambda: raw.put(url, "ETag=e", 0, 3, b"abc")).start()
    assert fetch_bytes(Counting(), raw, (url, "ETag=e", 0, 3), sample_id="k") == b"abc"
    assert gets == []
    raw.heartbeat_end()  # none runs: a miss is fetched at once
    assert fetch_bytes(Counting(), raw, (url, "ETag=e", 3, 6), sample_id="k") == b"xyz"
    assert gets == [(3, 6)]
    raw.close()
