"""``BaseSource``: the chassis of a source, so that each format writes only what is its own.

Every source answers the same questions the same way: how many samples, what each is
called (:class:`~mmcache.sources.ids.IdColumn`), the digest of the ids, each sample's key
(memoised by its stamp), the reject log, ``source[i]`` (the one raise-or-record,
:func:`~mmcache.sources.items.serve`) and how it travels to a worker process. This class
implements them once, and is a torch ``Dataset`` (``torch.utils.data`` indexes a source
itself: no wrapper between them); a format supplies three things:

- :meth:`BaseSource.stamps`: ``int64 [n, k]`` per-sample stamps (what changes when the
  sample's input changes; a row starting with ``-2``: none, never memoised);
- :meth:`BaseSource.stamp_string`: the identity text of one sample from its stamp row
  (what the key is made of beside the id and the pipeline's fingerprint);
- :meth:`BaseSource.produce`: the sample's arrays.

and may override :meth:`BaseSource.key_text` (a text the key holds, e.g. a caption) and
:meth:`BaseSource.stamp_strings`, the batched form of ``stamp_string``, for a format that
finds many identities in one pass (loose files: one ledger transaction for the batch's
files; the default calls ``stamp_string`` per row).

Keys (:meth:`BaseSource.key_rows`): ``keys.sample_key(id, stamp_string, fingerprint,
key_text)``, hashed again only for samples whose stamp row changed since it was last
remembered; the comparison is one vectorised step over the batch, so a warm batch costs
its ``stamps`` and no hashing. They are remembered in the node's key table
(:mod:`~mmcache.sources.keytable`: one file every process of the node maps and the next
run finds, each row checked) when the source names what its keys depend on
(:meth:`BaseSource.key_table_parts`), else in a memo of this process. A source whose
stamps do not tell when its bytes change (``content_stamp=True``: the stat fields are not
trusted) sets :attr:`BaseSource._memoise_keys` to False and every key is computed again.

Per-process state is declared once, in :attr:`BaseSource._per_process`: those attributes
are dropped when the source is pickled (a spawned worker, a forked one's copy is its own)
and rebuilt on first use. Thread/process safety: read-only after construction but for
the reject log (process-safe, :mod:`~mmcache.sources.rejects`) and the per-process
attributes (one thread per process calls :meth:`key_rows`).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from mmcache import keys
from mmcache.errors import SampleError
from mmcache.sources import identity
from mmcache.sources.base import OnError, StampKind, check_on_error
from mmcache.sources.bytesproc import PipelineFields
from mmcache.sources.ids import IdColumn
from mmcache.sources.items import item_tensors, serve
from mmcache.sources.keytable import KeyTable, open_table, table_identity
from mmcache.sources.nodecolumns import columns_dir
from mmcache.sources.rejects import Reject, RejectLog
from mmcache.transforms.pipeline import Processor

__all__ = ["BaseSource", "lazy_zeros"]

logger = logging.getLogger(__name__)


class BaseSource(PipelineFields, torch.utils.data.Dataset[dict[str, Any] | None]):
    """The members of :class:`~mmcache.sources.base.SampleSource` that do not depend on
    the format (see the module docstring for what a subclass implements), and the torch
    ``Dataset`` face: ``source[i]`` is the sample's tensors, or ``None`` for one skipped
    under ``on_error="skip"`` (:func:`~mmcache.sources.items.serve`).

    A subclass sets :attr:`stamp_kind` and calls ``__init__`` with its pipeline (anything
    with ``fingerprint()``; the subclass checks what more it needs), its ids and
    ``on_error``; what it leaves out when opened goes to :attr:`open_rejects`.
    """

    stamp_kind: StampKind
    on_error: OnError
    #: Attributes of one process: not pickled, rebuilt on first use (a subclass adds its
    #: own, e.g. open file handles: ``_per_process = (*BaseSource._per_process, "_fds")``).
    _per_process: ClassVar[tuple[str, ...]] = (
        "_memo_keys",
        "_memo_stamp",
        "_memo_have",
        "_table",
    )
    #: Whether a key may be remembered under its stamp row (False: a stamp row that is
    #: equal does not mean equal bytes, so every key is computed again).
    _memoise_keys: bool = True

    def __init__(self, *, pipeline: Processor, ids: IdColumn, on_error: OnError) -> None:
        self.on_error = check_on_error(on_error)
        self.pipeline = pipeline
        self._fingerprint = pipeline.fingerprint()
        self._ids = ids
        self._memo_keys: npt.NDArray[np.uint8] | None = None
        self._memo_stamp: npt.NDArray[np.int64] | None = None
        self._memo_have: npt.NDArray[np.bool_] | None = None
        # The node's key table, once looked for (False: none; see key_table).
        self._table: KeyTable | bool | None = None
        self._rejects = RejectLog()
        #: Samples left out when the source was opened (under ``on_error="skip"``).
        self.open_rejects: list[Reject] = []

    # -- what a format implements -----------------------------------------------------
    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``int64 [n, k]`` stamps of ``indices`` (see :class:`StampKind`)."""
        raise NotImplementedError

    def stamp_string(self, index: int, stamp: npt.NDArray[np.int64]) -> str:
        """The identity text of sample ``index`` (in its key) from its :meth:`stamps` row."""
        raise NotImplementedError

    def stamp_strings(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64]
    ) -> list[str]:
        """The identity texts of ``indices`` (checked) from their :meth:`stamps` rows, in
        order: :meth:`stamp_string` per row, unless a format finds them in one pass."""
        return [self.stamp_string(i, stamps[j]) for j, i in enumerate(indices.tolist())]

    def produce(self, index: int) -> dict[str, np.ndarray]:
        """The arrays of sample ``index``. Raises :class:`SampleError`."""
        raise NotImplementedError

    def key_text(self, index: int) -> str | None:
        """A text the key of sample ``index`` holds beside its stamp (default: none)."""
        return None

    # -- which sample -------------------------------------------------------------------
    def __len__(self) -> int:
        return self._ids.n

    def _checked(self, indices: Sequence[int] | np.ndarray) -> npt.NDArray[np.int64]:
        """``indices`` as ``int64 [n]``; IndexError for one outside ``[0, len)``."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self._ids.n
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"sample index out of range for {n} samples")
        return idx

    def sample_id(self, index: int) -> str:
        """The user's id of sample ``index``."""
        return self._ids.ids(self._checked([index]))[0]

    def ids(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """The ids of ``indices``, in order (a batch's ``"id"`` field)."""
        return self._ids.ids(self._checked(indices))

    def ids_digest(self) -> str:
        """A digest of every id in index order (for resume checks)."""
        return self._ids.digest()

    # -- keys ---------------------------------------------------------------------------
    def key(self, index: int) -> bytes:
        """The 16-byte cache key of sample ``index`` (``key_rows([index])[0]``)."""
        key: bytes = self.key_rows([index])[0].tobytes()
        return key

    def keys(self, indices: Sequence[int] | np.ndarray) -> list[bytes]:
        """The keys of ``indices`` as ``bytes`` (:meth:`key_rows`, one row each)."""
        rows = self.key_rows(indices)
        return [rows[j].tobytes() for j in range(rows.shape[0])]

    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """Keys as ``uint8 [n, 16]``: ``sample_key(id, stamp_string, fingerprint, key_text)``,
        hashed again only for samples whose stamp row is not the one their remembered key
        was made under (in the node's key table, :meth:`key_table`, or this process's
        memo); a key is remembered only under a settled stamp (not a row starting with
        ``-2``, no stamp, nor one :meth:`_unsettled` names). The identity texts of a
        batch's changed samples are asked for in one :meth:`stamp_strings` call.
        ``stamps``: :meth:`stamps` of ``indices`` taken just before, if the caller has
        them. Not thread-safe (one thread per process calls it)."""
        idx = self._checked(indices)
        if stamps is None:
            stamps = self.stamps(idx)
        table = self.key_table(stamps.shape[1])
        if table is not None:
            rows, found = table.lookup(idx, stamps)
            stale = np.flatnonzero(~found)
        else:
            rows, stale = self._memo_rows(idx, stamps)
        if stale.size:
            # The stale rows' ids in one call and their rows in one write: a new process
            # with no table keys every sample of its first epoch here, and per-row numpy
            # writes cost about what the key's hash does.
            redo = idx[stale]
            taken = identity.ledger().clock()  # before any byte is read for the keys
            texts = self.stamp_strings(redo, stamps[stale])
            fp, key_text = self._fingerprint, self.key_text
            made = [
                keys.sample_key(sid, text, fp, key_text(i))
                for sid, text, i in zip(self._ids.ids(redo), texts, redo.tolist(), strict=True)
            ]
            rows[stale] = np.frombuffer(b"".join(made), dtype=np.uint8).reshape(-1, 16)
            # A row without a stamp (-2: missing) is never remembered, nor any under
            # content_stamp=True, nor one whose files changed too recently for their stamp
            # to vouch for the key (a rewrite could still keep it: the ledger's racy rule).
            have = (stamps[stale, 0] != -2) & self._memoise_keys
            if self._memoise_keys:
                young = self._unsettled(redo, stamps[stale], taken)
                if young is not None:
                    have &= ~young
            if table is not None:
                keep = np.flatnonzero(have)
                table.store(redo[keep], rows[stale[keep]], stamps[stale[keep]])
            else:
                self._remember(redo, rows[stale], stamps[stale], have)
        return rows

    def _memo_rows(
        self, idx: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
        """The private memo's keys of ``idx`` and which of them are stale (not remembered,
        or under another stamp row than ``stamps``): a source without a key table."""
        if self._memo_keys is None or self._memo_stamp is None or self._memo_have is None:
            # Zero pages mapped on demand (a page is memory of this process only once a
            # row of it is written), the rows remembered marked in _memo_have: a process
            # that keys a few batches holds a few pages, not 49 bytes for every sample.
            n = self._ids.n
            self._memo_keys = lazy_zeros((n, 16), np.uint8)
            self._memo_stamp = lazy_zeros((n, stamps.shape[1]), np.int64)
            self._memo_have = lazy_zeros((n,), np.bool_)
        rows = self._memo_keys[idx]
        if not self._memoise_keys:
            return rows, np.arange(idx.shape[0])
        changed = (stamps != self._memo_stamp[idx]).any(axis=1)
        return rows, np.flatnonzero(changed | ~self._memo_have[idx])

    def _remember(
        self,
        idx: npt.NDArray[np.int64],
        rows: npt.NDArray[np.uint8],
        stamps: npt.NDArray[np.int64],
        have: npt.NDArray[np.bool_],
    ) -> None:
        """Write keys just made to the private memo (``have``: which may be used again)."""
        assert self._memo_keys is not None and self._memo_stamp is not None
        assert self._memo_have is not None  # made by _memo_rows
        self._memo_keys[idx] = rows
        self._memo_stamp[idx] = stamps
        self._memo_have[idx] = have

    def key_table(self, k: int) -> KeyTable | None:
        """This process's mapping of the node's key table (:mod:`~mmcache.sources.keytable`)
        for stamp rows of ``k`` words, or None: the source names no identity for one
        (:meth:`key_table_parts`), key tables are off, or none can be made here."""
        if not self._memoise_keys:
            return None  # every key is computed again (see the module docstring)
        if self._table is None:
            self._table = False
            parts = self.key_table_parts()
            folder = columns_dir()
            if parts is not None and folder is not None:
                what, watch = parts
                name = type(self)
                ident = table_identity(
                    [f"{name.__module__}.{name.__qualname__}", self._fingerprint, k, what]
                )
                self._table = open_table(folder, ident, self._ids.n, k, watch=watch) or False
        table = self._table
        return table if isinstance(table, KeyTable) and table.k == k else None

    def key_table_parts(self) -> tuple[Any, list[Any]] | None:
        """What this source's keys depend on besides each stamp row and the pipeline's
        fingerprint, named cheaply (JSON-able: e.g. the digest of the manifest's column
        file, which covers its ids, captions and paths), and ``[path, digest]`` of the
        column file a table made of it is swept with; None (the default): no key table,
        keys are remembered in this process only. Whatever the keys read beyond the
        stamps must be in it, or a table would serve keys of other samples."""
        return None

    def _unsettled(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64], taken: float
    ) -> npt.NDArray[np.bool_] | None:
        """Which of ``indices`` (their ``stamps``, keyed from bytes read after ``taken``)
        may not be remembered under their stamp yet: a file changed less than
        :data:`~mmcache.sources.identity.RACY_SECONDS` before the read can be rewritten
        at the same size without a field of its stamp changing (the identity ledger's
        racy rule), so its key is computed again until the stamp is old enough. None
        (the default): every row may be (stamps that are not a local file's ``stat``)."""
        return None

    # -- serving ------------------------------------------------------------------------
    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """What ``source[index]`` returns for a produced or cached sample (tensors + id)."""
        return item_tensors(self._ids.id(index), sample, self.channels_last_fields)

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        """Sample ``index``'s tensors and id; ``None`` for a sample that cannot be
        produced under ``on_error="skip"`` (recorded: :meth:`rejects`)."""
        return serve(self, index)

    # -- rejects ------------------------------------------------------------------------
    def record_reject(self, err: Exception) -> None:
        """Append a reject to the process-shared log (one atomic O_APPEND write)."""
        if not isinstance(err, SampleError):  # the loader only skips SampleErrors
            err = SampleError(f"{type(err).__name__}: {err}", sample_id="<unknown>")
        self._rejects.record(err)
        logger.warning("skipped %s", err)

    def rejects(self) -> list[Reject]:
        """What was left out at open (:attr:`open_rejects`, every one: a repeated id's
        later rows are several entries of one id), then the samples skipped since in any
        process (deduplicated by id, first reason kept: workers and epochs record one
        sample again). A kept row that fails later is listed beside its id's left-out
        repeats, not hidden by them."""
        since: dict[str, Reject] = {}
        for rej in self._rejects.read():
            since.setdefault(rej.sample_id, rej)
        return [*self.open_rejects, *since.values()]

    # -- to a worker ----------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self._per_process:
            state[name] = None  # rebuilt on first use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def lazy_zeros(shape: tuple[int, ...], dtype: type[np.generic]) -> npt.NDArray[Any]:
    """A zeroed, writable array of private anonymous memory whose pages are made on first
    write. (``np.zeros`` is ``calloc``, which clears memory it reuses from the heap page by
    page: resident at once, after a process freed large buffers as a parse does.)
    Private: a forked child gets a copy-on-write view, never the parent's later writes."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if not size:
        return np.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dtype=dtype).reshape(shape)
