"""Batch assembly in the training process: gather the hits, fill in the rows workers sent.

Given a :class:`~mmcache.loader.tasks.BatchPlan`, the planned hits (and the
rows a worker put in the first tier instead of sending them) are gathered
straight from the cache's reader (shared memory, then the disk tier's map)
into the batch tensors
(:func:`~mmcache.loader.gather.gather_hits`), then the rows a worker sent are
copied in. A row that cannot be served as planned is made again here by one
fallback (:meth:`BatchAssembler._redo`): a planned hit evicted or expired in
the meantime (a *late miss*, counted), a cached entry of another layout under
its key (dropped from every tier as damaged), or, before the batch layout is
known, a batch whose cached entries all fail their checksum.

The batch is what torch's default collate would make of the source's items,
plus the cache keys: ``{"id": list[str], "key": list[str], "image": uint8
[B,3,H,W], "input_ids": [B,L], "attention_mask": [B,L]}``. Nothing about it
depends on the cache: the same seed gives bitwise the same batches with the
cache on, off, cold or warm.

Thread safety: :meth:`BatchAssembler.assemble` and :meth:`~BatchAssembler.gather_guess`
run on two threads at once (the loader's helper thread and the training
loop); the layout learnt from the first batch and the buffer pool are locked.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmcache import codec
from mmcache.cache import Cache
from mmcache.errors import ConfigError, SampleError
from mmcache.loader.counters import EpochCounter
from mmcache.loader.gather import BufferPool, gather_hits
from mmcache.loader.shmroom import ShmRoom
from mmcache.loader.tasks import BatchPlan, SampleOrigin, WorkerPlanner
from mmcache.loader.varying import (
    channels_last_fields,
    compatible,
    finish_rows,
    present_channels_last,
    read_other_shapes,
    varying_fields,
)
from mmcache.sources.base import SampleSource
from mmcache.stores.base import BatchReader, Store
from mmcache.stores.gathering import count_served, reader_names

__all__ = ["BatchAssembler"]

#: What a batch without shared memory costs (ShmRoom's warning).
_PRIVATE_BATCHES = "batches go in private memory and are cropped in the training process"

_MEMORY, _LOWER, _PRODUCED, _REJECTED = (
    SampleOrigin.MEMORY_HIT,
    SampleOrigin.DISK_HIT,
    SampleOrigin.PRODUCED,
    SampleOrigin.REJECTED,
)


@dataclass
class _Rows:
    """What assembly knows of the rows of one batch: the samples to copy in (by row),
    each row's origin, and for a hit the name of the tier that served it."""

    samples: dict[int, dict[str, np.ndarray]]
    origins: list[SampleOrigin | None]
    tiers: list[str]


