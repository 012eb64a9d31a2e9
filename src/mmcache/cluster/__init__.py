"""``scope="cluster"``: one home node per sample, pushed ahead of time to the nodes that read it.

- :mod:`~mmcache.cluster.placement`: the home node of each sample (a seeded
  partition weighted by the nodes' memory budgets).
- :mod:`~mmcache.cluster.topology`: which rank runs on which node, gathered once.
- :mod:`~mmcache.cluster.schedule`: what each rank sends to which peer in a
  window of batches, derived from (seed, epoch, world size, placement).
- :mod:`~mmcache.cluster.wire`: one message per peer and window, over
  ``torch.distributed`` point-to-point ops.
- :mod:`~mmcache.cluster.exchange`: the loader hook and its background thread.
- :mod:`~mmcache.cluster.flight`: the node's in-flight tier (other homes' samples
  held for a window, outside the memory budget and its policy).

The loader adds :class:`ClusterExchange` by itself when its cache has a cluster
scope (``Cache(scope=Cluster(peer_timeout=60))``; ``scope="cluster"`` is
``Cluster()``) and ``torch.distributed`` is initialised. :class:`Cluster` is
defined in :mod:`mmcache.scope` (below the cache, which checks it).
"""

from __future__ import annotations

from mmcache.cluster.exchange import ClusterExchange, ExchangeStats
from mmcache.cluster.hook import cluster_exchange
from mmcache.cluster.placement import home_nodes
from mmcache.cluster.topology import Topology
from mmcache.scope import Cluster

__all__ = [
    "Cluster",
    "ClusterExchange",
    "ExchangeStats",
    "Topology",
    "cluster_exchange",
    "home_nodes",
]
