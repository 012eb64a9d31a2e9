"""``RemotePrefetch``: a loader hook that revalidates a remote source once per epoch and
fetches its raw-tier misses ahead, in the epoch's exact order, with bounded concurrency.

``DataLoader(source, ..., hooks=[RemotePrefetch(source)])``. Before each epoch (in the
thread that iterates the loader) it

1. calls ``source.revalidate()``: every remote object's stamp (ETag) checked once,
   batched; a changed object is re-keyed, so nothing of its old version is served.
   When the store cannot be reached it logs one warning for the epoch and goes on: what
   the raw tier and the cache hold is still served, only misses fail (as SampleErrors
   naming the URL);
2. starts a thread that walks the epoch's batches (``EpochContext.batches``) from the
   batch it starts at, and for each sample whose bytes the raw tier lacks submits the
   ranged GET to a pool of ``threads`` threads, never more than ``ahead`` batches past
   the batch the training loop last received (``after_assemble`` tells it), so a raw
   tier smaller than an epoch is not flushed by its own prefetch.

A cold epoch over a store with tens of milliseconds of latency is then bound by
decoding, not by round trips. Failed prefetches are left to the producing worker,
which retries and reports them.

The source must offer ``raw`` (a :class:`~mmcache.sources.remote.raw.RawTier`),
``remote_span(index) -> (url, stamp, start, end) | None``, ``fetch(url, stamp, start,
end, sample_id=...)``, ``sample_id`` and ``revalidate()`` (as
:class:`~mmcache.sources.wds.WebDatasetSource` does). Thread safety: the hook's methods
are called by the loader's threads; its state is guarded by a condition variable.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from mmcache.errors import ConfigError, SampleError
from mmcache.sources.remote.fs import RemoteError
from mmcache.sources.remote.raw import RawTier

__all__ = ["PrefetchSource", "RemotePrefetch"]

logger = logging.getLogger(__name__)

#: Spans remembered as held (a set of tuples: ~200 bytes each).
_MAX_KNOWN = 5_000_000


class PrefetchSource(Protocol):
    """What :class:`RemotePrefetch` needs of a source."""

    raw: RawTier | None

    def sample_id(self, index: int) -> str: ...

    def remote_span(self, index: int) -> tuple[str, str, int, int] | None: ...

    def fetch(
        self, url: str, stamp: str, start: int, end: int, *, sample_id: str, wait: bool = True
    ) -> bytes: ...

    def revalidate(self) -> list[str]: ...


class RemotePrefetch:
    """See the module docstring.

    Args:
        source: the remote source (it must have a raw tier: ``raw=RawTier(...)``).
        threads: concurrent GETs (bounded; 16 hides ~25 ms of latency for ~600 samples/s).
        ahead: batches past the one the training loop last received that may be fetched.
    """

    def __init__(self, source: PrefetchSource, *, threads: int = 16, ahead: int = 64) -> None:
        if getattr(source, "raw", None) is None:
            raise ConfigError(
                "RemotePrefetch needs a source with a raw tier to fetch into (raw=RawTier(...))"
            )
        for name, value in (("threads", threads), ("ahead", ahead)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        self.source = source
        self.threads = threads
        self.ahead = ahead
        self._cond = threading.Condition()
        self._consumed = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Per epoch: GETs submitted, and whether the store could be revalidated.
        self.fetched = 0
        self.revalidated = True
        # Spans held or fetched by this process in earlier epochs: a warm epoch skips them
        # without asking the raw tier (a span evicted since is fetched by its worker).
        # A changed object has a new stamp, hence new spans.
        self._known: set[tuple[str, str, int, int]] = set()

    def before_epoch(self, ctx: Any) -> None:
        """Revalidate, then prefetch epoch ``ctx.epoch`` from batch ``ctx.start``."""
        self.close()
        try:
            changed = self.source.revalidate()
        except RemoteError as err:
            self.revalidated = False
            logger.warning(
                "epoch %d: cannot revalidate remote objects (%s); serving what is cached, "
                "misses will fail",
                ctx.epoch,
                err,
            )
        else:
            self.revalidated = True
            if changed:
                logger.info("epoch %d: %d remote objects changed", ctx.epoch, len(changed))
        batches = ctx.batches(ctx.epoch)[ctx.start :]
        with self._cond:
            self._consumed = -1
        self._stop = threading.Event()
        if not self.revalidated:
            return  # the store is down: do not queue a GET per miss
        self.fetched = 0
        self._thread = threading.Thread(
            target=self._run, args=(batches, self._stop), name="mmcache-prefetch", daemon=True
        )
        self._thread.start()

    def after_assemble(self, batch: dict[str, Any], ctx: Any) -> dict[str, Any]:
        with self._cond:
            self._consumed = max(self._consumed, int(ctx.batch))
            self._cond.notify_all()
        return batch

    def _run(self, batches: list[np.ndarray], stop: threading.Event) -> None:
        raw = self.source.raw
        assert raw is not None
        limit = threading.BoundedSemaphore(self.threads * 2)
        seen = self._known
        if len(seen) > _MAX_KNOWN:
            seen.clear()

        def one(span: tuple[str, str, int, int], index: int) -> None:
            try:
                if not raw.contains(*span):
                    sid = self.source.sample_id(index)
                    self.source.fetch(*span, sample_id=sid, wait=False)
                seen.add(span)
            except (SampleError, RemoteError, OSError) as exc:  # the worker will report it
                logger.debug("prefetch of %s failed: %s", span[0], exc)
            finally:
                limit.release()

        beat = 0.0
        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="mmcache-get") as pool:
                pending: list[Future[None]] = []
                for number, batch in enumerate(batches):
                    if time.monotonic() - beat > 0.5:  # producers that miss wait for us
                        raw.heartbeat()
                        beat = time.monotonic()
                    with self._cond:
                        while not stop.is_set() and number > self._consumed + self.ahead:
                            self._cond.wait(0.1)
                    if stop.is_set():
                        break
                    for index in np.asarray(batch).tolist():
                        span = self.source.remote_span(int(index))
                        if span is None or span in seen:
                            continue
                        if raw.contains(*span):
                            seen.add(span)
                            continue
                        limit.acquire()
                        if stop.is_set():
                            limit.release()
                            break
                        self.fetched += 1
                        pending.append(pool.submit(one, span, int(index)))
                    pending = [f for f in pending if not f.done()]
                    if time.monotonic() - beat > 0.5:
                        raw.heartbeat()
                        beat = time.monotonic()
        finally:
            raw.heartbeat_end()

    def close(self) -> None:
        """Stop the prefetch thread of the current epoch (waits for GETs in flight)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
