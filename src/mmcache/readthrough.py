"""Read-through: the cached sample, or claim it, produce it, time it, admit it, release it.

Every path that turns a key into a sample goes through :func:`read_through`:
``Cache.get_or_produce``, :class:`~mmcache.cached.CachedDataset`,
:func:`~mmcache.warm.warm`, the loader's workers
(:class:`~mmcache.loader.tasks.WorkerPlanner`) and the decodes of
:func:`~mmcache.features.warm.warm_features`. One place decides:

* **what a miss costs**: the CPU time of ``produce`` in this thread
  (``time.thread_time``, not wall time, which other processes on a busy node inflate),
  times ``weight`` (a mixture's entry read r times an epoch saves r misses);
* **how the sample is encoded** (once, with the cache's clock as its creation time) and
  admitted (``write``: the cache's ``put_encoded``, or the loader's write-behind);
* **one preparation per node**: given ``claims`` (:mod:`mmcache.stores.claims`), a miss
  is produced under the node's claim on its key; a process that misses a key another
  process is producing waits for it and takes what it published (``waited``) instead of
  producing the sample a second time;
* **what a bad sample does** (``on_error``: ``"raise"`` stops, ``"skip"`` records it
  through ``record_reject`` and returns a rejected :class:`ReadThrough`, leaving the
  caller to leave it out).

Thread/process safety: as safe as the cache and ``produce``; nothing is kept here, and
a claim is held only inside one call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from mmcache import codec
from mmcache.errors import SampleError
from mmcache.sources.base import OnError
from mmcache.stores.claims import Claims

__all__ = [
    "CacheLike",
    "Look",
    "ReadThrough",
    "ReadThroughSource",
    "Write",
    "read_through",
]

Sample = dict[str, np.ndarray]
#: ``write(key, raw, cost, tag)``: admit an encoded entry; whether a tier admitted it.
#: Default ``cache.put_encoded``; the loader's workers pass the write-behind's submit.
Write = Callable[[bytes, bytes, float, "str | None"], bool]


class CacheLike(Protocol):
    """What :func:`read_through` needs of a :class:`~mmcache.cache.Cache`."""

    clock: Callable[[], float]

    def lookup(self, key: bytes | str) -> tuple[Sample | None, str | None]: ...

    def contains(self, key: bytes | str) -> bool: ...

    def put_encoded(
        self, key: bytes | str, raw: bytes, *, cost: float, tag: str | None = None
    ) -> bool: ...


class ReadThroughSource(Protocol):
    """The members of a :class:`~mmcache.sources.base.SampleSource` that
    :class:`~mmcache.cached.CachedDataset` and :func:`~mmcache.warm.warm` use
    (every SampleSource has them)."""

    on_error: OnError

    def __len__(self) -> int: ...

    def key(self, index: int) -> bytes: ...

    def fingerprint(self) -> str: ...

    def describe(self) -> str: ...

    def produce(self, index: int) -> Sample: ...

    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]: ...

    def record_reject(self, err: SampleError) -> None: ...


@dataclass(frozen=True)
class ReadThrough:
    """What :func:`read_through` did for one key.

    ``sample``: the arrays (read-only views for a hit, the produced dict for a
    miss), None when rejected, deferred, or ``held``. ``tier``: the name of the tier
    that served a hit, None otherwise. ``cost``: CPU seconds ``produce`` took (0.0 for
    a hit). ``admitted``: whether a tier admitted the produced sample. ``error``: the
    :class:`~mmcache.errors.SampleError` of a rejected sample. ``waited``: another
    process of the node held the key's claim; this one waited for it (and ``tier``
    says where it found what that process published). ``held``: a hit left where it
    is (the loader's workers: the entry is in the node-shared first tier, and the
    training process gathers it). ``deferred``: another process holds the claim and
    the caller asked not to wait (``wait=False``): nothing was done, ask again later.
    """

    sample: Sample | None
    tier: str | None = None
    cost: float = 0.0
    admitted: bool = False
    error: SampleError | None = None
    waited: bool = False
    held: bool = False
    deferred: bool = False

    @property
    def hit(self) -> bool:
        return self.tier is not None

    @property
    def rejected(self) -> bool:
        return self.error is not None


#: ``look(key)``: the hit for ``key`` in the cache, or None. Default: ``cache.lookup``.
Look = Callable[[bytes], ReadThrough | None]
#: ``published(key, waited)``: whether to look ``key`` up again once claimed (``waited``:
#: another process held the claim first). Default: whether a tier holds it (no count).
Published = Callable[[bytes, bool], bool]


def read_through(
    cache: CacheLike | None,
    key: bytes,
    produce: Callable[[], Mapping[str, np.ndarray]],
    *,
    claims: Claims | None = None,
    wait: bool = True,
    write: Write | None = None,
    on_error: OnError = "raise",
    record_reject: Callable[[SampleError], None] | None = None,
    tag: str | None = None,
    lookup: bool = True,
    look: Look | None = None,
    published: Published | None = None,
    weight: float = 1.0,
) -> ReadThrough:
    """Look ``key`` up in ``cache``; on a miss claim it, ``produce()`` it, time it, admit
    it and release the claim.

    ``claims``: the node's production claims (``cache.claims``; None: produce unclaimed).
    While another process holds ``key``'s claim this one waits (bounded, see
    :class:`~mmcache.stores.claims.Claims`), then looks the key up again and returns
    what that process published (``waited``); with ``wait=False`` it returns at once a
    ``deferred`` result instead. Once claimed, ``key`` is looked up again when
    ``published(key, waited)`` says so (default: some tier holds it, asked without
    counting: another process may have produced and released it between this one's
    lookup and its claim), so a sample is produced once per node.

    ``lookup=False`` skips the first read (the caller knows it is a miss: ``warm``
    checked ``contains``, the loader planned it). ``look``: how a key is looked up
    (default ``cache.lookup``; the loader's workers leave first-tier hits in place).
    ``tag``: the pipeline fingerprint the entry is logged under (see
    :mod:`mmcache.registry`). ``write``: how to admit the encoded entry (default
    ``cache.put_encoded``). ``weight``: the reads an entry saves per epoch (its cost is
    ``weight`` times the CPU time). A :class:`~mmcache.errors.SampleError` from
    ``produce`` is raised under ``on_error="raise"``; under ``"skip"`` it is passed to
    ``record_reject`` (if given) and returned in a rejected result. ``cache=None`` only
    produces (no lookup, no claim).
    """
    miss = _Miss(on_error, record_reject, tag, write, weight)
    if cache is None:
        return miss.produced(None, key, produce)
    find = look if look is not None else _looker(cache)
    if lookup:
        found = find(key)
        if found is not None:
            return found
    claim = claims.acquire(key, wait=wait) if claims is not None else None
    if claim is None:  # no claims here: produce, as without them
        return miss.produced(cache, key, produce)
    try:
        if claim.fd < 0 and not wait:
            return ReadThrough(None, waited=True, deferred=True)  # another process has it
        again = published(key, claim.waited) if published is not None else cache.contains(key)
        if again:
            found = find(key)  # what the other producer published
            if found is not None:
                return replace(found, waited=True) if claim.waited else found
        return miss.produced(cache, key, produce)
    finally:
        claim.release()


def _looker(cache: CacheLike) -> Look:
    """``cache.lookup`` as a :data:`Look`."""

    def look(key: bytes) -> ReadThrough | None:
        sample, tier = cache.lookup(key)
        return None if sample is None else ReadThrough(sample, tier)

    return look


@dataclass(frozen=True)
class _Miss:
    """How a miss is produced and admitted (the arguments of :func:`read_through`)."""

    on_error: OnError
    record_reject: Callable[[SampleError], None] | None
    tag: str | None
    write: Write | None
    weight: float

    def produced(
        self,
        cache: CacheLike | None,
        key: bytes,
        produce: Callable[[], Mapping[str, np.ndarray]],
    ) -> ReadThrough:
        """Produce ``key``'s sample, time it, encode it and admit it."""
        t0 = time.thread_time()
        try:
            sample = dict(produce())
        except SampleError as err:
            if self.on_error == "raise":
                raise
            if self.record_reject is not None:
                self.record_reject(err)
            return ReadThrough(None, error=err)
        cost = (time.thread_time() - t0) * self.weight
        admitted = False
        if cache is not None:
            raw = codec.encode(sample, ctime=cache.clock(), cost=cost)
            if self.write is None:
                admitted = cache.put_encoded(key, raw, cost=cost, tag=self.tag)
            else:
                admitted = self.write(key, raw, cost, self.tag)
        return ReadThrough(sample, cost=cost, admitted=admitted)
