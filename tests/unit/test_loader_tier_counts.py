"""Each hit is counted for the tier that served it (issue 37, item 12).

After the memory tier is lost (unlinked, a reboot) the disk tier serves the next run's
first epoch: the loader promotes each entry into memory ahead of its gather, and the
gather then reads it from memory. Those hits were counted as memory hits in
``loader.stats()``, the progress bar and ``on_epoch_end``; they are the disk tier's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mmcache as mc
from mmcache.loader.counters import EpochCounter
from mmcache.loader.tasks import SampleOrigin
from mmcache.stores.tiered import Promotions

N = 48  # tiny_data


@pytest.mark.parametrize("workers", [0, 2])
def test_a_disk_tiers_epoch_after_the_memory_tier_is_lost_is_counted_as_disk_hits(
    tiny_data: Path,
    small_pipeline: Any,
    cache_root: Path,
    workers: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ds = mc.MultimodalDataset(tiny_data, pipeline=small_pipeline)
    with mc.Cache(cache_root, memory="64MiB", disk="64MiB") as cache:
        loader = mc.DataLoader(ds, cache=cache, batch_size=16, num_workers=workers)
        assert sum(len(b["id"]) for b in loader) == N  # cold: written to both tiers
        loader.close()
        assert cache.memory is not None
        cache.memory.unlink()  # what `Cache(root).memory.unlink()` or a reboot does
    scalars: list[dict[str, float]] = []
    with mc.Cache(cache_root, memory="64MiB", disk="64MiB") as cache:  # the next run
        loader = mc.DataLoader(
            ds, cache=cache, batch_size=16, num_workers=workers, progress=True,
            on_epoch_end=scalars.append,
        )  # fmt: skip
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sum(len(b["id"]) for b in loader) == N
        loader.close()
    first, second = loader.stats().epochs
    assert (first.hits, first.misses) == (N, 0)
    assert first.tier_hits == {"disk": N}  # was {"memory": N}
    assert second.tier_hits == {"memory": N}  # promoted in the first: memory's now
    assert scalars[0]["hit_rate/disk"] == 1.0 and scalars[0]["hit_rate/memory"] == 0.0
    bars = [line.split("\r")[-1] for line in capsys.readouterr().err.split("\n")]
    bars = [b for b in bars if b.startswith("epoch ")]
    assert re.search(r"memory 0%, disk 100%", bars[0]), bars
    assert re.search(r"memory 100%, disk 0%", bars[1]), bars


def test_the_counter_counts_a_promoted_row_for_the_tier_it_came_from_once() -> None:
    promotions = Promotions()
    keys = np.arange(3 * 16, dtype=np.uint8).reshape(3, 16)
    counter = EpochCounter(0, None, promotions)
    promotions.note(keys[1].tobytes(), "disk")  # ahead of its gather, this epoch
    hit = SampleOrigin.MEMORY_HIT
    counter.count([hit, hit, SampleOrigin.PRODUCED], ["memory", "memory", ""], keys)
    assert counter.snapshot().tier_hits == {"memory": 1, "disk": 1}
    assert len(promotions) == 0  # its next read is memory's own
    counter.count([hit, hit, hit], ["memory"] * 3, keys)
    assert counter.snapshot().tier_hits == {"memory": 4, "disk": 1}


def test_promotions_forget_the_oldest_beyond_their_bound() -> None:
    promotions = Promotions(kept=2)
    for i in range(3):
        promotions.note(bytes([i]) * 16, "disk")
    assert len(promotions) == 2
    assert promotions.take([bytes([i]) * 16 for i in range(3)]) == {1: "disk", 2: "disk"}
    assert promotions.take([bytes([2]) * 16]) == {}


def test_a_promotion_that_lands_after_its_read_is_not_taken_by_the_next_epoch() -> None:
    """The read-ahead can promote an entry after the gather that read it (from disk,
    counted so): the next epoch's read of it is memory's own."""
    promotions = Promotions()
    key = np.full((1, 16), 7, dtype=np.uint8)
    hit = SampleOrigin.MEMORY_HIT
    first = EpochCounter(0, None, promotions)
    first.count([SampleOrigin.DISK_HIT], ["disk"], key)  # served by disk...
    promotions.note(key[0].tobytes(), "disk")  # ...then the lagging promotion
    second = EpochCounter(1, None, promotions)
    second.count([hit], ["memory"], key)
    assert second.snapshot().tier_hits == {"memory": 1}
