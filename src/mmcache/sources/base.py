"""The ``SampleSource`` protocol: what the loader, the cache and ``warm`` need of a dataset.

A source knows how many samples it has, what each one is called, a per-sample
*stamp* that changes when the sample's input changes (a file's stat, a shard
member's offset, a Parquet row, an ETag), the cache key of each sample (built
from the stamp and the processing fingerprint, see :mod:`mmcache.keys`) and how
to produce one sample's arrays. Nothing below it (tiers, codec, loader) knows
about files, shards or rows: a new data format is a new source, nothing else.

Sources are used from several processes (DataLoader workers, fork or spawn):
they must pickle cheaply (columnar buffers, no per-row Python objects) and be
read-only after construction except for their reject log (process-safe) and key
memo (one thread per process).

A source is checked by :class:`mmcache.testing.source_contract.SourceContract`;
every implementation subclasses that suite in its tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from mmcache.errors import ConfigError

__all__ = ["OnError", "SampleSource", "StampKind", "check_on_error"]

#: What a source does with a sample it cannot produce.
OnError = Literal["raise", "skip"]


def check_on_error(on_error: object) -> OnError:
    """``on_error`` if it is ``"raise"`` or ``"skip"``, else ConfigError."""
    if on_error == "raise":
        return "raise"
    if on_error == "skip":
        return "skip"
    raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


class StampKind(str, Enum):
    """What a source's per-sample stamps are, so that the loader knows how to re-check them.

    ``FILE``: the stat of one local file per sample (:func:`mmcache.keys.stat_stamp`
    fields). A warm epoch re-checks them with ``stat`` before serving cached
    entries (the stat prefetcher and the file-check board do this ahead of use).

    ``CONTENT``: a digest of the sample's bytes, computed with the key; there is
    no cheap re-check, so every batch is keyed afresh.

    ``FIXED``: fixed when the source was opened (a shard member's offset and
    size inside a shard whose own stamp was checked at open; a row of a Parquet
    file or a dataset fingerprint). Nothing to re-check per epoch.
    """

    FILE = "file"
    CONTENT = "content"
    FIXED = "fixed"


@runtime_checkable
class SampleSource(Protocol):
    """A map-style collection of samples that a cache can sit in front of.

    Index ``i`` is a position in ``[0, len(source))``; the sampler decides the
    order. ``produce`` is the only expensive call: everything else must be
    cheap enough to run for every sample of every batch.
    """

    #: What :meth:`stamps` returns (see :class:`StampKind`).
    stamp_kind: StampKind
    #: ``"raise"``: a bad sample stops the epoch; ``"skip"``: it is recorded and left out.
    on_error: OnError

    def __len__(self) -> int: ...

    def sample_id(self, index: int) -> str:
        """The user's id of sample ``index`` (for batches, errors and reject reports)."""
        ...

    def ids(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """:meth:`sample_id` of many samples, in order (a batch's ``"id"`` field)."""
        ...

    def ids_digest(self) -> str:
        """A digest of every id in index order: ``state_dict`` stores it so that a resume
        over a reordered or different source is refused."""
        ...

    def fingerprint(self) -> str:
        """Fingerprint of the processing (the pipeline's stages): part of every key."""
        ...

    def describe(self) -> str:
        """One line naming the processing, recorded beside the fingerprint by the cache."""
        ...

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Per-sample stamps of ``indices`` as ``int64 [n, k]`` (``k`` fixed per source);
        a row of ``-2`` where the sample has no stamp (missing file, text only).

        For ``StampKind.FILE`` these are the fields of :func:`mmcache.keys.stat_stamp`;
        the loader compares rows taken at two moments to tell whether a file changed.
        """
        ...

    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """Cache keys of ``indices`` as ``uint8 [n, 16]`` (row j: the key of ``indices[j]``).

        ``stamps``: :meth:`stamps` of ``indices`` taken just before, if the caller
        has them. Not thread-safe (one thread per process calls it).
        """
        ...

    def key(self, index: int) -> bytes:
        """The 16-byte cache key of sample ``index`` (``key_rows([index])[0]``)."""
        ...

    def produce(self, index: int) -> dict[str, np.ndarray]:
        """The cacheable arrays of sample ``index``. Raises :class:`~mmcache.errors.SampleError`."""
        ...

    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """What ``source[index]`` returns for a produced or cached sample (tensors + id)."""
        ...

    def record_reject(self, err: Exception) -> None:
        """Record a sample skipped under ``on_error="skip"`` (process-safe)."""
        ...
