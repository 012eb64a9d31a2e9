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

The loader adds :class:`ClusterExchange` by itself when its cache has
``scope="cluster"`` and ``torch.distributed`` is initialised.
"""

from __future__ import annotations

from mmcache.cluster.exchange import ClusterExchange, ExchangeStats
from mmcache.cluster.hook import cluster_exchange
from mmcache.cluster.placement import home_nodes
from mmcache.cluster.topology import Topology

__all__ = ["ClusterExchange", "ExchangeStats", "Topology", "cluster_exchange", "home_nodes"]
