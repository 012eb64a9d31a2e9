"""The cluster's configuration is its own (``Cache(scope=Cluster(...))``), and its in-flight
tier is a side tier of the cache's tier list: read after the memory tier, never written
by the cache's puts nor promoted into, outside the budget."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache import codec
from mmcache.cache import Cache
from mmcache.cluster import Cluster, hook
from mmcache.cluster.flight import FLIGHT, open_flight
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader, LoaderHook
from mmcache.scope import Cluster as BaseCluster
from mmcache.transforms import ImageSpec
from mmcache.transforms.pipeline import Pipeline


def test_scope_takes_a_cluster_configuration_and_cluster_means_its_defaults(
    cache_root: Path,
) -> None:
    assert Cluster is BaseCluster  # one class, below the cache
    with Cache(cache_root, memory="1MiB", temporary=True) as node:
        assert node.cluster is None and node.scope == "node"
    with Cache(cache_root, memory="1MiB", scope="cluster", temporary=True) as cache:
        assert cache.cluster == Cluster() and cache.cluster.peer_timeout == 60.0
    spec = Cluster(peer_timeout=5, backend="gloo")
    with Cache(cache_root, memory="1MiB", scope=spec, temporary=True) as cache:
        assert cache.cluster is spec and cache.scope is spec
        twin = pickle.loads(pickle.dumps(cache))
        try:
            assert twin.cluster == spec
        finally:
            twin.close()
    with pytest.raises(ConfigError, match="Cluster"):
        Cache(cache_root, memory="1MiB", scope={"peer_timeout": 5})  # type: ignore[arg-type]


def test_the_exchange_takes_its_timeout_and_backend_from_the_cluster_configuration(
    tiny_data: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[dict[str, Any]] = []

    class Recorder(LoaderHook):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(kwargs)
            self.guests = None

        def close(self) -> None:
            return None

    monkeypatch.setattr(hook, "dist_initialized", lambda: True)
    monkeypatch.setattr(hook, "ClusterExchange", Recorder)
    ds = MultimodalDataset(tiny_data, pipeline=Pipeline(image=ImageSpec(size=32)))
    spec = Cluster(peer_timeout=3, backend="gloo")
    with Cache(cache_root, memory="4MiB", scope=spec, temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=8)
        assert isinstance(loader.exchange, Recorder)
        loader.exchange = None
        loader.close()
    assert made[0]["timeout"] == 3.0 and made[0]["backend"] == "gloo"


def test_the_in_flight_tier_sits_in_the_tier_list_as_a_side_tier(cache_root: Path) -> None:
    raw = codec.encode({"x": np.arange(4, dtype=np.int64)}, ctime=0.0, cost=1.0)
    guest, home = bytes(range(16)), bytes(range(1, 17))
    with Cache(cache_root, memory="4MiB", scope="cluster", temporary=True) as cache:
        flight = open_flight(cache, entries=8)
        assert [t.name for t in cache.store.entries] == ["memory", FLIGHT]
        assert list(cache.tiers) == ["memory"]  # the budgeted tiers
        # the cache's own puts never reach it
        assert cache.put(home, {"x": np.arange(4, dtype=np.int64)})
        assert not flight.contains(home)
        # written by its owner (a worker producing another home's sample), then read
        # like a memory hit, and never promoted into the memory tier (outside its budget)
        assert cache.put_side(FLIGHT, guest, raw, cost=1.0, ctime=0.0)
        sample, tier = cache.lookup(guest)
        assert sample is not None and tier == "memory"  # the flight store is a MemoryStore
        memory = cache.memory
        assert memory is not None and not memory.contains(guest)
        assert cache.contains(guest)
        assert cache.delete(guest) and not flight.contains(guest)
        assert cache.put_side("nowhere", guest, raw, cost=1.0, ctime=0.0) is False


def test_the_in_flight_tier_needs_a_memory_tier(cache_root: Path) -> None:
    with Cache(cache_root, memory=0, temporary=True) as cache, pytest.raises(ConfigError):
        open_flight(cache, entries=8)


def test_caches_options_are_written_once_and_pinned_to_its_signature(cache_root: Path) -> None:
    """``Cache``'s option list (``cache._OPTIONS``) is ``__init__``'s parameters, in order;
    pickling carries each, ``cache.json`` records the root's, ``repr`` is derived from it."""
    import inspect

    import mmcache.cache as cache_module

    names = [o.name for o in cache_module._OPTIONS]
    params = list(inspect.signature(Cache.__init__).parameters)
    assert params[:2] == ["self", "root"]
    assert [p for p in params[2:] if not p.startswith("_")] == names
    spec = Cluster(peer_timeout=9)
    with Cache(
        cache_root, memory="1MiB", policy="lru", ttl=60, mode=0o600, memory_entries=2048,
        scope=spec, disk="4MiB", temporary=True,
    ) as cache:  # fmt: skip
        state = cache.__getstate__()
        assert set(names) <= set(state)
        twin = pickle.loads(pickle.dumps(cache))
        try:
            for o in cache_module._OPTIONS:
                assert repr(getattr(twin, o.attr)) == repr(getattr(cache, o.attr)), o.name
        finally:
            twin.close()
        assert cache._options() == {
            "memory": 1 << 20, "disk": 4 << 20, "policy": "lru", "ttl": 60.0, "disk_form": "raw",
        }  # fmt: skip
        assert repr(cache) == (
            f"Cache({str(cache.root)!r}, memory=1048576, disk=4194304, "
            f"policy={cache.policy!r}, ttl=60.0)"
        )
