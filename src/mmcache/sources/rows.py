"""What the sources of rows holding image bytes share (:class:`RowSource`): ids, keys, produce.

A Parquet file (:mod:`~mmcache.sources.parquet`) and an HF dataset
(:mod:`~mmcache.sources.hfdataset`) hold each sample as a row: the image's
encoded bytes (or a path beside them, the HF ``Image`` layout), a text and
perhaps an id. Such a source names its rows (:class:`~mmcache.sources.ids.IdColumn`: a
UTF-8 buffer and offsets, or the row position), says how a row is stamped, and reads one
row's bytes. A sample is a row; where ``on_error="skip"`` left rows of a repeated id out
(:meth:`RowSource.first_of_each_id`: the first row of an id is kept), sample ``i`` is row
:meth:`RowSource.row` ``(i)``, and with none left out the two are the same (ids, their
digest and keys unchanged). :class:`RowSource` is the
:class:`~mmcache.sources.chassis.BaseSource` of both (ids, keys of ``(id, stamp string,
pipeline fingerprint)`` memoised per stamp, rejects, pickling), adds the identity of image
files that cells name by path, and produces through
:func:`~mmcache.sources.bytesproc.process_bytes`, which runs a pipeline's stages on
bytes in hand exactly as :meth:`mmcache.Pipeline.process` does on a file (same
output, bit for bit; re-exported here).

Thread/process safety: read-only after construction but for the reject log
(process-safe), the key memo (one thread per process) and a subclass's readers
(its own lock); pickles as its columns and the pipeline.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from mmcache import keys
from mmcache.errors import ConfigError, ManifestError
from mmcache.sources import identity
from mmcache.sources.base import OnError
from mmcache.sources.bytesproc import process_bytes
from mmcache.sources.cells import image_cell
from mmcache.sources.chassis import BaseSource
from mmcache.sources.freshness import stat_rows
from mmcache.sources.ids import IdColumn, duplicate_message
from mmcache.sources.rejects import Reject
from mmcache.transforms.pipeline import StagedProcessor

__all__ = [
    "IdColumn",
    "RowSource",
    "check_columns",
    "image_cell",
    "path_column",
    "process_bytes",
]

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


class RowSource(BaseSource):
    """The :class:`~mmcache.sources.chassis.BaseSource` of row sources.

    A subclass sets :attr:`stamp_kind`, calls ``__init__`` with its ids and
    implements :meth:`stamps`, :meth:`stamp_string` (the source stamp of one row,
    from its :meth:`stamps` row) and :meth:`read_row` (one row's image bytes or
    file, and text).
    """

    #: Sample index -> row, where rows of a repeated id were left out (``None``: none
    #: were, sample ``i`` is row ``i``).
    pipeline: StagedProcessor
    _rows: npt.NDArray[np.int64] | None = None

    def __init__(self, *, pipeline: StagedProcessor, ids: IdColumn, on_error: OnError) -> None:
        if not isinstance(pipeline, StagedProcessor):
            raise ConfigError(
                f"pipeline must be a mmcache.Pipeline (or have its stages and fingerprint), "
                f"got {type(pipeline).__name__}"
            )
        super().__init__(pipeline=pipeline, ids=ids, on_error=on_error)

    def first_of_each_id(
        self, ids: IdColumn, on_error: OnError, name_row: Callable[[int], tuple[str, int]]
    ) -> tuple[IdColumn, list[Reject]]:
        """The ids of the samples to serve, and the rows left out, for a subclass to call
        before ``__init__`` with every row's ids (the one rule of :mod:`~mmcache.sources.ids`).

        ``name_row(row)`` is ``(file, row in it)``, how messages name a row. A repeated id
        is a :class:`ManifestError` naming both rows under ``on_error="raise"``; under
        ``"skip"`` the first row of each id is kept, every later one is left out and listed
        as a :class:`Reject` (its id, ``"<file> row <r>"``, and the first row in
        :func:`~mmcache.sources.ids.duplicate_message`'s words), and :meth:`row` maps
        each sample to its row. With no repeated id, ``ids`` itself and no map."""
        found = ids.duplicates()
        self._rows = None
        if not found:
            return ids, []
        rejects = []
        for first, later in found:
            (path0, r0), (path, r) = name_row(first), name_row(later)
            message = duplicate_message(f"{path0} row {r0}")
            if on_error == "raise":
                raise ManifestError(message, path=path, line=r, sample_id=ids.id(later))
            rejects.append(Reject(ids.id(later), f"{path} row {r}", message))
        left_out = np.fromiter((later for _, later in found), dtype=np.int64)
        rows = np.setdiff1d(np.arange(ids.n, dtype=np.int64), left_out, assume_unique=True)
        self._rows = rows
        return ids.take(rows), rejects

    def row(self, index: int) -> int:
        """The row of sample ``index`` (itself unless repeated ids were left out)."""
        return index if self._rows is None else int(self._rows[index])

    def rows(self, indices: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The rows of samples ``indices`` (checked), as :meth:`row`."""
        return indices if self._rows is None else self._rows[indices]

    # -- for subclasses -----------------------------------------------------------------
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

    # -- keys ---------------------------------------------------------------------------
    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """:meth:`BaseSource.key_rows <mmcache.sources.chassis.BaseSource.key_rows>`, then
        the rows whose image cell names a file keyed again with that file's identity
        (``stat``-checked at every call, as loose files are; never memoised here)."""
        idx = self._checked(indices)
        if stamps is None:
            stamps = self.stamps(idx)
        rows = super().key_rows(idx, stamps=stamps)
        refs = self.image_refs(idx)
        named = [j for j, ref in enumerate(refs) if ref is not None]
        if named:
            rows = rows.copy()
            fields = stat_rows([os.fsencode(refs[j] or "") for j in named])  # threads if slow
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
