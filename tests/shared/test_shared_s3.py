"""The shared tier on an S3 server started in the test (moto): another node's first epoch
from the share, a batch's misses read with one GET per pack, flipped bytes never served,
writers killed or side by side, and a server that stops answering costing one warning."""

from __future__ import annotations

import json
import logging
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from shared_support import epoch, node, same_batches
from shared_writer_child import entry, key
from test_shared_writers import check, spawn

from mmcache.dataset import MultimodalDataset
from mmcache.shared import SharedTier
from mmcache.synth import make_dataset
from support.s3 import DelayProxy, S3Endpoint, moto_s3


@pytest.fixture
def s3() -> Iterator[S3Endpoint]:
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def url() -> str:
    """A prefix of its own: moto's servers in one process share their buckets."""
    return f"s3://data/share-{uuid.uuid4().hex}"


@pytest.fixture
def data(tmp_path: Path, small_pipeline) -> MultimodalDataset:  # type: ignore[no-untyped-def]
    return MultimodalDataset(make_dataset(tmp_path / "data", 24, seed=4), pipeline=small_pipeline)


def tier(s3: S3Endpoint, url: str, tmp_path: Path, **kw) -> SharedTier:  # type: ignore[no-untyped-def]
    return SharedTier(url, storage_options=s3.storage_options(), spool_dir=tmp_path / "spool", **kw)


def objects(s3: S3Endpoint, url: str, folder: str) -> list[str]:
    prefix = url.removeprefix("s3://data/")
    listed = s3.client.list_objects_v2(Bucket="data", Prefix=f"{prefix}/{folder}/")
    return sorted(o["Key"] for o in listed.get("Contents", []))


def test_a_second_node_serves_its_first_epoch_from_s3(s3, url, data, tmp_path):
    with node(tmp_path / "a", tier(s3, url, tmp_path)) as a:
        cold, first = epoch(data, a, workers=2)
    assert first.misses == 24 and objects(s3, url, "index")
    with node(tmp_path / "b", tier(s3, url, tmp_path)) as b:
        served, stats = epoch(data, b, workers=2)
        assert stats.misses == 0 and stats.tier_hits == {"shared": 24}, stats
        same_batches(served, cold)


def test_a_batch_of_misses_is_one_get_per_pack(s3, url, tmp_path):
    host, port = s3.url.removeprefix("http://").split(":")
    writer = tier(s3, url, tmp_path, linger=0)
    for i in range(20):
        writer.put(key(i), entry(i))
    writer.close()  # one pack
    with DelayProxy(host, int(port), delay=0.0) as proxy:
        reader = SharedTier(url, storage_options=s3.storage_options(proxy.url), publish=False)
        reader.refresh()
        packs = url.replace("s3://", "/") + "/packs/"
        before = len(proxy.object_gets(packs))
        reader.fetch_ahead([key(i) for i in range(0, 20, 3)])
        gets = proxy.object_gets(packs)[before:]
        assert len(gets) == 1 and gets[0].ranged
        assert all(reader.get(key(i)) == entry(i) for i in range(0, 20, 3))
        assert len(proxy.object_gets(packs)) == before + 1  # served ahead
        reader.close()


def test_flipped_bytes_in_an_s3_pack_are_never_served(s3, url, data, tmp_path):
    with node(tmp_path / "a", tier(s3, url, tmp_path)) as a:
        cold, _ = epoch(data, a)
    (name,) = objects(s3, url, "packs")
    blob = bytearray(s3.client.get_object(Bucket="data", Key=name)["Body"].read())
    blob[len(blob) // 3] ^= 0x5A
    s3.client.put_object(Bucket="data", Key=name, Body=bytes(blob))
    with node(tmp_path / "b", tier(s3, url, tmp_path)) as b:
        served, stats = epoch(data, b)
        assert stats.misses == 1 and stats.tier_hits == {"shared": 23}
        same_batches(served, cold)


def test_s3_writers_killed_or_side_by_side(s3, url, tmp_path):
    options = s3.storage_options()
    child = spawn(url, tmp_path / "spool", 0, 300, 0, options=options)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    killed = check(url, options)
    assert killed  # what was committed reads back whole
    # another process and this one publishing at once
    other = spawn(url, tmp_path / "spool", 1000, 60, 1, options=options)
    here = tier(s3, url, tmp_path, pack_bytes="16KiB", linger=0)
    for i in range(1030, 1090):
        here.put(key(i), entry(i))
    here.close()
    out, _ = other.communicate(timeout=120)
    assert other.returncode == 0 and out.strip().endswith("done")
    assert check(url, options) == killed | set(range(1000, 1090))


def test_a_server_that_stops_answering_costs_one_warning(s3, url, data, tmp_path, caplog):
    alone, _ = epoch(data, None)
    share = SharedTier(url, storage_options=s3.storage_options(), retries=1)
    s3.stop()
    with caplog.at_level(logging.WARNING), node(tmp_path / "a", share) as a:
        served, stats = epoch(data, a)
        epoch(data, a)
    assert stats.misses == 24
    same_batches(served, alone)
    warned = [r.getMessage() for r in caplog.records if "shared tier" in r.getMessage()]
    assert len(warned) == 1, warned


def test_stats_and_gc_of_an_s3_share(s3, url, tmp_path, capsys):
    from test_shared_cli import DAY, run

    options = json.dumps(s3.storage_options())
    old = tier(s3, url, tmp_path, linger=0)
    for i in range(4):
        old.put(key(i), entry(i), ctime=time.time() - 40 * DAY)
    old.close()
    new = tier(s3, url, tmp_path, linger=0)
    new.put(key(9), entry(9), ctime=time.time())
    new.close()
    shared = ("--shared", url, "--shared-options", options)
    assert run(capsys, "stats", *shared)["entries"] == 5
    report = run(capsys, "gc", *shared, "--older-than", "30d")
    assert (report["packs"], report["entries"]) == (1, 4)
    assert len(objects(s3, url, "packs")) == len(objects(s3, url, "index")) == 1
