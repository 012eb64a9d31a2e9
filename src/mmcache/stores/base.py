"""The byte-store contract every tier implements.

A store maps 16-byte keys (digests from :mod:`mmcache.keys`; never raw user
strings) to immutable byte strings under a hard byte budget. It stores bytes
only: encoding samples is :mod:`mmcache.codec`'s job, choosing victims is the
:class:`~mmcache.policies.Policy`'s. Composition does the rest: a tier that wraps
two stores is itself a store.

Budget rule (checked by the contract suite): ``nbytes() <= capacity()`` at every
moment, where ``nbytes`` counts the payload bytes of the entries held.

The surface is declared, as the source surface is (:mod:`mmcache.sources.capabilities`):
what every store answers has a default on :class:`Store` (``put_many``, ``fetch_ahead``,
``commit``, ``enable_gather``, ``claims``...); what only some stores can do is a small
named protocol a store has by having its members, checked with ``isinstance``, never
probed by name: :class:`BatchReader` (batch gathers), :class:`GathersRows` (gathers
into given rows), :class:`ReadsAhead` (page read-ahead), :class:`Promotes` (names the
entries worth copying up), :class:`ChecksEntries` (checks itself), :class:`Salvages`
(a file that can be walked and salvaged).

Lifetime of buffers: :meth:`Store.get` returns bytes the caller owns (one copy,
safe anywhere, even after other processes evict the entry); :meth:`Store.view`
lends a zero-copy buffer valid only inside its ``with`` block (the store holds a
read lock or transaction meanwhile, so keep the block short).
"""

from __future__ import annotations

import contextlib
import errno
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from mmcache.keys import KEY_SIZE
from mmcache.stats import TierStats
from mmcache.stores.claims import Claims
from mmcache.stores.gathercheck import CopiedCheck, EntryCheck, RowsCheck

__all__ = [
    "KEY_SIZE",
    "NO_SPACE_ERRNOS",
    "BatchReader",
    "ChecksEntries",
    "EntryInfo",
    "GathersRows",
    "Keys",
    "Promotes",
    "ReadsAhead",
    "Salvages",
    "Store",
    "check_key",
    "dir_mode",
    "is_no_space",
]


#: Keys of a batched call: 16-byte ``bytes`` each, or one ``uint8 [n, 16]`` array.
Keys = Sequence[bytes] | npt.NDArray[np.uint8]


#: errno values meaning "the file system (or the user's quota) has no room": every tier
#: turns them into a refused put, or a CacheError at open, never a crash.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says the file system (or the user's quota) is full."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


def check_key(key: bytes) -> bytes:
    """Validate a store key: exactly 16 bytes. Raises ``TypeError``/``ValueError``."""
    if not isinstance(key, bytes):
        raise TypeError(f"store keys are 16-byte digests (bytes), got {type(key).__name__}")
    if len(key) != KEY_SIZE:
        raise ValueError(f"store keys are {KEY_SIZE}-byte digests, got {len(key)} bytes")
    return key


def dir_mode(mode: int) -> int:
    """Folder permissions matching the file ``mode`` of a cache: x wherever r is set
    (0600 -> 0700, 0660 -> 0770)."""
    return mode | ((mode & 0o444) >> 2)


@dataclass(frozen=True)
class EntryInfo:
    """Metadata of one entry: payload ``size``, miss ``cost`` (seconds), creation
    time ``ctime`` (wall clock, seconds since the epoch, as given to ``put``),
    last access ``atime`` (store clock) and read count ``hits``."""

    size: int
    cost: float
    ctime: float
    atime: float
    hits: int


