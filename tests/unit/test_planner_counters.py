"""A worker's plan counts each missing sample once in every tier's ``misses`` counter,
also a row it deferred while another process held the production claim on its key."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader.tasks import SampleOrigin, WorkerPlanner
from mmcache.transforms import ImageSpec
from mmcache.transforms.pipeline import Pipeline


def _misses(cache: Cache) -> dict[str, int]:
    return {name: tier.stats().misses for name, tier in cache.tiers.items()}


@pytest.mark.parametrize("disk", [None, "8MiB"])
def test_a_row_deferred_to_another_producer_counts_one_miss(
    tiny_data: Path, cache_root: Path, disk: str | None
) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=Pipeline(image=ImageSpec(size=32)))
    with Cache(cache_root, memory="4MiB", disk=disk, temporary=True) as cache:
        planner = WorkerPlanner(ds, cache)
        indices = np.arange(2, dtype=np.int64)
        key0 = ds.key_rows(indices[:1])[0].tobytes()
        claims = cache.claims
        assert claims is not None
        held = claims.acquire(key0)  # another producer of row 0 (it will die publishing nothing)
        assert held is not None and held.fd >= 0
        tiers = cache.tiers

        def release_once_both_rows_were_looked_up() -> None:
            deadline = time.monotonic() + 60
            while min(t.stats().misses for t in tiers.values()) < 2:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            held.release()

        holder = threading.Thread(target=release_once_both_rows_were_looked_up)
        holder.start()
        try:
            plan = planner.produced(indices)
        finally:
            holder.join(60)
        assert [r.origin for r in plan.results] == [SampleOrigin.PRODUCED] * 2
        # Two samples missed: two misses in every tier, not three (row 0 looked up again
        # after its deferral, on main).
        assert _misses(cache) == dict.fromkeys(tiers, 2)


def test_a_batch_the_memory_tier_holds_is_planned_with_one_lookup_of_it(
    tiny_data: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning a batch over memory and disk asks the memory tier once when it holds every
    key: the read-ahead's promotion and page reads only act on keys it lacks (on main they
    asked it twice more per batch, ~0.2 ms each for 16 keys, in the training process of a
    new run's first epoch). A key only the disk holds is still a hit and promoted."""
    from mmcache.writeback import flush_all

    ds = MultimodalDataset(tiny_data, pipeline=Pipeline(image=ImageSpec(size=32)))
    with Cache(cache_root, memory="4MiB", disk="8MiB", temporary=True) as cache:
        planner = WorkerPlanner(ds, cache)
        indices = np.arange(4, dtype=np.int64)
        planner.produced(indices)
        flush_all()
        memory = cache.memory
        assert memory is not None and len(cache.tiers) == 2
        asked: list[int] = []
        real = memory.contains_many

        def counted(keys: np.ndarray) -> np.ndarray:
            asked.append(len(keys))
            return real(keys)

        monkeypatch.setattr(memory, "contains_many", counted)
        plan = planner.plan(indices, produce=False)
        assert plan is not None and plan.planned_hit.all()
        assert asked == [4]
        key3 = plan.keys[3].tobytes()
        assert memory.discard(key3, why="expired")  # now on disk only
        asked.clear()
        plan = planner.plan(indices, produce=False)
        assert plan is not None and plan.planned_hit.all()
        assert asked[0] == 4 and memory.contains_many(plan.keys[3:])[0]  # promoted again
