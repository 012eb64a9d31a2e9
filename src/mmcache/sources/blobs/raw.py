"""The raw-bytes tier: remote objects' bytes (whole objects or byte ranges of shards) kept
on local disk, keyed by URL + version stamp (ETag), under their own byte budget.

A :class:`RawTier` is a :class:`~mmcache.stores.disk.DiskStore` (LMDB, the repo's
policies, a hard budget) in its own directory, usually ``<cache root>/raw``. A key is
the digest of ``(url, stamp, start, end)``: an object that changes gets a new ETag and
so new keys, and its old bytes are never found again (they age out under the policy).
So a run whose decoded samples do not fit the cache's budgets still reads from local
disk after its first epoch, and goes on through an object-store outage on what it has.

Every value carries the xxh3_128 of its bytes (16 bytes in front of them), checked on every
read: a value damaged on disk (one flipped byte was decoded and served before, G3) is
dropped and fetched again, never served. DiskStore does not checksum values (the sample
codec carries its own checksum); raw bytes have none of their own, so the tier adds it.

Thread- and process-safe (the DiskStore is); pickles as its configuration and reopens
the environment in each process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import xxhash

from mmcache import keys
from mmcache.errors import RemoteSampleError
from mmcache.policies import Policy
from mmcache.rootfiles import make_dir, replace_file
from mmcache.sources.blobs.objects import Remote, RemoteError
from mmcache.stores.disk import DiskStore
from mmcache.units import parse_size

__all__ = ["RawTier", "fetch_bytes"]

logger = logging.getLogger(__name__)

#: Bytes of the checksum in front of every value (xxh3_128 of the payload).
_SUM = 16

#: A prefetcher that beat within this many seconds is running.
_BEAT_S = 2.0
#: How long a producer that misses waits for a running prefetcher, and how often it looks.
_WAIT_S = 1.0
_POLL_S = 0.005


class RawTier:
    """Raw bytes of remote objects on local disk (see the module docstring).

    Args:
        path: its directory (created; e.g. ``cache.root / "raw"``).
        budget: bytes of payload it may hold (an int or ``"20GiB"``).
        policy: admission/eviction policy by name or instance (``"lru"`` by default).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, budget: int | str, policy: str | Policy = "lru"
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.budget = parse_size(budget)
        self.policy = policy
        self._store: DiskStore | None = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "budget": self.budget, "policy": self.policy}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._store = None
        self._pid = -1

    def __repr__(self) -> str:
        return f"RawTier({self.path!r}, budget={self.budget})"

    @property
    def store(self) -> DiskStore:
        """The DiskStore of this process (opened on first use)."""
        if self._store is None or self._pid != os.getpid():
            self._store = DiskStore(self.path, capacity=self.budget, policy=self.policy)
            self._pid = os.getpid()
        return self._store

    @staticmethod
    def key(url: str, stamp: str, start: int, end: int) -> bytes:
        """The key of bytes ``[start, end)`` of version ``stamp`` of ``url`` (version 2 of the
        scheme: values framed with their checksum; version-1 values are never read)."""
        return keys.digest("mmcache.raw", 2, url, stamp, start, end)

    @staticmethod
    def _framed(data: bytes | memoryview) -> bytes:
        return xxhash.xxh3_128_digest(data) + bytes(data)

    def get(self, url: str, stamp: str, start: int, end: int) -> bytes | None:
        """The bytes if held and intact, else ``None``. A held value whose checksum or
        length does not match is deleted (one warning naming the URL and the span) and
        reads as a miss, so the caller fetches it again."""
        key = self.key(url, stamp, start, end)
        value = self.store.get(key)
        if value is None:
            return None
        data = value[_SUM:]
        if len(data) == end - start and xxhash.xxh3_128_digest(data) == value[:_SUM]:
            return data
        logger.warning(
            "raw tier %s: the held bytes [%d, %d) of %s fail their checksum (damaged on "
            "disk): dropped, fetched again",
            self.path,
            start,
            end,
            url,
        )
        with contextlib.suppress(Exception):  # a failed delete only leaves a miss behind
            self.store.delete(key)
        return None

    def contains(self, url: str, stamp: str, start: int, end: int) -> bool:
        return self.store.contains(self.key(url, stamp, start, end))

    def put(self, url: str, stamp: str, start: int, end: int, data: bytes) -> bool:
        """Keep ``data``; False when the policy or the budget refuses it."""
        return self.store.put(self.key(url, stamp, start, end), self._framed(data))

    def put_spans(
        self, url: str, stamp: str, spans: list[tuple[int, int, bytes | memoryview]]
    ) -> list[bool]:
        """Keep each ``(start, end, data)`` of version ``stamp`` of ``url`` (few write
        transactions: what one GET of a fetch group brings)."""
        return self.store.put_many(
            [(self.key(url, stamp, s, e), self._framed(data), 0.0, 0.0) for s, e, data in spans]
        )

    # -- the prefetcher's heartbeat: a producer that misses waits for it a little ---------
    @property
    def _beat_path(self) -> str:
        return os.path.join(self.path, "prefetching")

    def heartbeat(self) -> None:
        """Say that a prefetcher is fetching into this tier (called at least every second)."""
        with contextlib.suppress(OSError):  # a fixed name: never written through a link
            make_dir(self.path, 0o700)
            replace_file(self._beat_path, str(os.getpid()).encode("ascii"), 0o600)

    def heartbeat_end(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._beat_path)

    def prefetching(self, clock: Callable[[], float] = time.time) -> bool:
        """Whether a prefetcher beat within the last ``_BEAT_S`` seconds (one ``stat``)."""
        try:
            return clock() - os.stat(self._beat_path).st_mtime < _BEAT_S
        except OSError:
            return False

    def wait_for(
        self, url: str, stamp: str, start: int, end: int, *, timeout: float = _WAIT_S
    ) -> bytes | None:
        """The bytes once a running prefetcher has put them, within ``timeout``; ``None``
        when no prefetcher runs or it has not got them in time (the caller fetches)."""
        if not self.prefetching():
            return None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(_POLL_S)
            held = self.get(url, stamp, start, end)
            if held is not None:
                return held
        return None

    def nbytes(self) -> int:
        return self.store.nbytes()

    def close(self) -> None:
        if self._store is not None and self._pid == os.getpid():
            self._store.close()
        self._store = None


def fetch_bytes(
    remote: Remote,
    raw: RawTier | None,
    span: tuple[str, str, int, int],
    *,
    sample_id: str,
    wait: bool = True,
) -> bytes:
    """Bytes ``[start, end)`` of version ``stamp`` of ``url`` (``span``): from ``raw`` if it holds
    them (``wait``: or once a running prefetcher has put them there, within a second, so
    that the producer and the prefetcher do not both GET them), else one ranged GET
    (under the retry policy) kept in ``raw``. Raises
    :class:`~mmcache.errors.RemoteSampleError` (a SampleError and a RemoteError) naming
    the sample, the URL, the HTTP status and the kind; a miss does not wait for the
    prefetcher while the store is unreachable (the breaker is open)."""
    url, stamp, start, end = span
    if raw is not None:
        held = raw.get(url, stamp, start, end)
        if held is None and wait and not remote.unreachable:
            held = raw.wait_for(url, stamp, start, end)
        if held is not None:
            return held
    try:
        data = remote.read(url, start, end)
    except RemoteError as err:
        raise RemoteSampleError(err, sample_id=sample_id) from err
    if raw is not None:
        raw.put(url, stamp, start, end, data)
    return data
