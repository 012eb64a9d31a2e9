"""``TieredStore``: an ordered list of tiers (fastest first) that is itself a :class:`Store`.

One walk over the tiers serves every path of the cache: a read goes down the
list until a tier holds the key, checks the bytes it found (``lookup``'s read
check: a corrupt or expired entry is discarded from that tier and the walk goes
on) and promotes them into every faster tier whose policy admits them; a write
offers the same bytes to every tier (each tier's policy decides, a tier that
fails is logged and skipped: a put never stops training). The write-behind
(:mod:`mmcache.stores.writebehind`) is the same write split in two: the *front*
tiers now, the *deferred* ones (the disk tier: an ``fsync`` per commit) in
groups from a background thread. A new tier (a remote store, a peer exchange)
is one more entry in the list; nothing else names the tiers.

The Store face. The contract (:mod:`mmcache.testing.store_contract`) has one
budget, and a union of tiers that evict on their own has none: a read served
by the memory tier is not a read of the disk tier, so the disk tier's
least-recently-used entry can be the one the memory tier just served, and the
union would then hold more than either budget. So ``contains``, ``keys``,
``info``, ``nbytes``, ``capacity``, ``len``, ``delete``'s and ``expire``'s
answers and the byte counts of ``stats`` are those of the **last tier, the
store of record**; the faster tiers are caches in front of it. ``get`` and
``put`` serve the whole list: ``get`` may still find, in a faster tier, an
entry the store of record has since evicted (always the value last put: a put
goes to every tier, and a tier that refuses a new value drops its old one),
and ``put`` returns whether *any* tier admitted the value. :meth:`holder` says
which tier serves a key (what ``Cache.contains`` asks). Rejected: the union as
the Store face (no budget holds, see above); the first tier as the record (it
is the smallest, and a put it refuses is still cached below).

Which tier served a read. A promotion copies an entry into the faster tiers so
that the *next* read finds it there; the loader promotes the entries of the
batches ahead of the one it gathers (so its gathers find them in memory), and its
gather then reads them from memory: the read that brought them was the lower
tier's. :class:`Promotions` remembers, per key, the tier each promotion came from
until the read that serves it, so that the loader counts that hit for the tier
that really served it (a disk tier's epoch counted as memory hits after the memory
tier was lost). Rejected: a mark per entry in the memory tier (a column of its
shared table, written under its lock and read by every gather) for what only the
process that promoted needs to know.

Thread/process safety: as safe as the tiers (each locks itself); the
TieredStore's own counters (hits, misses, puts of its Store face) are per
object, and approximate when threads share it; its :class:`Promotions` are this
process's, thread-safe. Pickling is the tiers' business: a ``Cache`` rebuilds its
TieredStore in each process instead.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Literal, TypeVar

from mmcache.errors import CorruptEntryError
from mmcache.stats import TierStats
from mmcache.stores.base import EntryInfo, Keys, Store, check_key

__all__ = ["Accepted", "Hit", "Later", "Promotions", "ReadCheck", "Row", "Tier", "TieredStore"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: One entry of a batched write: ``(key, value, cost, ctime)``.
Row = tuple[bytes, bytes, float, float]
#: Promotions remembered at most (the oldest are forgotten first): more than the loader
#: has in flight (its read-ahead promotes 8 batches ahead), 16 B a key (~2 MiB in all).
PROMOTIONS_KEPT = 1 << 14


@dataclass(frozen=True)
class Tier:
    """One tier of a :class:`TieredStore` and how the list treats it.

    ``verify``: passed to the read check for the bytes this tier serves (the
    cache trusts its memory tier, which holds only bytes verified or produced on
    the way in, and checks every disk read). ``deferred``: the write-behind
    writes this tier from a background thread instead of at once.

    A *side tier* (``promote_into=False, budgeted=False``: the cluster's in-flight
    tier) is read in its place in the list like any other, but the list never
    writes it: no put is offered to it and no hit is promoted into it (its owner
    writes it), and it is outside the budget: never the store of record, and what
    it serves is not promoted into the tiers above it (its entries are there for a
    while, on purpose outside their budget and policy). ``label``: its name in the
    list when it is not its store's ``name`` (a second memory store).

    ``node=False``: a tier that is not the node's own (the shared tier below the disk
    tier, :mod:`mmcache.shared`): read, written and promoted from like any other, but
    never the store of record (it has no budget of the node's) and left alone by the
    node's maintenance (``Cache.tiers``: gc, verify).
    """

    store: Store
    verify: bool = True
    deferred: bool = False
    promote_into: bool = True
    budgeted: bool = True
    label: str | None = None
    node: bool = True

    @property
    def name(self) -> str:
        """The tier's name in the list: ``label``, else its store's ``name``."""
        return self.label or self.store.name


# Accepted and Hit are made once per read: plain slotted records (a frozen dataclass's
# __init__ costs about 1 us, a third of what the tier walk adds to a memory hit).
@dataclass(slots=True)
class Accepted(Generic[T]):
    """A read check's answer for bytes it accepts: what to serve (``value``) and the
    ``cost`` and ``ctime`` to promote them with."""

    value: T
    cost: float
    ctime: float


#: ``check(raw, verify)``: accept the bytes a tier served (:class:`Accepted`), return
#: None for an expired entry, or raise :class:`~mmcache.errors.CorruptEntryError`.
ReadCheck = Callable[[bytes, bool], "Accepted[T] | None"]

#: ``later(stores, row)``: promote ``row`` into ``stores`` (deferred tiers) later, from a
#: background thread (the write-behind's :meth:`~mmcache.stores.writebehind.WriteBehind.promote`).
Later = Callable[[tuple[Store, ...], Row], None]


@dataclass(slots=True)
class Hit(Generic[T]):
    """What :meth:`TieredStore.lookup` found: the checked value and the tier that held it."""

    value: T
    tier: Store


class Promotions:
    """The entries this process promoted into a faster tier, each with the name of the
    tier it came from, until the read that serves it (see the module docstring).

    :meth:`note` records a promotion, :meth:`take` asks for (and forgets) those of the
    keys a batch served that were promoted after a :meth:`mark` (the start of the
    reader's epoch). A promotion can land after the read it was meant for (the
    loader's read-ahead lagging behind its gathers: that read was the lower tier's
    anyway); counted from a mark, it is not taken for the next epoch's read, which
    memory really serves. At most ``kept`` are remembered, the oldest forgotten first.
    Thread-safe: promotions come from the planner and its read-ahead threads, takes
    from the assembling threads.
    """

    def __init__(self, kept: int = PROMOTIONS_KEPT) -> None:
        self._kept = kept
        self._from: dict[bytes, tuple[str, int]] = {}  # insertion order: the oldest first
        self._seq = 0  # promotions noted so far
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._from)

    def mark(self) -> int:
        """A point in the promotions: :meth:`take` only counts those noted after it."""
        return self._seq

    def note(self, key: bytes, tier: str) -> None:
        """``key`` was promoted from the tier called ``tier``."""
        with self._lock:
            self._seq += 1
            self._from.pop(key, None)  # a second promotion is the newest
            self._from[key] = (tier, self._seq)
            if len(self._from) > self._kept:
                del self._from[next(iter(self._from))]

    def take(self, keys: Keys, *, since: int = 0) -> dict[int, str]:
        """For the positions of ``keys`` (16-byte keys, or rows of a ``uint8 [n, 16]``
        array) promoted after the mark ``since`` and not read since, the tier each came
        from; forgets every promotion of ``keys``."""
        if not self._from:  # the common case (a warm memory tier): no lock, no copies
            return {}
        with self._lock:
            found = {}
            for i, key in enumerate(keys):
                got = self._from.pop(key if isinstance(key, bytes) else key.tobytes(), None)
                if got is not None and got[1] > since:
                    found[i] = got[0]
            return found


class TieredStore(Store):
    """Tiers fastest first; read-through with promotion, write to all, deferred writes.

    >>> import tempfile
    >>> from mmcache.stores.disk import DiskStore
    >>> disk = DiskStore(tempfile.mkdtemp(), capacity=2**20)
    >>> store = TieredStore([Tier(disk, deferred=True)])
    >>> store.put(bytes(16), b"value")
    True
    >>> store.get(bytes(16)), store.holder(bytes(16)).name
    (b'value', 'disk')
    >>> store.close()

    The cache's list is ``[Tier(memory, verify=False), Tier(disk, deferred=True)]``.
    Bare stores are accepted in the list (``Tier(store)`` defaults). An empty
    list is a store that holds nothing (a cache without tiers).
    """

    name = "tiered"

    def __init__(self, tiers: Sequence[Store | Tier]) -> None:
        self._set([t if isinstance(t, Tier) else Tier(t) for t in tiers])
        self._hits = self._misses = self._puts = self._admitted = 0
        #: The entries this process promoted, until their next read (:class:`Promotions`).
        self.promotions = Promotions()

    def _set(self, tiers: list[Tier]) -> None:
        # Replaced whole (never mutated), so a walk in another thread keeps a consistent list.
        self._tiers: tuple[Tier, ...] = tuple(tiers)
        self._written = tuple(t for t in tiers if t.promote_into)  # the list's puts go here
        self._front = tuple(t.store for t in self._written if not t.deferred)
        self._deferred = tuple(t for t in self._written if t.deferred)
        self._by_name = {t.name: t.store for t in tiers}
        self._record = next((t.store for t in reversed(tiers) if t.budgeted and t.node), None)
        if len(self._by_name) != len(tiers):
            raise ValueError(f"tier names must differ, got {[t.name for t in tiers]}")

    # -- the list ---------------------------------------------------------------------------
    @property
    def tiers(self) -> tuple[Store, ...]:
        """The tiers, fastest first."""
        return tuple(t.store for t in self._tiers)

    @property
    def entries(self) -> tuple[Tier, ...]:
        """The tiers with how the list treats each, fastest first."""
        return self._tiers

    def insert(self, tier: Tier, *, after: str) -> None:
        """Put ``tier`` right after the tier called ``after`` (a ValueError if there is
        none, or if ``tier``'s name is taken)."""
        tiers = list(self._tiers)
        i = next((j for j, t in enumerate(tiers) if t.name == after), None)
        if i is None:
            raise ValueError(f"no tier {after!r} to put the {tier.name!r} tier after")
        tiers.insert(i + 1, tier)
        self._set(tiers)

    def remove(self, name: str) -> Store | None:
        """Take the tier called ``name`` out of the list (left open: the caller closes
        it) and return its store, or None if there is none."""
        store = self._by_name.get(name)
        if store is not None:
            self._set([t for t in self._tiers if t.name != name])
        return store

    def tier(self, name: str) -> Store | None:
        """The tier called ``name`` (its ``Store.name``), or None."""
        return self._by_name.get(name)

    def by_name(self) -> dict[str, Store]:
        """The tiers by name, fastest first (a new dict)."""
        return dict(self._by_name)

    @property
    def record(self) -> Store | None:
        """The store of record (the last budgeted tier of the node), or None without one."""
        return self._record

    @property
    def deferred(self) -> bool:
        """Whether some tier is written later by the write-behind."""
        return bool(self._deferred)

    def replace(self, name: str, store: Store) -> Store:
        """Put ``store`` in the place of the tier called ``name``; return the old tier
        (left open: the caller closes it). ``store.name`` must be ``name``."""
        if store.name != name or name not in self._by_name:
            raise ValueError(f"no tier {name!r} to replace with a {store.name!r} store")
        tiers = list(self._tiers)
        i = next(j for j, t in enumerate(tiers) if t.name == name)
        old = tiers[i]
        tiers[i] = replace(old, store=store)
        self._set(tiers)
        return old.store

    def holder(self, key: bytes) -> Store | None:
        """The first tier holding ``key`` (no hit or miss counted, no TTL or checksum
        checked), or None: where a read would be served from."""
        for t in self._tiers:
            if t.store.contains(key):
                return t.store
        return None

    # -- reads ------------------------------------------------------------------------------
    def lookup(
        self, key: bytes, check: ReadCheck[T], *, later: Later | None = None
    ) -> Hit[T] | None:
        """The first tier's entry for ``key`` that ``check`` accepts, promoted into every
        faster tier (whose policy may refuse it), or None.

        ``later``: where promotions into *deferred* faster tiers go (the disk tier, for a
        hit of the shared tier below it: a commit, so an ``fsync``, per entry, most of
        what a shared hit costs), written from the write-behind's thread in groups;
        without it they are written here, at once.

        ``check(raw, verify)`` sees the bytes with the tier's ``verify`` flag; an
        entry it rejects is discarded from that tier (counted there as ``expired``
        or ``corrupt``, a corrupt one logged as an error) and the walk goes on.
        Counts a hit or a miss per tier it asks, and one for this store.
        """
        tiers = self._tiers
        for i, t in enumerate(tiers):
            raw = t.store.get(key)
            if raw is None:
                continue
            try:
                accepted = check(raw, t.verify)
            except CorruptEntryError as exc:
                logger.error("corrupt %s-tier entry %s dropped: %s", t.store.name, key.hex(), exc)
                t.store.discard(key, why="corrupt")
                continue
            if accepted is None:
                t.store.discard(key, why="expired")
                continue
            if i and t.budgeted:
                faster = tiers[:i]
                if later is not None:
                    deferred = tuple(f.store for f in faster if f.deferred and f.promote_into)
                    if deferred:
                        later(deferred, (key, raw, accepted.cost, accepted.ctime))
                    faster = tuple(f for f in faster if not f.deferred)
                if _promote(faster, key, raw, accepted.cost, accepted.ctime):
                    self.promotions.note(key, t.name)
            self._hits += 1
            return Hit(accepted.value, t.store)
        self._misses += 1
        return None

    def get(self, key: bytes) -> bytes | None:
        """The value from the first tier holding ``key``, promoted into the faster tiers
        (with the cost and creation time that tier recorded)."""
        check_key(key)
        return self._get_from(key, 0)

    def _get_from(self, key: bytes, start: int) -> bytes | None:
        """:meth:`get`, asking the tiers from ``start`` on."""
        tiers = self._tiers
        for i in range(start, len(tiers)):
            t = tiers[i]
            raw = t.store.get(key)
            if raw is None:
                continue
            if i and t.budgeted:
                info = t.store.info(key)
                if info is not None and _promote(tiers[:i], key, raw, info.cost, info.ctime):
                    self.promotions.note(key, t.name)
            self._hits += 1
            return raw
        self._misses += 1
        return None

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        """Lend the value without a copy when the first tier holds it (that tier's own
        :meth:`~mmcache.stores.base.Store.view`, under its rules: keep the block short);
        else :meth:`get` from the lower tiers (promoted, as ``get`` does), lent from
        that copy. None if absent. Valid only inside the ``with`` block.

        What the loader reads an entry of another shape with (a row of varied length):
        the default ``view`` copied every such entry out of shared memory twice."""
        check_key(key)
        tiers = self._tiers
        if tiers:
            with tiers[0].store.view(key) as mv:
                if mv is not None:
                    self._hits += 1
                    yield mv
                    return
        raw = self._get_from(key, 1 if tiers else 0)
        yield None if raw is None else memoryview(raw)

    # -- writes -----------------------------------------------------------------------------
    def put(
        self, key: bytes, value: bytes | memoryview, *, cost: float = 0.0, ctime: float = 0.0
    ) -> bool:
        """Offer ``value`` to every tier; return whether any tier admitted it."""
        check_key(key)
        raw = value if isinstance(value, bytes) else bytes(value)
        return self.put_many([(key, raw, cost, ctime)])[0]

    def put_many(self, rows: Sequence[Row], *, skip_front: bool = False) -> list[bool]:
        """Offer every ``(key, value, cost, ctime)`` row to every tier (``skip_front``: to
        the deferred tiers only, the write-behind's second half); return, per row,
        whether any tier admitted it.

        A tier with its own ``put_many`` (the disk tier: one commit per group) gets
        the rows in one call. A tier that raises ``OSError`` (a full disk, a
        damaged segment) is logged and counts as refusing: a put never stops training.
        """
        admitted = [False] * len(rows)
        for t in self._deferred if skip_front else self._written:
            _put_rows(t.store, rows, admitted)
        self._puts += len(rows)
        self._admitted += sum(admitted)
        return admitted

    def put_into(self, stores: Sequence[Store], rows: Sequence[Row]) -> list[bool]:
        """Offer ``rows`` to ``stores`` only (tiers of this list: the promotions the
        write-behind writes); return, per row, whether any of them admitted it."""
        admitted = [False] * len(rows)
        for store in stores:
            _put_rows(store, rows, admitted)
        return admitted

    def put_front(self, key: bytes, value: bytes, *, cost: float, ctime: float) -> bool:
        """Offer one entry to the front tiers only (the write-behind's first half);
        return whether any of them admitted it."""
        admitted = False
        for store in self._front:
            try:
                admitted = store.put(key, value, cost=cost, ctime=ctime) or admitted
            except OSError as exc:
                logger.warning("put to %s tier failed: %s", store.name, exc)
        return admitted

    def fetch_ahead(self, keys: Keys) -> None:
        """Ask every tier to read ``keys`` ahead (:meth:`Store.fetch_ahead`: the shared tier
        reads a batch's misses grouped by pack before they are looked up one by one)."""
        for t in self._tiers:
            t.store.fetch_ahead(keys)

    def commit(self) -> None:
        """Make what every tier holds of this handle's writes visible to others
        (:meth:`Store.commit`: the shared tier's open pack); a tier that fails is logged."""
        for t in self._tiers:
            try:
                t.store.commit()
            except OSError as exc:
                logger.warning("commit of the %s tier failed: %s", t.name, exc)

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` from every tier; return whether the store of record held it."""
        check_key(key)
        held = False
        for t in self._tiers:
            gone = t.store.delete(key)
            held = gone if t.store is self._record else held
        return held

    def discard(self, key: bytes, *, why: Literal["corrupt", "expired"]) -> bool:
        """Remove ``key`` from every tier, counting it there as ``why``."""
        held = False
        for t in self._tiers:
            gone = t.store.discard(key, why=why)
            held = gone if t.store is self._record else held
        return held

    def expire(self, before: float) -> int:
        """Expire every tier; return how many entries the store of record removed."""
        removed = 0
        for t in self._tiers:
            n = t.store.expire(before)
            removed = n if t.store is self._record else removed
        return removed

    # -- the store of record's view --------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        check_key(key)
        record = self.record
        return record is not None and record.contains(key)

    def info(self, key: bytes) -> EntryInfo | None:
        check_key(key)
        record = self.record
        return record.info(key) if record is not None else None

    def keys(self) -> Iterator[bytes]:
        record = self.record
        return record.keys() if record is not None else iter(())

    def __len__(self) -> int:
        record = self.record
        return len(record) if record is not None else 0

    def nbytes(self) -> int:
        record = self.record
        return record.nbytes() if record is not None else 0

    def capacity(self) -> int:
        record = self.record
        return record.capacity() if record is not None else 0

    def stats(self) -> TierStats:
        """Reads and puts of this store's face (per object), and the store of record's
        evictions, expiries, corrupt drops and bytes."""
        record = self.record
        base = record.stats() if record is not None else TierStats(budget=0)
        return TierStats(
            hits=self._hits,
            misses=self._misses,
            puts=self._puts,
            admitted=self._admitted,
            refused=self._puts - self._admitted,
            evictions=base.evictions,
            expired=base.expired,
            corrupt=base.corrupt,
            bytes=base.bytes,
            budget=base.budget,
            items=base.items,
        )

    def close(self) -> None:
        """Close every tier (idempotent); the list is empty afterwards, so a writer still
        holding this store writes nothing."""
        tiers = self._tiers
        self._set([])
        for t in tiers:
            t.store.close()

    def __repr__(self) -> str:
        return f"TieredStore([{', '.join(t.name for t in self._tiers)}])"


def _promote(faster: Sequence[Tier], key: bytes, raw: bytes, cost: float, ctime: float) -> bool:
    """Offer a hit to the tiers above the one that served it (their policies decide);
    return whether one of them admitted it."""
    admitted = False
    for t in faster:
        if not t.promote_into:
            continue
        try:
            admitted = t.store.put(key, raw, cost=cost, ctime=ctime) or admitted
        except OSError as exc:  # a failed promotion costs a hit later, nothing more
            logger.warning("promotion to %s tier failed: %s", t.store.name, exc)
    return admitted


def _put_rows(store: Store, rows: Sequence[Row], admitted: list[bool]) -> None:
    """Offer ``rows`` to one tier in one ``put_many`` (a tier that batches commits them in
    groups) and set ``admitted[i]`` for each row it admitted; a tier that fails is
    logged and skipped (a put never stops training)."""
    try:
        got = store.put_many(rows)
    except OSError as exc:
        logger.warning("put to %s tier failed: %s", store.name, exc)
        return
    for i, ok in enumerate(got):
        if ok:
            admitted[i] = True
