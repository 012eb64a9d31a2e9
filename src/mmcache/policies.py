"""Admission and eviction policies, registered by name.

A policy decides *what* to keep; it knows nothing about *where* bytes live. A
store that is full asks its policy, through :meth:`Policy.select_victims`, which
residents to evict for a newcomer, and the policy answers with their row numbers,
or refuses the newcomer. While a newcomer fits in the free space every policy
admits it: an empty byte is never better than a cached one.

Why the default is not LRU: each epoch of shuffled training reads every sample
once in a fresh random order, so every reuse crosses an epoch boundary and no
policy can hit more than C/N per epoch. LRU gets far less (c + (1-c) ln(1-c):
0.5% at c=10%, 15% at c=50%) because it keeps evicting entries just before
their reuse. "Fill once, never evict" (``keep``) reaches the bound. With items of
different sizes and costs, which items are admitted decides how much time is
saved: ``value`` admits by miss cost per byte and replaces a resident only when
the newcomer is clearly (``margin`` times) denser, so measurement noise never
causes churn. Measured: the cache-core benchmark (``benchmarks/cache.py``).

>>> import numpy as np
>>> r = Residents.from_columns(size=[100, 100], cost=[1.0, 5.0])
>>> get_policy("lru").select_victims(r, size=100, cost=1.0, need=100).tolist()
[0]
>>> get_policy("keep").select_victims(r, size=100, cost=9.0, need=100) is None
True

A store never trusts the answer: :func:`validate_victims` is the one check of
what a policy returned (every tier calls it, so a buggy plug-in is treated the
same way by all of them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from mmcache.errors import ConfigError

__all__ = [
    "FIFOPolicy",
    "KeepPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "Policy",
    "Residents",
    "ValuePolicy",
    "VictimCheck",
    "get_policy",
    "policy_names",
    "register_policy",
    "validate_victims",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Residents:
    """Metadata of the entries a tier holds now, as parallel arrays (one row per entry).

    Row numbers are what :meth:`Policy.select_victims` returns; the store maps
    them back to its own slots. ``atime`` and ``ctime`` are in the store's clock,
    ``seq`` increases with every admission (insertion order), ``hits`` counts reads.
    """

    size: IntArray
    cost: FloatArray
    atime: FloatArray
    ctime: FloatArray
    hits: IntArray
    seq: IntArray

    def __len__(self) -> int:
        return int(self.size.shape[0])

    @classmethod
    def from_columns(
        cls,
        *,
        size: Sequence[int] | IntArray,
        cost: Sequence[float] | FloatArray | None = None,
        atime: Sequence[float] | FloatArray | None = None,
        ctime: Sequence[float] | FloatArray | None = None,
        hits: Sequence[int] | IntArray | None = None,
        seq: Sequence[int] | IntArray | None = None,
    ) -> Residents:
        """Build from columns; missing ones default to zeros (``seq`` to 0..n-1)."""
        n = len(size)

        def f(x: Sequence[float] | FloatArray | None) -> FloatArray:
            return np.zeros(n) if x is None else np.asarray(x, dtype=np.float64)

        def i(x: Sequence[int] | IntArray | None, default: IntArray) -> IntArray:
            return default if x is None else np.asarray(x, dtype=np.int64)

        return cls(
            size=np.asarray(size, dtype=np.int64),
            cost=f(cost),
            atime=f(atime),
            ctime=f(ctime),
            hits=i(hits, np.zeros(n, dtype=np.int64)),
            seq=i(seq, np.arange(n, dtype=np.int64)),
        )


class Policy(ABC):
    """Chooses victims for a newcomer, or refuses it. Stateless between calls.

    Policies hold no per-entry state of their own: everything they need is in
    :class:`Residents`, which the store keeps (in shared memory for the memory
    tier), so every process of a node makes the same decision. Instances are
    immutable and therefore thread- and process-safe.
    """

    name: ClassVar[str]

    @abstractmethod
    def select_victims(
        self, residents: Residents, *, size: int, cost: float, need: int
    ) -> IntArray | None:
        """Return rows of ``residents`` to evict so that ``need`` more bytes are free.

        ``size`` and ``cost`` describe the newcomer (bytes, seconds to recompute).
        Return ``None`` to refuse the newcomer. The rows returned must free at
        least ``need`` bytes in total; the store checks this.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True)
class VictimCheck:
    """What :func:`validate_victims` made of a policy's answer.

    ``rows``: the victims, sorted rows of the residents without repeats, or None:
    the newcomer is refused. ``freed``: the bytes those rows free. ``problem``:
    why an answer was refused although the policy chose victims (they free too
    little); the store logs it once (a policy bug, but the budget holds).
    """

    rows: IntArray | None
    freed: int = 0
    problem: str | None = None

    @property
    def admitted(self) -> bool:
        return self.rows is not None


