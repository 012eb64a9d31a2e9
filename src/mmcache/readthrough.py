"""Read-through: the cached sample, or produce it, time it, admit it, or reject it.

Every path that turns a key into a sample goes through :func:`read_through`:
``Cache.get_or_produce``, :class:`~mmcache.cached.CachedDataset`, :func:`~mmcache.warm.warm`
(and the loader's workers and the feature warm-up adopt it). One place decides
what a miss costs (the CPU time of ``produce`` in this thread,
``time.thread_time``, not wall time, which other processes on a busy node
inflate), how the sample is encoded (once, with the cache's clock as its
creation time) and what a bad sample does (``on_error``: ``"raise"`` stops,
``"skip"`` records it through ``record_reject`` and returns a rejected
:class:`ReadThrough`, leaving the caller to leave it out).

Thread/process safety: as safe as the cache and ``produce``; nothing is kept here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mmcache import codec
from mmcache.errors import SampleError
from mmcache.sources.base import OnError

__all__ = ["CacheLike", "ReadThrough", "ReadThroughSource", "Write", "describe", "read_through"]

Sample = dict[str, np.ndarray]
#: ``write(key, raw, cost, tag)``: admit an encoded entry; whether a tier admitted it.
#: Default ``cache.put_encoded``; the loader's workers pass the write-behind's submit.
Write = Callable[[bytes, bytes, float, "str | None"], bool]


class CacheLike(Protocol):
    """What :func:`read_through` needs of a :class:`~mmcache.cache.Cache`."""

    clock: Callable[[], float]

    def lookup(self, key: bytes | str) -> tuple[Sample | None, str | None]: ...

    def put_encoded(
        self, key: bytes | str, raw: bytes, *, cost: float, tag: str | None = None
    ) -> bool: ...


class ReadThroughSource(Protocol):
    """The members of a :class:`~mmcache.sources.base.SampleSource` that
    :class:`~mmcache.cached.CachedDataset` and :func:`~mmcache.warm.warm` use
    (every SampleSource has them; ``describe`` is optional, see :func:`describe`)."""

    on_error: OnError

    def __len__(self) -> int: ...

    def key(self, index: int) -> bytes: ...

    def fingerprint(self) -> str: ...

    def produce(self, index: int) -> Sample: ...

    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]: ...

    def record_reject(self, err: SampleError) -> None: ...


@dataclass(frozen=True)
class ReadThrough:
    """What :func:`read_through` did for one key.

    ``sample``: the arrays (read-only views for a hit, the produced dict for a
    miss), None when rejected. ``tier``: the name of the tier that served a hit,
    None otherwise. ``cost``: CPU seconds ``produce`` took (0.0 for a hit).
    ``admitted``: whether a tier admitted the produced sample. ``error``: the
    :class:`~mmcache.errors.SampleError` of a rejected sample.
    """

    sample: Sample | None
    tier: str | None = None
    cost: float = 0.0
    admitted: bool = False
    error: SampleError | None = None

    @property
    def hit(self) -> bool:
        return self.tier is not None

    @property
    def rejected(self) -> bool:
        return self.error is not None


def read_through(
    cache: CacheLike | None,
    key: bytes,
    produce: Callable[[], Mapping[str, np.ndarray]],
    *,
    on_error: OnError = "raise",
    record_reject: Callable[[SampleError], None] | None = None,
    tag: str | None = None,
    lookup: bool = True,
    write: Write | None = None,
) -> ReadThrough:
    """Look ``key`` up in ``cache``; on a miss ``produce()`` it, time it and admit it.

    ``lookup=False`` skips the read (the caller knows it is a miss: ``warm``
    checked ``contains``, the loader planned it). ``tag``: the pipeline
    fingerprint the entry is logged under (see :mod:`mmcache.registry`).
    ``write``: how to admit the encoded entry (default ``cache.put_encoded``).
    A :class:`~mmcache.errors.SampleError` from ``produce`` is raised under
    ``on_error="raise"``; under ``"skip"`` it is passed to ``record_reject`` (if
    given) and returned in a rejected result. ``cache=None`` only produces.
    """
    if cache is not None and lookup:
        sample, tier = cache.lookup(key)
        if sample is not None:
            return ReadThrough(sample, tier)
    t0 = time.thread_time()
    try:
        produced = dict(produce())
    except SampleError as err:
        if on_error == "raise":
            raise
        if record_reject is not None:
            record_reject(err)
        return ReadThrough(None, error=err)
    cost = time.thread_time() - t0
    admitted = False
    if cache is not None:
        raw = codec.encode(produced, ctime=cache.clock(), cost=cost)
        if write is None:
            admitted = cache.put_encoded(key, raw, cost=cost, tag=tag)
        else:
            admitted = write(key, raw, cost, tag)
    return ReadThrough(produced, cost=cost, admitted=admitted)


def describe(source: object) -> str:
    """The one line a cache records beside a source's fingerprint: its ``describe()``,
    or ``repr`` of its ``pipeline`` for sources that predate it."""
    method = getattr(source, "describe", None)
    if callable(method):
        return str(method())
    return repr(getattr(source, "pipeline", source))
