"""The parts of scope="cluster" that need no processes: placement, schedule, messages,
node names and configuration."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from mmcache import codec
from mmcache.cache import Cache
from mmcache.cacheroot import memory_name
from mmcache.cluster import Cluster
from mmcache.cluster.flight import FLIGHT, MIN_BYTES, open_flight
from mmcache.cluster.placement import home_nodes, shares
from mmcache.cluster.schedule import Schedule
from mmcache.cluster.topology import Topology
from mmcache.cluster.wire import Message, pack, unpack
from mmcache.dataset import MultimodalDataset
from mmcache.dist import node_name
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader
from mmcache.loader.stream import BatchOrder, EpochOrder, StreamState, WorkerTaskSampler
from mmcache.loader.tasks import WorkerPlanner
from mmcache.sampler import EpochSampler
from mmcache.transforms import ImageSpec
from mmcache.transforms.pipeline import Pipeline


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
        Cluster(peer_timeout=0)
    with pytest.raises(ConfigError, match="backend"):
        Cluster(backend="mpi")  # type: ignore[arg-type]
    ds = MultimodalDataset(tiny_data, pipeline=Pipeline(image=ImageSpec(size=32)))
    with Cache(cache_root, memory="4MiB", scope="cluster", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=8)
        assert loader.exchange is None
        assert sum(len(b["id"]) for b in loader) == len(ds)


def test_the_in_flight_tier_is_gathered_after_memory_outside_its_budget_and_pickles(
    tiny_data: Path, cache_root: Path
) -> None:
    # What a node holds for other nodes' samples is read like a memory hit, but does
    # not count against the memory budget nor go through its policy.
    with Cache(cache_root, memory="64KiB", scope="cluster", temporary=True) as cache:
        flight = open_flight(cache, entries=8)
        assert cache.side_tier(FLIGHT) is flight and FLIGHT not in cache.tiers  # a side tier
        assert flight.index_capacity == 64 and flight.capacity() >= MIN_BYTES
        raw = codec.encode({"x": np.arange(4, dtype=np.int64)}, ctime=0.0, cost=1.0)
        key = bytes(range(16))
        assert flight.put(key, raw)
        reader = cache.reader
        assert reader is not None and reader.contains_many([key]).tolist() == [True]
        memory = cache.memory
        assert memory is not None and memory.nbytes() == 0 and key not in set(memory.keys())
        twin = pickle.loads(pickle.dumps(cache))  # a spawned worker's copy
        try:
            assert twin.side_tier(FLIGHT) is not None and twin.reader is not None
            assert twin.reader.contains_many([key]).tolist() == [True]
        finally:
            twin.close()
    plain = Cache(cache_root, memory="64KiB", temporary=True)
    try:
        assert plain.side_tier(FLIGHT) is None and plain.reader is plain.memory  # as before
    finally:
        plain.close()


def test_a_sample_homed_on_another_node_is_produced_into_the_in_flight_tier(
    tiny_data: Path, cache_root: Path
) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=Pipeline(image=ImageSpec(size=32)))
    with Cache(cache_root, memory="4MiB", scope="cluster", temporary=True) as cache:
        flight = open_flight(cache, entries=16)
        planner = WorkerPlanner(ds, cache)
        planner.guests = np.arange(len(ds)) % 2 == 1  # odd samples: homed elsewhere
        plan = planner.produced(np.arange(8, dtype=np.int64))
        keys = [k.tobytes() for k in plan.keys]
        memory = cache.memory
        assert memory is not None
        assert [memory.contains(k) for k in keys] == [i % 2 == 0 for i in range(8)]
        assert [flight.contains(k) for k in keys] == [i % 2 == 1 for i in range(8)]


def test_under_a_cluster_exchange_each_worker_task_is_one_batch() -> None:
    # Warm stretches group batches into tasks (1, 2, 4, 8 batches); under an exchange a
    # task that reaches beyond the exchange's horizon would be planned before its
    # samples arrive, so tasks stay one batch each.
    order = EpochOrder(BatchOrder(EpochSampler(64, seed=1), 2, False))
    for max_group, sizes in [(8, [1, 2, 4, 8, 8, 8]), (1, [1] * 6)]:
        state = StreamState(warm=True, max_group=max_group)
        sampler = WorkerTaskSampler(state, order, persistent=False, guess_next=lambda: False)
        assert [len(t) for t in sampler][:6] == sizes