class Store(ABC):
    """A byte store with a hard budget. See the module docstring for the rules.

    Subclasses state in each method's docstring whether it is thread-safe and
    process-safe. ``name`` is the tier name used in stats (``memory``, ``disk``).
    """

    name: str = "store"
    #: Whether the store is also a :class:`BatchReader` (copies byte ranges of a batch of
    #: entries straight into caller arrays, in the reading process). The loader gathers
    #: cached batches from every tier that says so (``Cache.reader``: memory, then disk).
    supports_gather: bool = False
    #: Whether the store keeps a byte budget of its own with a policy (``capacity``,
    #: eviction, refusal: the contract's budget tests). False for a store outside any
    #: node's budget (the shared tier, :mod:`mmcache.shared`: what a share holds is its
    #: owner's business); its ``capacity()`` is then the largest size there is.
    bounded: bool = True

    @abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """Return a copy of the value, or None if absent. Counts a hit or a miss."""

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        """Lend a zero-copy read-only buffer of the value (None if absent).

        Valid only inside the ``with`` block. The default implementation copies.
        """
        value = self.get(key)
        yield None if value is None else memoryview(value)

    @abstractmethod
    def put(
        self, key: bytes, value: bytes | memoryview, *, cost: float = 0.0, ctime: float = 0.0
    ) -> bool:
        """Store ``value`` under ``key`` if the policy admits it; return whether it did.

        Replacing an existing key is allowed. An entry larger than ``capacity()``
        is refused (returns False, counted as ``refused``, logged once with sizes).
        """

    def put_many(self, rows: Sequence[tuple[bytes, bytes, float, float]]) -> list[bool]:
        """``put`` each ``(key, value, cost, ctime)``; per row, whether it was admitted.
        A tier that writes in groups (the disk tier: one commit, one fsync, per MiB)
        overrides it; the default puts one row at a time."""
        return [self.put(k, v, cost=c, ctime=t) for k, v, c, t in rows]

    def enable_gather(
        self,
        check: EntryCheck,
        *,
        copied: CopiedCheck | None = None,
        rows: RowsCheck | None = None,
    ) -> None:
        """Check every entry a batch gather serves with ``check`` (the codec's checksum;
        ``copied``, ``rows``: the same check reading the copies a gather made, one entry
        or a batch of one layout at once), as the cache installs it on each of its
        tiers. The default does nothing: a store without batch gathers is read through
        the tier list's own check."""
        del check, copied, rows

    def claims(self) -> Claims | None:
        """The node's production claims kept on this store's files (one preparation
        per node, :mod:`mmcache.stores.claims`), or None (the default: a store that is
        not shared by the processes of a node has none to offer)."""
        return None

    def fetch_ahead(self, keys: Keys) -> None:
        """Read ``keys`` ahead, for the ``get`` of each that follows soon. A tier far
        away (the shared tier) reads them in batches and keeps them for those gets;
        the default does nothing (a local tier reads one entry as fast as many)."""
        del keys

    def commit(self) -> None:
        """Make what this handle wrote visible to every other handle now. A tier that
        publishes in larger units (the shared tier's packs) commits its open unit; the
        default does nothing (every put is visible once it returns)."""
        return None

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present."""

    def discard(self, key: bytes, *, why: Literal["corrupt", "expired"]) -> bool:
        """Remove an entry the cache found corrupt or expired, counting it as such.

        Returns whether it was present. The default only deletes; tiers with
        shared counters override it to count ``corrupt``/``expired``.
        """
        return self.delete(key)

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is present (does not count a hit or a miss)."""

    def contains_many(self, keys: Keys) -> npt.NDArray[np.bool_]:
        """Presence of each of ``keys`` (no hit/miss counted). Default: one call per key.

        ``keys``: 16-byte keys, or a ``uint8 [n, 16]`` array with one key per row.
        """
        seq = [k.tobytes() for k in keys] if isinstance(keys, np.ndarray) else keys
        return np.fromiter((self.contains(k) for k in seq), dtype=bool, count=len(seq))

    @abstractmethod
    def info(self, key: bytes) -> EntryInfo | None:
        """Metadata of ``key``, or None if absent (does not count a hit or a miss)."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Iterate the keys present (a snapshot; concurrent changes may or may not show)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Payload bytes held now."""

    @abstractmethod
    def capacity(self) -> int:
        """The hard byte budget."""

    @abstractmethod
    def stats(self) -> TierStats:
        """Counters of this tier (aggregated over the node's processes where shared)."""

    @abstractmethod
    def expire(self, before: float) -> int:
        """Remove entries whose ``ctime < before``; return how many were removed."""

    @abstractmethod
    def close(self) -> None:
        """Release handles. Idempotent. The stored data persists where the tier persists."""

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.contains(key)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@runtime_checkable
class BatchReader(Protocol):
    """A tier the loader can gather whole batches from, in the training process.

    What the loader needs of the tiers it gathers from (``Cache.reader``): copy the
    same byte ranges of many entries into preallocated arrays under one read
    lock (no per-sample Python, no pickling through worker pipes), ask which
    keys are present, and count hits it decided to serve. Implementations are
    thread- and process-safe. Stores that implement it set
    ``Store.supports_gather = True``.
    """

    name: str

    def gather_ranges(
        self,
        keys: Keys,
        targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]],
        *,
        count: bool = True,
    ) -> npt.NDArray[np.bool_]:
        """Copy bytes ``[offset, offset+length)`` of each present entry into ``out[i]`` for
        every ``(offset, length, out)`` of ``targets``; return the found mask.
        ``count=False`` leaves the hit/miss counters to :meth:`count_reads`."""
        ...

    def contains_many(self, keys: Keys) -> npt.NDArray[np.bool_]:
        """Presence of each of ``keys`` (no hit/miss counted)."""
        ...

    def count_reads(self, *, hits: int = 0, misses: int = 0) -> None:
        """Add to the hit and miss counters (after ``gather_ranges(count=False)``)."""
        ...


