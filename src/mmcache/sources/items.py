"""What ``source[i]`` returns: a produced or cached sample's arrays as tensors plus its id.

One function for every source, so that they agree on two things: read-only arrays
(views of a cache entry) are copied, fresh ones wrapped without a copy; and a field the
pipeline caches interleaved (``[H, W, C]``, ``ImageSpec(channels_last=True)``) is
presented as its ``[C, H, W]`` view, as the loader presents it in batches.

Thread safety: a pure function.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["item_tensors"]


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
