"""What length grouping and packing read of a source: tokens per sample, and which have images.

A source that offers SFT samples (``input_ids`` of varied lengths) answers two cheap
calls, computed from what it already knows (its cached lengths, its records), never
by producing a sample:

- ``lengths() -> int64 [N]``: the exact number of tokens of each sample (image
  token runs included), what its cached ``input_ids`` will hold; 0 for a sample the
  source will refuse (fully masked, under ``on_error="skip"``): grouped and packed
  batches leave it out;
- ``modalities() -> bool [N]``: whether each sample has at least one image.

The two are the capability :class:`~mmcache.sources.capabilities.HasLengths`; a source
without it gets a ConfigError naming it when grouping or packing is asked for.
:func:`sample_lengths` and :func:`sample_has_image` read them, checked.

Thread/process safety: pure functions.
"""

from __future__ import annotations

import numpy as np

from mmcache.errors import ConfigError
from mmcache.sources.capabilities import HasLengths, index_count, require

__all__ = ["HasLengths", "sample_has_image", "sample_lengths"]

#: The source's method giving the tokens per sample.
LENGTHS = "lengths"
#: The source's method giving whether each sample has an image.
HAS_IMAGE = "modalities"


def sample_lengths(source: object, *, why: str) -> np.ndarray:
    """``source.lengths()`` as ``int64 [len(source)]``, every value >= 0; ConfigError
    (saying ``why`` they are needed) when the source has none or they are malformed."""
    require(source, HasLengths, why=f"{why} (tokens per sample, from a chat-template source)")
    assert isinstance(source, HasLengths)  # for mypy: require raised otherwise
    n = index_count(source)
    lengths = np.asarray(source.lengths())
    if lengths.shape != (n,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ConfigError(
            f"{type(source).__name__}.{LENGTHS}() must be an integer array of shape ({n},), "
            f"got {lengths.dtype} {lengths.shape}"
        )
    lengths = lengths.astype(np.int64)
    if n and int(lengths.min()) < 0:
        i = int(np.argmin(lengths))
        raise ConfigError(f"{type(source).__name__}.{LENGTHS}()[{i}] is {lengths[i]}: must be >= 0")
    return lengths


def sample_has_image(source: object) -> np.ndarray:
    """``source.modalities()`` as ``bool [len(source)]``; all False for a source that is
    not :class:`HasLengths`."""
    n = index_count(source)
    if not isinstance(source, HasLengths):
        return np.zeros(n, dtype=bool)
    flags = np.asarray(source.modalities())
    if flags.shape != (n,):
        raise ConfigError(
            f"{type(source).__name__}.{HAS_IMAGE}() must have shape ({n},), got {flags.shape}"
        )
    return flags.astype(bool)
