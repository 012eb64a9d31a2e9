"""``RemotePrefetch``: a loader hook that revalidates a remote source once per epoch and
fetches its raw-tier misses ahead, in the epoch's exact order, with bounded concurrency
and few requests.

``DataLoader(source, ..., hooks=[RemotePrefetch(source)])``. Before each epoch (in the
thread that iterates the loader) it

1. calls ``source.revalidate()``: every remote object's stamp (ETag) checked once,
   batched (one listing per directory of shards); a changed object is re-keyed, so
   nothing of its old version is served. It runs on the prefetch thread while the
   loader gathers the first batches, which wait for its answer before they are served
   (a source's ``shared_stamps`` gate, :mod:`~mmcache.sources.blobs.state`). When the
   store cannot be reached it logs one warning for the epoch and goes on: what the raw
   tier and the cache hold is still served, only misses fail (as
   :class:`~mmcache.errors.RemoteSampleError` naming the URL; at once once the circuit
   breaker is open, :mod:`~mmcache.sources.blobs.retry`);
2. starts a thread that walks the epoch's batches (``EpochContext.batches``) from the
   batch it starts at and fetches what the raw tier lacks into it, never more than
   ``ahead`` batches past the batch the training loop last received (``after_assemble``
   tells it), with at most ``threads`` GETs in flight. A source that offers fetch
   groups (``fetch_groups``/``fetch_group``, as
   :class:`~mmcache.sources.wds.WebDatasetSource` does: the samples of a shard whose
   bytes start in one aligned block, :mod:`~mmcache.sources.blobs.blocks`) gets one
   ranged GET per group the epoch needs, cut back into its samples' spans in the raw
   tier; others one GET per sample. ``ahead`` counts batches: with groups, each sample
   ahead may bring its whole block, so on a set of many shards up to ``ahead`` x batch
   size x ``fetch_block`` bytes are fetched ahead (the raw tier's budget should hold it).

The samples whose bytes this process has fetched or found held are remembered (one bit
per sample, forgotten when ``source.remote_version()`` changes: an object changed), so
the walk of a warm epoch costs a few numpy operations, and an epoch with nothing to
fetch starts no thread at all. A span evicted from the raw tier since is fetched by its
producing worker. A cold epoch over a store with tens of milliseconds of latency is then
bound by decoding, not by round trips or the store's rate of requests. Failed prefetches
are left to the producing worker, which retries and reports them.

The source must offer ``raw`` (a :class:`~mmcache.sources.blobs.raw.RawTier`, or
``None``), ``remote`` (a :class:`~mmcache.sources.blobs.objects.Remote`), ``__len__``,
``remote_span(index) -> (url, stamp, start, end) | None``, ``fetch(url, stamp, start,
end, sample_id=...)``, ``sample_id`` and ``revalidate()``: a
:class:`~mmcache.sources.wds.WebDatasetSource`,
:class:`~mmcache.sources.files.FileSource` (images or video clips) or
:class:`~mmcache.sources.parquet.ParquetSource` of ``s3://``, ``gs://`` or ``http(s)://``
URLs. A source whose bytes are not fetched ahead (``fetches_ahead`` is false: a
ParquetSource, whose rows pyarrow reads) is only revalidated at each epoch; one that is
needs a raw tier to fetch into. Another source is refused with a
:class:`~mmcache.errors.ConfigError` saying what to do (a source of local files needs no
hook: its files are ``stat``-ed at every batch).
Thread safety: the hook's methods are called by the loader's threads; its state is
guarded by a condition variable and a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from mmcache.errors import ConfigError, SampleError
from mmcache.hooks import BatchContext, EpochContext, LoaderHook
from mmcache.sources.blobs.objects import RemoteError
from mmcache.sources.capabilities import GroupedFetching, Revalidating, SharesStamps

__all__ = ["PrefetchSource", "RemotePrefetch"]

logger = logging.getLogger(__name__)


class PrefetchSource(Revalidating, Protocol):
    """What :class:`RemotePrefetch` needs of a source: the
    :class:`~mmcache.sources.capabilities.Revalidating` capability and its size and ids
    (:class:`~mmcache.sources.capabilities.GroupedFetching` and
    :class:`~mmcache.sources.capabilities.SharesStamps` are used when offered)."""

    def __len__(self) -> int: ...

    def sample_id(self, index: int) -> str: ...


class RemotePrefetch(LoaderHook):
    """See the module docstring.

    Args:
        source: the remote source (with a raw tier, ``raw=RawTier(...)``, when its bytes
            are fetched ahead).
        threads: concurrent GETs (bounded; 16 hides ~25 ms of latency for ~600 samples/s).
        ahead: batches past the one the training loop last received that may be fetched.
    """

    def __init__(self, source: PrefetchSource, *, threads: int = 16, ahead: int = 64) -> None:
        if not isinstance(source, Revalidating):
            raise ConfigError(
                f"RemotePrefetch cannot drive {source!r}: it checks remote objects again at "
                "each epoch and fetches them ahead, for a WebDatasetSource, a FileSource "
                "or a ParquetSource (or MultimodalDataset) of s3://, gs:// or http(s):// "
                "URLs. For local files leave it out of hooks=: they are checked at every "
                "batch without it (a changed file is read again)"
            )
        if source.fetches_ahead and source.raw is None:
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
        self._lock = threading.Lock()
        #: Of the last epoch: samples whose bytes were fetched, GETs issued, whether the
        #: store could be revalidated, and the seconds the revalidation took.
        self.fetched = 0
        self.gets = 0
        self.revalidated = True
        self.revalidate_s = 0.0
        self._changed = False
        # One bit per sample: its bytes were fetched or found held by this process (for
        # the source version ``_version``): a warm epoch does not look at them again.
        self._known: np.ndarray | None = None
        self._version: Any = None

    def _known_bits(self, changed: bool) -> np.ndarray:
        version = self.source.remote_version()
        n = len(self.source)
        if (
            self._known is None
            or self._known.shape[0] != n
            or version != self._version
            or (changed and version is None)
        ):
            self._known = np.zeros(n, dtype=bool)
            self._version = version
        return self._known

    def before_epoch(self, ctx: EpochContext) -> None:
        """Start revalidating, then prefetching, epoch ``ctx.epoch`` from batch ``ctx.start``.

        With a source that shares its stamps (``shared_stamps``), the revalidation runs on
        the prefetch thread while the loader gathers the first batches: every process's
        next look at the source's keys waits until it has answered (see
        :mod:`~mmcache.sources.blobs.state`), so a batch gathered meanwhile is checked
        against the new keys and an overwritten object is never served. Otherwise it
        runs here, before the epoch."""
        self.close()
        self.source.remote.new_epoch()
        with self._cond:
            self._consumed = -1
        self._stop = threading.Event()
        self.fetched = self.gets = 0
        if not isinstance(self.source, SharesStamps):
            self._revalidate(ctx.epoch)
            self._start_fetching(ctx)
            return
        gate = self.source.shared_stamps
        gate.begin()
        started = threading.Event()

        def run() -> None:
            try:
                self._revalidate(ctx.epoch)
            finally:
                gate.end()
                started.set()
            self._start_fetching(ctx, inline=True)

        self._thread = threading.Thread(target=run, name="mmcache-prefetch", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            gate.end()
            raise

    def _revalidate(self, epoch: int) -> None:
        t0 = time.perf_counter()
        changed: list[str] = []
        try:
            changed = self.source.revalidate()
        except (RemoteError, OSError) as err:
            self.revalidated = False
            logger.warning(
                "epoch %d: cannot revalidate remote objects (%s); serving what is cached, "
                "misses will fail",
                epoch,
                err,
            )
        else:
            # an answer from the kept listing (the store is down, offline="auto"/True)
            # is not a revalidation: the listing is not fresh
            self.revalidated = not self.source.remote.stale
            if not self.revalidated:
                logger.warning(
                    "epoch %d: cannot revalidate remote objects (the store cannot be "
                    "reached: the kept listing answered, it is not fresh); serving what is "
                    "cached, misses will fail",
                    epoch,
                )
            if changed:
                logger.info("epoch %d: %d remote objects changed", epoch, len(changed))
        self._changed = bool(changed)
        self.revalidate_s = time.perf_counter() - t0

    def _start_fetching(self, ctx: EpochContext, *, inline: bool = False) -> None:
        """Walk the epoch's batches and fetch ahead (here when ``inline``: already on the
        prefetch thread; else on a new one). Nothing when the store is down or all held."""
        if not self.source.fetches_ahead:
            return  # another reader reads its bytes: revalidating was all
        if not self.revalidated or self.source.remote.unreachable:
            return  # the store is down: do not queue a GET per miss
        known = self._known_bits(self._changed)
        batches = [np.asarray(b, dtype=np.int64) for b in ctx.batches(ctx.epoch)[ctx.start :]]
        if not batches or bool(known[np.concatenate(batches)].all()):
            return  # a warm epoch: nothing to fetch
        raw = self.source.raw
        assert raw is not None
        raw.heartbeat()  # before the first producer looks (it waits for us, not GETs twice)
        if inline:
            self._run(batches, known, self._stop)
            return
        self._thread = threading.Thread(
            target=self._run,
            args=(batches, known, self._stop),
            name="mmcache-prefetch",
            daemon=True,
        )
        self._thread.start()

    def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> dict[str, Any]:
        with self._cond:
            self._consumed = max(self._consumed, int(ctx.batch))
            self._cond.notify_all()
        return batch

    def _members(self, item: int, grouped: bool) -> tuple[str, str, list[tuple[int, int, int]]]:
        if grouped:
            assert isinstance(self.source, GroupedFetching)
            url, stamp, members = self.source.fetch_group(item)
            return url, stamp, members
        span = self.source.remote_span(item)
        if span is None:
            return "", "", []
        return span[0], span[1], [(item, span[2], span[3])]

    def _fetch(self, item: int, grouped: bool, known: np.ndarray) -> None:
        """Fetch what the raw tier lacks of ``item`` (a group, or a sample): one GET."""
        raw = self.source.raw
        assert raw is not None
        url, stamp, members = self._members(item, grouped)
        held: list[int] = []
        missing: list[tuple[int, int, int]] = []
        for i, s, e in members:
            if raw.contains(url, stamp, s, e):
                held.append(i)
            else:
                missing.append((i, s, e))
        if len(missing) == 1:
            i, s, e = missing[0]
            self.source.fetch(url, stamp, s, e, sample_id=self.source.sample_id(i), wait=False)
            held.append(i)
        elif missing:
            lo, hi = missing[0][1], max(e for _, _, e in missing)
            view = memoryview(self.source.remote.read(url, lo, hi))
            kept = raw.put_spans(url, stamp, [(s, e, view[s - lo : e - lo]) for _, s, e in missing])
            held += [i for (i, _, _), ok in zip(missing, kept, strict=True) if ok]
        with self._lock:
            self.gets += bool(missing)
            self.fetched += len(missing)
        known[np.asarray(held, dtype=np.int64)] = True

    def _run(self, batches: list[np.ndarray], known: np.ndarray, stop: threading.Event) -> None:
        raw = self.source.raw
        assert raw is not None
        grouped = isinstance(self.source, GroupedFetching)
        limit = threading.BoundedSemaphore(self.threads * 2)
        submitted: set[int] = set()

        def one(item: int) -> None:
            try:
                self._fetch(item, grouped, known)
            except (SampleError, RemoteError, OSError) as exc:  # the worker will report it
                logger.debug("prefetch of %s failed: %s", item, exc)
            finally:
                limit.release()

        beat = time.monotonic()
        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="mmcache-get") as pool:
                for number, batch in enumerate(batches):
                    with self._cond:
                        while not stop.is_set() and number > self._consumed + self.ahead:
                            self._cond.wait(0.1)
                    if stop.is_set() or self.source.remote.unreachable:
                        break  # the breaker opened: misses fail at once, no waiting for us
                    todo = batch[~known[batch]]
                    if not todo.size:
                        continue
                    if grouped:
                        assert isinstance(self.source, GroupedFetching)
                        groups = self.source.fetch_groups(todo)
                        known[todo[groups < 0]] = True
                        items = groups[groups >= 0].tolist()
                    else:
                        items = todo.tolist()
                    for item in items:
                        if item in submitted:
                            continue
                        submitted.add(item)
                        limit.acquire()
                        if stop.is_set():
                            limit.release()
                            break
                        pool.submit(one, item)
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
