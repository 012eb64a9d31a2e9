"""Remote shards fetched by blocks: a cold epoch issues a few ranged GETs per shard (counted
at a proxy in front of a real local S3 server), a warm one only the revalidation, and
neither a changed shard nor a truncated one is ever read wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.errors import ConfigError
from mmcache.loader import DataLoader
from mmcache.sources.blobs import RawTier
from mmcache.sources.blobs.blocks import FetchGroups, check_block
from mmcache.sources.blobs.prefetch import RemotePrefetch
from mmcache.sources.wds import WebDatasetSource, write_shards
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline
from support.s3 import DelayProxy, S3Endpoint, moto_s3

N, PER_SHARD = 24, 8
K = N // PER_SHARD


@pytest.fixture
def s3() -> Iterator[S3Endpoint]:
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def proxy(s3: S3Endpoint) -> Iterator[DelayProxy]:
    with DelayProxy("127.0.0.1", int(s3.url.rsplit(":", 1)[1]), delay=0.0) as p:
        yield p


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    return write_shards(
        make_dataset(tmp_path / "data", N, seed=5), tmp_path / "shards", per_shard=8
    )


def upload(s3: S3Endpoint, paths: list[Path]) -> list[str]:
    for path in paths:
        s3.client.upload_file(str(path), "data", f"wds/{path.name}")
    return [f"s3://data/wds/{p.name}" for p in paths]


def remote_source(
    urls: list[str], pipe: Pipeline, s3: S3Endpoint, proxy: DelayProxy, tmp: Path, **kw: Any
) -> WebDatasetSource:
    return WebDatasetSource(
        urls,
        pipeline=pipe,
        storage_options=s3.storage_options(proxy.url),
        index_dir=tmp / "idx",
        raw=RawTier(tmp / "raw", budget="64MiB"),
        retries=1,
        **kw,
    )


def epoch(loader: DataLoader) -> dict[str, dict[str, np.ndarray]]:
    return {
        sid: {name: batch[name][j].numpy() for name in ("image", "input_ids")}
        for batch in loader
        for j, sid in enumerate(batch["id"])
    }


def assert_equal_to(got: dict[str, dict[str, np.ndarray]], src: WebDatasetSource) -> None:
    assert len(got) == len(src)
    for i in range(len(src)):
        want = src.produce(i)
        for name, value in got[src.sample_id(i)].items():
            np.testing.assert_array_equal(value, want[name], err_msg=f"{src.sample_id(i)} {name}")


def test_a_cold_epoch_fetches_each_shard_with_one_get(s3, proxy, shards, small_pipeline, tmp_path):
    urls = upload(s3, shards)
    src = remote_source(urls, small_pipeline, s3, proxy, tmp_path)
    hook = RemotePrefetch(src, threads=4)
    loader = DataLoader(src, cache=None, batch_size=5, shuffle=True, seed=3, hooks=[hook])
    proxy.requests.clear()  # the index was read when the source was opened
    got = epoch(loader)
    assert_equal_to(got, WebDatasetSource(shards, pipeline=small_pipeline, index_dir=False))
    gets = proxy.object_gets("/data/wds/")
    # one GET per shard (all its samples start in its first 8 MiB block); a producer
    # that outran the prefetcher may add one of its own, never one per sample
    assert hook.gets == K and hook.fetched == N
    assert len(gets) <= 2 * K, [g.target for g in gets]
    assert all(g.ranged for g in gets)
    # the same epoch with one GET per sample, for comparison
    per_sample = remote_source(urls, small_pipeline, s3, proxy, tmp_path / "b", fetch_block=None)
    hook = RemotePrefetch(per_sample, threads=4)
    proxy.requests.clear()
    list(DataLoader(per_sample, cache=None, batch_size=5, shuffle=True, seed=3, hooks=[hook]))
    # one GET per sample (a producer that outran the prefetcher may add its own, as above)
    assert hook.gets == N and N <= len(proxy.object_gets("/data/wds/")) <= 2 * N


def test_a_warm_epoch_issues_only_the_revalidation(s3, proxy, shards, small_pipeline, tmp_path):
    src = remote_source(upload(s3, shards), small_pipeline, s3, proxy, tmp_path)
    hook = RemotePrefetch(src, threads=4)
    loader = DataLoader(src, cache=None, batch_size=5, shuffle=True, seed=3, hooks=[hook])
    first = epoch(loader)
    walked: list[int] = []
    for name in ("fetch_groups", "remote_span"):  # the prefetch walk looks at no sample
        real = getattr(src, name)

        def spy(arg: Any, real: Any = real) -> Any:
            walked.append(int(np.asarray(arg).size))
            return real(arg)

        setattr(src, name, spy)
    proxy.requests.clear()
    second = epoch(loader)  # every sample's bytes are in the raw tier
    assert proxy.object_gets("/data/wds/") == []
    assert len(proxy.requests) <= K  # the batched revalidation: one listing here
    assert walked == [] and hook.gets == 0
    for sid, arrays in first.items():
        for name, value in arrays.items():
            np.testing.assert_array_equal(second[sid][name], value)


def test_an_overwritten_shard_is_fetched_again_by_blocks(
    s3, proxy, shards, small_pipeline, tmp_path
):
    urls = upload(s3, shards)
    src = remote_source(urls, small_pipeline, s3, proxy, tmp_path)
    hook = RemotePrefetch(src, threads=4)
    loader = DataLoader(src, cache=None, batch_size=5, shuffle=True, seed=3, hooks=[hook])
    epoch(loader)
    other = make_dataset(tmp_path / "other", N, seed=11)  # other images, the same keys
    new = write_shards(other, tmp_path / "new", per_shard=PER_SHARD)
    s3.client.upload_file(str(new[0]), "data", "wds/00000.tar")
    proxy.requests.clear()
    got = epoch(loader)
    # only the changed shard is fetched again, with one GET
    assert {g.target for g in proxy.object_gets("/data/wds/")} == {"/data/wds/00000.tar"}
    assert hook.gets == 1
    fresh = WebDatasetSource([new[0], *shards[1:]], pipeline=small_pipeline, index_dir=False)
    assert_equal_to(got, fresh)


def test_a_truncated_shard_is_read_by_blocks_up_to_its_last_whole_member(
    s3, proxy, shards, small_pipeline, tmp_path
):
    data = shards[2].read_bytes()
    cut = shards[2].parent / "cut" / shards[2].name
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) - 3000])  # the last member cut short
    local = WebDatasetSource(
        [*shards[:2], cut], pipeline=small_pipeline, index_dir=False, on_error="skip"
    )
    urls = upload(s3, [*shards[:2], cut])
    # blocks much smaller than a shard: a shard is several GETs, the last one short
    src = remote_source(urls, small_pipeline, s3, proxy, tmp_path, fetch_block=200_000)
    src.on_error = "skip"
    groups = src._groups()
    assert 2 * K < len(groups) < N
    last = [g for g in range(len(groups)) if groups.g_obj[g] == 2][-1]
    ends = [src.span(i)[1] for i in range(len(src)) if src.remote_span(i) and i >= 2 * PER_SHARD]
    assert groups.g_end[last] == max(ends) <= len(data) - 3000  # never past the cut
    hook = RemotePrefetch(src, threads=4)
    loader = DataLoader(src, cache=None, batch_size=5, shuffle=True, seed=3, hooks=[hook])
    proxy.requests.clear()
    got = epoch(loader)
    assert hook.gets == len(groups) < N and hook.fetched == len(src)
    kept = [i for i in range(len(local)) if local.sample_id(i) in got]
    assert len(kept) == len(got) == len(local) - len(local.rejects())
    for i in kept:
        want = local.produce(i)
        np.testing.assert_array_equal(got[local.sample_id(i)]["image"], want["image"])


def test_fetch_groups_cut_spans_by_aligned_block():
    obj = np.array([0, 0, 0, 0, 1, -1, 1, 0])
    start = np.array([0, 90, 120, 250, 10, 0, 300, 400])
    end = np.array([80, 110, 200, 260, 20, 5, 310, 400])  # the last one is empty
    groups = FetchGroups(obj, start, end, block=100)
    # shard 0: [0, 80) and [90, 110) start in block 0, [120, 200) in 1, [250, 260) in 2
    assert groups.group_of.tolist() == [0, 0, 1, 2, 3, -1, 4, -1]
    assert groups.g_start.tolist() == [0, 120, 250, 10, 300]
    assert groups.g_end.tolist() == [110, 200, 260, 20, 310]  # never past the last span
    assert groups.members(0).tolist() == [0, 1]
    one_each = FetchGroups(obj, start, end, block=0)
    assert len(one_each) == 6 and sorted(one_each.group_of[one_each.group_of >= 0]) == list(
        range(6)
    )
    assert check_block("8MiB") == 8 << 20 and check_block(None) == 0
    with pytest.raises(ConfigError, match="fetch_block"):
        check_block("lots")
