"""The parts of scope="cluster" that need no processes: placement, schedule, messages,
node names and configuration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmcache.cache import Cache
from mmcache.cacheroot import memory_name
from mmcache.cluster.placement import home_nodes, shares
from mmcache.cluster.schedule import Schedule
from mmcache.cluster.topology import Topology
from mmcache.cluster.wire import Message, pack, unpack
from mmcache.dataset import MultimodalDataset
from mmcache.dist import node_name
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader
from mmcache.loader.stream import BatchOrder
from mmcache.pipeline import ImageSpec, Pipeline
from mmcache.sampler import EpochSampler


def test_placement_gives_each_node_its_budget_share_exactly_and_the_same_everywhere() -> None:
    home = home_nodes(1000, [2, 1, 1], seed=3)
    assert np.bincount(home).tolist() == [500, 250, 250]
    assert (home == home_nodes(1000, [2, 1, 1], seed=3)).all()  # every node computes it
    assert not (home == home_nodes(1000, [2, 1, 1], seed=4)).all()
    assert shares(10, [1, 1, 1]) == [4, 3, 3] and sum(shares(7, [0, 0])) == 7
    with pytest.raises(ConfigError):
        shares(5, [1, -1])


def _schedule(rank: int) -> Schedule:
    topo = Topology.from_pairs(rank, [("a", 10), ("a", 10), ("b", 10), ("b", 10), ("c", 10)])
    home = home_nodes(61, topo.budgets, seed=0)
    order = BatchOrder(EpochSampler(61, seed=1, world_size=5), 4, False)

    def batches(r: int, e: int) -> list[np.ndarray]:
        return order.for_rank(r).batches(e)

    return Schedule(topo, home, batches, window=2)


def test_every_foreign_read_has_exactly_one_sender() -> None:
    # 3 nodes (2, 2 and 1 ranks), 61 samples: what each rank reads from other nodes in
    # a window is sent to it by exactly one rank of the sample's home node.
    scheds = [_schedule(r) for r in range(5)]
    topo = scheds[0].topology
    assert topo.node_of == (0, 0, 1, 1, 2) and topo.partner(4, 0) == 0
    for w in range(scheds[0].windows(0)):
        for q in range(5):
            senders: dict[int, int] = {}
            for p in topo.peers(q):
                for i in scheds[p].serve(0, w, q).tolist():
                    assert i not in senders
                    senders[i] = p
            assert sorted(senders) == scheds[q].foreign(0, w).tolist()
            assert all(topo.node_of[p] == scheds[q].home[i] for i, p in senders.items())


def test_a_message_round_trips_and_a_damaged_one_is_refused() -> None:
    msg = Message([bytes(range(16)), bytes(16)], [3, 9], [b"abc", b""])
    back = unpack(pack(msg))
    assert back == msg
    buf = pack(msg)
    with pytest.raises(ValueError):
        unpack(buf[:-1])
    with pytest.raises(ValueError):
        unpack(buf[:4])


def test_mmcache_node_names_the_node_and_separates_its_memory_tier(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("MMCACHE_NODE", raising=False)
    plain = memory_name(tmp_path)
    monkeypatch.setenv("MMCACHE_NODE", "n1")
    assert node_name() == "n1"
    one = memory_name(tmp_path)
    monkeypatch.setenv("MMCACHE_NODE", "n2")
    assert len({plain, one, memory_name(tmp_path)}) == 3


def test_scope_is_validated_and_cluster_without_torch_distributed_caches_per_node(
    tiny_data: Path, cache_root: Path
) -> None:
    with pytest.raises(ConfigError, match="scope"):
        Cache(cache_root, memory="1MiB", scope="world")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="peer_timeout"):
        Cache(cache_root, memory="1MiB", peer_timeout=0)
    ds = MultimodalDataset(tiny_data, pipeline=Pipeline(image=ImageSpec(size=32)))
    with Cache(cache_root, memory="4MiB", scope="cluster", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=8)
        assert loader.exchange is None
        assert sum(len(b["id"]) for b in loader) == len(ds)
