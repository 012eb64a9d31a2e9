"""The write path of a FeatureCache: newly encoded features from the device into the Cache.

On CUDA the device-to-host copy for the Cache is issued ``non_blocking`` into
pinned memory and handed over at the *next* call (or :meth:`FeatureWrites.flush`),
when the copy has long finished: the training step never waits for it (a
synchronous copy would stall the GPU queue every step, as mlx-vlm#976
measured). A write-behind thread (:class:`FeatureWriter`) then encodes the
entries and commits them to the Cache's tiers; the disk tier fsyncs each
commit, which takes far longer than the GPU takes to encode the batch. On the
CPU there is nothing to overlap and the put is immediate (``write_behind=False``).
A process killed before a flush loses at most a few batches of writes (the
queue's depth), which the next run recomputes; at normal exit they are written.

Why not the loader's write-behind (:mod:`mmcache.writeback`): that one takes
entries already encoded, puts them in the memory tier on the caller's thread
and, with a full queue, makes the caller do the disk write. Here the whole
point is to keep the training thread free of both: it hands over a pinned host
tensor, and the codec encoding and every tier's put run on the writer thread;
a full queue makes the caller *wait* (bounding pinned host memory) rather than
write. ``FeatureWriter.join`` also waits without stopping the thread, which
:meth:`FeatureCache.flush` needs between epochs.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmcache.cache import Cache
from mmcache.features.entry import encode_entry, host_bits

__all__ = ["FeatureWriter", "FeatureWrites", "put_features"]

logger = logging.getLogger(__name__)


def put_features(
    cache: Cache, dtype: torch.dtype, fkeys: list[bytes], host: torch.Tensor, cost: float
) -> None:
    """Encode each row of ``host`` as a codec entry and offer it to every tier of ``cache``."""
    bits = host_bits(host)
    for j, fk in enumerate(fkeys):
        raw = encode_entry(bits[j], dtype, ctime=cache.clock(), cost=cost)
        cache.put_encoded(fk, raw, cost=cost)


class FeatureWriter:
    """Write-behind: one daemon thread puts finished feature batches into the Cache.

    The training thread only hands over ``(keys, host tensor, cost)``; encoding
    and the tiers' commits run here, overlapped with training (lmdb releases
    the GIL during I/O). The queue holds at most ``depth`` batches: when the
    disk is slower than the encoder, the training thread waits, which bounds
    host memory. A failed put is logged and counted; those features are
    recomputed later. Thread-safe: ``submit``/``join``/``close`` may be called
    from any thread.
    """

    def __init__(self, cache: Cache, dtype: torch.dtype, depth: int = 4) -> None:
        self._cache = cache
        self._dtype = dtype
        self._queue: queue.Queue[tuple[list[bytes], torch.Tensor, float] | None] = queue.Queue(
            depth
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def submit(self, fkeys: list[bytes], host: torch.Tensor, cost: float) -> None:
        """Queue a batch (waits while the queue is full); starts the thread on first use."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="mmcache-feature-writer", daemon=True
                )
                self._thread.start()
        self._queue.put((fkeys, host, cost))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                put_features(self._cache, self._dtype, *item)
            except Exception:  # never kill the writer: the entries are just recomputed later
                self.failures += 1
                n = len(item[0]) if item is not None else 0
                logger.exception("writing %d features to the cache failed", n)
            finally:
                self._queue.task_done()

    def join(self) -> None:
        """Wait until every submitted batch is in the Cache."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread (idempotent)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()


@dataclass
class _Pending:
    """Features copied (non-blocking) to pinned host memory, to be put once the copy is done."""

    fkeys: list[bytes]
    host: torch.Tensor | None
    done: Any  # torch.cuda.Event recorded after the copy, or None (CPU: already done)
    timing: tuple[Any, Any] | None  # CUDA (start, end) events around the encoder
    cost: float  # seconds per sample, when already known (CPU)


class FeatureWrites:
    """The pending device-to-host copies of one FeatureCache and where they go (see the module).

    Args:
        cache: where features go; ``None``: nowhere (copies are skipped).
        dtype: the features' dtype (for the codec entry).
        device: the encoder's device: on CUDA copies are non-blocking and put later.
        write_behind: put through a :class:`FeatureWriter` thread instead of inline.
        timed: called with ``(seconds, n_samples)`` once a CUDA batch's encoder time
            is known (its events completed), so the caller can count it.

    ``defer`` (True on CUDA) makes CPU writes wait for the next drain too (the
    CUDA path, exercised on the CPU by tests). Driven by one thread.
    """

    def __init__(
        self,
        cache: Cache | None,
        dtype: torch.dtype,
        *,
        device: torch.device,
        write_behind: bool,
        timed: Callable[[float, int], None],
    ) -> None:
        self.cache = cache
        self.dtype = dtype
        self.cuda = device.type == "cuda"
        self.defer = self.cuda
        self.writer = FeatureWriter(cache, dtype) if write_behind and cache is not None else None
        if self.writer is not None:
            # Queued writes reach the Cache when this object dies or at interpreter exit.
            self._finalizer = weakref.finalize(self, self.writer.close)
        self._timed = timed
        self._pending: list[_Pending] = []

    def submit(
        self,
        fkeys: list[bytes],
        y: torch.Tensor,
        *,
        timing: tuple[Any, Any] | None,
        cost: float = 0.0,
    ) -> None:
        """Hand over a batch of new features ``y`` (on the device) for the Cache."""
        if self.cuda:
            host = None
            if self.cache is not None:
                host = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
                host.copy_(y, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
            self._pending.append(_Pending(fkeys, host, done, timing, 0.0))
            return
        host = y if y.device.type == "cpu" else y.to("cpu")
        if self.defer:
            self._pending.append(_Pending(fkeys, host, None, None, cost))
            return
        self._put(fkeys, host, cost)

    def drain(self, *, block: bool) -> None:
        """Put the pending writes whose copies are done (all of them with ``block``)."""
        while self._pending:
            p = self._pending[0]
            if p.done is not None:
                if block:
                    p.done.synchronize()
                elif not p.done.query():
                    return
            self._pending.pop(0)
            cost = self._resolve_timing(p)
            if p.host is not None:
                self._put(p.fkeys, p.host, cost)

    def _resolve_timing(self, p: _Pending) -> float:
        """Seconds per sample of a pending batch; CUDA timings are reported once complete."""
        if p.timing is None:
            return p.cost
        start, end = p.timing  # both recorded before `done`, so complete once it is
        seconds = float(start.elapsed_time(end)) / 1000.0
        self._timed(seconds, len(p.fkeys))
        return seconds / max(len(p.fkeys), 1)

    def _put(self, fkeys: list[bytes], host: torch.Tensor, cost: float) -> None:
        if self.cache is None:
            return
        if self.writer is not None:
            self.writer.submit(fkeys, host, cost)
        else:
            put_features(self.cache, self.dtype, fkeys, host, cost)

    def flush(self) -> None:
        """Put every pending batch (waits for the copies and for the writer thread)."""
        self.drain(block=True)
        if self.writer is not None:
            self.writer.join()

    def close(self) -> None:
        """Flush, then stop the writer thread (later writes are put inline)."""
        self.flush()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
