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
from mmcache.errors import ConfigError

__all__ = ["Topology", "decode_row", "encode_row"]

#: Longest node name sent (a hostname has at most 253 bytes).
_NAME_BYTES = 256


def encode_row(name: str, budget: int) -> torch.Tensor:
    """One rank's ``(node name, memory budget)`` as int64: ``[budget, n, byte...]``."""
    raw = name.encode("utf-8")
    if len(raw) > _NAME_BYTES:
        raise ConfigError(f"node name is longer than {_NAME_BYTES} bytes: {name[:64]!r}...")
    row = torch.zeros(2 + _NAME_BYTES, dtype=torch.int64)
    row[0], row[1] = budget, len(raw)
    row[2 : 2 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    return row


def decode_row(row: torch.Tensor, rank: int) -> tuple[str, int]:
    """The ``(node name, budget)`` of :func:`encode_row`; ConfigError if malformed."""
    values = row.tolist()
    budget, n, raw = values[0], values[1], values[2:]
    if not (budget >= 0 and 0 < n <= _NAME_BYTES and all(0 <= b < 256 for b in raw[:n])):
        raise ConfigError(f"rank {rank} sent a malformed node record (budget {budget}, {n} bytes)")
    try:
        return bytes(raw[:n]).decode("utf-8"), int(budget)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"rank {rank} sent a node name that is not UTF-8: {exc}") from exc


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
        """Every rank's node and budget (one ``all_gather`` of plain tensors, a collective).

        Not ``all_gather_object``: it unpickles what every peer sends. Each rank sends
        a fixed-size row of int64: its budget, the length of its node's UTF-8 name
        and the name's bytes; a row that does not decode raises ConfigError naming
        the rank. ``group`` must be a gloo (CPU) group.
        """
        row = encode_row(node_name(), int(budget))
        rows = [torch.empty_like(row) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(rows, row, group=group)
        pairs = [decode_row(r, rank) for rank, r in enumerate(rows)]
        return cls.from_pairs(torch.distributed.get_rank(), pairs)

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
