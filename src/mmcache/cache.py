"""``Cache``: the memory and disk tiers, a policy, budgets, TTL and stats, as one object.

Data path of a read (:meth:`Cache.get`): the node-shared memory tier, then the
persistent disk tier (checksum verified; a corrupt entry is dropped, counted
and never returned), promoting a disk hit into memory when the memory tier's
policy admits it. A write (:meth:`Cache.put`) encodes the sample once
(:mod:`mmcache.codec`) and offers the same bytes to both tiers: memory for
this run, disk for the next runs.

Verification: entries read from disk are checked against their xxhash
checksum (disk bytes can rot, and LMDB does not checksum its pages); entries
read from the memory tier are not, because they were verified or produced
when they entered it, and checking every read costs about a third of the
gather speed; :meth:`Cache.verify` (``mmcache verify``) checks both tiers.

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

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import xxhash

from mmcache import codec, sizing
from mmcache.errors import CacheError, ConfigError, CorruptEntryError
from mmcache.keys import as_key
from mmcache.policies import Policy, get_policy, policy_names
from mmcache.registry import FingerprintRegistry
from mmcache.stats import CacheStats
from mmcache.stores.base import BatchReader, Store, dir_mode
from mmcache.units import parse_duration, parse_size

if TYPE_CHECKING:
    from mmcache.stores.disk import CompactReport

__all__ = ["Cache", "GcReport", "VerifyReport"]

logger = logging.getLogger(__name__)

Sample = dict[str, np.ndarray]
KeyLike = bytes | str
Fallback = Literal["raise", "uncached"]
OpenedAs = Literal["owner", "worker", "inspect"]

#: Budgets of a cache root, written beside its disk tier (see Cache.open_existing).
CONFIG_FILE = "cache.json"


@dataclass(frozen=True)
class GcReport:
    """What :meth:`Cache.gc` removed."""

    expired: int = 0
    corrupt: int = 0
    evicted: int = 0
    freed_bytes: int = 0
    orphan_segments: tuple[str, ...] = ()
    dropped_fingerprints: tuple[str, ...] = ()
    dropped_entries: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class VerifyReport:
    """What :meth:`Cache.verify` found: entries checked, bad keys (hex), removed count,
    the tiers checked (fastest first) and, for each bad key, the tier holding it."""

    checked: int
    bad: tuple[str, ...]
    removed: int
    tiers: tuple[str, ...] = ()
    bad_tiers: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.bad

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def _to_key(key: KeyLike) -> bytes:
    return as_key(key)  # 16 bytes and 32 hex as they are, any other str/bytes hashed


def _memory_name(root: Path) -> str:
    """Name of the memory tier of ``root``: a hash, never the path itself.

    No uid in it: the store's directory says whose it is (``/dev/shm/mmcache-u<uid>/``,
    or ``mmcache-g<gid>/`` shared by a group, where every member must find one name).
    """
    return xxhash.xxh3_64_hexdigest(str(root).encode())


def _memory_group(root: Path, mode: int) -> int | None:
    """The group sharing the memory tier: the root's, when ``mode`` opens it to a group."""
    if not mode & 0o060:
        return None
    try:
        return os.stat(root).st_gid
    except OSError:
        return os.getegid()


