"""How :class:`~mmcache.sources.wds.WebDatasetSource` fetches the bytes of remote shards:
one sample's span (:meth:`RemoteShards.fetch`, what a producing worker does on a raw-tier
miss), and the fetch groups that
:class:`~mmcache.sources.blobs.prefetch.RemotePrefetch` fetches with one ranged GET
each (runs of neighbouring samples of a shard: :mod:`~mmcache.sources.blobs.blocks`).

A mixin: it reads the source's ``columns``, ``locations``, ``shard_stamps``, ``remote``,
``raw`` and ``fetch_block``. The groups are computed lazily from the member table and
dropped when a shard is indexed again (a new version has other spans). Not pickled (a
worker never needs them); made once per process, under the GIL, read-only after.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from mmcache.sources import identity
from mmcache.sources.blobs.blocks import FetchGroups
from mmcache.sources.blobs.objects import Remote, RemoteError, is_remote
from mmcache.sources.blobs.raw import RawTier, fetch_bytes
from mmcache.sources.wds.table import SampleColumns

__all__ = ["RemoteShards"]

logger = logging.getLogger(__name__)

C = SampleColumns
#: An unversioned shard is digested in reads of this size (each one ranged GET, retried).
_DIGEST_BLOCK = 8 << 20


class RemoteShards:
    """Remote fetching of a WebDataset source (see the module docstring)."""

    if TYPE_CHECKING:
        columns: SampleColumns
        locations: list[str]
        shard_stamps: list[str]
        remote: Remote
        raw: RawTier | None
        fetch_block: int
        member_limit: int | None

        def span(self, index: int) -> tuple[int, int]: ...

    #: Samples' spans are fetched ahead into the raw tier (the Revalidating capability).
    fetches_ahead = True
    _fetch_groups: FetchGroups | None = None
    _warned_unversioned = False

    def unversioned_stamp(self, url: str, size: int) -> str | RemoteError:
        """The stamp of a shard whose server gives no ETag or version id (G6: its size alone
        missed a same-size overwrite): the digest of its bytes, read now in ranged GETs of
        8 MiB, at open and at each revalidation, as
        :class:`~mmcache.sources.blobs.objectfiles.ObjectFiles` stamps such objects. Warns
        once per source, naming the object; a failed read is returned, not raised."""
        if not self._warned_unversioned:
            self._warned_unversioned = True
            logger.warning(
                "%s has no ETag or version id: its server gives no change detector, so each "
                "such shard of this source is read and digested at open and at each "
                "revalidation (%d bytes here)",
                url,
                size,
            )
        hasher = xxhash.xxh3_128()
        try:
            for start in range(0, size, _DIGEST_BLOCK):
                hasher.update(self.remote.read(url, start, min(size, start + _DIGEST_BLOCK)))
        except RemoteError as err:
            return err
        return identity.CONTENT_PREFIX + hasher.hexdigest()

    def remote_span(self, index: int) -> tuple[str, str, int, int] | None:
        """``(url, stamp, start, end)`` of sample ``index``'s bytes if its shard is remote
        (what :class:`~mmcache.sources.blobs.prefetch.RemotePrefetch` fetches), else ``None``."""
        shard = int(self.columns.rows[index, C.SHARD])
        loc = self.locations[shard]
        start, end = self.span(index)
        if not is_remote(loc) or end == start or not self._within_limit(index):
            return None
        return loc, self.shard_stamps[shard], start, end

    def _within_limit(self, rows: int | slice) -> np.ndarray:
        """Whether the members of ``rows`` are all within :attr:`member_limit` (bool)."""
        limit = self.member_limit
        sizes = self.columns.rows[rows][..., [C.IMG_LEN, C.TXT_LEN]]
        top = limit if limit is not None else np.iinfo(np.int64).max
        return np.asarray((sizes <= top).all(axis=-1))

    def fetch(
        self, url: str, stamp: str, start: int, end: int, *, sample_id: str, wait: bool = True
    ) -> bytes:
        """Bytes ``[start, end)`` of version ``stamp`` of ``url``: from the raw tier, else one
        ranged GET (kept in the raw tier). SampleError naming the URL (and HTTP status)."""
        return fetch_bytes(
            self.remote, self.raw, (url, stamp, start, end), sample_id=sample_id, wait=wait
        )

    def remote_version(self) -> tuple[str, ...]:
        """The shards' stamps: what the prefetcher's memory of held spans depends on."""
        return tuple(self.shard_stamps)

    def _groups(self) -> FetchGroups:
        groups = self._fetch_groups
        if groups is None:
            rows = self.columns.rows
            img, txt = rows[:, C.IMG_OFF] >= 0, rows[:, C.TXT_OFF] >= 0
            big = np.iinfo(np.int64).max
            start = np.minimum(
                np.where(img, rows[:, C.IMG_OFF], big), np.where(txt, rows[:, C.TXT_OFF], big)
            )
            end = np.maximum(
                np.where(img, rows[:, C.IMG_OFF] + rows[:, C.IMG_LEN], -1),
                np.where(txt, rows[:, C.TXT_OFF] + rows[:, C.TXT_LEN], -1),
            )
            remote = np.array([is_remote(loc) for loc in self.locations], dtype=bool)
            shard = rows[:, C.SHARD].astype(np.int64)
            # a sample with a member over the limit is never fetched: producing it refuses it
            fits = self._within_limit(slice(None))
            obj = np.where(remote[shard] & (img | txt) & fits, shard, -1) if len(rows) else shard
            groups = FetchGroups(obj, start, end, block=self.fetch_block)
            self._fetch_groups = groups
        return groups

    def fetch_groups(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The fetch group of each of ``indices`` (``int64``; ``-1``: no remote bytes)."""
        out: np.ndarray = self._groups().group_of[np.asarray(indices, dtype=np.int64)]
        return out

    def fetch_group(self, group: int) -> tuple[str, str, list[tuple[int, int, int]]]:
        """``(url, stamp, [(index, start, end), ...])`` of ``group``'s samples, in offset
        order: one ranged GET from the first start to the last end fetches them all."""
        groups = self._groups()
        shard = int(groups.g_obj[group])
        members = [(i, *self.span(i)) for i in groups.members(group).tolist()]
        return self.locations[shard], self.shard_stamps[shard], members
