"""The ``Blobs`` protocol: where a record source's media bytes live, apart from what a
record is.

A record source (:class:`~mmcache.sources.files.FileSource`) knows its records: ids,
captions, conversations, and which files each sample is made of (its *references*). How
those references are stamped, identified, read and checked again is the blobs' business,
so one source serves local paths and object URLs alike:

- :class:`~mmcache.sources.blobs.local.LocalFiles`: a file system; stamps are ``stat``
  fields, checked at every batch (``StampKind.FILE``, or ``CONTENT`` when keys come from
  the bytes);
- :class:`~mmcache.sources.blobs.objectfiles.ObjectFiles`: objects in a store
  (``s3://``, ``gs://``, ``http(s)://``) through the one door
  (:class:`~mmcache.sources.blobs.objects.Remote`: the retry policy, the circuit
  breaker, offline starts); stamps are the objects' versions (ETags), taken in one batch
  at open and checked again by :meth:`Blobs.revalidate` (``StampKind.FIXED``).

What a stamp row is (its width, what ``-2`` means) belongs to the blobs: a source stores
rows and hands them back, it never reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from mmcache.sources.base import StampKind

__all__ = ["Blobs"]


@runtime_checkable
class Blobs(Protocol):
    """Where the bytes of a record source's samples are (see the module docstring).

    A reference is a local path or an object URL; ``None`` is "no file" (a text-only
    record). Implementations are read-only after construction but for their stamps'
    refresh (documented on each) and pickle cheaply (a source is sent to its workers).
    """

    #: How the loader checks a cached sample's stamps (by this blobs' kind).
    stamp_kind: StampKind
    #: Whether an identity is a function of the bytes only, not of where they are: a
    #: record's key then holds no location of its own (an object copied under another
    #: prefix keeps its keys). Local identities hold the path's evidence instead.
    location_free: bool

    def stamps(self, refs: Sequence[str | bytes | None]) -> npt.NDArray[np.int64]:
        """``int64 [n, k]``: one row per reference (``-2`` where there is none)."""
        ...

    def identities(
        self, refs: Sequence[str | bytes | None], stamps: npt.NDArray[np.int64]
    ) -> list[str]:
        """What a key holds of each reference, given its row of :meth:`stamps`."""
        ...

    def group_stamp(self, refs: Sequence[str]) -> npt.NDArray[np.int64]:
        """One stamp row standing for every file of a sample made of several."""
        ...

    def group_identity(self, refs: Sequence[str]) -> str:
        """The identity of a sample made of several files (each one's, in order)."""
        ...

    def read(self, ref: str, *, sample_id: str, max_bytes: int | None = None) -> bytes:
        """The whole file or object ``ref``, never more than ``max_bytes`` bytes (a
        larger one is a :class:`~mmcache.errors.SampleError` naming it, before its bytes
        are read). Raises SampleError naming ``sample_id`` and ``ref``."""
        ...

    def revalidate(self) -> list[str]:
        """Check every stamp again; return the references that changed (local files:
        none, they are ``stat``-ed at every batch)."""
        ...
