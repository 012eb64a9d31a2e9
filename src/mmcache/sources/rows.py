"""What the sources of rows holding image bytes share (:class:`RowSource`): ids, keys, produce.

A Parquet file (:mod:`~mmcache.sources.parquet`) and an HF dataset
(:mod:`~mmcache.sources.hfdataset`) hold each sample as a row: the image's
encoded bytes (or a path beside them, the HF ``Image`` layout), a text and
perhaps an id. Such a source names its rows (:class:`IdColumn`: a UTF-8 buffer
and offsets, or the row position), says how a row is stamped, and reads one
row's bytes; :class:`RowSource` does the rest of the
:class:`~mmcache.sources.base.SampleSource` protocol the same way for both:
keys of ``(id, stamp string, pipeline fingerprint)`` memoised per stamp
(as :class:`~mmcache.sources.files.FileSource` does), and producing through
:func:`~mmcache.sources.bytesproc.process_bytes`, which runs a pipeline's stages on
bytes in hand exactly as :meth:`mmcache.Pipeline.process` does on a file (same
output, bit for bit; re-exported here with :class:`StagedProcessor`).

Thread/process safety: read-only after construction but for the reject log
(process-safe), the key memo (one thread per process) and a subclass's readers
(its own lock); pickles as its columns and the pipeline.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache import keys
from mmcache.errors import ConfigError, SampleError
from mmcache.sources import identity
from mmcache.sources.base import OnError, StampKind
from mmcache.sources.bytesproc import PipelineFields, StagedProcessor, process_bytes
from mmcache.sources.cells import image_cell
from mmcache.sources.items import item_tensors
from mmcache.sources.rejects import Reject, RejectLog

__all__ = [
    "IdColumn",
    "RowSource",
    "StagedProcessor",
    "check_columns",
    "image_cell",
    "path_column",
    "process_bytes",
]

logger = logging.getLogger(__name__)

#: The column roles a tabular source takes names for (``columns={"image": "jpg", ...}``).
COLUMN_ROLES = ("id", "image", "text")


def check_columns(
    columns: Mapping[str, str | None] | None, defaults: Mapping[str, str | None]
) -> dict[str, str | None]:
    """``defaults`` updated with ``columns``; ConfigError for a role other than
    :data:`COLUMN_ROLES` or a name that is not a string (``None``: no such column)."""
    out = dict(defaults)
    if columns is None:
        return out
    if not isinstance(columns, Mapping):
        raise ConfigError(f"columns must be a dict of role -> column name, got {columns!r}")
    for role, name in columns.items():
        if role not in COLUMN_ROLES:
            raise ConfigError(f"columns: unknown role {role!r} (roles: {', '.join(COLUMN_ROLES)})")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"columns[{role!r}] must be a column name or None, got {name!r}")
        out[role] = name
    return out


class IdColumn:
    """The ids of a source's rows: a UTF-8 buffer plus ``int64`` offsets (no per-row
    objects, as :class:`~mmcache.sources.records.Records` holds them), or, with no
    buffer, each row's position as a decimal string."""

    def __init__(self, n: int, buf: npt.NDArray[np.uint8] | None = None, offsets: Any = None):
        self.n = n
        self._buf = buf
        self._off: npt.NDArray[np.int64] | None = offsets

    @classmethod
    def of_strings(cls, values: Sequence[str]) -> IdColumn:
        """From Python strings (small inputs: a COCO file, tests)."""
        encoded = [v.encode("utf-8") for v in values]
        off = np.zeros(len(encoded) + 1, dtype=np.int64)
        off[1:] = np.cumsum([len(e) for e in encoded])
        return cls(len(encoded), np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), off)

    @classmethod
    def of_arrow(cls, array: Any) -> IdColumn:
        """From a pyarrow array (or chunked array) of any type castable to string,
        without null: its buffers copied, no per-row objects."""
        import pyarrow as pa
        import pyarrow.compute as pc

        ids = pc.cast(array, pa.large_string())
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        _, off_buf, data_buf = ids.buffers()
        off = np.frombuffer(off_buf, dtype=np.int64)[ids.offset : ids.offset + len(ids) + 1]
        start, stop = int(off[0]), int(off[-1])
        data = np.zeros(0, dtype=np.uint8)
        if data_buf is not None:
            data = np.frombuffer(data_buf, dtype=np.uint8)[start:stop].copy()
        return cls(len(ids), data, (off - start).astype(np.int64))

    def id(self, i: int) -> str:
        if self._buf is None or self._off is None:
            return str(i)
        return self._buf[self._off[i] : self._off[i + 1]].tobytes().decode("utf-8")

    def ids(self, idx: npt.NDArray[np.int64]) -> list[str]:
        if self._buf is None or self._off is None:
            return [str(i) for i in idx.tolist()]
        view = self._buf.data
        starts, stops = self._off[idx].tolist(), self._off[idx + 1].tolist()
        return [str(view[a:b], "utf-8") for a, b in zip(starts, stops, strict=True)]

    def digest(self) -> str:
        hasher = xxhash.xxh3_64()
        if self._buf is None or self._off is None:
            hasher.update(f"positions:{self.n}".encode())
        else:
            hasher.update(np.ascontiguousarray(self._buf).data)
            hasher.update(np.ascontiguousarray(self._off - self._off[0], dtype="<i8").data)
        return hasher.hexdigest()

    def duplicate(self) -> int | None:
        """The first row whose id an earlier row has, or None."""
        if self._buf is None or self._off is None:
            return None
        seen: set[str] = set()
        for i, sid in enumerate(self.ids(np.arange(self.n, dtype=np.int64))):
            if sid in seen:
                return i
            seen.add(sid)
        return None