class BatchAssembler:
    """Makes batches from plans: owns the batch layout (learnt from the first sample)
    and the buffer pool.

    Args:
        source: the samples (ids, rejects).
        cache: the cache (None: every row was produced).
        planner: makes a row again when it cannot be served as planned.
        pin_memory: allocate batch tensors in pinned memory (never recycled:
            an asynchronous host-to-device copy may still read one).
        shm: the loader's room in ``/dev/shm`` (None: a room of its own), where the
            :attr:`shared` fields go while it has some.
    """

    def __init__(
        self,
        source: SampleSource,
        cache: Cache | None,
        planner: WorkerPlanner,
        *,
        pin_memory: bool,
        shm: ShmRoom | None = None,
    ) -> None:
        self._source = source
        self._cache = cache
        self._planner = planner
        self.pin_memory = pin_memory
        self._shm = shm if shm is not None else ShmRoom()
        #: The tiers that gather whole batches (else every row comes from workers).
        self.reader: BatchReader | None = cache.reader if cache is not None else None
        # The same tiers as Stores (their get, a verified read, and discard), and the
        # one Store face over them (the first tier, or the cache's tier list).
        self._names: tuple[str, ...] = ()
        self._stores: tuple[Store, ...] = ()
        self._first: Store | None = None
        if cache is not None and self.reader is not None:
            self._names = reader_names(self.reader)
            self._stores = tuple(cache.tiers[name] for name in self._names)
            self._first = self._stores[0] if len(self._stores) == 1 else cache.store
        # Guards the layout and the buffer pool: batches are assembled on two threads.
        self._lock = threading.Lock()
        self._layout: codec.Header | None = None
        self._pool = BufferPool(enabled=not pin_memory)
        #: Fields whose shapes vary between samples (batches hold them as lists).
        self.varying = varying_fields(source)
        self.channels_last = channels_last_fields(source)
        # Whether the fixed-slot gather served at least half the rows of the last batch
        # (a source of varied shapes): when not, rows are read one by one straight away.
        self._fixed_pays = True
        # Per thread: rows of the last guessed gather whose hits the tier already counted.
        self._counted = threading.local()
        #: Fields whose batch tensors are allocated in shared memory (what crop processes
        #: read without a copy: :mod:`mmcache.loader.croppool`); recycled like the others.
        #: Private while /dev/shm is full (the crops then run in the training process).
        self.shared: frozenset[str] = frozenset()

    @property
    def layout(self) -> codec.Header | None:
        """The batch layout (field names, dtypes, shapes), once a sample was seen."""
        return self._layout

    def entry_bytes(self) -> int | None:
        """The size of one cache entry of the batch layout, once it is known."""
        layout = self._layout
        return layout.length if layout is not None else None

    # -- a guessed plan ------------------------------------------------------------------
    def gather_guess(self, plan: BatchPlan) -> dict[str, Any] | None:
        """The batch of a guessed plan, gathered from shared memory; None unless every
        key is there (nothing is produced for it, nothing counted)."""
        reader, layout = self.reader, self._layout
        if reader is None or layout is None:
            return None
        n = len(plan.indices)
        out = self._allocate(layout, n)
        rows = np.arange(n, dtype=np.int64)
        found, own, served = self._gather(reader, layout, plan.keys, rows, out, count=False)
        self._counted.own = list(own)  # read one by one: the tier counted those hits
        if not found.all():
            return None
        plan.served = served
        batch: dict[str, Any] = {
            "id": self._source.ids(plan.indices),
            "key": _hex_rows(plan.keys),
        }
        batch.update(out)
        if self.varying:
            self._fill(layout, out, own)
            finish_rows(
                batch, out, own, self.varying, list(range(n)), channels_last=self.channels_last
            )
        present_channels_last(batch, self.channels_last)
        return batch

    def count_guess(self, plan: BatchPlan, counter: EpochCounter) -> bool:
        """Count a served guessed batch: all hits, each in the tier that served it (the
        rows read one by one, entries of other shapes, the tier counted already).

        Returns whether a tier below the first served a row, and True for a single
        tier (what the loader's read-ahead reads: a disk tier alone reads its own
        pages; a memory tier alone never reads ahead). While the first tier of
        several serves every row, the read-ahead has nothing to read."""
        reader, n = self.reader, len(plan.indices)
        own: list[int] = getattr(self._counted, "own", [])
        self._counted.own = []
        if reader is None:
            return False
        served = plan.served
        if served is None or len(self._names) == 1:
            reader.count_reads(hits=n - len(own))  # gathered with count=False
            counter.count_hits(reader.name, n, plan.indices)
            return True
        uncounted = np.ones(n, dtype=bool)
        uncounted[own] = False
        count_served(reader, served[uncounted])  # gathered with count=False
        counter.count(
            [_MEMORY if i == 0 else _LOWER for i in served.tolist()],
            [self._names[i] for i in served.tolist()],
            plan.keys,
            indices=plan.indices,
        )
        return bool(served.any())

    # -- a planned batch -----------------------------------------------------------------
    def assemble(
        self, plan: BatchPlan, counter: EpochCounter
    ) -> tuple[dict[str, Any], np.ndarray] | None:
        """The batch of ``plan`` and the dataset index of each of its rows; None when
        every sample of it was rejected."""
        n = len(plan.indices)
        rows = _Rows({}, [None] * n, [""] * n)
        origins, tiers, samples = rows.origins, rows.tiers, rows.samples
        in_memory: list[int] = []
        miss_rows = np.flatnonzero(~plan.planned_hit).tolist()
        if len(miss_rows) != len(plan.results):  # pragma: no cover - plan() makes one per row
            raise RuntimeError("a batch plan has not one result per missing row")
        for r, res in zip(miss_rows, plan.results, strict=True):
            if res.error is not None:
                self._reject(res.error)
                origins[r] = _REJECTED
                continue
            origins[r], tiers[r] = res.origin, res.tier
            if res.in_memory:
                in_memory.append(r)
            elif res.sample is not None:
                samples[r] = res.sample
        planned = np.flatnonzero(plan.planned_hit)
        hit_rows = planned
        if in_memory:
            hit_rows = np.union1d(planned, np.asarray(in_memory, dtype=np.int64)).astype(np.int64)
        # Learn the layout (field names, dtypes, shapes) from the first sample we see.
        if self._layout is None:
            with self._lock:  # the other assembling thread may be learning it too
                if self._layout is None:
                    self._layout = self._find_layout(plan, rows, hit_rows)
                    if self._layout is None and len(hit_rows):
                        # No trustworthy sample to learn the layout from (the cached ones
                        # fail their checksum): decode this batch's hits here instead.
                        for rr in hit_rows:
                            self._redo(plan, int(rr), rows, counter, late=True)
                        planned = hit_rows = np.zeros(0, dtype=np.int64)
                        self._layout = self._find_layout(plan, rows, hit_rows)
        layout = self._layout
        if layout is None:  # every sample of the batch was rejected
            counter.count(origins, tiers, plan.keys, indices=plan.indices)
            return None
        out = self._allocate(layout, n)
        found = np.zeros(n, dtype=bool)
        served = np.zeros(n, dtype=np.int8)
        if len(hit_rows) and self.reader is not None:
            ok, own, got = self._gather(self.reader, layout, plan.keys[hit_rows], hit_rows, out)
            found[hit_rows] = ok
            served[hit_rows] = got
            for i, sample in own.items():  # entries of other shapes (varying fields)
                samples[int(hit_rows[i])] = sample
        for rr in hit_rows[~found[hit_rows]]:
            # Planned hit evicted (or expired) since planning: produce it here. A sample
            # a worker produced this epoch stays a miss, even when it is fetched again
            # (from disk) because it was evicted before the gather.
            self._redo(plan, int(rr), rows, counter, cached=True, late=True)
        names = self._names
        for rr in planned[found[planned]].tolist():
            i = int(served[rr])
            origins[rr], tiers[rr] = (_MEMORY if i == 0 else _LOWER), names[max(i, 0)]
        for r in list(samples):
            if origins[r] is not _PRODUCED and not self._matches(layout, samples[r]):
                # A cached entry of another layout under this key: damaged. Drop it
                # from every tier and decode the sample instead.
                if self._cache is not None:
                    for tier in self._cache.tiers.values():
                        tier.discard(plan.keys[r].tobytes(), why="corrupt")
                self._redo(plan, r, rows, counter)
        for r, sample in samples.items():
            self._check_shapes(layout, sample, int(plan.indices[r]))
        self._fill(layout, out, samples)
        counter.count(origins, tiers, plan.keys, indices=plan.indices)
        keep = [r for r in range(n) if origins[r] is not _REJECTED]
        if not keep:
            return None
        kept = plan.indices[keep]
        batch: dict[str, Any] = {"id": self._source.ids(kept), "key": _hex_rows(plan.keys[keep])}
        if len(keep) < n:
            for name, tensor in out.items():
                part = torch.from_numpy(tensor.numpy()[keep])
                batch[name] = part.pin_memory() if self.pin_memory else part
        else:
            batch.update(out)
        if self.varying:
            finish_rows(batch, out, samples, self.varying, keep, channels_last=self.channels_last)
        present_channels_last(batch, self.channels_last)
        return batch, kept

    def _matches(self, layout: codec.Header, sample: dict[str, np.ndarray]) -> bool:
        if self.varying:
            return compatible(layout, sample, self.varying)
        return _shapes_match(layout, sample)

    def _fill(
        self,
        layout: codec.Header,
        out: dict[str, torch.Tensor],
        own: dict[int, dict[str, np.ndarray]],
    ) -> None:
        """Copy the rows in ``own`` into ``out`` (a varying field stays in its sample)."""
        for r, sample in own.items():
            for f in layout.fields:
                if f.name not in self.varying:
                    out[f.name].numpy()[r] = sample[f.name]

    def _redo(
        self,
        plan: BatchPlan,
        r: int,
        rows: _Rows,
        counter: EpochCounter,
        *,
        cached: bool = False,
        late: bool = False,
    ) -> None:
        """Make row ``r`` here, as it cannot be served as planned: from the cache's other
        tiers (``cached``) or the source. ``late``: a planned hit, counted as a late miss.
        A row a worker produced this epoch stays counted as produced."""
        res = self._planner.run(int(plan.indices[r]), plan.keys[r].tobytes(), cached=cached)
        if late:
            counter.late_miss()
        if res.error is not None:
            self._reject(res.error)
            rows.origins[r] = _REJECTED
            rows.samples.pop(r, None)
            return
        if res.sample is None:  # pragma: no cover - run() here returns one or the other
            raise RuntimeError("a miss task returned neither a sample nor an error")
        rows.samples[r] = res.sample
        if rows.origins[r] is not _PRODUCED:
            rows.origins[r], rows.tiers[r] = res.origin, res.tier

    def _reject(self, err: SampleError) -> None:
        if self._source.on_error == "raise":
            raise err
        self._source.record_reject(err)

    def _find_layout(
        self, plan: BatchPlan, rows: _Rows, hit_rows: np.ndarray
    ) -> codec.Header | None:
        """The batch layout, from a freshly produced sample if there is one, else from a
        cached entry whose checksum verifies (first-tier reads are not verified)."""
        for r, sample in rows.samples.items():
            if rows.origins[r] is _PRODUCED:
                return codec.read_header(codec.encode(sample))
        for r in hit_rows:
            for store in self._stores:
                raw = store.get(plan.keys[r].tobytes())
                if raw is None:
                    continue
                if codec.verify(raw):
                    return codec.read_header(raw)
                store.discard(plan.keys[r].tobytes(), why="corrupt")  # never served, and dropped
        for sample in rows.samples.values():  # from a lower tier (verified) via a worker
            return codec.read_header(codec.encode(sample))
        return None

    def _allocate(self, layout: codec.Header, n: int) -> dict[str, torch.Tensor]:
        with self._lock:
            reused = self._pool.acquire(layout.layout_key, n)
            if reused is not None:
                return reused
            out: dict[str, torch.Tensor] = {}
            for f in layout.fields:
                dtype = torch.from_numpy(np.empty(0, dtype=f.dtype)).dtype
                out[f.name] = torch.empty((n, *f.shape), dtype=dtype, pin_memory=self.pin_memory)
                if f.name in self.shared:
                    self._shm.share(out[f.name], "batch buffers", _PRIVATE_BATCHES)
            self._pool.add(layout.layout_key, n, out)
            return out

    def _gather(
        self,
        reader: BatchReader,
        layout: codec.Header,
        keys: np.ndarray,
        rows: np.ndarray,
        out: dict[str, torch.Tensor],
        *,
        count: bool = True,
    ) -> tuple[np.ndarray, dict[int, dict[str, np.ndarray]], np.ndarray]:
        """Copy the hits' fields from the reader's tiers into ``out``: the found mask,
        the samples (by position in ``keys``) of entries of other shapes in varying
        fields, read on their own (see :mod:`~mmcache.loader.varying`), and the index
        of the tier that served each key. Any other entry of another layout, or
        expired, is dropped (from every tier) so nobody else serves it."""
        n = len(keys)
        cutoff = self._ttl_cutoff()
        served = np.zeros(n, dtype=np.int8)  # the first tier, unless the gather says other
        if self.varying and self._first is not None and not self._fixed_pays:
            # Most rows lately were of other shapes: the fixed-slot gather would copy
            # ranges only to find they do not match; read every row on its own.
            ok = np.zeros(n, dtype=bool)
            corrupt = np.zeros(n, dtype=bool)
            expired = np.zeros(n, dtype=bool)
        else:
            got = gather_hits(reader, layout, keys, rows, out, ttl_cutoff=cutoff, count=count)
            ok, corrupt, expired = got.ok, got.corrupt, got.expired.copy()
            served = np.maximum(got.tier, 0).astype(np.int8)
            if self.varying and n:
                self._fixed_pays = bool(ok.sum() * 2 >= n)
        own: dict[int, dict[str, np.ndarray]] = {}
        # An entry of another shape fails the layout check, or, when it is shorter than
        # the layout's ranges, is not found at all: both are read on their own.
        if self.varying and self._first is not None and not (ok | expired).all():
            at = np.flatnonzero(~(ok | expired))
            good, bad, late = read_other_shapes(
                self._first, layout, keys[at], self.varying, ttl_cutoff=cutoff
            )
            ok, corrupt = ok.copy(), np.zeros_like(corrupt)
            for i, sample in good.items():
                ok[at[i]] = True
                own[int(at[i])] = sample
            corrupt[at[bad]] = True
            expired[at[late]] = True
        if corrupt.any() or expired.any():
            for store in self._stores:
                for i in np.flatnonzero(corrupt).tolist():
                    store.discard(keys[i].tobytes(), why="corrupt")
                for i in np.flatnonzero(expired).tolist():
                    store.discard(keys[i].tobytes(), why="expired")
        return ok, own, served

    def _ttl_cutoff(self) -> float | None:
        if self._cache is None or self._cache.ttl is None:
            return None
        return self._cache.clock() - self._cache.ttl

    def _check_shapes(
        self, layout: codec.Header, sample: dict[str, np.ndarray], index: int
    ) -> None:
        if self.varying and compatible(layout, sample, self.varying):
            return
        for f in layout.fields:
            arr = sample.get(f.name)
            if not _fits(f, arr):
                got = None if arr is None else (tuple(arr.shape), str(arr.dtype))
                raise ConfigError(
                    f"sample {index} has field {f.name!r} of shape/dtype {got}, but the batch "
                    f"expects {(tuple(f.shape), str(f.dtype))}: every sample of a batch must have "
                    "the same shapes (fixed image size and max_length), unless the source "
                    "names the fields whose shapes vary in varying_fields"
                )


def _hex_rows(keys: np.ndarray) -> list[str]:
    """The hex form of each row of ``uint8 [n, 16]`` keys (== :func:`mmcache.keys.key_hex`)."""
    text = keys.tobytes().hex()
    width = 2 * keys.shape[1]
    return [text[i : i + width] for i in range(0, len(text), width)]


def _fits(f: codec.Field, arr: np.ndarray | None) -> bool:
    return arr is not None and tuple(arr.shape) == tuple(f.shape) and arr.dtype == f.dtype


def _shapes_match(layout: codec.Header, sample: dict[str, np.ndarray]) -> bool:
    """Whether ``sample`` has exactly the fields of ``layout``, with their shapes and dtypes."""
    return len(sample) == len(layout.fields) and all(
        _fits(f, sample.get(f.name)) for f in layout.fields
    )
