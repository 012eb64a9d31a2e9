"""What ``source[i]`` returns: a produced or cached sample's arrays as tensors plus its id.

One function for every source, so that they agree on two things: read-only arrays
(views of a cache entry) are copied, fresh ones wrapped without a copy; and a field the
pipeline caches interleaved (``[H, W, C]``, ``ImageSpec(channels_last=True)``) is
presented as its ``[C, H, W]`` view, as the loader presents it in batches.

:func:`serve` is ``source[i]`` for every source that is a torch ``Dataset``: produce, then
:func:`item_tensors`, and the one place where a bad sample is raised or recorded.

Thread safety: pure functions (``serve`` records a reject through the source's
process-safe log).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmcache.errors import SampleError

if TYPE_CHECKING:
    from mmcache.sources.base import SampleSource

__all__ = ["item_tensors", "serve"]


def item_tensors(
    sample_id: str, sample: Mapping[str, np.ndarray], channels_last: Collection[str] = ()
) -> dict[str, Any]:
    """``{"id": sample_id, field: tensor, ...}`` of ``sample`` (see the module docstring)."""
    item: dict[str, Any] = {"id": sample_id}
    for name, array in sample.items():
        arr = array if array.flags.writeable else array.copy()
        tensor = torch.from_numpy(arr)
        item[name] = (
            tensor.permute(2, 0, 1) if name in channels_last and tensor.ndim == 3 else tensor
        )
    return item


def serve(source: SampleSource, index: int) -> dict[str, Any] | None:
    """``source[index]``: ``to_item(index, produce(index))``; a sample that cannot be
    produced raises its SampleError under ``on_error="raise"``, and under ``"skip"`` is
    recorded (:meth:`~mmcache.sources.base.SampleSource.record_reject`) and served as
    ``None`` (which :func:`mmcache.dataset.collate` and ``mmcache.DataLoader`` drop)."""
    try:
        sample = source.produce(index)
    except SampleError as err:
        if source.on_error == "raise":
            raise
        source.record_reject(err)
        return None
    return source.to_item(index, sample)
