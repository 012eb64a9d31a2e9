"""``Cache``: the memory and disk tiers, a policy, budgets, TTL and stats, as one object.

Data path of a read (:meth:`Cache.get`): the tiers in order, fastest first
(a :class:`~mmcache.stores.tiered.TieredStore`): the node-shared memory tier,
then the persistent disk tier (checksum verified; a corrupt entry is dropped,
counted and never returned), promoting a disk hit into memory when the memory
tier's policy admits it. A write (:meth:`Cache.put`) encodes the sample once
(:mod:`mmcache.codec`) and offers the same bytes to every tier: memory for
this run, disk for the next runs; :func:`mmcache.writeback.write_behind` defers
the disk half to a background thread.

Verification: every read of every tier is checked against the entry's xxh3
checksum, so a flipped byte is never served: disk reads (LMDB does not checksum its
pages) and memory reads (``/dev/shm`` can be written by any process of the user),
batch gathers included (the copies are checked while they are in the CPU cache,
:mod:`mmcache.stores.gathercheck`); a damaged entry is dropped, counted ``corrupt``
and produced again. ``mmcache verify`` checks every entry of both.

TTL: every entry carries its creation time from ``clock`` (default
``time.time``: persisted entries outlive the process, so a monotonic clock,
which restarts at boot, cannot date them). An entry older than ``ttl`` is a
miss and is removed.

Thread/process safety: a ``Cache`` may be used from several threads (the
stores lock internally) and from every process of the node: DataLoader workers
(fork or spawn) get their own handles on the same shared memory and LMDB
environment; pickling carries only the configuration.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np

from mmcache import codec, sizing
from mmcache.cacheroot import (
    memory_group,
    read_config,
    record_config_once,
    root_id,
    write_config,
)
from mmcache.cacheroot import memory_name as _memory_name
from mmcache.checks import check_int
from mmcache.codec.compact import parse_disk_form
from mmcache.errors import CacheError, ConfigError
from mmcache.keys import as_key
from mmcache.maintenance import GcReport, VerifyReport
from mmcache.maintenance import gc as _gc
from mmcache.maintenance import verify as _verify
from mmcache.policies import Policy, get_policy
from mmcache.readthrough import read_through
from mmcache.registry import FingerprintRegistry
from mmcache.rootfiles import make_dir
from mmcache.scope import ScopeLike, parse_scope
from mmcache.shared.tier import SharedLike, SharedTier, as_shared
from mmcache.stats import CacheStats
from mmcache.stores import writebehind
from mmcache.stores.base import BatchReader, Store, dir_mode
from mmcache.stores.claims import Claims
from mmcache.stores.disk import DiskStore
from mmcache.stores.disk.formed import FormedDiskStore
from mmcache.stores.gathering import TieredReader
from mmcache.stores.memory import (
    MAX_INDEX_CAPACITY,
    MemoryStore,
    reclaim_orphans,
    store_exists,
)
from mmcache.stores.memory.budgets import shm_claims, sizing_turn
from mmcache.stores.tiered import Accepted, Row, Tier, TieredStore
from mmcache.units import parse_duration, parse_size

if TYPE_CHECKING:
    from mmcache.stores.disk import CompactReport

__all__ = ["Cache", "GcReport", "VerifyReport", "check_reads"]

S = TypeVar("S", bound=Store)

logger = logging.getLogger(__name__)

Sample = dict[str, np.ndarray]
KeyLike = bytes | str
Fallback = Literal["raise", "uncached"]
OpenedAs = Literal["owner", "worker", "inspect"]


_to_key = as_key  # 16 bytes and 32 hex as they are, any other str/bytes hashed


def check_reads(store: S) -> S:
    """Install the codec's checksum as the read check of ``store``'s batch gathers, as
    the cache does for each of its tiers, and return it (:meth:`Store.enable_gather
    <mmcache.stores.base.Store.enable_gather>`): a memory store (the memory tier, the
    cluster's in-flight tier) and a disk store check the copies they made (a batch of
    one layout at once); a formed disk store the stored entry, before its decode. Other
    stores keep the default, none (their reads go through the tier list's check)."""
    store.enable_gather(
        codec.checksum_matches,
        copied=codec.checksum_matches_copied,
        rows=codec.checksums_match_rows,
    )
    return store


@dataclass(frozen=True)
class _Option:
    """One configuration option of :class:`Cache`, written once here: the ``__init__``
    parameter ``name``, the attribute ``attr`` holding its checked value, and whether
    ``cache.json`` records it (``recorded``: the root's budgets, policy, TTL and disk
    form; ``as_recorded`` makes it plain JSON) and ``repr`` shows it. Pickling carries
    every option (``__init__`` takes each checked value back)."""

    name: str
    attr: str
    recorded: bool = False
    shown: bool = False
    as_recorded: Callable[[Any], Any] = lambda value: value


#: Cache's options, in ``__init__``'s order (after ``root``); ``_options``,
#: ``__getstate__`` and ``__repr__`` are derived from it, and a test pins it to the signature.
_OPTIONS = (
    _Option("memory", "memory_budget", recorded=True, shown=True),
    _Option("disk", "disk_budget", recorded=True, shown=True),
    _Option("policy", "policy", recorded=True, shown=True, as_recorded=lambda p: p.name),
    _Option("ttl", "ttl", recorded=True, shown=True),
    _Option("clock", "clock"),
    _Option("temporary", "temporary"),
    _Option("fallback", "fallback"),
    _Option("mode", "mode"),
    _Option("memory_entries", "memory_entries"),
    _Option("scope", "scope"),
    _Option("disk_form", "disk_form", recorded=True, as_recorded=str),
    _Option("shared", "shared"),
)


@dataclass(frozen=True)
class _TierSpec:
    """One tier a cache wants: its name (the store class's ``name``), whether it has a
    budget, how to open it (None: not there to attach), and how the list treats it."""

    name: str
    wanted: bool
    open: Callable[[], Store | None]
    verify: bool  # check the checksum of what it serves
    deferred: bool  # the write-behind writes it from a background thread
    node: bool = True  # the node's own tier (False: the shared tier below the disk tier)


class Cache:
    """Node-shared memory tier + persistent disk tier under a byte budget each.

    The tiers form a :class:`~mmcache.stores.tiered.TieredStore` (``store``),
    fastest first; ``memory`` and ``disk`` name its tiers (None when absent).

    >>> cache = Cache("/tmp/mmcache-doc", memory="64MiB", disk="1GiB")  # doctest: +SKIP
    >>> cache.get_or_produce(key, lambda: {"x": np.zeros(3)})            # doctest: +SKIP
    >>> cache.put("sample/001.jpg", {"x": np.zeros(3)})                  # doctest: +SKIP

    Keys. ``get``, ``lookup``, ``put``, ``put_encoded``, ``get_or_produce``,
    ``contains``, ``in`` and ``delete`` take any ``str`` or ``bytes``, mapped by
    :func:`mmcache.keys.as_key`: 16 bytes (a :func:`~mmcache.keys.sample_key`) and
    32 hex digits (its :func:`~mmcache.keys.key_hex`, either case) name that key
    as they always did; any other string or bytes (``"k0"``, ``b"abc"``) is hashed
    to 16 bytes (``"abc"`` and ``b"abc"`` are different keys). ``put_many`` and
    ``tag`` take 16-byte keys only (the loader's hot path).

    Args:
        root: directory of the persistent tier and of the cache's metadata.
        memory: byte budget of the node-shared memory tier: an int, an IEC
            string (``"8GiB"``), ``"auto"`` (a fraction of what the host really
            has free, see :mod:`mmcache.sizing`) or 0 (no memory tier).
        disk: byte budget of the disk tier under ``root``, or None (no disk tier).
        policy: a registered policy name (``value``, ``keep``, ``lru``, ``fifo``,
            ``lfu``) or a :class:`Policy` instance; used by both tiers.
        ttl: seconds (or ``"7d"``) after which an entry expires; None: never.
        clock: wall clock for entry creation times (injectable for tests).
        temporary: remove the shared-memory segments when the last process
            using them closes (the disk tier is kept).
        fallback: what to do when a tier cannot be opened (no /dev/shm, a
            read-only or full root): ``"raise"`` (default) stops with the
            reason; ``"uncached"`` logs one warning and goes on without it.
        mode: permissions of the files the cache creates (root folder, disk
            tier, shared-memory segments, ``cache.json``); folders get the
            matching search bits. The default ``0o600`` keeps the cache to its
            owner; ``0o660`` shares it with the group (e.g. one cache for the
            jobs of a team on a node). The memory tier is then shared with the
            cache root's group (make the root group-owned: ``chgrp team ROOT``):
            one copy in ``/dev/shm/mmcache-g<gid>/`` for every member; it is
            never shared beyond that group, whatever the "other" bits say.
        memory_entries: the entries the memory tier indexes, fixed (a warning says
            when the index is full while bytes are free). Default: the index starts
            at one entry per 4 KiB of the budget (at least 1024) and grows, sized
            from the entry sizes seen, when it is full while bytes are free, up to
            one entry per 64 B, so many small samples (tokens only, pooled
            features) use the whole budget.
        scope: ``"node"`` (default): each node caches alone. A
            :class:`~mmcache.cluster.Cluster` (``Cluster(peer_timeout=60)``;
            ``"cluster"``: ``Cluster()``): with ``torch.distributed`` initialised, a
            :class:`~mmcache.DataLoader` over this cache gives each sample one home
            node and sends it ahead to the nodes that read it (see
            :mod:`mmcache.cluster`); without it, as "node". The cache only carries
            it (``cluster``).
        disk_form: how the disk tier stores entries (:mod:`mmcache.codec.compact`):
            ``"raw"`` (default), ``"zstd"`` (lossless) or ``"jpeg:Q"`` (images
            re-encoded as JPEG of quality Q: lossy, several times fewer bytes); hits
            are gathered in the training process (compact ones decoded on threads),
            each in its own folder (``disk/``, ``disk-zstd/``...): forms never mix.
        shared: a shared tier below the disk tier (:class:`~mmcache.shared.SharedTier`,
            or its location: a folder on a shared file system, an object store URL such as
            ``"s3://bucket/prefix"``): a miss of memory and disk is looked up there
            before it is produced, a hit checked and kept in the node's tiers, and
            what this node produces is published there (written behind, in packs).
            Not recorded in ``cache.json``: each run says which share it reads.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        memory: int | str = "auto",
        disk: int | str | None = None,
        policy: str | Policy = "value",
        ttl: float | str | None = None,
        clock: Callable[[], float] = time.time,
        temporary: bool = False,
        fallback: Fallback = "raise",
        mode: int = 0o600,
        memory_entries: int | None = None,
        scope: ScopeLike = "node",
        disk_form: str = "raw",
        shared: SharedLike | None = None,
        _opened_as: OpenedAs = "owner",
        _root_id: int | None = None,
    ) -> None:
        #: The cluster's configuration (``scope``), or None: each node caches alone.
        self.cluster = parse_scope(scope)
        if not isinstance(mode, int) or mode & ~0o666 or (mode & 0o600) != 0o600:
            raise ConfigError(
                f"mode must be a file permission mask within 0o666 that includes 0o600, "
                f"got {mode!r}"
            )
        self.mode = mode
        if fallback not in ("raise", "uncached"):
            raise ConfigError(f"fallback must be 'raise' or 'uncached', got {fallback!r}")
        self.root = Path(os.path.expanduser(os.fspath(root))).absolute()
        self.policy = get_policy(policy)
        self.ttl = None if ttl is None else parse_duration(ttl)
        self.clock = clock
        self.temporary = temporary
        self.fallback: Fallback = fallback
        if memory_entries is not None:  # checked here, so the error names this parameter
            check_int("memory_entries", memory_entries, minimum=1, maximum=MAX_INDEX_CAPACITY)
        self.memory_entries = memory_entries
        self.disk_form = parse_disk_form(disk_form)
        #: The shared tier's configuration (``shared=``), or None.
        self.shared: SharedTier | None = as_shared(shared)
        #: Tiers that could not be opened (fallback="uncached"), with the reason.
        self.degraded: dict[str, str] = {}
        # "owner": a caller creating or configuring the cache; its budgets are recorded
        # in cache.json. "worker": a pickled copy re-attaching; records nothing.
        # "inspect" (open_existing, the CLI): attaches the memory tier only if it
        # exists and records nothing, so a one-off override (memory=0, a TTL) never
        # becomes the budget of later opens.
        self._opened_as: OpenedAs = _opened_as
        self._inspect = _opened_as == "inspect"
        # The root's identity (cacheroot.root_id), read or made once at open; a pickled
        # copy brings its parent's, so a worker attaches the parent's memory tier even
        # if the root was removed and made again meanwhile.
        self._root_id = _root_id
        auto = memory == "auto"
        if auto:
            self.memory_budget = 0  # sized as the tiers open, in this user's turn (below)
        elif isinstance(memory, (int, str)):
            self.memory_budget = parse_size(memory, name="memory")
        else:
            raise ConfigError(f"memory must be bytes, an IEC string, 'auto' or 0, got {memory!r}")
        self.disk_budget = None if disk is None else parse_size(disk, name="disk")
        self.registry: FingerprintRegistry | None = None
        self._store = TieredStore([])
        if not auto:
            self._open()
            return
        # Sized and created in this user's turn: a job started at the same moment
        # then sees this store's budget (mmcache.sizing).
        with sizing_turn(memory_group(self.root, self.mode)):
            self._prepare_root(memory_wanted=True)
            claims = shm_claims(self.memory_name)
            host = sizing.host_memory(
                shm=claims.directory, shm_promised=claims.promised, shm_own=claims.own
            )
            self.memory_budget = sizing.auto_memory_budget(host=host)
            logger.debug("memory='auto' for %s: %s", self.root, sizing.describe(host))
            self._open()

    # -- opening --------------------------------------------------------------------------
    def _specs(self) -> list[_TierSpec]:
        """The tiers this cache wants, fastest first."""
        return [
            _TierSpec(
                MemoryStore.name,
                self.memory_budget > 0,
                self._open_memory,
                # Every read is checked: /dev/shm can be written by any process of the
                # user after an entry was checked on the way in (a gather checks the
                # copies it made while cache-hot: MemoryStore.enable_gather).
                verify=True,
                deferred=False,
            ),
            _TierSpec(DiskStore.name, self.disk_budget is not None, self._open_disk, True, True),
            # Below the node's tiers; every hit checked; published by the write-behind.
            _TierSpec(
                SharedTier.name,
                self.shared is not None,
                self._open_shared,
                verify=True,
                deferred=True,
                node=False,
            ),
        ]

    def _degrade(self, tier: str, exc: BaseException) -> None:
        msg = f"cannot open the {tier} tier of cache {self.root}: {exc}"
        if self._inspect and tier == MemoryStore.name:
            # Inspecting (the CLI): a damaged memory tier is what stats and verify
            # report and gc removes, so it must not stop them from opening.
            logger.info("%s", msg)
            self.degraded[tier] = str(exc)
            return
        if self.fallback == "raise":
            raise CacheError(f"{msg} (pass fallback='uncached' to train without it)") from exc
        logger.warning("%s; continuing without it (fallback='uncached')", msg)
        self.degraded[tier] = str(exc)

    def _prepare_root(self, *, memory_wanted: bool) -> None:
        """Make the root's folder and read (or, for an owner configuring a memory tier,
        make) its identity; idempotent. Runs before ``memory="auto"`` is sized, since the
        identity names this root's memory tier, whose pages count as its own room."""
        folder_mode = dir_mode(self.mode)
        try:
            if not self.root.is_dir():  # (the user's root may be a link to a folder)
                make_dir(self.root, folder_mode)  # exact mode; a 2770 parent's setgid kept
        except OSError as exc:
            if self.disk_budget is not None:
                self._degrade(DiskStore.name, exc)
                self.disk_budget = None
        if self._root_id is None:  # a caller configuring a memory tier gives the root one
            create = self._opened_as == "owner" and memory_wanted
            self._root_id = root_id(self.root, mode=self.mode, create=create)

    def _open(self) -> None:
        self._prepare_root(memory_wanted=self.memory_budget > 0)
        specs = self._specs()
        opened: dict[str, Store] = {}
        # Slowest first: the disk tier decides whether the root is usable (and records
        # the budgets) before any shared memory is attached.
        for spec in reversed(specs):
            if not spec.wanted:
                continue
            try:
                store = spec.open()
            except (OSError, CacheError) as exc:
                self._degrade(spec.name, exc)
                continue
            if store is not None:
                opened[spec.name] = store
        self._store = TieredStore(
            [
                Tier(opened[s.name], s.verify, s.deferred, node=s.node)
                for s in specs
                if s.name in opened
            ]
        )
        if self._opened_as == "owner" and self.disk_budget is None and self.memory_budget > 0:
            # A memory-only root records its options too (the disk tier's opening does it
            # otherwise), so the CLI can check and collect it; never over a disk's record.
            record_config_once(self.root, self._options(), mode=self.mode)

    def _open_disk(self) -> Store:
        if self.disk_budget is None:  # pragma: no cover - only opened when wanted
            raise CacheError("no disk budget")
        disk = self._new_disk(self.disk_budget)
        if self._opened_as == "owner":
            write_config(self.root, self._options(), mode=self.mode)
        try:
            self.registry = FingerprintRegistry(self.root / "fingerprints", mode=self.mode)
        except OSError as exc:
            logger.debug("no fingerprint registry in %s: %s", self.root, exc)
        return disk

    def _new_disk(self, capacity: int) -> DiskStore:
        """The disk tier in its form's folder, gathering (verified) in this process."""
        form, root, policy = self.disk_form, self.root, self.policy
        if form.kind == "raw":
            disk = DiskStore(root / "disk", capacity=capacity, policy=policy, mode=self.mode)
            return check_reads(disk)
        formed = FormedDiskStore(
            root / f"disk-{form.tag}", form=form, capacity=capacity, policy=policy, mode=self.mode
        )
        return check_reads(formed)

    def _open_shared(self) -> Store | None:
        # The cache's own handle (closing the cache closes it, not the caller's object).
        # Opening lists nothing yet (the first read does), so it cannot fail for a share
        # that cannot be reached: that is one warning, later, and local production.
        return None if self.shared is None else self.shared.handle()

    def _open_memory(self) -> Store | None:
        group = memory_group(self.root, self.mode)
        if self._inspect and not store_exists(self.memory_name, group=group):
            return None  # inspecting a cache must not allocate shared memory
        memory = self._memory_store(
            self.memory_name,
            capacity=self.memory_budget,
            policy=self.policy,
            create=not self._inspect,
            temporary=self.temporary,
            index_capacity=self.memory_entries,
        )
        if self._opened_as == "owner":
            # The memory tiers of this root's earlier incarnations (removed and made
            # again at this path, or from before it had an identity) that nobody uses
            # any more: their names are unknown here, their recorded owner path is not.
            try:
                reclaim_orphans(owner=str(self.root), group=group)
            except (OSError, CacheError) as exc:  # a cleanup: never a reason not to open
                logger.debug("cannot reclaim older memory tiers of %s: %s", self.root, exc)
        return check_reads(memory)

    def _memory_store(self, name: str, **options: Any) -> MemoryStore:
        """A node-shared memory store of this root, with the root's sharing: the group's
        (``mode & 0o660``) when the cache is shared with the root's group, else 0600."""
        group = memory_group(self.root, self.mode)
        mode = self.mode & 0o660 if group is not None else 0o600
        return MemoryStore(
            name,
            owner_path=str(self.root),
            owner_id=self.root_id,
            mode=mode,
            group=group,
            **options,
        )

    def open_side_tier(self, name: str, *, capacity: int, entries: int) -> MemoryStore:
        """Create (or attach to) the node-shared memory tier ``<memory tier>-<name>`` and
        put it in the tier list right after the memory tier, as a side tier
        (:class:`~mmcache.stores.tiered.Tier` ``promote_into=False, budgeted=False``):
        gathered and looked up after the memory tier, so its entries are ordinary
        memory hits, but outside the memory budget and policy, never promoted into and
        never offered the cache's puts (its owner writes it, or :meth:`put_side`).

        ``capacity``: its byte ceiling (pages are allocated only when written);
        ``entries``: the entries it indexes. Temporary: gone with the last process of
        the node. The cluster's in-flight tier is one (:mod:`mmcache.cluster.flight`).
        A second open of the same name replaces (and closes) the first handle.
        ConfigError without a memory tier.
        """
        if self.memory is None:
            raise ConfigError(
                f"a side tier ({name!r}) sits after the memory tier: give the cache a memory budget"
            )
        store = self._memory_store(
            f"{self.memory_name}-{name}",
            capacity=capacity,
            policy="keep",
            temporary=True,
            index_capacity=entries,
        )
        self._attach_side(name, store)
        return store

    def _attach_side(self, name: str, store: Store) -> None:
        old = self._store.remove(name)
        if old is not None and old is not store:
            old.close()
        # Its gathers and lookups are checked as the memory tier's are (check_reads).
        side = Tier(check_reads(store), verify=True, promote_into=False, budgeted=False, label=name)
        self._store.insert(side, after=MemoryStore.name)

    def side_tier(self, name: str) -> Store | None:
        """The side tier called ``name`` (:meth:`open_side_tier`), or None."""
        tier = next((t for t in self._store.entries if t.name == name and not t.budgeted), None)
        return None if tier is None else tier.store

    def put_side(self, name: str, key: bytes, raw: bytes, *, cost: float, ctime: float) -> bool:
        """Offer encoded bytes to the side tier called ``name`` only; False when it is not
        open or refuses them (it is full)."""
        store = self.side_tier(name)
        return store is not None and store.put(key, raw, cost=cost, ctime=ctime)

    def _options(self) -> dict[str, Any]:
        """The options ``cache.json`` records (see :func:`mmcache.cacheroot.write_config`)."""
        return {o.name: o.as_recorded(getattr(self, o.attr)) for o in _OPTIONS if o.recorded}

    @property
    def scope(self) -> ScopeLike:
        """``"node"``, or the :class:`~mmcache.cluster.Cluster` configuration."""
        return "node" if self.cluster is None else self.cluster

    @property
    def root_id(self) -> int:
        """The identity of the root (its ``root-id`` file, made when a caller first
        configured it; 0: none, see :func:`mmcache.cacheroot.root_id`), fixed at open."""
        return self._root_id or 0

    @property
    def memory_name(self) -> str:
        """Node-wide name of this root's memory tier (``/dev/shm/mmcache-<name>*``): from
        the root's path and identity, so a root made again at a path starts empty."""
        return _memory_name(self.root, self.root_id)

    @property
    def absent_tiers(self) -> tuple[str, ...]:
        """Tiers with a budget that are not open: not created yet (``open_existing``
        attaches the memory tier only if some process made it) or failed to open."""
        return tuple(s.name for s in self._specs() if s.wanted and self._store.tier(s.name) is None)

    @classmethod
    def open_existing(
        cls, root: str | os.PathLike[str], *, memory: int | str | None = None, **kwargs: Any
    ) -> Cache:
        """Reopen a cache with the budgets recorded in ``root/cache.json`` (CLI use).

        ``memory`` overrides the recorded memory budget (e.g. 0 to inspect the
        disk tier without attaching shared memory). The memory tier is attached
        only if it exists (never created: inspecting a cache must not allocate
        shared memory), and nothing passed here is written to ``cache.json``:
        overrides apply to this object only.
        """
        options = read_config(root)
        if memory is not None:
            options["memory"] = memory
        options.update(kwargs)
        return cls(root, **options, _opened_as="inspect")

    def __getstate__(self) -> dict[str, Any]:
        return {
            "root": self.root,
            **{o.name: getattr(self, o.attr) for o in _OPTIONS},
            "opened_as": "inspect" if self._inspect else "worker",
            "root_id": self.root_id,
            # a MemoryStore pickles by name: re-attached in the other process
            "side": [(t.name, t.store) for t in self._store.entries if not t.budgeted],
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        options = dict(state)  # keys missing from an older state take __init__'s defaults
        root, side = options.pop("root"), options.pop("side", [])
        options["_opened_as"] = options.pop("opened_as", "worker")
        options["_root_id"] = options.pop("root_id", None)  # an older state: read the root's
        self.__init__(root, **options)  # type: ignore[misc]
        for name, store in side:
            if self.memory is not None:
                self._attach_side(name, store)

    # -- the tiers ------------------------------------------------------------------------
    @property
    def store(self) -> TieredStore:
        """The open tiers as one :class:`~mmcache.stores.tiered.TieredStore`, fastest first."""
        return self._store

    @property
    def tiers(self) -> dict[str, Store]:
        """The open budgeted tiers of the node by name, fastest first (side tiers:
        :meth:`side_tier`; the shared tier: ``store.tier("shared")``)."""
        return {t.name: t.store for t in self._store.entries if t.budgeted and t.node}

    @property
    def memory(self) -> Store | None:
        """The node-shared memory tier, or None (no budget, not attached, or failed)."""
        return self._store.tier(MemoryStore.name)

    @property
    def disk(self) -> Store | None:
        """The persistent disk tier, or None (no budget, or failed)."""
        return self._store.tier(DiskStore.name)

    @property
    def claims(self) -> Claims | None:
        """The node's production claims for this cache (one preparation per node: a process
        that misses a key another process is producing waits for it; see
        :mod:`mmcache.stores.claims`), or None without a memory tier."""
        memory = self.memory
        return memory.claims() if memory is not None else None

    @property
    def reader(self) -> BatchReader | None:
        """The tiers that can gather whole batches in this process (a
        :class:`~mmcache.stores.base.BatchReader`: the first such tier alone, or a
        :class:`~mmcache.stores.gathering.TieredReader` over memory then disk), else None.

        What the loader gathers cached batches from; everything else (misses,
        promotion, writes) goes through the cache's own methods, so the loader
        never names a tier.
        """
        able = [t for t in self._store.tiers if t.supports_gather and isinstance(t, BatchReader)]
        if not able:
            return None
        return able[0] if len(able) == 1 else TieredReader(able)

    # -- reads ----------------------------------------------------------------------------
    def _expired(self, ctime: float) -> bool:
        return self.ttl is not None and ctime < self.clock() - self.ttl

    def _accept(self, raw: bytes, verify: bool) -> Accepted[Sample] | None:
        """The read check of the tiers: decoded arrays, None if expired; raises
        CorruptEntryError (the tiered store drops the entry and logs it)."""
        if verify:
            sample = codec.decode(raw, verify=True)
            header = codec.read_header(raw)
            if self._expired(header.ctime):
                return None
        else:
            header = codec.read_header(raw)
            if self._expired(header.ctime):
                return None
            sample = codec.decode(raw, verify=False)
        return Accepted(sample, header.cost, header.ctime)

    def get(self, key: KeyLike) -> Sample | None:
        """The cached sample for ``key`` (arrays the caller owns, read-only), or None.

        Counts a hit or miss per tier; expired entries are removed and count as misses.
        """
        return self.lookup(key)[0]

    def lookup(self, key: KeyLike) -> tuple[Sample | None, str | None]:
        """Like :meth:`get`, also naming the tier that served it (``"memory"``, ``"disk"``)."""
        hit = self._store.lookup(_to_key(key), self._accept, later=self._promote_later)
        return (None, None) if hit is None else (hit.value, hit.tier.name)

    def _promote_later(self, stores: tuple[Store, ...], row: Row) -> None:
        """Promote a hit into deferred tiers (a shared hit into the disk tier) from this
        process's write-behind (:meth:`~mmcache.stores.writebehind.WriteBehind.promote`)."""
        writer = writebehind.writer_for(
            self, lambda: writebehind.WriteBehind(self._store, tag=self.tag)
        )
        writer.promote(stores, row)

    def contains(self, key: KeyLike) -> bool:
        """Whether any tier holds ``key`` (no hit/miss counted, TTL not checked)."""
        return self._store.holder(_to_key(key)) is not None

    def __contains__(self, key: object) -> bool:
        return isinstance(key, (bytes, str)) and self.contains(key)

    # -- writes ---------------------------------------------------------------------------
    def put(
        self,
        key: KeyLike,
        sample: Mapping[str, np.ndarray],
        *,
        cost: float = 0.0,
        tag: str | None = None,
    ) -> bool:
        """Encode ``sample`` once and offer it to every tier; True if any tier admitted it.

        ``cost`` is the CPU seconds it took to produce the sample (the ``value``
        policy admits by cost per byte). ``tag``, the pipeline fingerprint of
        the writer, lets ``stats`` list it and ``gc`` drop its entries when it
        is no longer used (see :mod:`mmcache.registry`).
        """
        k = _to_key(key)
        raw = codec.encode(sample, ctime=self.clock(), cost=cost)
        return self.put_encoded(k, raw, cost=cost, tag=tag)

    def register(self, fingerprint: str, description: str = "") -> None:
        """Record that ``fingerprint`` uses this cache now (the loaders call it)."""
        if self.registry is not None:
            self.registry.touch(fingerprint, description, self.clock())

    def tag(self, fingerprint: str, keys: list[bytes]) -> None:
        """Log ``keys`` as written by ``fingerprint`` (for ``gc(unused_for=...)``)."""
        if self.registry is not None:
            self.registry.log(fingerprint, keys)

    def put_encoded(self, key: KeyLike, raw: bytes, *, cost: float, tag: str | None = None) -> bool:
        """Offer already-encoded bytes to every tier; True if any tier admitted them."""
        k = _to_key(key)
        if tag is not None:
            self.tag(tag, [k])
        return self.put_many([(k, raw, cost)])[0]

    def put_many(
        self, entries: list[tuple[bytes, bytes, float]], *, memory: bool = True
    ) -> list[bool]:
        """Offer many encoded ``(key, raw, cost)`` entries; the disk tier commits them in
        groups (fewer fsyncs). ``memory=False`` skips the front tiers, those the
        write-behind writes at once (the memory tier: the caller put them there
        already). Returns, per entry, whether any tier admitted it.

        A tier that fails (disk full and friends) is logged and skipped: a put never
        stops training.
        """
        rows = [(k, raw, cost, codec.read_header(raw).ctime) for k, raw, cost in entries]
        return self._store.put_many(rows, skip_front=not memory)

    def get_or_produce(
        self, key: KeyLike, produce: Callable[[], Mapping[str, np.ndarray]]
    ) -> Sample:
        """Read-through: the cached sample, or ``produce()``'s result, stored with its cost.

        The cost is the CPU time of ``produce`` in this thread (``time.thread_time``),
        not wall time, which other processes on a busy node inflate. A key another
        process of the node is producing is waited for (its claim), not produced twice
        (see :func:`mmcache.readthrough.read_through`).
        """
        sample = read_through(self, _to_key(key), produce, claims=self.claims).sample
        if sample is None:  # pragma: no cover - on_error="raise" never returns a reject
            raise RuntimeError("read_through returned no sample")
        return sample

    def commit(self) -> None:
        """Write what waits in this process (promotions of shared hits into the disk
        tier) and publish what it produced (the shared tier's open pack): the end of an
        epoch (the loader calls it), of a warm-up, of a job."""
        writebehind.flush_for(self)  # its queue (promotions too), then every tier
        self._store.commit()

    def fetch_ahead(self, keys: np.ndarray) -> None:
        """Read ``keys`` (``uint8 [n, 16]``, a batch's misses) ahead in the tiers that read
        in batches (the shared tier: grouped by pack), for the lookups that follow."""
        self._store.fetch_ahead(keys)

    def delete(self, key: KeyLike) -> bool:
        k = _to_key(key)
        removed = False
        for tier in self._store.tiers:
            removed = tier.delete(k) or removed
        return removed

    # -- maintenance ----------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """Per-tier counters, aggregated over every process of the node."""
        fps = (
            {e.fingerprint: e.as_dict() for e in self.registry.entries()}
            if self.registry is not None
            else {}
        )
        tiers = {name: tier.stats() for name, tier in self.tiers.items()}
        shared = self._store.tier(SharedTier.name)
        if shared is not None:  # this process's reads of the share, and what it holds
            tiers[SharedTier.name] = shared.stats()
        return CacheStats(tiers, fps, degraded=dict(self.degraded))

    def verify(self, *, repair: bool = False) -> VerifyReport:
        """Check every entry's header and checksum in every open tier; with ``repair``
        remove bad ones (see :func:`mmcache.maintenance.verify`)."""
        return _verify(self.tiers, repair=repair)

    def gc(
        self,
        *,
        older_than: float | str | None = None,
        max_size: int | str | None = None,
        unused_for: float | str | None = None,
        all_roots: bool = False,
    ) -> GcReport:
        """Remove expired and corrupt entries and orphaned shared-memory segments;
        ``max_size`` shrinks the disk tier, ``unused_for`` drops the entries of unused
        pipeline fingerprints (see :func:`mmcache.maintenance.gc`)."""
        return _gc(
            self,
            older_than=older_than,
            max_size=max_size,
            unused_for=unused_for,
            all_roots=all_roots,
        )

    def resize_disk(self, capacity: int | str) -> int:
        """Give the disk tier a new byte budget, for this object and for later opens.

        A smaller budget evicts by the policy down to it (``keep``/``value`` fall
        back to least recently used). The budget is recorded in ``cache.json``, the
        only field changed there (``gc --max-size``, ``warm --disk``). Returns the
        entries evicted; 0, changing nothing, without a disk tier.
        """
        disk = self.disk
        if disk is None:
            return 0
        limit = parse_size(capacity, name="disk")
        items = len(disk)
        disk.close()
        fresh = self._new_disk(limit)
        self._store.replace(DiskStore.name, fresh)
        self.disk_budget = limit
        write_config(self.root, self._options(), mode=self.mode, changes={"disk": limit})
        return items - len(fresh)

    def compact(self) -> CompactReport:
        """Swap in a compacted copy of the disk tier (``mmcache gc --compact``); a
        CacheError, with nothing changed, while another process has it open."""
        if not isinstance(self.disk, DiskStore):
            raise CacheError(f"cache {self.root} has no disk tier to compact")
        return self.disk.compact()

    def close(self) -> None:
        """Release every handle (idempotent); shared and persisted data stay. What this
        process's write-behind still holds for this cache is written first."""
        writebehind.flush_for(self)
        self._store.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        shown = ", ".join(f"{o.name}={getattr(self, o.attr)!r}" for o in _OPTIONS if o.shown)
        return f"Cache({str(self.root)!r}, {shown})"