def _read_config(root: str | os.PathLike[str]) -> dict[str, Any]:
    """The options recorded in ``root/cache.json``, validated: ``memory``, ``disk``,
    ``policy`` and ``ttl``, as :class:`Cache` takes them.

    Every command that reopens a root (``Cache.open_existing``: stats, verify, gc)
    reads the file here, so a hand-edited value is refused the same way by all of
    them, also where an override (``memory=0``) means it would not be used. An
    unknown policy name reads as ``value`` (policies are plug-ins: the one that
    wrote it may not be registered in this process). Raises CacheError when the
    file is missing or unreadable, ConfigError naming the file, key and value
    when a value is not valid.
    """
    path = Path(os.path.expanduser(os.fspath(root))) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CacheError(
            f"{path} not found: {root} is not an mmcache cache root (no disk tier was made)"
        ) from exc
    except (OSError, ValueError) as exc:
        raise CacheError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict) or config.get("format") != 1:
        raise CacheError(f"{path}: unknown cache config format")

    def finite_duration(value: Any) -> float:
        seconds = parse_duration(value)
        if not math.isfinite(seconds):
            raise ConfigError(f"duration must be a finite number of seconds, got {value!r}")
        return seconds

    checks: dict[str, Callable[[Any], object]] = {
        "memory": lambda v: v == "auto" or parse_size(v),
        "disk": lambda v: v is None or parse_size(v),
        "ttl": lambda v: v is None or finite_duration(v),
    }
    options = {
        "memory": config.get("memory", 0),
        "disk": config.get("disk"),
        "ttl": config.get("ttl"),
    }
    for name, check in checks.items():
        try:
            check(options[name])
        except ConfigError as exc:
            raise ConfigError(
                f"{path}: {name!r} is {options[name]!r}, which is not valid ({exc}); correct "
                "it, or open the root once with Cache(root, memory=..., disk=...) to record "
                "new budgets"
            ) from exc
    policy = config.get("policy", "value")
    options["policy"] = policy if policy in policy_names() else "value"
    return options


def _verifies(buf: bytes) -> bool:
    return codec.verify(buf)


