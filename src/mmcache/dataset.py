"""``MultimodalDataset``: a torch Dataset gluing manifest Records to a Pipeline.

It keeps "which sample" apart from "produce it", so that a cache can sit
between the two without reworking either:

- :meth:`MultimodalDataset.sample_id` and :meth:`MultimodalDataset.key` say
  which sample index ``i`` is and under which content key its output is cached
  (id, source stamp of the image file, caption and pipeline fingerprint; see
  :mod:`mmcache.keys`);
- :meth:`MultimodalDataset.produce` decodes, resizes and tokenizes it into numpy
  arrays (the cacheable :data:`Sample`), raising :class:`SampleError`;
- :meth:`MultimodalDataset.to_item` turns a Sample into what ``ds[i]`` returns.

Bad samples under ``on_error="skip"``: ``ds[i]`` returns ``None`` for a sample
that cannot be produced, records it (id, path, reason) and goes on. The
:func:`collate` function of this module drops ``None`` entries, and
``mmcache.DataLoader`` does so itself; with a plain ``torch.utils.data.DataLoader``
pass ``collate_fn=mmcache.collate``. We chose dropping over substituting another
sample because substitution makes some samples appear twice per epoch, which
changes training results; a filtered index would need a full decode pass
before the first epoch. Rejects found in DataLoader worker processes are
appended to a small JSON-lines log (one ``write`` with ``O_APPEND`` per reject,
atomic between processes) so :meth:`MultimodalDataset.rejects` lists them in
the parent whatever the start method.

Thread/process safety: a dataset is read-only after construction except for
the reject log, which is process-safe. It pickles cheaply (spawn workers): the
records are numpy buffers and the pipeline pickles its tokenizer as JSON.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from mmcache import keys
from mmcache.errors import ConfigError, SampleError
from mmcache.manifest import Records, read_manifest
from mmcache.pipeline import Pipeline
from mmcache.sources.base import StampKind

__all__ = ["MultimodalDataset", "Reject", "Sample", "collate"]

logger = logging.getLogger(__name__)

#: The cacheable output of a pipeline: field name -> numpy array.
Sample = dict[str, np.ndarray]

OnError = Literal["raise", "skip"]


@dataclass(frozen=True)
class Reject:
    """A sample skipped under ``on_error="skip"``: its id, image path and the reason."""

    sample_id: str
    path: str | None
    reason: str


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


_REJECT_LOG_PREFIX = "mmcache-rejects-"


def _remove_stale_reject_logs(directory: str) -> None:
    """Remove this user's reject logs whose creating process is gone (killed, so its
    finalizer never ran). The creator's pid is in the name (``mmcache-rejects-<pid>-*``);
    a reused pid only keeps a stale log for a while, it never removes a live one."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if not (name.startswith(_REJECT_LOG_PREFIX) and name.endswith(".jsonl")):
                continue
            pid = name[len(_REJECT_LOG_PREFIX) :].split("-", 1)[0]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                    os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class MultimodalDataset(torch.utils.data.Dataset[dict[str, Any] | None]):
    """Image-text samples from a manifest, decoded by a :class:`~mmcache.pipeline.Pipeline`.

    >>> ds = MultimodalDataset("train.jsonl", pipeline=pipe)      # doctest: +SKIP
    >>> ds[0]["image"].shape                                        # doctest: +SKIP
    torch.Size([3, 224, 224])

    Args:
        manifest: a seed JSONL or LLaVA JSON manifest path, or :class:`Records`.
        pipeline: how to turn a record into arrays.
        on_error: ``"raise"`` (default) raises :class:`SampleError` naming the id,
            the path and the reason; ``"skip"`` returns ``None`` for the sample,
            counts and lists it (see the module docstring).
        content_stamp: key samples by a hash of the image bytes instead of the
            file's ``stat`` stamp (size, mtime, ctime, inode: see
            :data:`mmcache.keys.STAT_FIELDS`); slower: reads every file to compute
            a key; for file systems whose ctimes or inode numbers are not
            trustworthy.
    """

    def __init__(
        self,
        manifest: str | os.PathLike[str] | Records,
        *,
        pipeline: Pipeline,
        on_error: OnError = "raise",
        content_stamp: bool = False,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if not isinstance(pipeline, Pipeline):
            raise ConfigError(f"pipeline must be a mmcache.Pipeline, got {type(pipeline).__name__}")
        if isinstance(manifest, Records):
            self.records = manifest
        else:
            self.records = read_manifest(manifest, on_error=on_error)
        self.pipeline = pipeline
        self.on_error: OnError = on_error
        self.content_stamp = content_stamp
        #: What :meth:`stamps` are (SampleSource): file stats, or content digests.
        self.stamp_kind = StampKind.CONTENT if content_stamp else StampKind.FILE
        self._fingerprint = pipeline.fingerprint()
        # Memo of keys by file stamp (see keys()); allocated on first use.
        self._memo_keys: np.ndarray | None = None
        self._memo_stamp: np.ndarray | None = None
        _remove_stale_reject_logs(tempfile.gettempdir())
        fd, self._reject_log = tempfile.mkstemp(
            prefix=f"{_REJECT_LOG_PREFIX}{os.getpid()}-", suffix=".jsonl"
        )
        os.close(fd)
        # Only the creating process removes the log; pickled copies in workers just append.
        self._finalizer: weakref.finalize[Any, Any] | None = weakref.finalize(
            self, _remove, self._reject_log
        )

    # -- which sample -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def sample_id(self, index: int) -> str:
        return self.records.id(index)

    def fingerprint(self) -> str:
        """The pipeline's fingerprint (part of every key)."""
        return self._fingerprint

    # -- SampleSource members the loader uses (thin: the sources helper's version wins) --
    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """:meth:`stat_stamps` (the protocol's name)."""
        return self.stat_stamps(indices)

    def ids(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """The ids of ``indices``, in order."""
        return self.records.ids(np.asarray(indices, dtype=np.int64))

    def ids_digest(self) -> str:
        """A digest of every id in index order (:meth:`Records.ids_digest`)."""
        return self.records.ids_digest()

    def describe(self) -> str:
        """One line naming the processing: the pipeline's repr."""
        return repr(self.pipeline)

    def key(self, index: int) -> bytes:
        """The 16-byte cache key of sample ``index``: changes when its image file,
        caption or the pipeline changes (see :func:`mmcache.keys.sample_key`)."""
        path = self.records.image_path(index)
        stamp = keys.source_stamp(path, content=self.content_stamp)
        return keys.sample_key(
            self.records.id(index), stamp, self._fingerprint, self.records.text(index)
        )

    def keys(self, indices: Sequence[int] | np.ndarray) -> list[bytes]:
        """Cache keys of many samples: ``[self.key(i) for i in indices]``, faster.

        See :meth:`key_rows`. Not thread-safe.
        """
        rows = self.key_rows(indices)
        return [rows[j].tobytes() for j in range(rows.shape[0])]

    def stat_stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """:func:`mmcache.keys.stat_fields` of each sample's image file (size, mtime_ns,
        ctime_ns, inode) as ``int64 [n, 4]``: one ``stat`` each; ``-2`` where there is
        none (text-only, missing, unreadable, bad path).

        What the default keys are made of (see :meth:`key_rows`); the loader also
        uses it to check that a plan made a little earlier is still current.
        """
        idx = self._checked(indices)
        stamps = np.full((idx.shape[0], len(keys.STAT_FIELDS)), -2, dtype=np.int64)
        image_path, stat, fields = self.records.image_path, os.stat, keys.stat_fields
        for j, i in enumerate(idx.tolist()):
            path = image_path(i)
            if path is None:
                continue
            try:
                stamps[j] = fields(stat(path))
            except (OSError, ValueError):  # missing, unreadable, or a NUL in the path
                continue
        return stamps

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
        stamp (:meth:`stat_stamps`) it was computed from:
        the file is still ``stat``-ed every time (a changed file gets a new key
        at once), only the hashing is skipped when nothing changed, and the
        comparison with the remembered stamps is one vectorised step. With
        ``content_stamp=True`` every key is recomputed from the file's bytes.
        ``stamps``: :meth:`stat_stamps` of ``indices`` taken just before, if the
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
            stamps = self.stat_stamps(idx)
        stale = np.flatnonzero((stamps != memo_stamp[idx]).any(axis=1) | (stamps[:, 0] == -2))
        for j in stale.tolist():
            i = int(idx[j])
            if stamps[j, 0] == -2:
                # Not memoised: the stamp ("none", "missing", "error:...") says why.
                memo_keys[i] = np.frombuffer(self.key(i), dtype=np.uint8)
                memo_stamp[i] = -1
                continue
            stamp = keys.fields_stamp(stamps[j].tolist())
            key = keys.sample_key(
                self.records.id(i), stamp, self._fingerprint, self.records.text(i)
            )
            memo_keys[i] = np.frombuffer(key, dtype=np.uint8)
            memo_stamp[i] = stamps[j]
        rows: np.ndarray = memo_keys[idx]
        return rows

    # -- produce it ---------------------------------------------------------------------
    def produce(self, index: int) -> Sample:
        """Decode/resize/tokenize sample ``index`` into numpy arrays. Raises SampleError."""
        if not 0 <= index < len(self.records):
            raise IndexError(f"sample index {index} out of range for {len(self.records)} records")
        return self.pipeline.process(
            self.records.image_path(index),
            self.records.text(index),
            sample_id=self.records.id(index),
        )

    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """What ``ds[index]`` returns for a produced (or cached) sample: tensors plus the id.

        Read-only arrays (cache views) are copied; fresh ones are wrapped without a copy.
        """
        item: dict[str, Any] = {"id": self.records.id(index)}
        for name, array in sample.items():
            arr = array if array.flags.writeable else array.copy()
            item[name] = torch.from_numpy(arr)
        return item

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        try:
            sample = self.produce(index)
        except SampleError as err:
            if self.on_error == "raise":
                raise
            self.record_reject(err)
            return None
        return self.to_item(index, sample)

    # -- rejects ------------------------------------------------------------------------
    def record_reject(self, err: Exception) -> None:
        """Append a reject to the process-shared log (one atomic O_APPEND write)."""
        if not isinstance(err, SampleError):  # the loader only skips SampleErrors
            err = SampleError(f"{type(err).__name__}: {err}", sample_id="<unknown>")
        line = json.dumps({"id": err.sample_id, "path": err.path, "reason": err.reason}) + "\n"
        try:
            fd = os.open(self._reject_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode("utf-8"))
            finally:
                os.close(fd)
        except OSError as exc:  # the log is a convenience; never fail training over it
            logger.warning("cannot record reject of %r: %s", err.sample_id, exc)
        logger.warning("skipped %s", err)

    def rejects(self) -> list[Reject]:
        """Samples skipped so far in any process (deduplicated by id, first reason kept),
        after the manifest records rejected at read time (``records.rejects``)."""
        out: dict[str, Reject] = {}
        for rej in self.records.rejects:
            sid = rej.sample_id if rej.sample_id is not None else f"<line {rej.line}>"
            out.setdefault(sid, Reject(sid, self.records.source, rej.reason))
        try:
            text = Path(self._reject_log).read_text(encoding="utf-8")
        except OSError:
            text = ""
        for line in text.splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:  # a torn line from a killed process
                continue
            out.setdefault(obj["id"], Reject(obj["id"], obj["path"], obj["reason"]))
        return list(out.values())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_finalizer"] = None
        state["_memo_keys"] = state["_memo_stamp"] = None  # workers do not plan
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._finalizer = None  # copies in workers never delete the log


def collate(batch: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """torch's default collate, after dropping ``None`` (skipped) samples.

    Use as ``torch.utils.data.DataLoader(ds, collate_fn=mmcache.collate)`` with
    ``on_error="skip"``. A batch whose samples were all skipped collates to ``{}``.
    """
    kept = [item for item in batch if item is not None]
    if not kept:
        return {}
    out: dict[str, Any] = torch.utils.data.default_collate(kept)
    return out
