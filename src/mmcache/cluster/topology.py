"""Which rank runs on which node, and each node's memory budget: gathered once per loader.

Nodes are named by :func:`mmcache.dist.node_name` (``$MMCACHE_NODE`` or the
hostname) and numbered in the order of their lowest rank. Each rank exchanges
its own batches: rank ``q`` is served by (and sends its cold samples home to)
one *partner* on every other node, the rank of that node with the same local
index modulo its rank count, so the work is spread over all ranks and each
loader waits only for its own exchange. Every rank exchanges a message with
every rank of the other nodes each window (most are small): samples sent home
reach every rank of their home node, so each of them finds them in its node's
memory before it plans the batches that read them. Immutable after :meth:`Topology.gather`:
thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmcache.dist import node_name

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """``node_of[rank]``: the node index of each rank; ``budgets[node]``: its memory budget."""

    rank: int
    node_of: tuple[int, ...]
    names: tuple[str, ...]
    budgets: tuple[int, ...]

    @classmethod
    def from_pairs(cls, rank: int, pairs: Sequence[tuple[str, int]]) -> Topology:
        """From each rank's ``(node name, memory budget)``, in rank order."""
        names: list[str] = []
        budgets: list[int] = []
        node_of = []
        for name, budget in pairs:
            if name not in names:
                names.append(name)
                budgets.append(int(budget))
            node_of.append(names.index(name))
        return cls(rank, tuple(node_of), tuple(names), tuple(budgets))

    @classmethod
    def gather(cls, budget: int, group: object = None) -> Topology:
        """Every rank's node and budget (one ``all_gather_object``, a collective)."""
        world = torch.distributed.get_world_size()
        pairs: list[object] = [None] * world
        torch.distributed.all_gather_object(pairs, (node_name(), int(budget)), group=group)
        return cls.from_pairs(torch.distributed.get_rank(), [p for p in pairs])  # type: ignore[misc]

    @property
    def nodes(self) -> int:
        return len(self.names)

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    def ranks_of(self, node: int) -> tuple[int, ...]:
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    def partner(self, rank: int, node: int) -> int:
        """The rank of ``node`` that serves ``rank`` (and takes its samples homed there)."""
        mine = self.ranks_of(self.node_of[rank])
        theirs = self.ranks_of(node)
        return theirs[mine.index(rank) % len(theirs)]

    def peers(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank`` exchanges with each window: every rank of the other nodes."""
        mine = self.node_of[rank]
        return tuple(q for q, n in enumerate(self.node_of) if n != mine)
