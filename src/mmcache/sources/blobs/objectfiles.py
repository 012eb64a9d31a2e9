"""``ObjectFiles``: the :class:`~mmcache.sources.blobs.base.Blobs` of objects in a store
(``s3://``, ``gs://``, ``http(s)://``), each read whole through the raw-bytes tier.

The objects a source names are known when it is opened: their version stamps (ETag,
generation) and sizes are taken in one batch then (one listing per directory of
objects, :meth:`~mmcache.sources.blobs.objects.Remote.stamps`) and again by
:meth:`ObjectFiles.revalidate` (once per epoch by
:class:`~mmcache.sources.blobs.prefetch.RemotePrefetch`): ``StampKind.FIXED``. An
overwritten object gets a new ETag, hence new keys, and its old bytes are never served
(the raw tier is keyed by URL + ETag). An object whose server gives no ETag or version
is stamped by the digest of its bytes (fetched at open and at each revalidation, kept in
the raw tier; one warning per source), so a same-size overwrite is seen too.

A key holds the identity of an object's bytes, not where it is, wherever the stamp is
one (:func:`~mmcache.sources.blobs.objects.object_identity`): an S3 ETag (computed from
the bytes) or the digest of the bytes. So the same objects copied under another bucket
or prefix keep their keys (the remote ``cp -a``), and other bytes never share one. HTTP
ETags, GCS generations and version ids name a version of one object only: those keys
keep the URL.

Thread/process safety: :meth:`~ObjectFiles.revalidate` runs on one thread (the
prefetcher's) while others read the stamps, which are replaced per object; the
revalidated stamps reach copies in other processes through
:class:`~mmcache.sources.blobs.state.SharedStamps` (:meth:`~ObjectFiles.refresh`, one
``stat`` while nothing changed). Pickles as URLs, stamps and options.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from mmcache import keys
from mmcache.errors import SampleError
from mmcache.sources import identity
from mmcache.sources.base import StampKind
from mmcache.sources.blobs.objects import Remote, RemoteError, object_identity
from mmcache.sources.blobs.raw import RawTier, fetch_bytes
from mmcache.sources.blobs.state import SharedStamps
from mmcache.sources.bytesproc import check_size

if TYPE_CHECKING:
    from mmcache.sources.blobs.base import Blobs

__all__ = ["ObjectFiles"]

logger = logging.getLogger(__name__)


def _int63(data: bytes) -> int:
    """The first 8 bytes of a digest as a non-negative int64."""
    return int.from_bytes(data[:8], "little") & ((1 << 63) - 1)


class ObjectFiles:
    """The objects ``urls``, stamped at construction (see the module docstring).

    Args:
        urls: every object the source names (each once).
        remote: the store (the retry policy, the circuit breaker, ``offline``).
        raw: a :class:`RawTier` keeping the objects on local disk (``None``: none).
        state_dir: where revalidated stamps are handed to other processes.
    """

    stamp_kind = StampKind.FIXED
    #: An S3 ETag or a digest of the bytes names the bytes, not the object's place.
    location_free = True

    def __init__(
        self, urls: Sequence[str], *, remote: Remote, raw: RawTier | None, state_dir: str
    ) -> None:
        self.urls = list(urls)
        self.remote = remote
        self.raw = raw
        self._where = {url: u for u, url in enumerate(self.urls)}
        self._warned_unversioned = False
        #: Each object's version stamp (``"error:<status>"``: it cannot be read).
        self.object_stamps: list[str] = [""] * len(self.urls)
        #: Each object's size (``-1``: it cannot be read).
        self.object_sizes = np.full(len(self.urls), -1, dtype=np.int64)
        self._take(self.remote.stamps(self.urls) if self.urls else {})
        name = keys.digest("mmcache.remote-files", os.getuid(), *self.urls).hex()
        path = os.path.join(state_dir, f"mmcache-state-{os.getuid()}-{name}.json")
        #: The file through which revalidated stamps reach the other processes (and the
        #: gate that holds them back while a revalidation is under way).
        self.shared_stamps = SharedStamps(path)

    def __repr__(self) -> str:
        return f"ObjectFiles({len(self.urls)} objects, {self.remote!r})"

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        del state["_where"]  # rebuilt from the URLs: a pickle (to each worker) stays small
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._where = {url: u for u, url in enumerate(self.urls)}

    # -- stamps ----------------------------------------------------------------------
    def _take(self, found: Mapping[str, tuple[int, str | None] | RemoteError]) -> list[int]:
        """Take new stamps; return the objects whose stamp changed."""
        changed = []
        for u, url in enumerate(self.urls):
            got = found.get(url)
            if got is None:
                continue
            if isinstance(got, RemoteError):
                stamp, size = f"error:{got.status}", -1
            else:
                size, etag = got
                stamp = etag or self._content_stamp(url, size)
            if stamp != self.object_stamps[u] or size != self.object_sizes[u]:
                self.object_stamps[u] = stamp
                self.object_sizes[u] = size
                changed.append(u)
        return changed

    def _content_stamp(self, url: str, size: int) -> str:
        """The stamp of an object that has no ETag or version id (G6: a same-size overwrite
        was never noticed): the digest of its bytes, fetched now (and kept in the raw tier,
        so producing does not GET it again). Warns once per source, naming the object."""
        if not self._warned_unversioned:
            self._warned_unversioned = True
            logger.warning(
                "%s has no ETag or version id: its server gives no change detector, so "
                "each such object of this source is fetched and digested at open and at "
                "each revalidation (one GET each)",
                url,
            )
        try:
            data = self.remote.read(url, 0, size)
        except RemoteError as err:
            return f"error:{err.status}"
        stamp = identity.content_digest(data)
        if self.raw is not None:
            self.raw.put(url, stamp, 0, size, data)
        return stamp

    def refresh(self) -> None:
        """Take the stamps another process revalidated (one ``stat`` when none did; waits
        while a revalidation is under way)."""
        state = self.shared_stamps.poll()
        if state is None or state.get("urls") != self.urls:
            return
        stamps, sizes = state.get("stamps"), state.get("sizes")
        if isinstance(stamps, list) and isinstance(sizes, list) and len(stamps) == len(sizes):
            # A changed object changes its samples' stamp rows: the chassis keys them again.
            for u, (stamp, size) in enumerate(zip(stamps, sizes, strict=True)):
                if isinstance(stamp, str) and isinstance(size, int):
                    self.object_stamps[u] = stamp
                    self.object_sizes[u] = size

    def revalidate(self) -> list[str]:
        """Check every object's stamp again (batched); the changed ones get new stamps
        here and, through :attr:`shared_stamps`, in every other process. Returns the
        changed URLs. Raises :class:`RemoteError` when the store cannot be reached."""
        changed = self._take(self.remote.stamps(self.urls)) if self.urls else []
        if changed:
            self.shared_stamps.publish(
                {
                    "urls": self.urls,
                    "stamps": self.object_stamps,
                    "sizes": self.object_sizes.tolist(),
                }
            )
        return [self.urls[u] for u in changed]

    def version(self) -> tuple[str, ...]:
        """The objects' stamps: what a memory of fetched objects depends on."""
        return tuple(self.object_stamps)

    def stamps(self, refs: Sequence[str | bytes | None]) -> npt.NDArray[np.int64]:
        """``int64 [n, 2]``: a 63-bit digest of each object's URL and stamp (ETag), and its
        size; ``-2`` for no object."""
        out = np.full((len(refs), 2), -2, dtype=np.int64)
        for j, ref in enumerate(refs):
            if ref is not None:
                u = self._where[os.fsdecode(ref)]
                out[j] = (_int63(keys.digest(self.urls[u], self.object_stamps[u])), self.size(u))
        return out

    def size(self, u: int) -> int:
        """The size of object number ``u`` (``-1``: it cannot be read)."""
        return int(self.object_sizes[u])

    def identity(self, ref: str) -> str:
        """What a key holds of object ``ref``
        (:func:`~mmcache.sources.blobs.objects.object_identity`: its bytes' identity and
        size where the stamp is one, else its URL, stamp and size)."""
        u = self._where[ref]
        return object_identity(ref, self.object_stamps[u], self.size(u))

    def identities(
        self, refs: Sequence[str | bytes | None], stamps: npt.NDArray[np.int64]
    ) -> list[str]:
        """Each object's :meth:`identity`; ``"none"`` for no object."""
        return ["none" if r is None else self.identity(os.fsdecode(r)) for r in refs]

    def group_stamp(self, refs: Sequence[str]) -> npt.NDArray[np.int64]:
        """``int64 [2]``: a 63-bit digest of the objects' :meth:`group_identity`, and their
        total size."""
        total = sum(self.size(self._where[r]) for r in refs)
        return np.array([_int63(keys.digest(self.group_identity(refs))), total], np.int64)

    def group_identity(self, refs: Sequence[str]) -> str:
        """Each object's :meth:`identity`, in order, joined by ``|``."""
        return "|".join(self.identity(r) for r in refs)

    # -- bytes -----------------------------------------------------------------------
    def span(self, ref: str, max_bytes: int | None) -> tuple[str, str, int, int] | None:
        """``(url, stamp, 0, size)`` of object ``ref`` (``None``: it cannot be read, or it
        is over ``max_bytes`` and is never fetched)."""
        u = self._where[ref]
        size = self.size(u)
        if size < 0 or (max_bytes is not None and size > max_bytes):
            return None
        return ref, self.object_stamps[u], 0, size

    def fetch(
        self, url: str, stamp: str, start: int, end: int, *, sample_id: str, wait: bool = True
    ) -> bytes:
        """Bytes ``[start, end)`` of version ``stamp`` of ``url``: the raw tier's, else one
        ranged GET kept there (:func:`~mmcache.sources.blobs.raw.fetch_bytes`)."""
        return fetch_bytes(
            self.remote, self.raw, (url, stamp, start, end), sample_id=sample_id, wait=wait
        )

    def read(self, ref: str, *, sample_id: str, max_bytes: int | None = None) -> bytes:
        """The whole object ``ref`` (raw tier first). An object that cannot be read, or
        whose listed size is over ``max_bytes`` (checked before anything is fetched), is a
        SampleError naming the sample and the URL."""
        u = self._where[ref]
        size = self.size(u)
        if size < 0:
            status = self.object_stamps[u].removeprefix("error:")
            raise SampleError(
                f"cannot fetch {ref} (HTTP {status}): the object was not found or is not readable",
                sample_id=sample_id,
                path=ref,
            )
        check_size(size, max_bytes, "object", sample_id=sample_id, path=ref)
        return self.fetch(ref, self.object_stamps[u], 0, size, sample_id=sample_id)


if TYPE_CHECKING:  # mypy checks that ObjectFiles conforms to the protocol

    def _conforms(blobs: ObjectFiles) -> Blobs:
        return blobs
