"""group_by_length=True: megabatches of similar length, one modality per batch, deterministic
per (seed, epoch), equal batch counts per rank, resumable mid-epoch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmcache import Cache, DataLoader
from mmcache.errors import ConfigError
from mmcache.loader import Distributed, SFTBatching
from mmcache.testing.sft import SyntheticSFTSource


def _index_lists(loader: DataLoader, epoch: int) -> list[list[int]]:
    loader.set_epoch(epoch)
    return [[int(s.split("-")[1]) for s in b["id"]] for b in loader]


def test_each_batch_is_one_modality_and_similar_lengths() -> None:
    src = SyntheticSFTSource(96, seed=1, image_counts=(1, 0, 0, 2), max_text=200)
    lengths, has_image = src.lengths(), src.modalities()
    grouped = DataLoader(
        src, cache=None, batch_size=8, seed=3, batching=SFTBatching(group_by_length=True)
    )
    plain = DataLoader(src, cache=None, batch_size=8, seed=3)
    batches = _index_lists(grouped, 0)
    assert sorted(i for b in batches for i in b) == list(range(96))  # every sample once
    for b in batches:
        assert len(set(has_image[b].tolist())) == 1  # image and text-only apart

    # Much less padding than random batches.
    def waste(bs: list[list[int]]) -> int:
        return sum(int(lengths[b].max()) * len(b) - int(lengths[b].sum()) for b in bs)

    assert waste(batches) * 2 < waste(_index_lists(plain, 0))


def test_grouping_is_deterministic_per_seed_and_epoch() -> None:
    src = SyntheticSFTSource(64, seed=2, max_text=100)
    a = DataLoader(
        src, cache=None, batch_size=4, seed=5, batching=SFTBatching(group_by_length=True)
    )
    b = DataLoader(
        src, cache=None, batch_size=4, seed=5, batching=SFTBatching(group_by_length=True)
    )
    assert _index_lists(a, 1) == _index_lists(b, 1)
    assert _index_lists(a, 0) != _index_lists(a, 1)  # another epoch, another order
    c = DataLoader(
        src, cache=None, batch_size=4, seed=6, batching=SFTBatching(group_by_length=True)
    )
    assert _index_lists(c, 1) != _index_lists(a, 1)


@pytest.mark.parametrize("distributed_drop_last", [False, True])
def test_equal_batch_counts_per_rank(distributed_drop_last: bool) -> None:
    src = SyntheticSFTSource(161, seed=3, image_counts=(1, 0, 1))
    world = 3
    per_rank = []
    for rank in range(world):
        loader = DataLoader(
            src,
            cache=None,
            batch_size=4,
            distributed=Distributed(rank=rank, world_size=world, drop_last=distributed_drop_last),
            batching=SFTBatching(group_by_length=True),
        )
        per_rank.append(_index_lists(loader, 2))
        assert len(loader) == len(per_rank[-1])
    assert len({len(p) for p in per_rank}) == 1
    seen = {i for p in per_rank for b in p for i in b}
    if not distributed_drop_last:
        assert seen == set(range(161))  # every sample, a few twice
    # At each step the ranks' batches come from one megabatch (one modality), but
    # where the two short megabatches (each modality's last) meet.
    has_image = src.modalities()
    mixed = [
        step
        for step in zip(*per_rank, strict=True)
        if len({bool(has_image[i]) for b in step for i in b}) > 1
    ]
    assert len(mixed) <= 2


def test_resume_mid_epoch_yields_exactly_the_rest(cache_root: Path) -> None:
    src = SyntheticSFTSource(40, seed=4, max_text=80)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(
            src, cache=cache, batch_size=4, seed=1, batching=SFTBatching(group_by_length=True)
        )
        full = _index_lists(loader, 1)
        loader.set_epoch(1)
        it = iter(loader)
        head = [[int(s.split("-")[1]) for s in next(it)["id"]] for _ in range(3)]
        state = loader.state_dict()
        assert state["batching"] == "group_by_length"
        again = DataLoader(
            src, cache=cache, batch_size=4, seed=1, batching=SFTBatching(group_by_length=True)
        )
        again.load_state_dict(state)
        again.set_epoch(1)
        rest = [[int(s.split("-")[1]) for s in b["id"]] for b in again]
        assert head + rest == full
        plain = DataLoader(src, cache=cache, batch_size=4, seed=1)
        with pytest.raises(ConfigError, match="batching"):
            plain.load_state_dict(state)
        # grouped plans are per world size: an elastic resume of them is refused clearly
        wider = DataLoader(
            src,
            cache=cache,
            batch_size=4,
            seed=1,
            distributed=Distributed(rank=0, world_size=2),
            batching=SFTBatching(group_by_length=True),
        )
        with pytest.raises(ConfigError, match="same world size only"):
            wider.load_state_dict(state)


def test_group_by_length_needs_lengths() -> None:
    class NoLengths(SyntheticSFTSource):
        lengths = None  # type: ignore[assignment]

    with pytest.raises(ConfigError, match="lengths"):
        DataLoader(
            NoLengths(4), cache=None, batch_size=2, batching=SFTBatching(group_by_length=True)
        )


def test_the_workers_and_warm_epochs_follow_the_grouped_order(cache_root: Path) -> None:
    src = SyntheticSFTSource(32, seed=5, max_text=60)
    ref = _index_lists(
        DataLoader(src, cache=None, batch_size=4, batching=SFTBatching(group_by_length=True)), 0
    )
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        grouped = SFTBatching(group_by_length=True)
        loader = DataLoader(
            src, cache=cache, batch_size=4, num_workers=2, persistent_workers=True, batching=grouped
        )
        cold = _index_lists(loader, 0)
        warm = _index_lists(loader, 0)
        assert loader.stats().epochs[-1].hits == 32
        loader.close()
    assert cold == warm == ref
    assert np.array_equal(np.sort(np.concatenate(ref)), np.arange(32))
