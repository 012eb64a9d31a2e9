"""What a cache is shared by: one node (``scope="node"``) or the cluster (:class:`Cluster`).

``Cache(root, scope=Cluster(peer_timeout=60))`` asks every
:class:`~mmcache.DataLoader` over the cache, under an initialised
``torch.distributed``, to give each sample one home node and send it ahead to
the nodes that read it (:mod:`mmcache.cluster`). ``scope="cluster"`` means
``Cluster()`` (the defaults). The cache only carries this configuration (it is
pickled with the cache to the loader's workers); the cluster package reads it.

It lives in the base layer, below :mod:`mmcache.cache`, so that ``Cache`` can
check it without importing the cluster machinery (which sits above the cache);
``from mmcache.cluster import Cluster`` is the same class.

Immutable, so safe to share between caches, threads and processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmcache.errors import ConfigError

__all__ = ["Cluster", "ScopeLike", "parse_scope"]


@dataclass(frozen=True)
class Cluster:
    """The configuration of ``scope="cluster"``.

    Args:
        peer_timeout: seconds the cluster exchange waits for a peer before it drops
            it and produces that peer's samples locally.
        backend: the exchange's own process group, ``"gloo"`` (CPU tensors) or
            ``"nccl"`` (payloads staged in pinned memory, sent as CUDA tensors:
            written for GPUs, untested here); None: the ``MMCACHE_EXCHANGE_BACKEND``
            environment variable, else ``"gloo"``.
    """

    peer_timeout: float = 60.0
    backend: Literal["gloo", "nccl"] | None = None

    def __post_init__(self) -> None:
        timeout = self.peer_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ConfigError(f"peer_timeout must be seconds (a number), got {timeout!r}")
        if not timeout > 0:
            raise ConfigError(f"peer_timeout must be > 0 seconds, got {timeout!r}")
        object.__setattr__(self, "peer_timeout", float(timeout))
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError(
                f"the exchange backend is 'gloo', 'nccl' or None, got {self.backend!r}"
            )


#: What ``Cache(scope=...)`` takes.
ScopeLike = Literal["node", "cluster"] | Cluster


def parse_scope(scope: object) -> Cluster | None:
    """``scope`` as the cluster's configuration, or None for ``"node"`` (ConfigError else)."""
    if isinstance(scope, Cluster):
        return scope
    if scope == "node":
        return None
    if scope == "cluster":
        return Cluster()
    raise ConfigError(f"scope must be 'node', 'cluster' or a Cluster(...), got {scope!r}")