class RowSource(PipelineFields):
    """The :class:`~mmcache.sources.base.SampleSource` members shared by row sources.

    A subclass sets :attr:`stamp_kind`, calls ``__init__`` with its ids and
    implements :meth:`stamps`, :meth:`stamp_string` (the source stamp of one row,
    from its :meth:`stamps` row) and :meth:`read_row` (one row's image bytes or
    file, and text).
    """

    stamp_kind: StampKind
    on_error: OnError

    def __init__(self, *, pipeline: StagedProcessor, ids: IdColumn, on_error: OnError) -> None:
        if not isinstance(pipeline, StagedProcessor):
            raise ConfigError(
                f"pipeline must be a mmcache.Pipeline (or have its stages and fingerprint), "
                f"got {type(pipeline).__name__}"
            )
        self.on_error = on_error
        self.pipeline = pipeline
        self._fingerprint = pipeline.fingerprint()
        self._ids = ids
        self._memo_keys: npt.NDArray[np.uint8] | None = None
        self._memo_stamp: npt.NDArray[np.int64] | None = None
        self._rejects = RejectLog()
        #: Rows or files left out when the source was opened (under ``on_error="skip"``).
        self.open_rejects: list[Reject] = []

    # -- for subclasses -----------------------------------------------------------------
    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def stamp_string(self, index: int, stamp: npt.NDArray[np.int64]) -> str:
        """The source stamp of row ``index`` (in the key) from its :meth:`stamps` row."""
        raise NotImplementedError

    def read_row(self, index: int) -> tuple[bytes | None, str | None, str | None, str]:
        """``(image bytes, image file, text, where)`` of row ``index``; ``where`` names the
        row in messages. Raises SampleError."""
        raise NotImplementedError

    def image_refs(self, indices: npt.NDArray[np.int64]) -> list[str | None]:
        """The local file each row's image cell names by path (``None``: none), read
        without the image bytes. A row that names one is keyed by that file's identity
        too (G7, and HF ``Image()`` columns of paths): its key changes when the file's
        bytes change, as a loose file's does. The default: no row names a file."""
        return [None] * int(indices.shape[0])

    # -- which sample -------------------------------------------------------------------
    def __len__(self) -> int:
        return self._ids.n

    def _checked(self, indices: Sequence[int] | np.ndarray) -> npt.NDArray[np.int64]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self._ids.n
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"sample index out of range for {n} rows")
        return idx

    def sample_id(self, index: int) -> str:
        return self._ids.ids(self._checked([index]))[0]

    def ids(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        return self._ids.ids(self._checked(indices))

    def ids_digest(self) -> str:
        return self._ids.digest()

    # -- keys ---------------------------------------------------------------------------
    def key(self, index: int) -> bytes:
        key: bytes = self.key_rows([index])[0].tobytes()
        return key

    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """Keys as ``uint8 [n, 16]``: ``sample_key(id, stamp_string, fingerprint)``, hashed
        again only for rows whose stamp changed since the last call. Not thread-safe."""
        idx = self._checked(indices)
        if stamps is None:
            stamps = self.stamps(idx)
        n = self._ids.n
        if self._memo_keys is None or self._memo_stamp is None:
            self._memo_keys = np.zeros((n, 16), dtype=np.uint8)
            self._memo_stamp = np.full((n, stamps.shape[1]), -1, dtype=np.int64)
        memo_keys, memo_stamp = self._memo_keys, self._memo_stamp
        stale = np.flatnonzero((stamps != memo_stamp[idx]).any(axis=1))
        for j in stale.tolist():
            i = int(idx[j])
            key = keys.sample_key(
                self._ids.id(i), self.stamp_string(i, stamps[j]), self._fingerprint, None
            )
            memo_keys[i] = np.frombuffer(key, dtype=np.uint8)
            memo_stamp[i] = stamps[j] if stamps[j, 0] != -2 else -1  # missing: not memoised
        rows: np.ndarray = memo_keys[idx]
        refs = self.image_refs(idx)
        named = [j for j, ref in enumerate(refs) if ref is not None]
        if named:  # stat-checked at every call, as loose files are; never memoised here
            rows = rows.copy()
            fields = np.full((len(named), len(keys.STAT_FIELDS)), -2, dtype=np.int64)
            for n, j in enumerate(named):
                try:
                    fields[n] = keys.stat_fields(os.stat(refs[j] or ""))
                except (OSError, ValueError):
                    continue
            idents = identity.file_identities([refs[j] for j in named], fields)
            for j, ident in zip(named, idents, strict=True):
                i = int(idx[j])
                stamp = f"{self.stamp_string(i, stamps[j])}|image:{ident}"
                key = keys.sample_key(self._ids.id(i), stamp, self._fingerprint, None)
                rows[j] = np.frombuffer(key, dtype=np.uint8)
        return rows

    # -- produce ------------------------------------------------------------------------
    def produce(self, index: int) -> dict[str, np.ndarray]:
        """Decode/resize/tokenize row ``index`` into numpy arrays. Raises SampleError."""
        self._checked([index])
        data, image_file, text, where = self.read_row(index)
        return process_bytes(
            self.pipeline,
            data,
            text,
            sample_id=self._ids.id(index),
            path=where,
            image_file=image_file,
            unit="row",
        )

    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return item_tensors(self._ids.id(index), sample, self.channels_last_fields)

    # -- rejects ------------------------------------------------------------------------
    def record_reject(self, err: Exception) -> None:
        if not isinstance(err, SampleError):
            err = SampleError(f"{type(err).__name__}: {err}", sample_id="<unknown>")
        self._rejects.record(err)
        logger.warning("skipped %s", err)

    def rejects(self) -> list[Reject]:
        """What was left out at open (:attr:`open_rejects`), then the samples skipped
        since in any process (deduplicated by id, first reason kept)."""
        out: dict[str, Reject] = {}
        for rej in [*self.open_rejects, *self._rejects.read()]:
            out.setdefault(rej.sample_id, rej)
        return list(out.values())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_memo_keys"] = state["_memo_stamp"] = None  # rebuilt on first use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def path_column(column: Any, base_dir: str) -> list[str | None] | None:
    """The ``path`` field of an image column (pyarrow, HF ``Image`` structs) as the files it
    names where its ``bytes`` are null (the cells :func:`image_cell` reads from a file,
    joined with ``base_dir`` likewise), or None when the column has no ``path`` field.
    Reads no image bytes: a struct's field is a view of its child array, and only the
    ``bytes`` child's validity bitmap is looked at."""
    import pyarrow as pa
    import pyarrow.compute

    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    out: list[str | None] = []
    for chunk in chunks:
        if not pa.types.is_struct(chunk.type) or chunk.type.get_field_index("path") < 0:
            return None
        paths = chunk.field("path").to_pylist()
        named = chunk.is_valid()
        if chunk.type.get_field_index("bytes") >= 0:
            named = pa.compute.and_(named, chunk.field("bytes").is_null())
        out += [
            os.path.normpath(os.path.join(base_dir, p)) if ok and p else None
            for p, ok in zip(paths, named.to_pylist(), strict=True)
        ]
    return out
