"""What length grouping and packing read of a source: tokens per sample, and which have images.

A source that offers SFT samples (``input_ids`` of varied lengths) answers two cheap
calls, computed from what it already knows (its cached lengths, its records), never
by producing a sample:

- ``lengths() -> int64 [N]``: the exact number of tokens of each sample (image
  token runs included), what its cached ``input_ids`` will hold; 0 for a sample the
  source will refuse (fully masked, under ``on_error="skip"``): grouped and packed
  batches leave it out;
- ``modalities() -> bool [N]`` (optional): whether each sample has at least one
  image. A source without it is all text (one group).

:func:`sample_lengths` and :func:`sample_has_image` read them, checked. The names
are the two constants below: a source naming them differently adapts here, in one line.

Thread/process safety: pure functions.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from mmcache.errors import ConfigError

__all__ = ["LengthSource", "sample_has_image", "sample_lengths"]

#: The source's method giving the tokens per sample.
LENGTHS = "lengths"
#: The source's method giving whether each sample has an image.
HAS_IMAGE = "modalities"


@runtime_checkable
class LengthSource(Protocol):
    """A source that knows each sample's token count without producing it."""

    def __len__(self) -> int: ...

    def lengths(self) -> np.ndarray:
        """``int64 [N]``: tokens of each sample."""
        ...


def sample_lengths(source: object, *, why: str) -> np.ndarray:
    """``source.lengths()`` as ``int64 [len(source)]``, every value >= 0; ConfigError
    (saying ``why`` they are needed) when the source has none or they are malformed."""
    fn = getattr(source, LENGTHS, None)
    if fn is None or not callable(fn):
        raise ConfigError(
            f"{why} needs the source's token counts, but {type(source).__name__} has no "
            f"{LENGTHS}() method (a chat-template source has one: tokens per sample, int64 [N])"
        )
    n = len(source)  # type: ignore[arg-type]
    lengths = np.asarray(fn())
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
    """``source.modalities()`` as ``bool [len(source)]``; all False without one."""
    n = len(source)  # type: ignore[arg-type]
    fn = getattr(source, HAS_IMAGE, None)
    if fn is None or not callable(fn):
        return np.zeros(n, dtype=bool)
    flags = np.asarray(fn())
    if flags.shape != (n,):
        raise ConfigError(
            f"{type(source).__name__}.{HAS_IMAGE}() must have shape ({n},), got {flags.shape}"
        )
    return flags.astype(bool)
