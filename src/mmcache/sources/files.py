"""``FileSource``: manifest records with one local image file each, through a pipeline;
the :class:`~mmcache.sources.base.SampleSource` for image-text files on a file system.

It is a :class:`~mmcache.sources.chassis.BaseSource` (length, ids, keys memoised by
stamp, rejects, ``source[i]``, pickling are the chassis'); what is its own are the stamps
(one ``stat`` per file), the identities (a batch's files in one ledger pass:
:meth:`FileSource.stamp_strings`) and producing. It keeps "which sample" apart from
"produce it", so that a cache can sit between the two without reworking either:

- :meth:`FileSource.sample_id` and :meth:`FileSource.key` say which sample index
  ``i`` is and under which content key its output is cached (id, source stamp of
  the image file, caption and pipeline fingerprint; see :mod:`mmcache.keys`);
- :meth:`FileSource.produce` decodes, resizes and tokenizes it into numpy arrays
  (the cacheable :data:`Sample`), raising :class:`SampleError`;
- :meth:`FileSource.to_item` turns a Sample into what ``ds[i]`` returns.

The stamps are each image file's ``stat`` fields (:func:`mmcache.keys.stat_fields`),
so the source's :attr:`~FileSource.stamp_kind` is ``FILE``: a loader re-checks a
cached batch with a ``stat`` per file. With ``content_stamp=True`` keys are made
from the files' bytes instead and the kind is ``CONTENT``.

Thread/process safety: a source is read-only after construction except for the
reject log (process-safe, :mod:`mmcache.sources.rejects`) and the key memo (one
thread per process). It pickles cheaply (spawn workers): the records are numpy
buffers and the pipeline pickles its tokenizer as JSON.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from mmcache.errors import ConfigError
from mmcache.sources import chat as _chat
from mmcache.sources import identity
from mmcache.sources.base import OnError, SampleSource, StampKind, check_on_error
from mmcache.sources.chassis import BaseSource
from mmcache.sources.freshness import FileChecks, Freshness, check_freshness, stat_rows
from mmcache.sources.readers import read_manifest
from mmcache.sources.records import Records
from mmcache.sources.rejects import Reject

__all__ = ["FileSource", "RecordProcessor", "Sample", "check_on_error"]

#: The cacheable output of a pipeline: field name -> numpy array.
Sample = dict[str, np.ndarray]


@runtime_checkable
class RecordProcessor(Protocol):
    """What a :class:`FileSource` needs of its pipeline (:class:`mmcache.Pipeline` is one)."""

    def fingerprint(self) -> str:
        """A stable digest of the processing: part of every key."""
        ...

    def process(
        self, image_path: str | None, text: str | None, *, sample_id: str
    ) -> dict[str, np.ndarray]:
        """One record -> its arrays. Raises :class:`SampleError`."""
        ...


class FileSource(BaseSource):
    """Image-text samples from a manifest, one image file each, produced by a pipeline.

    Args:
        manifest: a seed JSONL or LLaVA JSON manifest path (any format
            :func:`~mmcache.sources.readers.read_manifest` reads), or :class:`Records`.
        pipeline: how to turn a record into arrays (a :class:`mmcache.Pipeline`, or
            anything with its ``process`` and ``fingerprint``: :class:`RecordProcessor`).
        on_error: ``"raise"`` (default) raises :class:`SampleError` naming the id,
            the path and the reason; ``"skip"`` lets the caller leave the sample out
            and record it (:meth:`record_reject`, :meth:`rejects`).
        content_stamp: key samples by a hash of the image bytes instead of the
            file's ``stat`` stamp (size, mtime, ctime, inode: see
            :data:`mmcache.keys.STAT_FIELDS`); slower: reads every file to compute
            a key; for file systems whose ctimes or inode numbers are not
            trustworthy. Sets :attr:`stamp_kind` to ``CONTENT``.
        freshness: how often the files' stamps are taken again: ``"epoch"`` (default:
            every check, each epoch) or ``"run"`` (once per run and process, for files
            that do not change while the job runs: a file rewritten meanwhile is not
            seen). See :mod:`mmcache.sources.freshness`.
        recheck: with ``freshness="epoch"``, seconds a file found unchanged is trusted
            without a new ``stat`` (default 0: every check stats it). A file rewritten
            within the window is seen when it ends. For network file systems, where a
            ``stat`` costs ~0.5 ms.
    """

    #: ``FILE`` (keys from ``stat``), or ``CONTENT`` with ``content_stamp=True``.
    stamp_kind: StampKind
    pipeline: RecordProcessor
    on_error: OnError
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
        self._chat = getattr(pipeline, "chat", None)
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
        self.stamp_kind = StampKind.CONTENT if content_stamp else StampKind.FILE
        # content_stamp=True: the stat fields are not trusted, so a key is never
        # remembered under them (every key reads its files again).
        self._memoise_keys = not content_stamp
        self.open_rejects = [
            Reject(
                rej.sample_id if rej.sample_id is not None else f"<line {rej.line}>",
                self.records.source,
                rej.reason,
            )
            for rej in self.records.rejects
        ]

    # -- which sample -------------------------------------------------------------------
    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """:func:`mmcache.keys.stat_fields` of each sample's image file (size, mtime_ns,
        ctime_ns, inode) as ``int64 [n, 4]``: one ``stat`` each (on threads when the file
        system is slow to answer); ``-2`` where there is none (text-only, missing,
        unreadable, bad path). With ``recheck`` or ``freshness="run"``, a file checked
        recently enough in this process is not ``stat``-ed: its stamp from then is
        returned (:class:`~mmcache.sources.freshness.FileChecks`).

        What the default keys are made of (see :meth:`key_rows`); the loader also
        uses it to check that a plan made a little earlier is still current. (With
        ``content_stamp=True`` they are the same stat fields, but keys do not use them.)
        """
        idx = self._checked(indices)
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
        """:meth:`stamps` of ``idx``, each file ``stat``-ed now."""
        stamps = stat_rows(self.records.stat_paths(idx))
        if self._chat is not None:  # a multi-file sample: all its files in one row
            multi = np.flatnonzero(self._multi_files()[idx]).tolist()
            media = [self._media(int(idx[j])) for j in multi]
            # Every file of the batch's multi-file samples in one call (on threads when
            # the file system is slow), then folded into one row per sample.
            fields = stat_rows([os.fsencode(p) for files in media for p in files])
            at = 0
            for j, files in zip(multi, media, strict=True):
                stamps[j] = _chat.multi_stamp_fields(fields[at : at + len(files)])
                at += len(files)
        return stamps

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
        parts' options."""
        video = self.records.video_json(i)
        chat = self.records.chat_json(i)
        return chat if not video else f"{chat}\x00{video}"

    def key_text(self, index: int) -> str:
        """What the key holds of the record beside its files: the caption, or a chat
        sample's conversation (and its video parts' options)."""
        return self._chat_text(index) if self._chat is not None else self.records.text(index)

    def stamp_string(self, index: int, stamp: npt.NDArray[np.int64]) -> str:
        """The identity of sample ``index``'s files (:mod:`mmcache.sources.identity`)."""
        return self.stamp_strings(np.asarray([index], dtype=np.int64), stamp[None, :])[0]

    def stamp_strings(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64]
    ) -> list[str]:
        """The identities of ``indices``' files: the samples of one file each with a
        stamp are digested together (:func:`~mmcache.sources.identity.file_identities`:
        one ledger pass, a ``stat``-equal file served from the ledger); a chat sample of
        several files, one without a stamp (``"none"``, ``"missing"``, ``"error:..."``
        say why) and every sample under ``content_stamp=True`` one by one."""
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
            for j, ident in zip(single, identity.file_identities(paths, stamps[sel]), strict=True):
                out[j] = ident
        return out

    def _identity(self, i: int) -> str:
        """The identity of sample ``i``'s files, found on its own."""
        if self._chat is not None:  # every image and video
            return _chat.multi_stamp(self._media(i), content=self.content_stamp)
        return identity.file_identity(self.records.image_path(i), content=self.content_stamp)

    # -- produce it ---------------------------------------------------------------------
    def produce(self, index: int) -> Sample:
        """Decode/resize/tokenize sample ``index`` into numpy arrays. Raises SampleError."""
        self._checked([index])
        if self._chat is not None:
            return self.pipeline.process_chat(  # type: ignore[attr-defined, no-any-return]
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

    # -- supervised fine-tuning (a pipeline with a ChatSpec) ------------------------------
    def _chat_lengths(self, root: str | os.PathLike[str] | None = None) -> _chat.ChatLengths:
        if self._chat is None:
            raise ConfigError(
                "lengths(), modalities() and text_report() need a pipeline whose text "
                "stage is a mmcache.ChatSpec"
            )
        if self._lengths is None:
            self._lengths = _chat.chat_lengths(
                self.records,
                self._chat,
                getattr(self.pipeline, "image", None),
                fingerprint=self._fingerprint,
                on_error=self.on_error,
                mismatched=self._mismatched,
                record_reject=self.record_reject,
                stamps=lambda: self.stamps(np.arange(len(self.records))),
                root=root,
                video=getattr(self.pipeline, "video", None),
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

    def text_report(self, root: str | os.PathLike[str] | None = None) -> _chat.TextReport:
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
