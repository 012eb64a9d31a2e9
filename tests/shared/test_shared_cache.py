"""``Cache(root, shared=...)`` on a local folder: another node's first epoch served from the
share with no decode and bitwise the same batches, promotion into the node's tiers,
damaged entries never served, another dataset getting nothing, a share that cannot be
reached costing one warning."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from shared_support import epoch, node, packs, same_batches

from mmcache.dataset import MultimodalDataset
from mmcache.synth import make_dataset
from mmcache.testing.store_contract import flip_in_files


@pytest.fixture
def data(tmp_path: Path, small_pipeline) -> MultimodalDataset:  # type: ignore[no-untyped-def]
    return MultimodalDataset(make_dataset(tmp_path / "data", 24, seed=4), pipeline=small_pipeline)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_second_node_serves_its_first_epoch_from_the_share(data, tmp_path, workers):
    share = tmp_path / "share"
    with node(tmp_path / "a", str(share)) as a:
        cold, first = epoch(data, a, workers=workers)
    assert first.misses == 24 and packs(share)  # produced, and published at the epoch's end
    with node(tmp_path / "b", str(share)) as b:
        served, stats = epoch(data, b, workers=workers)
        assert stats.misses == 0, stats  # no decode on node B
        assert stats.tier_hits == {"shared": 24}
        same_batches(served, cold)
        # promoted: the next epoch is local, and the node's disk keeps it for later runs
        again, local = epoch(data, b, workers=workers)
        assert local.misses == 0 and "shared" not in local.tier_hits, local.tier_hits
        same_batches(again, cold)
        assert len(b.disk) == 24
        assert b.stats()["shared"].hits == (24 if workers == 0 else 0)  # this process's


def test_publish_false_reads_and_writes_nothing(data, tmp_path):
    from mmcache.shared import SharedTier

    share = tmp_path / "share"
    with node(tmp_path / "a", SharedTier(share, publish=False)) as a:
        epoch(data, a)
    assert not packs(share)


def test_flipped_bytes_in_a_pack_are_never_served(data, tmp_path, caplog):
    share = tmp_path / "share"
    with node(tmp_path / "a", str(share)) as a:
        cold, _ = epoch(data, a)
    (pack,) = [p for p in (share / "packs").iterdir()]
    raw = pack.read_bytes()
    needle = raw[len(raw) // 3 : len(raw) // 3 + 64]  # inside some entry's pixels
    flip_in_files([str(pack)], needle)
    with caplog.at_level(logging.ERROR), node(tmp_path / "b", str(share)) as b:
        served, stats = epoch(data, b)
        assert stats.misses == 1 and stats.tier_hits == {"shared": 23}  # produced again
        same_batches(served, cold)
        assert b.stats()["shared"].corrupt == 1
    damaged = [r for r in caplog.records if "corrupt shared-tier entry" in r.getMessage()]
    assert len(damaged) == 1  # reported once


def test_another_dataset_with_the_same_names_sizes_and_mtimes_gets_nothing(
    data, tmp_path, small_pipeline
):
    """Keys are the bytes' identity: a dataset whose files have the same names, sizes and
    modification times but other bytes gets no entry of the share."""
    share = tmp_path / "share"
    with node(tmp_path / "a", str(share)) as a:
        epoch(data, a)
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "data", other)
    for jpg in sorted((other / "images").iterdir()):
        blob = bytearray(jpg.read_bytes())
        blob[len(blob) // 2] ^= 0xFF  # same size, other bytes
        stat = jpg.stat()
        jpg.write_bytes(bytes(blob))
        import os

        os.utime(jpg, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    ds = MultimodalDataset(other / "manifest.jsonl", pipeline=small_pipeline)
    alone, _ = epoch(ds, None)
    with node(tmp_path / "b", str(share)) as b:
        served, stats = epoch(ds, b)
    assert stats.misses == 24 and "shared" not in stats.tier_hits
    same_batches(served, alone)


def test_a_share_that_cannot_be_reached_costs_one_warning(data, tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"")  # a file where the share's folder should be
    alone, _ = epoch(data, None)
    with caplog.at_level(logging.WARNING), node(tmp_path / "a", str(blocker / "share")) as a:
        served, stats = epoch(data, a)
        epoch(data, a)  # a second epoch: no second warning
    assert stats.misses == 24
    same_batches(served, alone)
    warned = [r for r in caplog.records if "shared tier" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]  # not one per read or pack
    assert "cannot be reached" in warned[0].getMessage()


def test_a_shared_hit_is_promoted_into_the_disk_tier_by_the_write_behind(
    data, tmp_path, monkeypatch
):
    """The disk tier takes one commit (an fsync) per write: a shared hit promoted into it
    in the reading worker cost one each (1.2 of 1.55 s of a first epoch from a folder, 200
    samples); the write-behind's thread writes them in groups instead. Memory has the hit
    at once."""
    import threading

    from mmcache.stores.disk import DiskStore

    share = tmp_path / "share"
    with node(tmp_path / "a", str(share)) as a:
        epoch(data, a)
    writers: list[str] = []
    put_many = DiskStore.put_many

    def recorded(self, entries):  # type: ignore[no-untyped-def]
        writers.append(threading.current_thread().name)
        return put_many(self, entries)

    monkeypatch.setattr(DiskStore, "put_many", recorded)
    key = data.key(0)
    with node(tmp_path / "b", str(share)) as b:
        sample, tier = b.lookup(key)
        assert sample is not None and tier == "shared"
        assert b.memory is not None and b.memory.contains(key)
        b.commit()  # the end of an epoch (the loader calls it), of a job
        assert b.disk is not None and b.disk.contains(key)
    assert writers and threading.current_thread().name not in writers, writers
