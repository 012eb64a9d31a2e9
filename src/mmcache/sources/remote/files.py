"""``RemoteFileSource``: a JSONL/LLaVA manifest whose images are objects (``s3://``,
``gs://``, ``http(s)://``), read whole through fsspec and the raw-bytes tier.

The manifest is read as for :class:`~mmcache.sources.files.FileSource` (image
references that are URLs are kept as they are); the images are objects, so the stamps
are each object's version stamp (ETag, generation) and size, taken in one batch when the
source is opened (one listing per directory of objects) and again by :meth:`revalidate`
(once per epoch by :class:`~mmcache.sources.remote.prefetch.RemotePrefetch`):
``StampKind.FIXED``. An overwritten object gets a new ETag, hence a new key, and its
old bytes are never served (the raw tier is keyed by URL + ETag).

A key holds the identity of the object's bytes, not where the object is, wherever the
stamp is one (:func:`~mmcache.sources.remote.fs.byte_identity`): an S3 ETag (computed
from the bytes) or the digest of the bytes of an object whose server gives no ETag. So
the same objects copied under another bucket or prefix keep their keys (the remote
``cp -a``), and other bytes never share one. HTTP ETags, GCS generations and version
ids name a version of one object only: those keys keep the URL. Producing a sample
fetches the whole object (raw tier first) and runs the pipeline on its bytes, exactly as
the loose file would be (:func:`~mmcache.sources.bytesproc.process_bytes`).

Thread/process safety: as :class:`FileSource`; the revalidated stamps reach copies in
other processes through :class:`~mmcache.sources.remote.state.SharedStamps`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from mmcache import keys
from mmcache.errors import ConfigError, SampleError
from mmcache.sources import identity
from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.sources.bytesproc import StagedProcessor, byte_limit, check_size, process_bytes
from mmcache.sources.files import FileSource, RecordProcessor
from mmcache.sources.records import Records
from mmcache.sources.remote.fs import (
    Offline,
    Remote,
    RemoteError,
    RetryPolicy,
    is_remote,
    object_identity,
)
from mmcache.sources.remote.raw import RawTier, fetch_bytes
from mmcache.sources.remote.state import SharedStamps, private_dir

__all__ = ["RemoteFileSource"]

logger = logging.getLogger(__name__)


class RemoteFileSource(FileSource):
    """Image-text samples of a manifest whose images are remote objects.

    Args:
        manifest: a seed JSONL or LLaVA JSON manifest (local), or :class:`Records`;
            every image reference must be a URL.
        pipeline: a :class:`mmcache.Pipeline`.
        on_error: as :class:`FileSource` (a missing or forbidden object is a
            SampleError naming the URL and the HTTP status).
        storage_options: passed to fsspec.
        raw: a :class:`RawTier` keeping the objects on local disk (``None``: none).
        retries: a :class:`RetryPolicy` for every remote call, or the retries of a
            transient error under the default one.
        offline: when the store cannot be reached at open: ``"auto"`` starts from the
            listing kept in ``state_dir`` (a warning; cached samples are served),
            ``True`` never contacts the store, ``False`` raises :class:`RemoteError`.
        state_dir: where revalidated stamps are handed to other processes and the last
            listing is kept (default the raw tier's folder, else a 0700 folder of this
            user: :func:`~mmcache.sources.remote.state.private_dir`).
    """

    stamp_kind: StampKind
    #: Objects are fetched ahead into the raw tier (the Revalidating capability).
    fetches_ahead = True

    def __init__(
        self,
        manifest: str | os.PathLike[str] | Records,
        *,
        pipeline: StagedProcessor,
        on_error: OnError = "raise",
        storage_options: Mapping[str, Any] | None = None,
        raw: RawTier | None = None,
        retries: int | RetryPolicy = 4,
        offline: Offline = "auto",
        state_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(pipeline, StagedProcessor) or not isinstance(pipeline, RecordProcessor):
            raise ConfigError(f"pipeline must be a mmcache.Pipeline, got {type(pipeline).__name__}")
        super().__init__(manifest, pipeline=pipeline, on_error=on_error)
        self.stamp_kind = StampKind.FIXED
        self.staged = pipeline
        self.max_object_bytes = byte_limit(pipeline)  # objects over it are never fetched
        if state_dir is not None:
            base = os.fspath(state_dir)
        else:
            base = os.path.join(raw.path, "state") if raw is not None else private_dir()
        self.remote = Remote(storage_options, retries=retries, offline=offline, listing_dir=base)
        self.raw = raw
        n = len(self.records)
        urls: list[str] = []
        row_url = np.full(n, -1, dtype=np.int64)
        where: dict[str, int] = {}
        for i in range(n):
            path = self.records.image_path(i)
            if path is None:
                continue
            if not is_remote(path):
                raise ConfigError(
                    f"RemoteFileSource: the image of {self.records.id(i)!r} is not a URL "
                    f"({path}); use FileSource for local files"
                )
            row_url[i] = where.setdefault(path, len(where))
            if row_url[i] == len(urls):
                urls.append(path)
        self.urls = urls
        self.row_url = row_url
        self._warned_unversioned = False
        self.object_stamps: list[str] = [""] * len(urls)
        self.object_sizes = np.full(len(urls), -1, dtype=np.int64)
        self._take(self.remote.stamps(urls) if urls else {})
        name = keys.digest("mmcache.remote-files", os.getuid(), *urls).hex()
        self._state = SharedStamps(os.path.join(base, f"mmcache-state-{os.getuid()}-{name}.json"))

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

    # -- which sample --------------------------------------------------------------------
    def _refresh(self) -> None:
        state = self._state.poll()
        if state is None or state.get("urls") != self.urls:
            return
        stamps, sizes = state.get("stamps"), state.get("sizes")
        if isinstance(stamps, list) and isinstance(sizes, list) and len(stamps) == len(sizes):
            # A changed object changes its samples' stamp rows: the chassis keys them again.
            for u, (stamp, size) in enumerate(zip(stamps, sizes, strict=True)):
                if isinstance(stamp, str) and isinstance(size, int):
                    self.object_stamps[u] = stamp
                    self.object_sizes[u] = size

    @property
    def shared_stamps(self) -> SharedStamps:
        """The file through which revalidated stamps reach the other processes (and the
        gate that holds them back while a revalidation is under way)."""
        return self._state

    def revalidate(self) -> list[str]:
        """Check every object's stamp again (batched); re-key the samples of the changed
        ones here and in every other process. Returns the changed URLs. Raises
        :class:`RemoteError` when the store cannot be reached."""
        changed = self._take(self.remote.stamps(self.urls)) if self.urls else []
        if changed:  # the samples of changed objects get new stamp rows, hence new keys
            self._state.publish(
                {
                    "urls": self.urls,
                    "stamps": self.object_stamps,
                    "sizes": self.object_sizes.tolist(),
                }
            )
        return [self.urls[u] for u in changed]

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``int64 [n, 2]``: a 63-bit digest of the object's stamp (ETag) and its size;
        ``-2`` for a text-only record."""
        idx = self._checked(indices)
        self._refresh()
        out = np.full((idx.shape[0], 2), -2, dtype=np.int64)
        for j, i in enumerate(idx.tolist()):
            u = int(self.row_url[i])
            if u >= 0:
                raw = keys.digest(self.urls[u], self.object_stamps[u])[:8]
                out[j] = (int.from_bytes(raw, "little") & ((1 << 63) - 1), self.object_sizes[u])
        return out

    def key_text(self, index: int) -> str:
        """The record's caption."""
        return self.records.text(index)

    def stamp_strings(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64]
    ) -> list[str]:
        """Each sample's object (:func:`~mmcache.sources.remote.fs.object_identity`): the
        identity of its bytes and its size where the stamp is one (an S3 ETag, the digest
        of a server without ETag), else its URL, stamp and size; ``"none"`` for a
        text-only record."""
        out = []
        for i in indices.tolist():
            u = int(self.row_url[i])
            if u < 0:
                out.append("none")
            else:
                url, stamp = self.urls[u], self.object_stamps[u]
                out.append(object_identity(url, stamp, int(self.object_sizes[u])))
        return out

    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """:meth:`~mmcache.sources.chassis.BaseSource.key_rows` after taking the stamps
        another process revalidated."""
        self._refresh()
        return super().key_rows(indices, stamps=stamps)

    # -- produce -------------------------------------------------------------------------
    def remote_span(self, index: int) -> tuple[str, str, int, int] | None:
        """``(url, stamp, 0, size)`` of sample ``index``'s object (``None``: none)."""
        u = int(self.row_url[index])
        if u < 0 or self.object_sizes[u] < 0:
            return None
        if self.max_object_bytes is not None and self.object_sizes[u] > self.max_object_bytes:
            return None  # never fetched: producing the sample refuses it by its size
        return self.urls[u], self.object_stamps[u], 0, int(self.object_sizes[u])

    def remote_version(self) -> tuple[str, ...]:
        """The objects' stamps: what the prefetcher's memory of held objects depends on."""
        return tuple(self.object_stamps)

    def fetch(
        self, url: str, stamp: str, start: int, end: int, *, sample_id: str, wait: bool = True
    ) -> bytes:
        return fetch_bytes(
            self.remote, self.raw, (url, stamp, start, end), sample_id=sample_id, wait=wait
        )

    def produce(self, index: int) -> dict[str, np.ndarray]:
        """Fetch sample ``index``'s object (raw tier first) and run the pipeline on it."""
        self._checked([index])
        self._refresh()
        sid = self.records.id(index)
        u = int(self.row_url[index])
        data = None
        if u >= 0:
            url = self.urls[u]
            if self.object_sizes[u] < 0:
                stamp = self.object_stamps[u]
                status = stamp.removeprefix("error:")
                raise SampleError(
                    f"cannot fetch {url} (HTTP {status}): the object was not found or is not "
                    "readable",
                    sample_id=sid,
                    path=url,
                )
            check_size(
                int(self.object_sizes[u]), self.max_object_bytes, "object", sample_id=sid, path=url
            )
            span = self.remote_span(index)
            if span is not None:
                data = self.fetch(*span, sample_id=sid)
        return process_bytes(
            self.staged,
            data,
            self.records.text(index),
            sample_id=sid,
            path=self.urls[u] if u >= 0 else None,
            unit="record",
        )


if TYPE_CHECKING:

    def _conforms(source: RemoteFileSource) -> SampleSource:
        return source
