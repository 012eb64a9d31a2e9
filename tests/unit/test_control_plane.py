"""The control-plane simulation (issue 41) at 10^5 samples: its phases run, the memory each
keeps per sample is bounded, and an elastic resume serves each remaining sample once.

The bounds are bytes per sample of the dataset, traced by ``tracemalloc`` (numpy's
buffers included) while the step runs, with the source (its ids: 19 B a sample) made
before. What the loader should keep for a plan (no cache, no workers): each remembered
epoch's order (8 B a sample), the source's key memo (16 B of key and 32 B of stamps a
sample, made by the first batch's keys) and the id column's text (11 B a sample, made by
the first batch's ids): 75 B for two epochs. Learnt keys (49 B a sample) are kept only
by a loader that can guess an epoch, and a rank's order holds its part only. A regression
guard, not a target: 10^8 samples at these figures is 7.5 GB for two planned epochs.
``benchmarks/control_plane.py`` runs the same steps at 10^6-10^8.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.sampler import EpochSampler
from mmcache.testing import control_plane as cp
from mmcache.testing.synthetic import SyntheticSource

N = 100_000
BATCH = 64
#: Most bytes per sample a step may keep (``kept``) and hold at its peak (``peak``).
BOUNDS = {
    "plan": (80, 100),  # 2 orders 16 + key memo 48 + id text 11 (+ the order's making: 8)
    "state": (72, 100),  # 1 order 8 + key memo 48 + id text 11 (the saver's loader dropped)
    "resume": (80, 100),  # the plans given 8 + key memo 48 + id text 11 (loaders dropped)
}


@pytest.fixture
def fresh() -> Iterator[SyntheticSource]:
    """``source`` with no key memo and no id text yet: as a new process opens it."""
    yield SyntheticSource(N, check_ids=False)


def traced(step: Callable[[], Any]) -> tuple[Any, float, float]:
    """``step()``, and the bytes per sample it kept and held at its peak."""
    gc.collect()
    tracemalloc.start()
    try:
        result = step()
        gc.collect()
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, kept / N, peak / N


def test_plan_keeps_the_orders_and_keys_only(fresh: SyntheticSource) -> None:
    loader, kept, peak = traced(lambda: cp.plan_epochs(fresh, batch_size=BATCH, epochs=2))
    assert len(loader) == -(-N // BATCH)
    assert kept <= BOUNDS["plan"][0] and peak <= BOUNDS["plan"][1], (kept, peak)


def test_state_round_trip_resumes_at_the_next_batch(fresh: SyntheticSource) -> None:
    (state, resumed, first), kept, peak = traced(
        lambda: cp.save_and_resume(fresh, batch_size=BATCH, after=3)
    )
    order = EpochSampler(N, seed=0).indices(0)
    np.testing.assert_array_equal(first, order[3 * BATCH : 4 * BATCH])
    assert state["consumed"] == 3 * BATCH and resumed.state_dict()["position"] == 4
    assert kept <= BOUNDS["state"][0] and peak <= BOUNDS["state"][1], (kept, peak)


@pytest.mark.parametrize(("world_from", "world_to", "repeats"), [(4, 8, 0), (4, 3, 2)])
def test_elastic_resume_gives_each_remaining_sample_once(
    fresh: SyntheticSource, world_from: int, world_to: int, repeats: int
) -> None:
    # 4 ranks x 3 batches of 64 consumed: 99,232 remain, split over 8 ranks exactly, or
    # over 3 ranks with 2 samples repeated (Distributed(drop_last=False) pads each rank's
    # part to the same length by repeating the first of the remaining order).
    result, kept, peak = traced(
        lambda: cp.elastic_resume(
            fresh, batch_size=BATCH, world_from=world_from, world_to=world_to, after=3
        )
    )
    assert result.consumed.shape == (world_from * 3 * BATCH,)
    assert len({part.shape[0] for part in result.remaining}) == 1  # equal parts
    assert cp.coverage(N, result) == cp.Coverage(never=0, again=0, repeats=repeats)
    assert kept <= BOUNDS["resume"][0] and peak <= BOUNDS["resume"][1], (kept, peak)


def test_an_elastic_resume_walked_serves_what_its_plan_said() -> None:
    # The data path at 10^4: each resumed rank yields every batch of the rest, and the
    # rows served are the samples the plan check above counted.
    n = 10_000
    small = SyntheticSource(n)
    walked = cp.elastic_resume(small, batch_size=50, world_from=2, world_to=3, after=2, walk=True)
    planned = cp.elastic_resume(small, batch_size=50, world_from=2, world_to=3, after=2)
    for served, plan in zip(walked.remaining, planned.remaining, strict=True):
        np.testing.assert_array_equal(served, plan)
    assert cp.coverage(n, walked) == cp.Coverage(never=0, again=0, repeats=1)


def test_load_state_dict_makes_no_epoch_order(
    fresh: SyntheticSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At 10^8 samples an epoch's order is seconds of CPU and 800 MB: a resume makes it
    # once, for the batches it yields, not to check the state (two more, before).
    made: list[int] = []
    permutation = EpochSampler.permutation

    def counted(self: EpochSampler, epoch: int) -> Any:
        made.append(epoch)
        return permutation(self, epoch)

    monkeypatch.setattr(EpochSampler, "permutation", counted)
    saver = cp.plan_epochs(fresh, batch_size=BATCH, epochs=3)  # now at epoch 2
    state = saver.state_dict()
    made.clear()
    for world in (1, 2):
        loader = cp._loader(fresh, BATCH, rank=world - 1, world_size=world)
        loader.load_state_dict(state)
        assert made == []
        next(iter(loader))
        assert made == [2]
        made.clear()


def test_a_rank_keeps_only_its_part_of_the_order() -> None:
    sampler = EpochSampler(N, seed=1, rank=1, world_size=4)
    mine, kept, _ = traced(lambda: sampler.indices(0))
    assert mine.shape == (N // 4,)
    assert kept <= 8 / 4 * 1.05, kept  # 2 B per sample of the dataset, not 8


def test_a_padded_rank_gathers_its_part_without_copying_the_order() -> None:
    # 100,000 over 3 ranks: each part padded by one sample. Peak: the order (8 B a
    # sample) and this rank's part, its positions and their remainders (3 x 8 / 3 B),
    # not two more copies of the order to pad one sample (a tile: 16 B a sample).
    sampler = EpochSampler(N, seed=1, rank=2, world_size=3)
    sampler.indices(1)  # (numpy's generator machinery set up, once per process)
    mine, _, peak = traced(lambda: sampler.indices(0))
    assert mine.shape == (-(-N // 3),)
    assert peak <= 8 + 3 * 8 / 3 + 1, peak


def test_claims_are_taken_and_dropped_for_every_key(tmp_path: Path) -> None:
    lock = tmp_path / "claims.lock"
    lock.touch()
    keys = SyntheticSource(1000).key_rows(np.arange(1000))
    held, kept, _ = traced(lambda: cp.claim_keys(lock, keys))
    assert held == 1000
    assert kept * N < 64 * 1024  # nothing kept per claim