class Cache:
    """Node-shared memory tier + persistent disk tier under a byte budget each.

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
        memory_entries: most entries the memory tier indexes (default: one per
            4 KiB of its budget, at least 1024); raise it for many small
            samples (tokens only, pooled features): a warning says when the
            index is full while bytes are free.
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
        _opened_as: OpenedAs = "owner",
    ) -> None:
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
        self.memory_entries = memory_entries
        #: Tiers that could not be opened (fallback="uncached"), with the reason.
        self.degraded: dict[str, str] = {}
        # "owner": a caller creating or configuring the cache; its budgets are recorded
        # in cache.json. "worker": a pickled copy re-attaching; records nothing.
        # "inspect" (open_existing, the CLI): attaches the memory tier only if it
        # exists and records nothing, so a one-off override (memory=0, a TTL) never
        # becomes the budget of later opens.
        self._opened_as: OpenedAs = _opened_as
        self._inspect = _opened_as == "inspect"
        self._memory_arg = memory
        self._disk_arg = disk
        if memory == "auto":
            self.memory_budget = sizing.auto_memory_budget()
        elif isinstance(memory, (int, str)):
            self.memory_budget = parse_size(memory)
        else:
            raise ConfigError(f"memory must be bytes, an IEC string, 'auto' or 0, got {memory!r}")
        self.disk_budget = None if disk is None else parse_size(disk)
        self.memory: Store | None = None
        self.disk: Store | None = None
        self._open()

    # -- opening --------------------------------------------------------------------------
    def _degrade(self, tier: str, exc: BaseException) -> None:
        msg = f"cannot open the {tier} tier of cache {self.root}: {exc}"
        if self.fallback == "raise":
            raise CacheError(f"{msg} (pass fallback='uncached' to train without it)") from exc
        logger.warning("%s; continuing without it (fallback='uncached')", msg)
        self.degraded[tier] = str(exc)

    def _open(self) -> None:
        from mmcache.stores.disk import DiskStore
        from mmcache.stores.memory import MemoryStore, store_exists

        folder_mode = dir_mode(self.mode)
        try:
            existed = self.root.is_dir()
            self.root.mkdir(mode=folder_mode, parents=True, exist_ok=True)
            if not existed:
                os.chmod(self.root, folder_mode)  # mkdir's mode is masked by the umask
        except OSError as exc:
            if self.disk_budget is not None:
                self._degrade("disk", exc)
                self.disk_budget = None
        if self.disk_budget is not None:
            try:
                self.disk = DiskStore(
                    self.root / "disk",
                    capacity=self.disk_budget,
                    policy=self.policy,
                    mode=self.mode,
                )
                if self._opened_as == "owner":
                    self._write_config()
            except (OSError, CacheError) as exc:
                self._degrade("disk", exc)
        self.registry: FingerprintRegistry | None = None
        if self.disk is not None:
            try:
                self.registry = FingerprintRegistry(self.root / "fingerprints", mode=self.mode)
            except OSError as exc:
                logger.debug("no fingerprint registry in %s: %s", self.root, exc)
        group = _memory_group(self.root, self.mode)
        attach = not self._inspect or store_exists(self.memory_name, group=group)
        if self.memory_budget > 0 and attach:
            try:
                self.memory = MemoryStore(
                    self.memory_name,
                    capacity=self.memory_budget,
                    policy=self.policy,
                    create=not self._inspect,
                    temporary=self.temporary,
                    owner_path=str(self.root),
                    index_capacity=self.memory_entries,
                    mode=self.mode & 0o660 if group is not None else 0o600,
                    group=group,
                )
            except (OSError, CacheError) as exc:
                self._degrade("memory", exc)

    @property
    def memory_name(self) -> str:
        """Node-wide name of this root's memory tier (``/dev/shm/mmcache-<name>*``)."""
        return _memory_name(self.root)

    @property
    def absent_tiers(self) -> tuple[str, ...]:
        """Tiers with a budget that are not open: not created yet (``open_existing``
        attaches the memory tier only if some process made it) or failed to open."""
        out = []
        if self.memory is None and self.memory_budget > 0:
            out.append("memory")
        if self.disk is None and self.disk_budget is not None:
            out.append("disk")
        return tuple(out)

    def _write_config(self, **changes: Any) -> None:
        """Record the budgets in ``root/cache.json`` so the CLI can reopen this cache.

        Without ``changes``: the budgets this object was created with (a caller
        creating or configuring a cache). With ``changes`` (``gc(max_size=...)``):
        only those fields change in the recorded file, so the overrides of an
        :meth:`open_existing` (``memory=0``, a TTL) are never persisted.
        Written atomically (temp file + rename); plain JSON, never executed.
        """
        path = self.root / CONFIG_FILE
        config: dict[str, Any] = {
            "format": 1,
            "memory": self.memory_budget,
            "disk": self.disk_budget,
            "policy": self.policy.name,
            "ttl": self.ttl,
        }
        if changes:
            try:
                recorded = json.loads(path.read_text())
            except (OSError, ValueError):
                recorded = None
            if isinstance(recorded, dict) and recorded.get("format") == 1:
                config = recorded
            config.update(changes)
        tmp = path.with_name(f".{CONFIG_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(config, indent=1))
            os.chmod(tmp, self.mode)
            os.replace(tmp, path)
        except OSError as exc:  # read-only root: the config is a convenience
            logger.debug("cannot write %s: %s", path, exc)

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
        options = _read_config(root)
        if memory is not None:
            options["memory"] = memory
        options.update(kwargs)
        return cls(root, **options, _opened_as="inspect")

    def __getstate__(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "memory": self.memory_budget,
            "disk": self.disk_budget,
            "policy": self.policy,
            "ttl": self.ttl,
            "clock": self.clock,
            "temporary": self.temporary,
            "fallback": self.fallback,
            "mode": self.mode,
            "memory_entries": self.memory_entries,
            "opened_as": "inspect" if self._inspect else "worker",
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["root"],
            memory=state["memory"],
            disk=state["disk"],
            policy=state["policy"],
            ttl=state["ttl"],
            clock=state["clock"],
            temporary=state["temporary"],
            fallback=state["fallback"],
            mode=state.get("mode", 0o600),
            memory_entries=state.get("memory_entries"),
            _opened_as=state.get("opened_as", "worker"),
        )

    @property
    def tiers(self) -> dict[str, Store]:
        """The open tiers by name, fastest first."""
        out: dict[str, Store] = {}
        if self.memory is not None:
            out["memory"] = self.memory
        if self.disk is not None:
            out["disk"] = self.disk
        return out

    @property
    def reader(self) -> BatchReader | None:
        """The first tier when it can gather whole batches in this process (a
        :class:`~mmcache.stores.base.BatchReader`), else None.

        What the loader gathers cached batches from; everything else (misses,
        promotion, writes) goes through the cache's own methods, so the loader
        never names a tier.
        """
        for tier in self.tiers.values():
            return tier if tier.supports_gather and isinstance(tier, BatchReader) else None
        return None

    # -- reads ----------------------------------------------------------------------------
    def _expired(self, ctime: float) -> bool:
        return self.ttl is not None and ctime < self.clock() - self.ttl

    def get(self, key: KeyLike) -> Sample | None:
        """The cached sample for ``key`` (arrays the caller owns, read-only), or None.

        Counts a hit or miss per tier; expired entries are removed and count as misses.
        """
        return self.lookup(key)[0]

    def lookup(self, key: KeyLike) -> tuple[Sample | None, str | None]:
        """Like :meth:`get`, also naming the tier that served it (``"memory"``, ``"disk"``)."""
        k = _to_key(key)
        if self.memory is not None:
            raw = self.memory.get(k)
            if raw is not None:
                try:
                    header = codec.read_header(raw)
                    if not self._expired(header.ctime):
                        return codec.decode(raw, verify=False), "memory"
                    self.memory.discard(k, why="expired")
                except CorruptEntryError as exc:
                    logger.error("corrupt memory-tier entry %s dropped: %s", k.hex(), exc)
                    self.memory.discard(k, why="corrupt")
        if self.disk is not None:
            raw = self.disk.get(k)
            if raw is not None:
                try:
                    sample = codec.decode(raw, verify=True)
                    header = codec.read_header(raw)
                except CorruptEntryError as exc:
                    logger.error("corrupt disk-tier entry %s dropped: %s", k.hex(), exc)
                    self.disk.discard(k, why="corrupt")
                    return None, None
                if self._expired(header.ctime):
                    self.disk.discard(k, why="expired")
                    return None, None
                if self.memory is not None:
                    self.memory.put(k, raw, cost=header.cost, ctime=header.ctime)
                return sample, "disk"
        return None, None

    def contains(self, key: KeyLike) -> bool:
        """Whether any tier holds ``key`` (no hit/miss counted, TTL not checked)."""
        k = _to_key(key)
        return any(t.contains(k) for t in self.tiers.values())

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
        groups (fewer fsyncs). ``memory=False`` skips the memory tier (the caller put
        them there already). Returns, per entry, whether any tier admitted it.

        A tier that fails (disk full and friends) is logged and skipped: a put never
        stops training.
        """
        ctimes = [codec.read_header(raw).ctime for _, raw, _ in entries]
        admitted = [False] * len(entries)
        if memory and self.memory is not None:
            for i, (k, raw, cost) in enumerate(entries):
                try:
                    admitted[i] = self.memory.put(k, raw, cost=cost, ctime=ctimes[i])
                except OSError as exc:
                    logger.warning("put to memory tier failed: %s", exc)
        disk = self.disk
        if disk is not None:
            rows = [(k, raw, cost, t) for (k, raw, cost), t in zip(entries, ctimes, strict=True)]
            try:
                many = getattr(disk, "put_many", None)
                if many is not None:
                    results = list(many(rows))
                else:
                    results = [disk.put(k, v, cost=c, ctime=t) for k, v, c, t in rows]
            except OSError as exc:
                logger.warning("put to disk tier failed: %s", exc)
                results = [False] * len(entries)
            admitted = [a or b for a, b in zip(admitted, results, strict=True)]
        return admitted

    def get_or_produce(
        self, key: KeyLike, produce: Callable[[], Mapping[str, np.ndarray]]
    ) -> Sample:
        """Read-through: the cached sample, or ``produce()``'s result, stored with its cost.

        The cost is the CPU time of ``produce`` in this thread (``time.thread_time``),
        not wall time, which other processes on a busy node inflate.
        """
        hit = self.get(key)
        if hit is not None:
            return hit
        t0 = time.thread_time()
        sample = dict(produce())
        cost = time.thread_time() - t0
        self.put(key, sample, cost=cost)
        return sample

    def delete(self, key: KeyLike) -> bool:
        k = _to_key(key)
        removed = False
        for tier in self.tiers.values():
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
        return CacheStats(tiers, fps, degraded=dict(self.degraded))

    def verify(self, *, repair: bool = False) -> VerifyReport:
        """Check every entry's header and checksum in every open tier; with ``repair``
        remove bad ones.

        Each tier checks itself (``Store.verify``, which the memory and disk tiers
        have): no hit or miss is counted and no access time changes, so verifying
        leaves the statistics and the policy's order as they were. Bad entries are
        counted as ``corrupt`` by the tier. Safe while other processes use the cache.
        """
        bad: list[tuple[str, bytes]] = []
        checked = 0
        for name, tier in self.tiers.items():
            checked += len(tier)
            check_tier = getattr(tier, "verify", None)
            if check_tier is not None:  # counts what it finds as corrupt
                found = list(check_tier(_verifies))
            else:  # a tier without its own check: plain reads (they count as hits)
                found = []
                for k in list(tier.keys()):
                    raw = tier.get(k)
                    if raw is not None and not _verifies(raw):
                        found.append(k)
            for k in found:
                bad.append((name, k))
                if repair and check_tier is not None:
                    tier.delete(k)
                elif repair:
                    tier.discard(k, why="corrupt")
        return VerifyReport(
            checked=checked,
            bad=tuple(k.hex() for _, k in bad),
            removed=len(bad) if repair else 0,
            tiers=tuple(self.tiers),
            bad_tiers=tuple(name for name, _ in bad),
        )

    def gc(
        self,
        *,
        older_than: float | str | None = None,
        max_size: int | str | None = None,
        unused_for: float | str | None = None,
        all_roots: bool = False,
    ) -> GcReport:
        """Remove expired and corrupt entries and orphaned shared-memory segments.

        ``older_than`` (seconds or ``"7d"``) also removes, this once, every entry
        created longer ago than that (``ttl`` stays as it is).

        Orphaned segments: this root's memory tier when it is damaged or unused
        and temporary (see :func:`~mmcache.stores.memory.reclaim_orphans`);
        ``all_roots`` also those of every other root of this user (or group).

        ``max_size`` shrinks the disk tier's budget to that size (evicting by the
        policy; ``keep``/``value`` fall back to least recently used) and records
        the new budget for later opens. ``unused_for`` (seconds or ``"30d"``)
        removes every entry of the pipeline fingerprints not used for that long.
        """
        from mmcache.stores.disk import DiskStore
        from mmcache.stores.memory import reclaim_orphans

        ages = [a for a in (self.ttl, older_than) if a is not None]
        before = sum(t.nbytes() for t in self.tiers.values())
        expired = 0
        if ages:
            cutoff = self.clock() - min(parse_duration(a) for a in ages)
            for tier in self.tiers.values():
                expired += tier.expire(cutoff)
        dropped: list[str] = []
        removed_by_fp = 0
        if unused_for is not None and self.registry is not None:
            cutoff = self.clock() - parse_duration(unused_for)
            for info in self.registry.entries():
                if info.last_used >= cutoff:
                    continue
                for k in self.registry.keys(info.fingerprint):
                    for tier in self.tiers.values():
                        removed_by_fp += int(tier.delete(k))
                self.registry.remove(info.fingerprint)
                dropped.append(info.fingerprint)
        report = self.verify(repair=True)
        evicted = 0
        if max_size is not None and self.disk is not None:
            limit = parse_size(max_size)
            items = len(self.disk)
            self.disk.close()
            self.disk = DiskStore(
                self.root / "disk", capacity=limit, policy=self.policy, mode=self.mode
            )
            self.disk_budget = limit
            self._write_config(disk=limit)
            evicted = items - len(self.disk)
        pattern = "*" if all_roots else _memory_name(self.root)
        orphans = tuple(reclaim_orphans(pattern, group=_memory_group(self.root, self.mode)))
        after = sum(t.nbytes() for t in self.tiers.values())
        return GcReport(
            expired=expired,
            corrupt=len(report.bad),
            evicted=evicted,
            freed_bytes=max(before - after, 0),
            orphan_segments=orphans,
            dropped_fingerprints=tuple(dropped),
            dropped_entries=removed_by_fp,
        )

    def compact(self) -> CompactReport:
        """Swap in a compacted copy of the disk tier (``mmcache gc --compact``); a
        CacheError, with nothing changed, while another process has it open."""
        from mmcache.stores.disk import DiskStore

        if not isinstance(self.disk, DiskStore):
            raise CacheError(f"cache {self.root} has no disk tier to compact")
        return self.disk.compact()

    def close(self) -> None:
        """Release every handle (idempotent); shared and persisted data stay."""
        for tier in self.tiers.values():
            tier.close()
        self.memory = None
        self.disk = None

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Cache({str(self.root)!r}, memory={self.memory_budget}, disk={self.disk_budget}, "
            f"policy={self.policy!r}, ttl={self.ttl})"
        )
