"""``FileSource``: manifest records with their image or video files, local paths or
object URLs, through a pipeline; the :class:`~mmcache.sources.base.SampleSource` of
image-text and video SFT records.

It is a :class:`~mmcache.sources.chassis.BaseSource` (length, ids, keys memoised by
stamp, rejects, ``source[i]``, pickling are the chassis'). What a record is (its id,
caption or conversation, which files it is made of) is its own; where those files live
is its :attr:`~FileSource.blobs` (:mod:`mmcache.sources.blobs`): local files
(:class:`~mmcache.sources.blobs.local.LocalFiles`: a ``stat`` per file, a batch's
identities in one ledger pass) or objects in a store
(:class:`~mmcache.sources.blobs.objectfiles.ObjectFiles`: ``s3://``, ``gs://``,
``http(s)://``, stamped by their ETags in one batch at open, checked again at each
epoch by :class:`~mmcache.sources.blobs.prefetch.RemotePrefetch`, read whole through
the raw-bytes tier under the one retry policy and circuit breaker). A manifest names
local files or URLs, not both. It keeps "which sample" apart from "produce it", so that
a cache can sit between the two without reworking either:

- :meth:`FileSource.sample_id` and :meth:`FileSource.key` say which sample index
  ``i`` is and under which content key its output is cached (id, source stamp of
  the image file, caption and pipeline fingerprint; see :mod:`mmcache.keys`);
- :meth:`FileSource.produce` decodes, resizes and tokenizes it into numpy arrays
  (the cacheable :data:`Sample`), raising :class:`SampleError`;
- :meth:`FileSource.to_item` turns a Sample into what ``ds[i]`` returns.

The stamps of local files are each file's ``stat`` fields
(:func:`mmcache.keys.stat_fields`), so the source's :attr:`~FileSource.stamp_kind` is
``FILE``: a loader re-checks a cached batch with a ``stat`` per file. With
``content_stamp=True`` keys are made from the files' bytes instead and the kind is
``CONTENT``. Objects are ``FIXED``: a key holds each object's identity
(:func:`~mmcache.sources.blobs.objects.object_identity`: an S3 ETag names the bytes, so a
copy under another bucket or prefix keeps its keys; a video part's options are keyed
without its URL for that reason), and a source of objects claims the ``Revalidating``
and ``SharesStamps`` capabilities (a source of local files does not: its files are
``stat``-ed at every batch). Not yet over objects: records with images in a
conversation (a chat pipeline) and ``lengths()`` of video records (it would fetch every
clip's header).

Thread/process safety: a source is read-only after construction except for the
reject log (process-safe, :mod:`mmcache.sources.rejects`) and the key memo (one
thread per process) and, over objects, the revalidated stamps (see
:class:`~mmcache.sources.blobs.objectfiles.ObjectFiles`; they reach copies in other
processes through a shared stamps file). It pickles cheaply (spawn workers): the
records are numpy buffers and the pipeline pickles its tokenizer as JSON.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
import numpy.typing as npt

from mmcache.errors import ConfigError
from mmcache.sources import chat as _chat
from mmcache.sources import identity
from mmcache.sources.base import OnError, SampleSource, StampKind, check_on_error
from mmcache.sources.blobs.local import LocalFiles
from mmcache.sources.blobs.objectfiles import ObjectFiles
from mmcache.sources.blobs.objects import Offline, Remote, is_remote
from mmcache.sources.blobs.raw import RawTier
from mmcache.sources.blobs.retry import RetryPolicy
from mmcache.sources.blobs.state import SharedStamps, private_dir
from mmcache.sources.bytesproc import byte_limit, process_bytes
from mmcache.sources.chassis import BaseSource
from mmcache.sources.freshness import FileChecks, Freshness, check_freshness
from mmcache.sources.readers import read_manifest
from mmcache.sources.records import Records
from mmcache.sources.rejects import Reject
from mmcache.stats import TextReport
from mmcache.transforms.pipeline import Pipeline, RecordProcessor, StagedProcessor

__all__ = ["FileSource", "RecordProcessor", "Sample", "check_on_error"]

#: The cacheable output of a pipeline: field name -> numpy array.
Sample = dict[str, np.ndarray]


class FileSource(BaseSource):
    """Image-text (or video SFT) samples from a manifest whose files are local paths or
    object URLs, produced by a pipeline.

    Args:
        manifest: a seed JSONL or LLaVA JSON manifest path (any format
            :func:`~mmcache.sources.readers.read_manifest` reads), or :class:`Records`.
            Its references are local paths or URLs (``s3://``, ``gs://``,
            ``http(s)://``), not both.
        pipeline: how to turn a record into arrays (a :class:`mmcache.Pipeline`, or
            anything with its ``process`` and ``fingerprint``: :class:`RecordProcessor`).
        on_error: ``"raise"`` (default) raises :class:`SampleError` naming the id,
            the path and the reason; ``"skip"`` lets the caller leave the sample out
            and record it (:meth:`record_reject`, :meth:`rejects`).
        content_stamp: key samples by a hash of the image bytes instead of the
            file's ``stat`` stamp (size, mtime, ctime, inode: see
            :data:`mmcache.keys.STAT_FIELDS`); slower: reads every file to compute
            a key; for file systems whose ctimes or inode numbers are not
            trustworthy. Sets :attr:`stamp_kind` to ``CONTENT``. Local files only.
        freshness: how often local files' stamps are taken again: ``"epoch"`` (default:
            every check, each epoch) or ``"run"`` (once per run and process, for files
            that do not change while the job runs: a file rewritten meanwhile is not
            seen). See :mod:`mmcache.sources.freshness`.
        recheck: with ``freshness="epoch"``, seconds a file found unchanged is trusted
            without a new ``stat`` (default 0: every check stats it). A file rewritten
            within the window is seen when it ends. For network file systems, where a
            ``stat`` costs ~0.5 ms.
        storage_options: the object store's options for URLs (credentials, endpoint:
            :class:`~mmcache.sources.blobs.objects.Remote`).
        raw: a :class:`~mmcache.sources.blobs.raw.RawTier` keeping the objects on local
            disk (``None``: none; what ``RemotePrefetch`` fetches ahead into).
        retries: a :class:`RetryPolicy` for every remote call, or the retries of a
            transient error under the default one.
        offline: when the store cannot be reached at open: ``"auto"`` starts from the
            listing kept in ``state_dir`` (a warning; cached samples are served),
            ``True`` never contacts the store, ``False`` raises :class:`RemoteError`.
        state_dir: where revalidated stamps are handed to other processes and the last
            listing is kept (default the raw tier's folder, else a 0700 folder of this
            user: :func:`~mmcache.sources.blobs.state.private_dir`).

    Over objects the source has :attr:`remote` (the store), :attr:`raw`,
    :attr:`shared_stamps` and ``fetches_ahead``, and :meth:`revalidate` checks its
    objects again: pass it to ``RemotePrefetch``. Over local files it has none of them.
    """

    #: ``FILE`` (keys from ``stat``), ``CONTENT`` with ``content_stamp=True``, ``FIXED``
    #: over objects.
    stamp_kind: StampKind
    pipeline: RecordProcessor
    on_error: OnError
    #: Where the samples' files are: local files, or objects in a store.
    blobs: LocalFiles | ObjectFiles
    # Over objects only (the Revalidating and SharesStamps capabilities, see above).
    remote: Remote
    raw: RawTier | None
    shared_stamps: SharedStamps
    fetches_ahead: bool
    #: Over objects: the most bytes one object may have (larger ones are never fetched).
    max_object_bytes: int | None
    _per_process: ClassVar[tuple[str, ...]] = (
        *BaseSource._per_process,
        "_lengths",
        "_multi",
        "_checks",
    )

    def __init__(
        self,
        manifest: str | os.PathLike[str] | Records,
        *,
        pipeline: RecordProcessor,
        on_error: OnError = "raise",
        content_stamp: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        raw: RawTier | None = None,
        retries: int | RetryPolicy = 4,
        offline: Offline = "auto",
        state_dir: str | os.PathLike[str] | None = None,
        freshness: Freshness = "epoch",
        recheck: float = 0.0,
    ) -> None:
        on_error = check_on_error(on_error)
        self.freshness, self.recheck = check_freshness(freshness, recheck)
        if not isinstance(pipeline, RecordProcessor):
            raise ConfigError(
                f"pipeline must be a mmcache.Pipeline (or have its process and fingerprint), "
                f"got {type(pipeline).__name__}"
            )
        if isinstance(manifest, Records):
            self.records = manifest
        else:
            self.records = read_manifest(manifest, on_error=on_error)
        # A chat pipeline (mmcache.ChatSpec): samples are made from the structured
        # conversations and all their images (see mmcache.sources.chat).
        self._chat = pipeline.chat if isinstance(pipeline, Pipeline) else None
        self._mismatched = 0
        self._lengths: _chat.ChatLengths | None = None
        self._multi: npt.NDArray[np.bool_] | None = None  # see _multi_files
        self._checks: FileChecks | None = None  # see stamps
        if self._chat is not None:
            self.records, self._mismatched = _chat.check_placeholders(
                self.records, self._chat.image_token, on_error
            )
        super().__init__(pipeline=pipeline, ids=self.records.id_column, on_error=on_error)
        self.content_stamp = content_stamp
        # content_stamp=True: the stat fields are not trusted, so a key is never
        # remembered under them (every key reads its files again).
        self._memoise_keys = not content_stamp
        urls = self._urls() if self.records.may_name_urls() else None
        if urls is None:
            self.blobs = LocalFiles(content=content_stamp)
        else:
            if content_stamp:
                raise ConfigError(
                    "content_stamp=True is for local files: an object is keyed by its "
                    "ETag (or the digest of its bytes where its server gives none)"
                )
            if state_dir is not None:
                base = os.fspath(state_dir)
            else:
                base = os.path.join(raw.path, "state") if raw is not None else private_dir()
            if not isinstance(pipeline, StagedProcessor):
                raise ConfigError(
                    f"a FileSource of objects needs a mmcache.Pipeline (its stages read "
                    f"the fetched bytes), got {type(pipeline).__name__}"
                )
            remote = Remote(storage_options, retries=retries, offline=offline, listing_dir=base)
            self.blobs = ObjectFiles(urls, remote=remote, raw=raw, state_dir=base)
            self.remote, self.raw = remote, raw
            self.shared_stamps = self.blobs.shared_stamps
            self.fetches_ahead = True  # objects are fetched ahead into the raw tier
            # Objects over this size are never fetched (producing refuses them by size).
            self.max_object_bytes = byte_limit(pipeline)
        self.stamp_kind = self.blobs.stamp_kind
        self.open_rejects = [
            Reject(
                rej.sample_id if rej.sample_id is not None else f"<line {rej.line}>",
                self.records.source,
                rej.reason,
            )
            for rej in self.records.rejects
        ]

    def _urls(self) -> list[str] | None:
        """Every object the records name, each once (``None``: they name local files).
        A manifest naming both is a ConfigError naming one of each; so is, over
        objects, a conversation with images (not yet: the chat pipeline reads images
        from paths)."""
        records = self.records
        urls: dict[str, None] = {}
        local: str | None = None
        for i in range(len(records)):
            media = self._media(i) if self._chat is not None else []
            if self._chat is None and (path := records.image_path(i)) is not None:
                media = [path]
            for ref in media:
                if is_remote(ref):
                    urls.setdefault(ref)
                elif local is None:
                    local = ref
            if urls and self._chat is not None and records.image_paths(i):
                raise ConfigError(
                    f"FileSource: record {records.id(i)!r} of {records.source} has images "
                    "in a conversation over objects: not yet (copy them locally, or read "
                    "video records only)"
                )
        if not urls:
            return None
        if local is not None:
            raise ConfigError(
                f"FileSource: {records.source} names local files ({local}) and URLs "
                f"({next(iter(urls))}); a source reads one or the other: split the manifest"
            )
        return list(urls)

    @property
    def _objects(self) -> ObjectFiles | None:
        return self.blobs if isinstance(self.blobs, ObjectFiles) else None

    # -- which sample -------------------------------------------------------------------
    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Each sample's stamp row, as its :attr:`blobs` makes them: local files the
        :func:`mmcache.keys.stat_fields` of its image (size, mtime_ns, ctime_ns, inode)
        as ``int64 [n, 4]``, one ``stat`` each; objects a 63-bit digest of its object's
        stamp (ETag) and size, ``int64 [n, 2]``. ``-2`` where there is none (text-only,
        missing, unreadable, bad path). A sample of several files has one row for all.
        With ``recheck`` or ``freshness="run"``, a local file checked recently enough in
        this process is not ``stat``-ed: its stamp from then is returned
        (:class:`~mmcache.sources.freshness.FileChecks`); local ``stat`` calls go on
        threads when the file system is slow to answer.

        What the default keys are made of (see :meth:`key_rows`); the loader also
        uses it to check that a plan made a little earlier is still current. (With
        ``content_stamp=True`` they are the same stat fields, but keys do not use them.)
        """
        idx = self._checked(indices)
        objects = self._objects
        if objects is not None:
            objects.refresh()
            if self._chat is not None:  # every sample a group of objects, in part order
                return np.stack([objects.group_stamp(self._media(i)) for i in idx.tolist()])
            return objects.stamps(self.records.stat_paths(idx))
        if self._checks is None:
            self._checks = FileChecks(
                len(self.records), freshness=self.freshness, recheck=self.recheck
            )
        return self._checks.stamps(idx, self._take_stamps, self._single_paths)

    def _single_paths(self, idx: npt.NDArray[np.int64]) -> list[bytes | None]:
        """The one file of each of ``idx`` (None: none, or a sample of several files), whose
        folder tells when it was replaced (see :class:`~mmcache.sources.freshness.FileChecks`)."""
        paths = self.records.stat_paths(idx)
        if self._chat is not None:
            for j in np.flatnonzero(self._multi_files()[idx]).tolist():
                paths[j] = None
        return paths

    def _take_stamps(self, idx: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """:meth:`stamps` of local files ``idx``, each file ``stat``-ed now."""
        blobs = self.blobs
        assert isinstance(blobs, LocalFiles)  # objects never come here (see stamps)
        stamps = blobs.stamps(self.records.stat_paths(idx))
        if self._chat is not None:  # a multi-file sample: all its files in one row
            multi = np.flatnonzero(self._multi_files()[idx])
            if multi.size:
                stamps[multi] = blobs.group_stamps([self._media(int(i)) for i in idx[multi]])
        return stamps

    def _unsettled(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64], taken: float
    ) -> npt.NDArray[np.bool_] | None:
        """Rows whose files changed too recently for their stamp to vouch for their key
        (:meth:`BaseSource._unsettled`); a chat sample of several files by each file's
        own stamp (its row is a hash of them). Stamps that are not local ``stat``
        fields (objects' ETags) vouch as they are."""
        if self.stamp_kind is not StampKind.FILE:
            return None
        young: npt.NDArray[np.bool_] = identity.racy_rows(stamps, taken)
        if self._chat is not None:
            for j in np.flatnonzero(self._multi_files()[indices]).tolist():
                young[j] = _chat.any_racy(self._media(int(indices[j])), taken)
        return young

    def _multi_files(self) -> npt.NDArray[np.bool_]:
        """Per sample: whether a chat sample is made of other files than its one image
        (several images, or a video). Found once per process for every record, with
        one vectorised count of the images: asked per sample, it cost ~5 us twice
        for each sample a new process keys (its stamps, then its identities), and
        once per sample of every epoch's file check."""
        if self._multi is None:
            records = self.records
            multi = records.image_counts() > 1
            if records.has_videos:
                videos = [bool(records.video_json(i)) for i in range(len(records))]
                multi |= np.asarray(videos, dtype=bool).reshape(len(records))
            self._multi = multi
        return self._multi

    def _media(self, i: int) -> list[str]:
        """Every file chat sample ``i`` is made of: its images, then its videos."""
        videos: list[str] = []
        for part in self.records.videos(i):
            ref = part["video"]
            videos.extend(ref if isinstance(ref, list) else [ref])  # a frame list: each
        return [*self.records.image_paths(i), *videos]

    def _chat_text(self, i: int) -> str:
        """What a chat sample's key holds of its record: the conversation and the video
        parts' options. Over objects the parts' URLs are left out: each clip is in the
        key by its identity (:meth:`stamp_strings`, which keeps the URL only where the
        ETag is no identity of the bytes), so a copy of the clips under another bucket
        or prefix keeps its keys (``scope="cluster"`` with copies per site)."""
        chat = self.records.chat_json(i)
        if self.blobs.location_free:
            parts = [{k: v for k, v in p.items() if k != "video"} for p in self.records.videos(i)]
            options = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            return f"{chat}\x00{options}"
        video = self.records.video_json(i)
        return chat if not video else f"{chat}\x00{video}"

    def key_text(self, index: int) -> str:
        """What the key holds of the record beside its files: the caption, or a chat
        sample's conversation (and its video parts' options)."""
        return self._chat_text(index) if self._chat is not None else self.records.text(index)

    def stamp_string(self, index: int, stamp: npt.NDArray[np.int64]) -> str:
        """The identity of sample ``index``'s files (:meth:`stamp_strings`)."""
        return self.stamp_strings(np.asarray([index], dtype=np.int64), stamp[None, :])[0]

    def stamp_strings(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64]
    ) -> list[str]:
        """The identities of ``indices``' files, as :attr:`blobs` gives them: local files
        with a stamp are digested together (:func:`~mmcache.sources.identity.file_identities`:
        one ledger pass, a ``stat``-equal file served from the ledger); a chat sample of
        several files, one without a stamp (``"none"``, ``"missing"``, ``"error:..."``
        say why) and every sample under ``content_stamp=True`` one by one. Objects:
        each one's :func:`~mmcache.sources.blobs.objects.object_identity` (for a chat
        sample, each of its objects' in part order, joined by ``|``)."""
        objects = self._objects
        if objects is not None:
            if self._chat is not None:
                return [objects.group_identity(self._media(i)) for i in indices.tolist()]
            return objects.identities(self.records.stat_paths(indices), stamps)
        out: list[str] = [""] * int(indices.shape[0])
        alone = stamps[:, 0] == -2  # rows identified one by one (see above)
        if self.content_stamp:
            alone[:] = True
        elif self._chat is not None:
            alone |= self._multi_files()[indices]
        for j in np.flatnonzero(alone).tolist():
            out[j] = self._identity(int(indices[j]))
        single = np.flatnonzero(~alone).tolist()  # keyed by one file's identity, in one pass
        if single:
            sel = np.asarray(single, dtype=np.int64)
            paths = self.records.stat_paths(indices[sel])
            for j, ident in zip(single, self.blobs.identities(paths, stamps[sel]), strict=True):
                out[j] = ident
        return out

    def _identity(self, i: int) -> str:
        """The identity of sample ``i``'s local files, found on its own."""
        assert isinstance(self.blobs, LocalFiles)  # objects never come here (see above)
        if self._chat is not None:  # every image and video
            return self.blobs.group_identity(self._media(i))
        return self.blobs.identity(self.records.image_path(i))

    def key_table_parts(self) -> tuple[Any, list[Any]] | None:
        """Local files whose records map the node's column file: the column file (its
        digest covers every id, caption, conversation and path), ``on_error`` and the
        records a chat pipeline left out (:meth:`BaseSource.key_table_parts`). Objects
        (their identities read the store's listing) and records parsed in this process
        have none: their keys stay in the process."""
        named = self.records.column_file()
        if named is None or self._objects is not None or self.content_stamp:
            return None
        path, digest, video_dir = named
        what = [path, digest, video_dir, len(self.records), self.on_error, self._mismatched]
        return what, [path, digest]

    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """:meth:`~mmcache.sources.chassis.BaseSource.key_rows`, over objects after taking
        the stamps another process revalidated."""
        if (objects := self._objects) is not None:
            objects.refresh()
        return super().key_rows(indices, stamps=stamps)

    # -- produce it ---------------------------------------------------------------------
    def produce(self, index: int) -> Sample:
        """Decode/resize/tokenize sample ``index`` into numpy arrays (over objects: from
        their bytes, fetched through the raw tier first). Raises SampleError."""
        self._checked([index])
        if (objects := self._objects) is not None:
            return self._produce_objects(objects, index)
        if self._chat is not None:
            return self._chat_pipeline().process_chat(
                self.records.image_paths(index),
                self.records.chat(index),
                sample_id=self.records.id(index),
                videos=self.records.videos(index),
            )
        return self.pipeline.process(
            self.records.image_path(index),
            self.records.text(index),
            sample_id=self.records.id(index),
        )

    def _produce_objects(self, objects: ObjectFiles, index: int) -> Sample:
        """Sample ``index`` from its objects' bytes: an image through the pipeline's stages
        (bitwise the loose file's sample), a conversation's clips decoded from memory."""
        objects.refresh()
        sid = self.records.id(index)
        limit = self.max_object_bytes
        if self._chat is None:
            url = self.records.image_path(index)
            data = None if url is None else objects.read(url, sample_id=sid, max_bytes=limit)
            return process_bytes(
                self.pipeline,  # type: ignore[arg-type]
                data,
                self.records.text(index),
                sample_id=sid,
                path=url,
                unit="record",
            )
        parts = []
        for part in self.records.videos(index):
            url = part["video"]
            data = objects.read(url, sample_id=sid, max_bytes=limit)
            parts.append({**part, "video": data, "name": url, "max_bytes": limit})
        return self._chat_pipeline().process_chat(
            [], self.records.chat(index), sample_id=sid, videos=parts
        )

    # -- objects: checked again at each epoch, fetched ahead ------------------------------
    def revalidate(self) -> list[str]:
        """Check every object's stamp again (batched); re-key the samples of the changed
        ones here and in every other process. Returns the changed URLs (local files:
        none, they are ``stat``-ed at every batch). Raises :class:`RemoteError` when the
        store cannot be reached."""
        return self.blobs.revalidate()

    def remote_version(self) -> tuple[str, ...]:
        """The objects' stamps: what the prefetcher's memory of held objects depends on."""
        objects = self._objects
        return () if objects is None else objects.version()

    def remote_span(self, index: int) -> tuple[str, str, int, int] | None:
        """``(url, stamp, 0, size)`` of sample ``index``'s object (``None``: none, local
        files, or a sample of several objects: those are fetched when it is produced)."""
        objects = self._objects
        if objects is None:
            return None
        if self._chat is None:
            ref = self.records.image_path(index)
        else:
            media = self._media(index)
            ref = media[0] if len(media) == 1 else None
        return None if ref is None else objects.span(ref, self.max_object_bytes)

    def fetch(
        self, url: str, stamp: str, start: int, end: int, *, sample_id: str, wait: bool = True
    ) -> bytes:
        """Bytes ``[start, end)`` of version ``stamp`` of object ``url`` (raw tier first).
        A ConfigError for a source of local files."""
        objects = self._objects
        if objects is None:
            raise ConfigError(f"{self!r} reads local files: there is nothing to fetch")
        return objects.fetch(url, stamp, start, end, sample_id=sample_id, wait=wait)

    # -- supervised fine-tuning (a pipeline with a ChatSpec) ------------------------------
    def _chat_pipeline(self) -> Pipeline:
        """The pipeline of a chat source: only a :class:`Pipeline` has a chat stage, so
        ``_chat`` is set only for one (see ``__init__``)."""
        return cast(Pipeline, self.pipeline)

    def _chat_lengths(self, root: str | os.PathLike[str] | None = None) -> _chat.ChatLengths:
        if self._chat is None:
            raise ConfigError(
                "lengths(), modalities() and text_report() need a pipeline whose text "
                "stage is a mmcache.ChatSpec"
            )
        if self._objects is not None:
            raise ConfigError(
                "lengths() of records whose clips are objects is not here yet (it would "
                "fetch every clip's header): use padded batches"
            )
        if self._lengths is None:
            self._lengths = _chat.chat_lengths(
                self.records,
                self._chat,
                self._chat_pipeline().image,
                fingerprint=self._fingerprint,
                on_error=self.on_error,
                mismatched=self._mismatched,
                record_reject=self.record_reject,
                stamps=lambda: self.stamps(np.arange(len(self.records))),
                root=root,
                video=self._chat_pipeline().video,
            )
        return self._lengths

    def lengths(self, root: str | os.PathLike[str] | None = None) -> np.ndarray:
        """Each sample's length in tokens (int64 ``[N]``): ``len(input_ids)`` of the
        sample it produces, image tokens included, after truncation; 0 for a sample
        that will be refused (under ``on_error="skip"``; under ``"raise"`` the first
        such sample raises its SampleError here).

        Computed without decoding an image (a render and a tokenization per sample;
        each image's size from its header through the image stage's resize rule),
        once per source: later calls return the same array (do not modify it).
        With a cache ``root`` the pass is saved there and the next run (a new source
        over the same records and pipeline) reuses it, measuring again only samples
        whose image files changed. For ``group_by_length`` and packing."""
        return self._chat_lengths(root).lengths

    def modalities(self, root: str | os.PathLike[str] | None = None) -> np.ndarray:
        """Whether each sample keeps an image (bool ``[N]``), from the same pass as
        :meth:`lengths` (``root`` as there): image and text-only samples are grouped
        apart."""
        return self._chat_lengths(root).has_image

    def text_report(self, root: str | os.PathLike[str] | None = None) -> TextReport:
        """Samples, truncated, fully masked, mismatched placeholders, trainable tokens
        and length percentiles, from the :meth:`lengths` pass; recorded under the cache
        ``root`` when given, for ``mmcache stats``."""
        report = self._chat_lengths(root).report
        if root is not None:
            report.write(root)
        return report


if TYPE_CHECKING:  # mypy checks that FileSource conforms to the protocol

    def _conforms(source: FileSource) -> SampleSource:
        return source
