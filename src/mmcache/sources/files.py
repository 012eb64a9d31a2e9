"""``FileSource``: manifest records with one local image file each, through a pipeline;
the :class:`~mmcache.sources.base.SampleSource` for image-text files on a file system.

It keeps "which sample" apart from "produce it", so that a cache can sit between
the two without reworking either:

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

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from mmcache import keys
from mmcache.errors import ConfigError, SampleError
from mmcache.sources import chat as _chat
from mmcache.sources import identity
from mmcache.sources.base import OnError, SampleSource, StampKind, check_on_error
from mmcache.sources.bytesproc import PipelineFields
from mmcache.sources.items import item_tensors
from mmcache.sources.readers import read_manifest
from mmcache.sources.records import Records
from mmcache.sources.rejects import Reject, RejectLog

__all__ = ["FileSource", "RecordProcessor", "Sample", "check_on_error"]

logger = logging.getLogger(__name__)

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


class FileSource(PipelineFields):
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
    """

    #: ``FILE`` (keys from ``stat``), or ``CONTENT`` with ``content_stamp=True``.
    stamp_kind: StampKind
    pipeline: RecordProcessor
    on_error: OnError

    def __init__(
        self,
        manifest: str | os.PathLike[str] | Records,
        *,
        pipeline: RecordProcessor,
        on_error: OnError = "raise",
        content_stamp: bool = False,
    ) -> None:
        self.on_error = check_on_error(on_error)
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
        if self._chat is not None:
            self.records, self._mismatched = _chat.check_placeholders(
                self.records, self._chat.image_token, self.on_error
            )
        self.pipeline = pipeline
        self.content_stamp = content_stamp
        self.stamp_kind = StampKind.CONTENT if content_stamp else StampKind.FILE
        self._fingerprint = pipeline.fingerprint()
        # Memo of keys by file stamp (see key_rows); allocated on first use.
        self._memo_keys: np.ndarray | None = None
        self._memo_stamp: np.ndarray | None = None
        self._rejects = RejectLog()

    # -- which sample -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def sample_id(self, index: int) -> str:
        """The manifest id of sample ``index``."""
        return self.records.id(index)

    def ids(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """The ids of ``indices``, in order (a batch's ``"id"`` field). IndexError if
        one is out of range."""
        return self.records.ids(self._checked(indices))

    def ids_digest(self) -> str:
        """:meth:`Records.ids_digest`: every id in index order, for resume checks."""
        return self.records.ids_digest()

    def key(self, index: int) -> bytes:
        """The 16-byte cache key of sample ``index``: changes when its image file,
        caption or the pipeline changes (see :func:`mmcache.keys.sample_key`)."""
        if self._chat is not None:  # every image and video, and the conversation as structured
            stamp = _chat.multi_stamp(self._media(index), content=self.content_stamp)
            return keys.sample_key(
                self.records.id(index), stamp, self._fingerprint, self._chat_text(index)
            )
        path = self.records.image_path(index)
        stamp = identity.file_identity(path, content=self.content_stamp)
        return keys.sample_key(
            self.records.id(index), stamp, self._fingerprint, self.records.text(index)
        )

    def keys(self, indices: Sequence[int] | np.ndarray) -> list[bytes]:
        """Cache keys of many samples: ``[self.key(i) for i in indices]``, faster.

        See :meth:`key_rows`. Not thread-safe.
        """
        rows = self.key_rows(indices)
        return [rows[j].tobytes() for j in range(rows.shape[0])]

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """:func:`mmcache.keys.stat_fields` of each sample's image file (size, mtime_ns,
        ctime_ns, inode) as ``int64 [n, 4]``: one ``stat`` each; ``-2`` where there is
        none (text-only, missing, unreadable, bad path).

        What the default keys are made of (see :meth:`key_rows`); the loader also
        uses it to check that a plan made a little earlier is still current. (With
        ``content_stamp=True`` they are the same stat fields, but keys do not use them.)
        """
        idx = self._checked(indices)
        stamps = np.full((idx.shape[0], len(keys.STAT_FIELDS)), -2, dtype=np.int64)
        stat, fields = os.stat, keys.stat_fields
        for j, path in enumerate(self.records.stat_paths(idx)):
            if path is None:
                continue
            try:
                stamps[j] = fields(stat(path))
            except (OSError, ValueError):  # missing, unreadable, or a NUL in the path
                continue
        if self._chat is not None:  # a multi-file sample: all its files in one row
            for j, i in enumerate(idx.tolist()):
                if self._multi_file(i):
                    stamps[j] = _chat.multi_stamp_fields(self._media(i))
        return stamps

    def _multi_file(self, i: int) -> bool:
        """Whether chat sample ``i`` is made of other files than its one image."""
        return self.records.image_count(i) > 1 or bool(self.records.video_json(i))

    def _media(self, i: int) -> list[str]:
        """Every file chat sample ``i`` is made of: its images, then its videos."""
        videos = [part["video"] for part in self.records.videos(i)]
        return [*self.records.image_paths(i), *videos]

    def _chat_text(self, i: int) -> str:
        """What a chat sample's key holds of its record: the conversation and the video
        parts' options."""
        video = self.records.video_json(i)
        chat = self.records.chat_json(i)
        return chat if not video else f"{chat}\x00{video}"

    def _checked(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self.records)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"sample index out of range for {n} records")
        return idx

    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """Cache keys of many samples as a ``uint8 [n, 16]`` array (row j: ``key(indices[j])``).

        What the loader asks for every batch it plans (in a worker, or in the
        training process). It remembers each sample's key with the image file's
        stamp (:meth:`stamps`) it was computed from:
        the file is still ``stat``-ed every time (a changed file gets a new key
        at once), only the hashing is skipped when nothing changed, and the
        comparison with the remembered stamps is one vectorised step. With
        ``content_stamp=True`` every key is recomputed from the file's bytes.
        ``stamps``: :meth:`stamps` of ``indices`` taken just before, if the
        caller has them. Not thread-safe (one thread per process calls it: a
        loader worker, or the loader's plan fetch in the training process).
        """
        idx = self._checked(indices)
        n = len(self.records)
        if self.content_stamp:
            out = np.empty((idx.shape[0], 16), dtype=np.uint8)
            for j, i in enumerate(idx.tolist()):
                out[j] = np.frombuffer(self.key(i), dtype=np.uint8)
            return out
        if self._memo_keys is None or self._memo_stamp is None:
            self._memo_keys = np.zeros((n, 16), dtype=np.uint8)
            self._memo_stamp = np.full((n, len(keys.STAT_FIELDS)), -1, dtype=np.int64)
        memo_keys, memo_stamp = self._memo_keys, self._memo_stamp
        if stamps is None:
            stamps = self.stamps(idx)
        stale = np.flatnonzero((stamps != memo_stamp[idx]).any(axis=1) | (stamps[:, 0] == -2))
        single: list[int] = []  # rows keyed by one file's identity, digested in one pass
        for j in stale.tolist():
            i = int(idx[j])
            if stamps[j, 0] == -2:
                # Not memoised: the stamp ("none", "missing", "error:...") says why.
                memo_keys[i] = np.frombuffer(self.key(i), dtype=np.uint8)
                memo_stamp[i] = -1
            elif self._chat is not None and self._multi_file(i):
                memo_keys[i] = np.frombuffer(self.key(i), dtype=np.uint8)  # several files
                memo_stamp[i] = stamps[j]
            else:
                single.append(j)
        if single:
            sel = np.asarray(single, dtype=np.int64)
            paths = self.records.stat_paths(idx[sel])
            idents = identity.file_identities(paths, stamps[sel])
            for j, ident in zip(single, idents, strict=True):
                i = int(idx[j])
                text = self.records.chat_json(i) if self._chat else self.records.text(i)
                key = keys.sample_key(self.records.id(i), ident, self._fingerprint, text)
                memo_keys[i] = np.frombuffer(key, dtype=np.uint8)
                memo_stamp[i] = stamps[j]
        rows: np.ndarray = memo_keys[idx]
        return rows

    # -- produce it ---------------------------------------------------------------------
    def produce(self, index: int) -> Sample:
        """Decode/resize/tokenize sample ``index`` into numpy arrays. Raises SampleError."""
        if not 0 <= index < len(self.records):
            raise IndexError(f"sample index {index} out of range for {len(self.records)} records")
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

    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """What ``ds[index]`` returns for a produced (or cached) sample: tensors plus the id.

        Read-only arrays (cache views) are copied; fresh ones are wrapped without a copy.
        """
        return item_tensors(self.records.id(index), sample, self.channels_last_fields)

    # -- rejects ------------------------------------------------------------------------
    def record_reject(self, err: Exception) -> None:
        """Append a reject to the process-shared log (one atomic O_APPEND write)."""
        if not isinstance(err, SampleError):  # the loader only skips SampleErrors
            err = SampleError(f"{type(err).__name__}: {err}", sample_id="<unknown>")
        self._rejects.record(err)
        logger.warning("skipped %s", err)

    def rejects(self) -> list[Reject]:
        """Samples skipped so far in any process (deduplicated by id, first reason kept),
        after the manifest records rejected at read time (``records.rejects``)."""
        out: dict[str, Reject] = {}
        for rej in self.records.rejects:
            sid = rej.sample_id if rej.sample_id is not None else f"<line {rej.line}>"
            out.setdefault(sid, Reject(sid, self.records.source, rej.reason))
        for logged in self._rejects.read():
            out.setdefault(logged.sample_id, logged)
        return list(out.values())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_memo_keys"] = state["_memo_stamp"] = None  # workers do not plan
        state["_lengths"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


if TYPE_CHECKING:  # mypy checks that FileSource conforms to the protocol

    def _conforms(source: FileSource) -> SampleSource:
        return source
