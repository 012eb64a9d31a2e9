import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmcache.errors import ConfigError
from mmcache.sampler import EpochSampler


def test_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a = EpochSampler(1000, seed=7)
    b = EpochSampler(1000, seed=7)
    assert np.array_equal(a.indices(3), b.indices(3))
    assert not np.array_equal(a.indices(3), a.indices(4))
    assert not np.array_equal(a.indices(0), EpochSampler(1000, seed=8).indices(0))


def test_seed_and_epoch_do_not_alias() -> None:
    # seed+epoch mixing would make (seed=1, epoch=0) replay (seed=0, epoch=1).
    assert not np.array_equal(
        EpochSampler(100, seed=1).indices(0), EpochSampler(100, seed=0).indices(1)
    )


def test_each_epoch_is_a_permutation() -> None:
    s = EpochSampler(257, seed=1)
    for e in range(3):
        assert sorted(s.indices(e).tolist()) == list(range(257))


def test_no_shuffle_is_identity() -> None:
    assert EpochSampler(5, shuffle=False).indices(9).tolist() == [0, 1, 2, 3, 4]


@given(
    size=st.integers(0, 300), world=st.integers(1, 8), epoch=st.integers(0, 5), drop=st.booleans()
)
def test_ranks_partition_like_distributed_sampler(
    size: int, world: int, epoch: int, drop: bool
) -> None:
    parts = [
        EpochSampler(size, seed=5, rank=r, world_size=world, drop_last=drop).indices(epoch)
        for r in range(world)
    ]
    lengths = {len(p) for p in parts}
    assert len(lengths) == 1  # every rank gets the same number of samples
    allidx = np.concatenate(parts) if parts else np.array([])
    if drop:
        assert len(set(allidx.tolist())) == len(allidx)  # disjoint
        assert len(allidx) == (size // world) * world
    else:
        assert set(allidx.tolist()) == set(range(size))  # every sample seen
        assert len(allidx) == (-(-size // world)) * world if size else len(allidx) == 0


def test_rank_validation() -> None:
    with pytest.raises(ConfigError):
        EpochSampler(10, rank=2, world_size=2)
    with pytest.raises(ConfigError):
        EpochSampler(10, world_size=0)


def test_rank_and_world_come_together_outside_torch_distributed() -> None:
    # One helper for the DataLoader, warm() and warm_features().
    from mmcache.dist import rank_and_world

    assert rank_and_world(None, None) == (0, 1)
    assert rank_and_world(2, 4) == (2, 4)
    with pytest.raises(ConfigError, match="rank is missing"):
        rank_and_world(None, 2)  # would silently be rank 0 in every process
    with pytest.raises(ConfigError, match="world_size is missing"):
        rank_and_world(1, None)
    for rank, world in ((2, 2), (-1, 2), (0, 0), (True, 2)):
        with pytest.raises(ConfigError):
            rank_and_world(rank, world)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 60), world=st.integers(1, 9), start=st.integers(0, 60))
def test_padding_repeats_the_order_from_its_start(size: int, world: int, start: int) -> None:
    # DistributedSampler's padding (drop_last=False): the order, repeated from its start
    # as often as needed, cut to a multiple of the world size; rank r takes r, r + world...
    # For a whole epoch and for the rest of one (a span, resumed elastically).
    start = min(start, size)
    for r in range(world):
        sampler = EpochSampler(size, seed=2, rank=r, world_size=world)
        for part, got in (
            (sampler.permutation(1), sampler.indices(1)),
            (sampler.permutation(1)[start:], sampler.span_indices(1, start, size)),
        ):
            total = -(-len(part) // world) * world
            padded = np.tile(part, -(-total // len(part)))[:total] if len(part) else part
            np.testing.assert_array_equal(got, padded[r:total:world])