def validate_victims(
    policy: Policy,
    residents: Residents,
    answer: object,
    *,
    need: int,
    entries: int = 0,
) -> VictimCheck:
    """Check what ``policy.select_victims(residents, ..., need=...)`` returned.

    The rules, the same for every tier: None is a refusal. Anything else must
    be row numbers of ``residents`` (integers in ``[0, len(residents))``, any
    shape, a list or an array); else the policy is broken and this raises
    :class:`~mmcache.errors.ConfigError` naming it and the answer (failing
    loudly: a policy that points outside the residents would evict the wrong
    entries). A row given twice counts once. Rows that free fewer than ``need``
    bytes, or fewer than ``entries`` entries (a full index needs a free slot),
    refuse the newcomer with a ``problem`` to log: the budget is never broken.

    >>> r = Residents.from_columns(size=[100, 50, 70])
    >>> validate_victims(LRUPolicy(), r, [2, 0, 2], need=150).rows.tolist()
    [0, 2]
    >>> validate_victims(LRUPolicy(), r, [1], need=150).problem
    'policy LRUPolicy() chose victims freeing 50 of the 150 bytes needed'
    """
    if answer is None:
        return VictimCheck(None)
    rows = np.asarray(answer)
    if rows.size == 0:
        rows = rows.astype(np.int64)
    if rows.dtype.kind not in "iu":
        raise ConfigError(
            f"policy {policy!r} returned {rows.dtype} victims, not row numbers: {answer!r:.200}"
        )
    rows = np.unique(rows.astype(np.int64, copy=False).reshape(-1))
    n = len(residents)
    if rows.size and (rows[0] < 0 or rows[-1] >= n):
        raise ConfigError(
            f"policy {policy!r} returned rows outside the {n} residents: {rows.tolist()!r:.200}"
        )
    freed = int(residents.size[rows].sum())
    if freed < need:
        problem = f"policy {policy!r} chose victims freeing {freed} of the {need} bytes needed"
        return VictimCheck(None, freed, problem)
    if rows.size < entries:
        return VictimCheck(
            None,
            freed,
            f"policy {policy!r} chose {rows.size} victims where {entries} entries must be freed",
        )
    return VictimCheck(rows, freed)


def _take_until(order: IntArray, size: IntArray, need: int) -> IntArray | None:
    """The shortest prefix of ``order`` whose sizes add up to ``need``, or None."""
    if need <= 0:
        return order[:0]
    freed = np.cumsum(size[order])
    if freed.shape[0] == 0 or freed[-1] < need:
        return None
    stop = int(np.searchsorted(freed, need, side="left")) + 1
    return order[:stop]


_REGISTRY: dict[str, type[Policy]] = {}
P = TypeVar("P", bound=type[Policy])


def register_policy(name: str) -> Callable[[P], P]:
    """Class decorator: make a policy available as ``Cache(policy=name)``."""

    def deco(cls: P) -> P:
        if name in _REGISTRY:
            raise ConfigError(f"policy {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def policy_names() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)


def get_policy(policy: str | Policy) -> Policy:
    """Return a policy instance from a registered name, or the instance itself."""
    if isinstance(policy, Policy):
        return policy
    cls = _REGISTRY.get(policy) if isinstance(policy, str) else None
    if cls is None:
        raise ConfigError(f"unknown policy {policy!r}: choose one of {policy_names()}")
    return cls()


@register_policy("keep")
class KeepPolicy(Policy):
    """First come, never evict (MinIO, CoorDL): reaches the C/N bound under shuffling."""

    def select_victims(
        self, residents: Residents, *, size: int, cost: float, need: int
    ) -> IntArray | None:
        return None


@register_policy("lru")
class LRUPolicy(Policy):
    """Evict the least recently used (by ``atime``; ties by insertion order).

    Thrashes under per-epoch shuffling; kept for workloads without epochs.
    """

    def select_victims(
        self, residents: Residents, *, size: int, cost: float, need: int
    ) -> IntArray | None:
        order = np.lexsort((residents.seq, residents.atime)).astype(np.int64)
        return _take_until(order, residents.size, need)


@register_policy("fifo")
class FIFOPolicy(Policy):
    """Evict the oldest admitted entry first."""

    def select_victims(
        self, residents: Residents, *, size: int, cost: float, need: int
    ) -> IntArray | None:
        order = np.argsort(residents.seq, kind="stable").astype(np.int64)
        return _take_until(order, residents.size, need)


@register_policy("lfu")
class LFUPolicy(Policy):
    """Evict the least frequently read entry (ties: least recently used)."""

    def select_victims(
        self, residents: Residents, *, size: int, cost: float, need: int
    ) -> IntArray | None:
        order = np.lexsort((residents.seq, residents.atime, residents.hits)).astype(np.int64)
        return _take_until(order, residents.size, need)


#: A newcomer must be this many times denser (cost per byte) than every entry it
#: replaces. CPU-time measurements of the same decode vary by 10-30% between
#: runs; below that margin two equal items would keep replacing each other, and
#: under shuffling every replacement of an entry that has not been read yet this
#: epoch is a lost hit.
DEFAULT_VALUE_MARGIN = 1.5


@register_policy("value")
class ValuePolicy(Policy):
    """Admission by miss cost per byte, the default.

    The newcomer replaces the least dense residents (cost/size ascending) only
    when it is more than ``margin`` times denser than every one of them. Equal
    values keep the incumbent, so with uniform items it behaves like ``keep``
    and reaches the C/N bound; with varied items it keeps the bytes that save
    the most decode time (about 2x ``keep`` at a 10% budget).
    """

    def __init__(self, margin: float = DEFAULT_VALUE_MARGIN) -> None:
        if not margin >= 1.0:
            raise ConfigError(f"value policy margin must be >= 1.0, got {margin}")
        self.margin = float(margin)

    def __repr__(self) -> str:
        return f"ValuePolicy(margin={self.margin})"

    def select_victims(
        self, residents: Residents, *, size: int, cost: float, need: int
    ) -> IntArray | None:
        if len(residents) == 0 or size <= 0:
            return None
        new_density = max(cost, 0.0) / size
        density = np.maximum(residents.cost, 0.0) / np.maximum(residents.size, 1)
        # Fast refusal, the common case in steady state: O(n) without a sort.
        if not new_density > self.margin * float(density.min()):
            return None
        order = np.lexsort((-residents.seq, density)).astype(np.int64)
        victims = _take_until(order, residents.size, need)
        if victims is None:
            return None
        if not new_density > self.margin * float(density[victims].max()):
            return None
        return victims
