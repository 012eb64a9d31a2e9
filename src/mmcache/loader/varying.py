"""Batches whose samples differ in the shapes of some fields (aspect-preserving images).

A source whose images keep their aspect ratio (``ImageSpec(crop=None)``) names
the fields whose shapes vary in ``varying_fields`` (an optional member of a
:class:`~mmcache.sources.base.SampleSource`; a :class:`~mmcache.MultimodalDataset`
takes it from its pipeline). Its batches then hold those fields as a list of
tensors, one per row, and the image's sizes as ``image_sizes`` (int64
``[B,2]``: height, width), every batch, whatever shapes it happens to hold.

The fixed-shape gather stays as it is: the batch layout is learnt from the
first sample, and every cached entry of that layout is copied straight into
the batch tensors. An entry of another layout is, for a fixed-shape source,
damaged (dropped and produced again); for a source with varying fields it is
read on its own (:func:`read_other_shapes`) and served when its checksum
verifies and it differs from the layout only in the shapes of those fields (so
is an entry shorter than the layout's byte ranges, which the gather does not
find at all). Such rows cost a read and a copy each: a batch of varied shapes
is slower to assemble than one of a single shape, which keeps its fast path.

Thread safety: pure functions (the store reads are thread- and process-safe).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from mmcache import codec
from mmcache.errors import CorruptEntryError
from mmcache.sources.capabilities import layout_of
from mmcache.stores.base import Store

__all__ = [
    "channels_last_fields",
    "compatible",
    "finish_rows",
    "present_channels_last",
    "read_other_shapes",
    "varying_fields",
]


def varying_fields(source: object) -> frozenset[str]:
    """The fields whose shapes vary between samples of ``source`` (empty: fixed shapes)."""
    return layout_of(source).varying


def channels_last_fields(source: object) -> frozenset[str]:
    """The fields ``source`` caches as ``[H, W, C]`` (``ImageSpec(channels_last=True)``):
    batches present them as ``[B, C, H, W]`` tensors in ``channels_last`` strides."""
    return layout_of(source).channels_last


def present_channels_last(batch: dict[str, Any], fields: Collection[str]) -> None:
    """Replace each batch tensor ``[B, H, W, C]`` of ``fields`` by its ``[B, C, H, W]``
    view (no copy: the same buffer in torch's ``channels_last`` memory format). Lists
    (varying shapes) are presented by :func:`finish_rows`."""
    for name in fields:
        value = batch.get(name)
        if isinstance(value, torch.Tensor) and value.ndim == 4:
            batch[name] = value.permute(0, 3, 1, 2)


def compatible(
    layout: codec.Header, sample: dict[str, np.ndarray], varying: Collection[str]
) -> bool:
    """Whether ``sample`` has the fields and dtypes of ``layout``, with its shapes except
    the number of dimensions of a field in ``varying``."""
    if len(sample) != len(layout.fields):
        return False
    for f in layout.fields:
        arr = sample.get(f.name)
        if arr is None or arr.dtype != f.dtype:
            return False
        if f.name in varying:
            if arr.ndim != len(f.shape):
                return False
        elif tuple(arr.shape) != tuple(f.shape):
            return False
    return True


def read_other_shapes(
    first: Store,
    layout: codec.Header,
    keys: np.ndarray,
    varying: Collection[str],
    *,
    ttl_cutoff: float | None = None,
) -> tuple[dict[int, dict[str, np.ndarray]], list[int], list[int]]:
    """Read the entries of ``keys`` (``uint8 [n,16]``) one by one from ``first``: the
    samples of those that verify and are :func:`compatible`, by position in ``keys``,
    the positions of the damaged or incompatible ones, and of those created before
    ``ttl_cutoff`` (expired; a key that is not there is in none).

    The variable-size layout: each entry is copied once, whole, from the tier's
    buffer (:meth:`Store.view`, the lock held for that copy only) into an array of
    its own, and its fields are writable views of that array, so a row costs one
    copy and a checksum, whatever its shapes (the fixed-slot gather copies the same
    byte ranges of every entry of one layout, which a sample of its own length
    never matches).
    """
    good: dict[int, dict[str, np.ndarray]] = {}
    bad: list[int] = []
    expired: list[int] = []
    for i in range(len(keys)):
        buf: np.ndarray | None = None
        with first.view(keys[i].tobytes()) as mv:
            if mv is not None:
                buf = np.empty(len(mv), dtype=np.uint8)
                np.copyto(buf, np.frombuffer(mv, dtype=np.uint8))  # no export outlives the block
        if buf is None:
            continue  # gone (or never there): the caller produces it
        try:
            decoded = codec.decode(buf.data, verify=True)  # the structure and checksum
            header = codec.read_header(buf.data)
        except CorruptEntryError:
            bad.append(i)
            continue
        if not compatible(layout, decoded, varying):
            bad.append(i)
            continue
        if ttl_cutoff is not None and header.ctime < ttl_cutoff:
            expired.append(i)
            continue
        good[i] = {
            f.name: buf[f.offset : f.offset + f.nbytes].view(f.dtype).reshape(f.shape)
            for f in header.fields
        }
    return good, bad, expired


def finish_rows(
    batch: dict[str, Any],
    out: dict[str, torch.Tensor],
    own: dict[int, dict[str, np.ndarray]],
    varying: Collection[str],
    keep: list[int],
    *,
    channels_last: Collection[str] = (),
) -> None:
    """Put the varying fields of rows ``keep`` into ``batch`` as lists of tensors: a
    row in ``own`` from its own sample, any other from its row of ``out`` (gathered
    there); a field of ``channels_last`` as ``[C, H, W]`` views of its ``[H, W, C]``
    rows. The image's sizes go to ``image_sizes``."""
    for name in varying:
        if name not in out:
            continue
        rows: list[torch.Tensor] = []
        for r in keep:
            sample = own.get(r)
            row = torch.from_numpy(sample[name]) if sample is not None else out[name][r]
            rows.append(row.permute(2, 0, 1) if name in channels_last and row.ndim == 3 else row)
        batch[name] = rows
        if name == "image":
            sizes = [tuple(t.shape[-2:]) for t in rows]
            batch["image_sizes"] = torch.tensor(sizes, dtype=torch.int64).reshape(len(rows), 2)
