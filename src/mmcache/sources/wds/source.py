"""``WebDatasetSource``: samples of WebDataset tar shards, read in place (local or remote),
one sample's bytes per read through a member index.

The shards' members are grouped by key as WebDataset groups them (``key.jpg|png|webp``,
``key.txt``, ``key.json``; the extensions are options) into a columnar table
(:mod:`~mmcache.sources.wds.table`) from each shard's member index
(:mod:`~mmcache.sources.wds.index`: the tar headers, scanned once per shard version and
kept in ``index_dir``). Producing sample ``i`` reads the byte span of its members (one
``pread``, or one ranged GET of a remote shard) and runs the pipeline on those bytes
(:func:`~mmcache.sources.bytesproc.process_bytes`): the result is bitwise the one of the
same image and caption as loose files.

Stamps (``StampKind.FIXED``): the shard's stamp (``size:mtime_ns`` of a local file, the
ETag of an object, checked when the source is opened) plus the offsets and sizes of the
sample's image and text members. Remote shards are checked again by :meth:`revalidate`
(once per epoch by :class:`~mmcache.sources.blobs.prefetch.RemotePrefetch`, batched):
a changed shard is indexed again and its samples get new stamps and keys in every
process (the new stamps go through a small state file that each process checks with one
``stat`` per call), so nothing from the old version is served.

Remote shards (``s3://``, ``gs://``, ``http(s)://`` through
:mod:`~mmcache.sources.blobs`, ``storage_options`` passed through) read through a
:class:`~mmcache.sources.blobs.raw.RawTier` when one is given (``raw=``): bytes already
held are served from local disk, also while the store cannot be reached; only misses
fail then, as SampleErrors naming the URL. The prefetcher fills that tier with one
ranged GET per fetch group (the samples of a shard starting in one aligned
``fetch_block``; :mod:`~mmcache.sources.wds.fetching`), a producing worker that misses
with one GET of its sample's span.

The source is a :class:`~mmcache.sources.chassis.BaseSource`: length, ids, the keys
remembered under the stamps above (a re-indexed shard's samples are keyed again), rejects,
``source[i]`` and pickling are the chassis'; the identities of a batch's samples are
found per shard in one pass (:meth:`WebDatasetSource.stamp_strings`). Over local shards
the keys are kept in the node's key table, named by the shards in order with their
stamps, the ids and the options (:mod:`~mmcache.sources.wds.keyparts`): a new process
over unchanged shards computes no key.

Thread/process safety: read-only after construction except the key memo (one thread per
process), the per-process file handles and the revalidated shard stamps; pickles as
numpy columns and small lists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tarfile
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from mmcache import keys
from mmcache.errors import ConfigError, ManifestError, SampleError
from mmcache.rootfiles import open_regular
from mmcache.sources import identity
from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.sources.blobs.blocks import DEFAULT_BLOCK, check_block
from mmcache.sources.blobs.objects import Offline, Remote, RemoteError, RetryPolicy, is_remote
from mmcache.sources.blobs.raw import RawTier
from mmcache.sources.blobs.state import SharedStamps, private_dir
from mmcache.sources.blobs.tarwalk import DamagedShard
from mmcache.sources.bytesproc import byte_limit, check_size, process_bytes
from mmcache.sources.chassis import BaseSource
from mmcache.sources.files import check_on_error
from mmcache.sources.ids import IdColumn
from mmcache.sources.keytable import KeyTable
from mmcache.sources.rejects import Reject
from mmcache.sources.wds.fetching import RemoteShards
from mmcache.sources.wds.home import index_home, state_home
from mmcache.sources.wds.index import load_or_build
from mmcache.sources.wds.keyparts import racy_shards, table_parts
from mmcache.sources.wds.table import Problem, SampleColumns, ShardTable, assemble, expand_shards
from mmcache.sources.wds.video import VIDEO_EXTS, is_video_member, produce_video
from mmcache.transforms.pipeline import StagedProcessor

__all__ = ["IMAGE_EXTS", "WebDatasetSource"]

logger = logging.getLogger(__name__)

#: Default image extensions, in order of preference when a key has several.
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
C = SampleColumns
MAX_DIGEST = identity.MAX_DIGEST_BYTES
#: int64 words of a sample's stamp row (:meth:`WebDatasetSource.stamps`).
STAMP_WIDTH = 5


class WebDatasetSource(RemoteShards, BaseSource):
    """Image-text samples of WebDataset tar shards (see the module docstring).

    >>> src = WebDatasetSource("shards/{00000..00009}.tar", pipeline=pipe)  # doctest: +SKIP
    >>> loader = mmcache.DataLoader(src, cache=cache, batch_size=64)        # doctest: +SKIP

    Args:
        shards: a path, glob, brace pattern or URL, or a list of them.
        pipeline: a :class:`mmcache.Pipeline` (anything with ``stages`` and ``fingerprint``).
        on_error: ``"raise"``: a bad shard (unreadable, duplicate keys) raises
            :class:`ManifestError` at open, a bad sample :class:`SampleError` when
            produced, each naming the shard, the member and the key; ``"skip"``: they
            are left out, counted and listed by :meth:`rejects`.
        image_exts, text_exts, json_exts: member extensions of each role (lower case;
            the first listed wins when a key has several).
        video_exts: member extensions of video clips (:mod:`~mmcache.sources.wds.video`):
            a sample's media member is an image or a clip, images preferred
            (:attr:`image_exts` then holds both lists, in that order).
        index_dir: where member indexes are kept (e.g. ``cache.root / "wds-index"``,
            which ``mmcache gc`` sweeps); default: beside the raw tier for remote
            shards, in a per-user folder beside local shards (see
            :mod:`~mmcache.sources.wds.home`); ``False``: not kept.
        storage_options: for remote shards, the object store's options (``{"key": ..., "secret":
            ..., "client_kwargs": {"endpoint_url": ...}}`` for S3).
        raw: a :class:`RawTier` keeping remote bytes on local disk (``None``: none).
        retries: a :class:`RetryPolicy` for every remote call, or the retries of a
            transient error (5xx, timeouts, throttling) under the default one.
        offline: when the store cannot be reached at open: ``"auto"`` starts from the
            last listing kept in ``index_dir`` (a warning; what the raw tier and the
            cache hold is served), ``True`` never contacts the store, ``False`` fails.
        fetch_block: the prefetcher fetches the samples of a remote shard whose bytes
            start in one aligned block of this size with one ranged GET (``"8MiB"``
            by default; ``None``: one GET per sample). See
            :mod:`~mmcache.sources.blobs.blocks`.
    """

    stamp_kind: StampKind = StampKind.FIXED
    pipeline: StagedProcessor
    on_error: OnError
    _per_process: ClassVar[tuple[str, ...]] = (*BaseSource._per_process, "_fds", "_fetch_groups")

    def __init__(
        self,
        shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        pipeline: StagedProcessor,
        on_error: OnError = "raise",
        image_exts: Sequence[str] = IMAGE_EXTS,
        text_exts: Sequence[str] = ("txt",),
        json_exts: Sequence[str] = ("json",),
        video_exts: Sequence[str] = VIDEO_EXTS,
        index_dir: str | os.PathLike[str] | bool | None = None,
        storage_options: Mapping[str, Any] | None = None,
        raw: RawTier | None = None,
        retries: int | RetryPolicy = 4,
        fetch_block: int | str | None = DEFAULT_BLOCK,
        offline: Offline = "auto",
    ) -> None:
        on_error = check_on_error(on_error)
        if not isinstance(pipeline, StagedProcessor):
            raise ConfigError(
                f"pipeline must be a mmcache.Pipeline (stages and fingerprint), "
                f"got {type(pipeline).__name__}"
            )
        if raw is not None and not isinstance(raw, RawTier):
            raise ConfigError(f"raw must be a RawTier or None, got {type(raw).__name__}")
        named = (("image_exts", image_exts), ("text_exts", text_exts), ("video_exts", video_exts))
        for name, exts in named:
            if isinstance(exts, str) or not all(isinstance(e, str) and e for e in exts):
                raise ConfigError(f"{name} must be a list of extensions, got {exts!r}")
        # The ids are known once the shards are indexed (_open_all needs on_error and the
        # open rejects first): none until then.
        super().__init__(pipeline=pipeline, ids=IdColumn(0), on_error=on_error)
        self.locations = expand_shards(shards)
        self.image_exts = tuple(e.lower().lstrip(".") for e in image_exts)
        self.video_exts = tuple(
            e for e in (v.lower().lstrip(".") for v in video_exts) if e not in self.image_exts
        )
        self.image_exts += self.video_exts  # one media role: an image or a clip
        self.text_exts = tuple(e.lower().lstrip(".") for e in text_exts)
        self.json_exts = tuple(e.lower().lstrip(".") for e in json_exts)
        # index_dir None: each shard's default home (index_home), chosen when indexed.
        self._index_default = index_dir is None or index_dir is True
        if index_dir is None or isinstance(index_dir, bool):
            self.index_dir: str | None = None
        else:
            self.index_dir = os.path.abspath(os.fspath(index_dir))
        self.remote = Remote(
            storage_options, retries=retries, offline=offline, listing_dir=self.index_dir
        )
        self.raw = raw
        self.fetch_block = check_block(fetch_block)
        self.member_limit = byte_limit(pipeline)
        self._fds: dict[int, int] = {}
        self._fd_pid = os.getpid()
        self.shard_stamps: list[str] = [""] * len(self.locations)
        self._sizes: list[int] = [0] * len(self.locations)
        self._shard_ints: np.ndarray | None = None  # stamps() column 0 per shard, made lazily
        self._open_all()
        self._ids = self.columns.id_column  # the same buffers in every later version
        # The shards as the ids were made of them: the key table's identity (keyparts).
        self._opened = (list(self.shard_stamps), list(self._sizes))
        self._ids_digest: str | None = None  # found once, travels with a pickle
        self._state = SharedStamps(self._make_state_path())

    # -- opening -----------------------------------------------------------------------
    def _shard_stats(self) -> dict[int, tuple[int, str] | Exception]:
        """``shard number -> (size, stamp)``, or the error that kept it from being read.

        A local shard's stamp is its local evidence (:func:`mmcache.keys.stat_stamp`: size,
        mtime, ctime, inode), so that a rewrite with size and mtime restored is indexed
        again; the samples' keys are made from their bytes (:meth:`key`), not from it."""
        out: dict[int, tuple[int, str] | Exception] = {}
        urls = [loc for loc in self.locations if is_remote(loc)]
        remote: dict[str, tuple[int, str | None] | RemoteError] = {}
        if urls:
            try:
                remote = self.remote.stamps(urls)
            except RemoteError as err:  # the store cannot be reached
                remote = dict.fromkeys(urls, err)
        for s, loc in enumerate(self.locations):
            if is_remote(loc):
                got = remote[loc]
                if isinstance(got, RemoteError):
                    out[s] = got
                    continue
                size, stamp = got
                if stamp is None:
                    digest = self.unversioned_stamp(loc, size)
                    out[s] = digest if isinstance(digest, RemoteError) else (size, digest)
                else:
                    out[s] = (size, stamp)
                continue
            try:
                # permissions are checked here, not at the first read; a FIFO or a
                # device is refused, never waited on nor read forever
                fd, st = open_regular(loc)
                os.close(fd)
            except OSError as exc:
                out[s] = exc
                continue
            out[s] = (st.st_size, keys.stat_stamp(st))
        return out

    def _index(self, s: int, size: int, stamp: str) -> ShardTable:
        loc = self.locations[s]

        def opener() -> IO[bytes]:
            if is_remote(loc):
                handle: IO[bytes] = self.remote.open(loc)
                return handle
            fd, _ = open_regular(loc)
            return open(fd, "rb", closefd=True)

        return load_or_build(
            location=loc,
            stamp=stamp,
            size=size,
            opener=opener,
            index_dir=self._index_dir_of(loc),
            exts=(self.image_exts, self.text_exts, self.json_exts),
        )

    def _index_dir_of(self, location: str) -> str | None:
        if not self._index_default:
            return self.index_dir
        return index_home(location, raw_path=None if self.raw is None else self.raw.path)

    def _open_all(self) -> None:
        """Index every shard (its table from its member index file, or scanned), then
        take their samples as one table: the problems (shards that cannot be read, keys
        repeated within a shard, keys found again in a later shard) in shard order."""
        stats = self._shard_stats()
        tables: list[tuple[int, ShardTable]] = []
        problems: dict[int, list[Problem]] = {}
        for s, loc in enumerate(self.locations):
            stat = stats[s]
            try:
                if isinstance(stat, Exception):
                    raise stat
                size, stamp = stat
                table = self._index(s, size, stamp)
            except (OSError, RemoteError, EOFError) as exc:
                problems[s] = [Problem(None, loc, None, f"cannot read the shard: {exc}")]
                continue
            except DamagedShard as exc:  # a hostile or corrupt header: never trusted
                problems[s] = [Problem(None, loc, exc.member, str(exc))]
                continue
            except tarfile.TarError as exc:  # not a tar at all
                problems[s] = [Problem(None, loc, None, f"not a tar file: {exc}")]
                continue
            self.shard_stamps[s] = stamp
            self._sizes[s] = size
            if table.truncated:
                logger.warning("shard %s is truncated: %d whole members kept", loc, table.members)
            if not table.members and not table.truncated:
                logger.warning("shard %s holds no members (an empty or all-zero tar)", loc)
            problems[s] = table.problems()
            tables.append((s, table))
        self.columns, again = assemble(tables)
        for problem in again:  # a key of an earlier shard: after that shard's own
            problems[self.locations.index(problem.shard)].append(problem)
        for s in range(len(self.locations)):
            for problem in problems.get(s, []):
                self._problem(problem)

    def _problem(self, problem: Problem) -> None:
        member = f", member {problem.member}" if problem.member else ""
        key = f", key {problem.key!r}" if problem.key else ""
        if self.on_error == "raise":
            raise ManifestError(
                f"{problem.reason} (shard {problem.shard}{member}{key})",
                path=problem.shard,
                sample_id=problem.key,
            )
        sid = problem.key if problem.key is not None else f"<shard {problem.shard}>"
        where = problem.shard if problem.member is None else f"{problem.shard}:{problem.member}"
        self.open_rejects.append(Reject(sid, where, problem.reason))
        logger.warning("skipped %s: %s", where, problem.reason)

    # -- which sample ------------------------------------------------------------------
    def image_sizes(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``int64 [n, 2]`` ``(width, height)`` of each sample from its ``.json`` member,
        read when the shard was indexed (no image decoded); ``-1`` where unknown."""
        rows = self.columns.rows[self._checked(indices)]
        out: np.ndarray = rows[:, [C.WIDTH, C.HEIGHT]].copy()
        return out

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``int64 [n, 5]``: the shard's stamp (a 63-bit digest of it), the offset and size
        of the image member and of the text member (``-1``: none)."""
        idx = self._checked(indices)
        self._refresh()
        rows = self.columns.rows[idx]
        if self._shard_ints is None:
            self._shard_ints = np.array(
                [self._stamp_int(s) for s in range(len(self.locations))], dtype=np.int64
            )
        out = np.empty((idx.shape[0], STAMP_WIDTH), dtype=np.int64)
        out[:, 0] = self._shard_ints[rows[:, C.SHARD]]
        out[:, 1:] = rows[:, [C.IMG_OFF, C.IMG_LEN, C.TXT_OFF, C.TXT_LEN]]
        return out

    def _stamp_int(self, shard: int) -> int:
        raw = keys.digest(self.locations[shard], self.shard_stamps[shard])[:8]
        return int.from_bytes(raw, "little") & ((1 << 63) - 1)

    def _layout(self, index: int) -> str:
        """Where the members lie in the sample's span (relative offsets, sizes, extension):
        two samples with equal span bytes but other members are keyed apart."""
        row = self.columns.rows[index]
        start = self.span(index)[0]
        parts = [int(row[C.IMG_OFF]) - start, int(row[C.IMG_LEN])]
        parts += [int(row[C.TXT_OFF]) - start, int(row[C.TXT_LEN]), int(row[C.EXT])]
        return ":".join(str(v) for v in parts)

    def _identities(self, todo: list[int]) -> dict[int, str]:
        """The identity of each sample's bytes: for a local shard the digest of its span
        (:func:`~mmcache.sources.identity.span_identities`: read once per node and shard
        version, then remembered), so the same bytes give the same key on every copy of
        the shard and other bytes another; for a remote shard its ETag (or version) and
        the span's place in it."""
        out: dict[int, str] = {}
        by_shard: dict[int, list[int]] = {}
        for i in todo:
            by_shard.setdefault(int(self.columns.rows[i, C.SHARD]), []).append(i)
        for shard, listed in by_shard.items():
            loc = self.locations[shard]
            if is_remote(loc) or not self.shard_stamps[shard]:
                for i in listed:
                    start, end = self.span(i)
                    out[i] = f"{self.shard_stamps[shard]}:{start}:{end}"
                continue
            fields = [int(f) for f in self.shard_stamps[shard].split(":")]
            # A span over the digest bound (a hostile member size) is never read for a key:
            # its identity is the shard's local evidence and the span; produce refuses it.
            big = {i for i in listed if self.span(i)[1] - self.span(i)[0] > MAX_DIGEST}
            for i in big:
                start, end = self.span(i)
                out[i] = f"stat:{self.shard_stamps[shard]}:{start}:{end}"
            members = [i for i in listed if i not in big]
            spans = [self.span(i) for i in members]

            def read(start: int, end: int, shard: int = shard) -> bytes:
                return self._pread(shard, start, end)

            try:
                idents = identity.span_identities(loc, fields, spans, read)
            except (OSError, SampleError):  # produce() reports it, naming the sample
                # Keyed by the local evidence instead (never stale: a rewrite changes it).
                stamp = self.shard_stamps[shard]
                idents = [f"stat:{stamp}:{a}:{b}" for a, b in spans]
            out.update(zip(members, idents, strict=True))
        return out

    def stamp_strings(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64]
    ) -> list[str]:
        """``wds:<identity of the span's bytes>:<layout>`` of each of ``indices``: the
        identities found per shard in one pass (:meth:`_identities`)."""
        listed = indices.tolist()
        idents = self._identities(listed)
        return [f"wds:{idents[i]}:{self._layout(i)}" for i in listed]

    def stamp_string(self, index: int, stamp: npt.NDArray[np.int64]) -> str:
        return self.stamp_strings(np.asarray([index], dtype=np.int64), stamp[None, :])[0]

    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """:meth:`~mmcache.sources.chassis.BaseSource.key_rows` after taking the stamps
        another process revalidated and the ``stat`` of each local shard of ``indices``
        (a changed shard is indexed again, so its samples' stamps, hence keys, change:
        remote ones after :meth:`revalidate`). Not thread-safe."""
        idx = self._checked(indices)
        self._refresh()
        if self._check_local(idx):
            stamps = None  # taken before the shard was indexed again
        return super().key_rows(idx, stamps=stamps)

    def key_table(self, k: int) -> KeyTable | None:
        """The node's key table of this source's keys (stamp rows of :data:`STAMP_WIDTH`
        words), or None; None for any other width, asked by a caller that keeps rows of
        file stamps (the loader's learnt keys): never made, so that the one table this
        process maps stays the one :meth:`key_rows` uses."""
        return super().key_table(k) if k == STAMP_WIDTH else None

    def key_table_parts(self) -> tuple[Any, list[Any]] | None:
        """Local shards: their locations, stamps and sizes when opened, the ids' digest,
        the extensions and ``on_error`` (:mod:`~mmcache.sources.wds.keyparts`); remote
        ones keep their keys in the process."""
        if any(is_remote(loc) for loc in self.locations):
            return None
        if self._ids_digest is None:
            self._ids_digest = self.ids_digest()
        stamps, sizes = self._opened
        exts = (self.image_exts, self.text_exts, self.json_exts, self.video_exts)
        return table_parts(
            locations=self.locations,
            stamps=stamps,
            sizes=sizes,
            ids_digest=self._ids_digest,
            n=len(self),
            exts=exts,
            on_error=self.on_error,
        )

    def _unsettled(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64], taken: float
    ) -> npt.NDArray[np.bool_] | None:
        """Samples of a local shard changed less than
        :data:`~mmcache.sources.identity.RACY_SECONDS` before their bytes were read
        (:meth:`~mmcache.sources.chassis.BaseSource._unsettled`): keyed again until it
        is older. A remote shard's stamp (ETag) vouches as it is."""
        shards, which = np.unique(self.columns.rows[indices, C.SHARD], return_inverse=True)
        locs, stamps_now = self.locations, self.shard_stamps
        local = ["" if is_remote(locs[s]) else stamps_now[s] for s in shards.tolist()]
        young: npt.NDArray[np.bool_] = racy_shards(local, taken)[which.reshape(-1)]
        return young

    def _check_local(self, idx: np.ndarray) -> bool:
        """``stat`` the local shards of ``idx`` (one each) and index again those whose
        evidence changed (G5: a shard rewritten during a run is never read at old offsets);
        whether one was."""
        again = False
        shards = np.unique(self.columns.rows[idx, C.SHARD]).tolist() if idx.size else []
        for shard in shards:
            loc = self.locations[shard]
            if is_remote(loc) or not self.shard_stamps[shard]:
                continue
            try:
                st = os.stat(loc)
            except OSError:
                continue  # produce() reports it, naming the sample
            stamp = keys.stat_stamp(st)
            if stamp != self.shard_stamps[shard]:
                try:
                    self._apply(shard, self._index(shard, st.st_size, stamp))
                    again = True
                except (OSError, EOFError, tarfile.TarError) as exc:
                    logger.warning("cannot index the changed shard %s again: %s", loc, exc)
        return again

    # -- produce -------------------------------------------------------------------------
    def member_name(self, index: int, role: str) -> str:
        """``key.ext`` of sample ``index``'s ``"image"`` or ``"text"`` member."""
        row = self.columns.rows[index]
        if role == "image":
            ext = self.image_exts[int(row[C.EXT])]
        else:
            ext = self.text_exts[int(row[C.TXT_EXT])]
        return f"{self.columns.id(index)}.{ext}"

    def span(self, index: int) -> tuple[int, int]:
        """The byte range ``[start, end)`` of the shard holding sample ``index``'s members."""
        row = self.columns.rows[index]
        starts = [int(row[o]) for o in (C.IMG_OFF, C.TXT_OFF) if row[o] >= 0]
        ends = [int(row[o] + row[o + 1]) for o in (C.IMG_OFF, C.TXT_OFF) if row[o] >= 0]
        if not starts:
            return 0, 0
        return min(starts), max(ends)

    def read_span(self, index: int) -> bytes:
        """The bytes of :meth:`span` (raw tier, then the shard). Raises SampleError."""
        start, end = self.span(index)
        shard = int(self.columns.rows[index, C.SHARD])
        loc = self.locations[shard]
        sid = self.columns.id(index)
        if end == start:
            return b""
        if not is_remote(loc):
            return self._pread(shard, start, end, sid)
        return self.fetch(loc, self.shard_stamps[shard], start, end, sample_id=sid)

    def _pread(self, shard: int, start: int, end: int, sid: str | None = None) -> bytes:
        """Bytes ``[start, end)`` of local shard ``shard``, checked to come from the version
        that was indexed: the shard's ``fstat`` after the read must equal its stamp, else
        SampleError (it changed since; its samples are indexed and keyed again at the next
        :meth:`key_rows`)."""
        loc = self.locations[shard]
        what = f" (members of key {sid!r})" if sid is not None else ""
        who = sid if sid is not None else f"<shard {loc}>"
        try:
            fd = self._fd(shard)
            data = os.pread(fd, end - start, start)
            now = keys.stat_stamp(os.fstat(fd))
        except OSError as exc:
            raise SampleError(
                f"cannot read shard {loc}{what}: {exc.strerror or exc}", sample_id=who, path=loc
            ) from exc
        if now != self.shard_stamps[shard] or len(data) != end - start:
            raise SampleError(
                f"shard {loc} changed after it was indexed{what}: its samples are indexed "
                "and keyed again, nothing is read at the old offsets",
                sample_id=who,
                path=loc,
            )
        return data

    def _fd(self, shard: int) -> int:
        if self._fd_pid != os.getpid():
            self._fds = {}
            self._fd_pid = os.getpid()
        fd = self._fds.get(shard)
        if fd is None:
            fd = self._fds[shard] = os.open(self.locations[shard], os.O_RDONLY)
        return fd

    def produce(self, index: int) -> dict[str, np.ndarray]:
        """Read sample ``index``'s members and run the pipeline. Raises SampleError naming
        the shard, the member and the key."""
        self._checked([index])
        self._refresh()
        self._check_local(np.array([index], dtype=np.int64))
        row = self.columns.rows[index]
        shard = self.locations[int(row[C.SHARD])]
        sid = self.columns.id(index)
        self._check_sizes(index)
        data = self.read_span(index)
        start = self.span(index)[0]
        image = text = None
        where = f"{shard}:{sid}"
        if row[C.IMG_OFF] >= 0:
            off = int(row[C.IMG_OFF]) - start
            image = data[off : off + int(row[C.IMG_LEN])]
            where = f"{shard}:{self.member_name(index, 'image')}"
        if row[C.TXT_OFF] >= 0:
            off = int(row[C.TXT_OFF]) - start
            try:
                text = data[off : off + int(row[C.TXT_LEN])].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SampleError(
                    f"text member is not UTF-8: {exc}",
                    sample_id=sid,
                    path=f"{shard}:{self.member_name(index, 'text')}",
                ) from exc
        if image is not None and is_video_member(where, self.video_exts):
            return produce_video(self.pipeline, image, text, sample_id=sid, path=where,
                                 max_bytes=self.member_limit)  # fmt: skip
        return process_bytes(self.pipeline, image, text, sample_id=sid, path=where)

    def _check_sizes(self, index: int) -> None:
        """SampleError when a member of sample ``index`` is over :attr:`member_limit`, from
        the sizes in the index: the oversized bytes are never read (nor fetched)."""
        row = self.columns.rows[index]
        shard = self.locations[int(row[C.SHARD])]
        for role, size in (("image", int(row[C.IMG_LEN])), ("text", int(row[C.TXT_LEN]))):
            if size >= 0:
                name = self.member_name(index, role)
                check_size(
                    size,
                    self.member_limit,
                    f"{role} member {name}",
                    sample_id=self.columns.id(index),
                    path=f"{shard}:{name}",
                )

    # -- revalidation (remote shards) ----------------------------------------------------
    def _make_state_path(self) -> str:
        raw_path = None if self.raw is None else self.raw.path
        base = self.index_dir or state_home(raw_path) or private_dir()
        name = keys.digest("mmcache.wds-state", os.getuid(), *self.locations).hex()
        return os.path.join(base, f"mmcache-wds-state-{os.getuid()}-{name}.json")

    @property
    def shared_stamps(self) -> SharedStamps:
        """The file through which revalidated stamps reach the other processes (and the
        gate that holds them back while a revalidation is under way)."""
        return self._state

    def revalidate(self) -> list[str]:
        """Check every shard's stamp again (a ``stat``; the ETags of remote shards batched),
        index the changed ones again and re-key their samples, here and, through the
        state file, in every other process. Returns the shards that changed. Raises
        :class:`RemoteError` (after taking the shards it could check) when some could not
        be checked: the store cannot be reached, or an object is gone."""
        stats = self._shard_stats()
        changed = []
        failure: Exception | None = None
        for s, loc in enumerate(self.locations):
            stat = stats[s]
            if isinstance(stat, Exception):
                failure = failure or stat
                continue
            size, stamp = stat
            if stamp != self.shard_stamps[s]:
                try:
                    index = self._index(s, size, stamp)
                except (OSError, RemoteError, EOFError, tarfile.TarError) as exc:
                    failure = failure or exc
                    continue
                self._apply(s, index)
                changed.append(loc)
        if changed:
            self._write_state()
        if failure is not None:
            if isinstance(failure, RemoteError):
                raise failure
            raise RemoteError(getattr(failure, "filename", None) or "?", None, True, str(failure))
        return changed

    def _apply(self, s: int, table: ShardTable) -> None:
        """Take version ``table`` of shard ``s``: its samples' rows from it (a key gone from
        the shard keeps no member: producing it raises)."""
        row_of = {table.key(j): j for j in range(len(table))}
        rows = self.columns.rows.copy()
        for i in np.flatnonzero(rows[:, C.SHARD] == s).tolist():
            j = row_of.get(self.columns.id(i))
            if j is None:
                rows[i, C.IMG_OFF :] = [-1, -1, -1, -1, -1, -1, -1, -1]
            else:
                rows[i, C.IMG_OFF :] = table.rows[j, : C.TXT_EXT]
        # The shard's new stamp changes its samples' stamp rows: the chassis keys them again.
        self.columns = SampleColumns(rows, self.columns.id_buf, self.columns.id_off)
        self.shard_stamps[s] = table.stamp
        self._sizes[s] = table.size
        self._shard_ints = None
        self._fetch_groups = None
        fd = self._fds.pop(s, None) if self._fd_pid == os.getpid() else None
        if fd is not None:  # a replaced file: the next read opens the new one
            with contextlib.suppress(OSError):
                os.close(fd)
        logger.warning(
            "shard %s changed (now %s): its samples are read again", table.location, table.stamp
        )

    def _write_state(self) -> None:
        self._state.publish(
            {"locations": self.locations, "stamps": self.shard_stamps, "sizes": self._sizes}
        )

    def _refresh(self) -> None:
        """Take the shard stamps another process revalidated (one ``stat`` when none did)."""
        state = self._state.poll()
        if state is None or state.get("locations") != self.locations:
            return
        stamps, sizes = state.get("stamps"), state.get("sizes")
        n = len(self.locations)
        if not (isinstance(stamps, list) and isinstance(sizes, list)):
            return
        if not len(stamps) == n == len(sizes):
            return
        for s, (stamp, size) in enumerate(zip(stamps, sizes, strict=True)):
            if not (isinstance(stamp, str) and stamp and isinstance(size, int)):
                continue
            if stamp == self.shard_stamps[s]:
                continue
            try:
                index = self._index(s, size, stamp)
            except (RemoteError, OSError, EOFError, tarfile.TarError) as exc:
                logger.warning("cannot take the new version of %s: %s", self.locations[s], exc)
                continue
            self._apply(s, index)

    # -- pickling ------------------------------------------------------------------------
    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._fds = {}
        self._fd_pid = -1  # this process has opened no shard yet

    def close(self) -> None:
        """Close this process's shard file handles."""
        if self._fd_pid == os.getpid():
            for fd in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds = {}


if TYPE_CHECKING:

    def _conforms(source: WebDatasetSource) -> SampleSource:
        return source
