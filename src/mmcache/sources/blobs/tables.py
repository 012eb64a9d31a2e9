"""``TableFiles``: the remote files of a table source (Parquet on ``s3://``, ``gs://``,
``http(s)://``), each file's version checked again at each epoch.

A table source keys each row by its file's stamp (:func:`file_stamp`: the size,
modification time, ETag and URL, read when the source is opened) and the row's place in
the file. A file rewritten during a run kept its old stamp, so its old rows were served
from the cache for the rest of the run (the new user's R4: "old image served, hit rate
1.00"). Now :meth:`TableFiles.revalidate` (called once per epoch by
:class:`~mmcache.sources.blobs.prefetch.RemotePrefetch`, as for shards and remote
images) asks the store for every file's version, batched (one listing per folder of
files, :meth:`~mmcache.sources.blobs.objects.Remote.stamps`, under the retry policy and the
circuit breaker), and for a file whose version changed (or that has none: a server
without ETags) reads its stamp again (one HEAD). A changed file's rows get new keys, so
nothing of its old version is served: the source drops what it read of the file and
reads its new version. The new stamps reach the source's copies in other processes
(DataLoader workers) through a :class:`~mmcache.sources.blobs.state.SharedStamps` file,
polled with one ``stat`` before a batch is keyed.

A file that is gone (or no longer readable) gets the stamp :data:`GONE`: its rows are
keyed as missing and producing them fails, naming the file.

Thread/process safety: :meth:`~TableFiles.revalidate` runs on one thread (the
prefetcher's) while others read :attr:`~TableFiles.stamps`, which is replaced whole,
never written in place; copies in other processes take the new stamps in
:meth:`~TableFiles.refresh`. Pickles as URLs, stamps and the options.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache import keys
from mmcache.sources.blobs.objects import Remote, RemoteError, object_stamp
from mmcache.sources.blobs.state import SharedStamps, private_dir

__all__ = ["GONE", "TableFiles", "file_stamp"]

#: The stamp of a file that is gone or unreadable (its rows are keyed as missing).
GONE = (-2, -2, -2, -2)


def _int64(value: object) -> int:
    """A stable signed 64-bit number for a string (an ETag, a URL)."""
    return int(np.int64(np.uint64(xxhash.xxh3_64_intdigest(str(value).encode())).view(np.int64)))


def file_stamp(url: str, info: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """The stamp of the remote file ``url`` that its rows' keys hold, from its fsspec
    ``info``: its size, and 64-bit hashes of its modification time, its ETag (or version
    id) and its URL."""
    etag = info.get("ETag") or info.get("etag") or info.get("version_id") or ""
    mtime = info.get("LastModified") or info.get("mtime") or ""
    return (int(info.get("size") or 0), _int64(mtime), _int64(etag), _int64(url))


class TableFiles:
    """The remote files ``urls`` of one table source, with the :func:`file_stamp` and
    the version (:func:`~mmcache.sources.blobs.objects.object_stamp`: what a listing shows)
    of each, as read when the source opened them (see the module docstring).

    Args:
        urls: the files, in the source's order.
        remote: the store, under mmcache's retry policy and circuit breaker.
        stamps: ``int64 [n, 4]``, each file's :func:`file_stamp`.
        versions: each file's version (``None``: its server gives none).
    """

    def __init__(
        self,
        urls: Sequence[str],
        remote: Remote,
        stamps: npt.ArrayLike,
        versions: Sequence[str | None],
    ) -> None:
        self.urls = list(urls)
        #: The store, under mmcache's retry policy and circuit breaker.
        self.remote = remote
        #: ``int64 [n, 4]``: each file's stamp now (replaced whole when one changes).
        self.stamps: npt.NDArray[np.int64] = np.asarray(stamps, dtype=np.int64).reshape(-1, 4)
        self.versions: list[str | None] = list(versions)
        name = keys.digest("mmcache.table-files", os.getuid(), *self.urls).hex()
        #: Where revalidated stamps reach the other processes (a 0700 folder of this user).
        self.state = SharedStamps(
            os.path.join(private_dir(), f"mmcache-table-state-{os.getuid()}-{name}.json")
        )

    def revalidate(self) -> list[int]:
        """Check every file's version again (batched) and take the new stamps of the
        changed ones, here and, through :attr:`state`, in every other process. Returns
        the numbers of the files that changed. Raises :class:`RemoteError` when the store
        cannot be reached (nothing is taken then)."""
        found = self.remote.stamps(self.urls)
        stamps, versions = self.stamps.copy(), list(self.versions)
        changed: list[int] = []
        for f, url in enumerate(self.urls):
            got = found.get(url)
            if got is None:
                continue
            version: str | None
            if isinstance(got, RemoteError):  # gone, or no longer ours to read
                stamp, version = GONE, f"error:{got.status}"
            else:
                size, version = got
                if version is not None and version == versions[f] and size == stamps[f, 0]:
                    continue  # the version a listing shows is the one read
                # Changed, or no version to tell: its full stamp (one HEAD). Unchanged
                # bytes keep their stamp, and the listing's word for the version is kept
                # so that the next epoch needs no HEAD.
                info = self.remote.info(url)
                stamp, version = file_stamp(url, info), object_stamp(info) or version
            versions[f] = version
            if stamp != tuple(stamps[f].tolist()):
                stamps[f] = stamp
                changed.append(f)
        self.versions = versions
        if changed:
            self.stamps = stamps
            self.state.publish({"urls": self.urls, "stamps": stamps.tolist(), "versions": versions})
        return changed

    def refresh(self) -> list[int]:
        """Take the stamps another process revalidated (one ``stat`` when none did; waits
        while a revalidation is under way). Returns the files whose stamp changed here."""
        state = self.state.poll()
        if state is None or state.get("urls") != self.urls:
            return []
        stamps, versions = state.get("stamps"), state.get("versions")
        n = len(self.urls)
        if not (isinstance(stamps, list) and isinstance(versions, list)):
            return []
        if not (len(stamps) == n == len(versions)):
            return []
        try:
            now = np.asarray(stamps, dtype=np.int64).reshape(n, 4)
        except (TypeError, ValueError):
            return []  # not ours (only this user's processes write it)
        changed = np.flatnonzero((now != self.stamps).any(axis=1)).tolist()
        self.versions = [v if isinstance(v, str) else None for v in versions]
        if changed:
            self.stamps = now
        return [int(f) for f in changed]