@runtime_checkable
class GathersRows(Protocol):
    """A :class:`BatchReader` that gathers straight into given rows of the targets (the
    disk tier's forms decode into them), instead of into temporaries copied over."""

    def gather_rows(
        self,
        keys: Keys,
        rows: npt.NDArray[np.int64],
        targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]],
        *,
        count: bool = True,
    ) -> npt.NDArray[np.bool_]:
        """Copy the ranges of key ``j`` into row ``rows[j]`` of each target; the found mask."""
        ...


@runtime_checkable
class ReadsAhead(Protocol):
    """A reader that can read the pages of entries ahead of their gather (the disk
    tier's ``madvise``; a tier list's lower tiers)."""

    def prefetch(self, keys: Keys) -> int:
        """Have the pages of ``keys`` read ahead; the bytes asked for."""
        ...


@runtime_checkable
class Promotes(Protocol):
    """A reader over several tiers that names the entries worth copying into its first
    tier (:class:`~mmcache.stores.gathering.TieredReader`)."""

    def promotable(self, keys: Keys) -> list[bytes]:
        """The keys a lower tier holds and the first tier has room for."""
        ...


@runtime_checkable
class ChecksEntries(Protocol):
    """A store that checks its own entries without counting hits (the memory and disk
    tiers): what ``mmcache verify`` asks of each tier."""

    def verify(self, check: Callable[[bytes], bool]) -> list[bytes]:
        """The keys whose value fails ``check`` (counted ``corrupt``, not deleted)."""
        ...


class Salvaged(Protocol):
    """What a salvage kept and lost (entries)."""

    kept: int
    lost: int


@runtime_checkable
class Salvages(Protocol):
    """A store whose file can be damaged beyond single entries (the disk tier's
    B-tree), can tell so, and can be salvaged into a fresh file."""

    def tree_problem(self) -> str | None:
        """Why the file cannot be walked, or None."""
        ...

    def salvage(self) -> Salvaged:
        """Replace the damaged file by one of the entries still readable."""
        ...
