"""How a sample's features are stored in the Cache: one codec field, in the cached dtype.

A feature entry is a codec entry ``{"features": array}``. Its array has the
numpy dtype of the cached torch dtype; bfloat16, which numpy lacks, is stored
as its uint16 bits and flagged to the codec. Both the read path (host array ->
device tensor) and the write path (device tensor -> codec bytes) go through
:func:`host_bits`, so the two cannot disagree on the layout.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from mmcache import codec

__all__ = [
    "DTYPE_NAMES",
    "FEATURE_FIELD",
    "STORAGE",
    "bfloat16_fields",
    "encode_entry",
    "entry_sizes",
    "host_bits",
    "to_device",
]

#: Field name of the features in a codec entry.
FEATURE_FIELD = "features"

#: The dtypes features may be cached in, with their names in the keys.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}
#: The numpy dtype a decoded entry of each dtype has (bfloat16: its uint16 bits).
STORAGE: dict[torch.dtype, np.dtype[Any]] = {
    torch.float16: np.dtype("<f2"),
    torch.bfloat16: np.dtype("<u2"),
    torch.float32: np.dtype("<f4"),
    torch.float64: np.dtype("<f8"),
}


def bfloat16_fields(dtype: torch.dtype) -> set[str]:
    """The codec's ``bfloat16=`` argument for entries of ``dtype``."""
    return {FEATURE_FIELD} if dtype == torch.bfloat16 else set()


def host_bits(t: torch.Tensor) -> npt.NDArray[Any]:
    """A numpy view of a CPU tensor's memory (bfloat16 as uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def encode_entry(row: npt.NDArray[Any], dtype: torch.dtype, *, ctime: float, cost: float) -> bytes:
    """The codec bytes of one sample's features (``row``: a :func:`host_bits` row)."""
    return codec.encode(
        {FEATURE_FIELD: row}, ctime=ctime, cost=cost, bfloat16=bfloat16_fields(dtype)
    )


def entry_sizes(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """(payload bytes, encoded bytes in the Cache) of one sample's features."""
    storage = STORAGE[dtype]
    payload = math.prod(shape) * storage.itemsize
    # np.empty only reserves address space and encoded_size never reads the data.
    dummy = np.empty(shape, storage)
    return payload, codec.encoded_size({FEATURE_FIELD: dummy}, bfloat16=bfloat16_fields(dtype))


def to_device(
    arrays: list[npt.NDArray[Any]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Decoded entries (host arrays of :data:`STORAGE` ``[dtype]``) as ``dtype`` tensors on
    ``device``: one staging buffer (pinned on CUDA) and one transfer per shape."""
    pin = device.type == "cuda"
    out: list[torch.Tensor | None] = [None] * len(arrays)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for j, a in enumerate(arrays):
        by_shape.setdefault(tuple(a.shape), []).append(j)
    for shape, idx in by_shape.items():
        host = torch.empty((len(idx), *shape), dtype=dtype, pin_memory=pin)
        bits = host_bits(host)
        for r, j in enumerate(idx):
            bits[r] = arrays[j]
        dev = host if device.type == "cpu" else host.to(device, non_blocking=pin)
        for r, j in enumerate(idx):
            out[j] = dev[r]
    return [t for t in out if t is not None]
