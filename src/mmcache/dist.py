"""Rank, world size and shards of a job: the one place that asks ``torch.distributed``.

Every part of mmcache that splits work by rank (the loader's sampler, ``warm``,
``warm_features``) takes its defaults from :func:`rank_and_world`, so that the
rules are the same everywhere: with ``torch.distributed`` initialised, the
process group's rank and world size; without it, a single process (rank 0 of 1);
giving only one of ``rank``/``world_size`` is refused, because every process
would otherwise read the same part of the data.

Thread-safe (reads only).
"""

from __future__ import annotations

import os
import socket

import torch

from mmcache.errors import ConfigError

__all__ = ["NODE_ENV", "dist_initialized", "node_name", "rank_and_world", "shard_bounds"]

#: The environment variable that names this node (default: the hostname): two
#: "nodes" on one machine (tests) get separate shared-memory tiers by it.
NODE_ENV = "MMCACHE_NODE"


def node_name() -> str:
    """This process's node: ``$MMCACHE_NODE`` when set (non-empty), else the hostname."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def dist_initialized() -> bool:
    """Whether ``torch.distributed`` is available and a process group is initialised."""
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's ``(rank, world_size)``: the ones given, torch.distributed's for
    those left ``None`` when it is initialised, else ``(0, 1)`` when both are ``None``.

    One of the two without the other, outside torch.distributed, is refused
    (:class:`ConfigError`): ``world_size=2`` alone would silently make every
    process rank 0 and read the same part. Checks ``0 <= rank < world_size``.
    """
    if rank is None or world_size is None:
        if dist_initialized():
            rank = torch.distributed.get_rank() if rank is None else rank
            world_size = torch.distributed.get_world_size() if world_size is None else world_size
        elif rank is None and world_size is None:
            rank, world_size = 0, 1
        else:
            missing = "rank" if rank is None else "world_size"
            raise ConfigError(
                f"{missing} is missing: give rank and world_size together (got rank={rank}, "
                f"world_size={world_size}), or neither to use torch.distributed's (not "
                "initialised here) or a single process"
            )
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous ``[start, stop)`` part of ``n`` items that ``rank`` takes.

    Parts are disjoint, cover everything and differ in size by at most one.
    """
    return rank * n // world_size, (rank + 1) * n // world_size
