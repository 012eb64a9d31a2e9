"""Whether a loader gets a :class:`~mmcache.cluster.exchange.ClusterExchange`, and its inputs.

The loader's one call into this package: a cache with a cluster scope
(``Cache(scope=Cluster(...))`` or ``scope="cluster"``) under an initialised
``torch.distributed`` gets an exchange configured by that
:class:`~mmcache.scope.Cluster` and fed by the loader's own batch order (every
rank's batches, resumed spans included); otherwise None. Called once per loader
in the training process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np

from mmcache.cache import Cache
from mmcache.cluster.exchange import ClusterExchange
from mmcache.dist import dist_initialized
from mmcache.sources.base import SampleSource
from mmcache.sources.capabilities import layout_of

__all__ = ["cluster_exchange"]

logger = logging.getLogger(__name__)

#: ``nccl`` makes the exchange's own group an NCCL one (GPUs; untested here), default gloo.
BACKEND_ENV = "MMCACHE_EXCHANGE_BACKEND"


def cluster_exchange(
    cache: Cache | None,
    dataset: SampleSource,
    batches: Callable[[int, int], list[np.ndarray]],
    seed: int,
    planned_ahead: int = 2,
) -> ClusterExchange | None:
    """The exchange of a loader over ``cache`` (None unless its cluster scope applies).

    ``batches(rank, epoch)``: any rank's batches of any epoch in the loader's order
    (it must not hold the loader: the loader's finalizer closes the exchange);
    ``planned_ahead``: how many batches its workers plan ahead of the one assembled.
    """
    cluster = None if cache is None else cache.cluster
    if cache is None or cluster is None:
        return None
    if not dist_initialized():
        logger.info('scope="cluster" without torch.distributed initialised: caching per node')
        return None
    backend = cluster.backend or os.environ.get(BACKEND_ENV, "gloo")
    # A source without varying_fields makes every sample with the same shapes (as the
    # loader reads it: loader/varying.py): received entries must then have its layout.
    fixed = not layout_of(dataset).varying
    return ClusterExchange(
        cache, dataset, batches, seed=seed, timeout=cluster.peer_timeout, backend=backend,
        planned_ahead=planned_ahead, fixed_shapes=fixed,
    )  # fmt: skip
