"""``HFDatasetSource``: a map-style HF ``datasets.Dataset`` read through its Arrow table.

A row's image is the ``Image`` feature's struct ``{bytes, path}`` as stored,
taken from the dataset in the ``"arrow"`` format (``ds.with_format("arrow")``:
no PIL decode, no Python row dict) and decoded by mmcache's own decode step,
so the output equals that of the same JPEG read as a loose file. ``ds[i]``
decoding (datasets#7753) is never used.

Stamps (``StampKind.FIXED``): the dataset's fingerprint (``ds._fingerprint``,
which ``datasets`` changes with every transform: ``map``, ``filter``,
``select``, ``shuffle``...), the identity of each Arrow file the dataset is
memory-mapped from (:func:`mmcache.sources.identity.file_identity`: the digest
of its bytes, remembered in the node's ledger under the file's stat, so read
once per node and file version), plus the row index. The files are in the key
because a fingerprint need not follow the bytes: ``Dataset.from_file`` hashes
the file's path and mtime only, so an Arrow file rewritten with its mtime
restored kept its keys and was served stale. A dataset is immutable, so nothing
is re-checked per epoch; a changed dataset is a new object with a new
fingerprint or new files, and all its keys are new.

Pickling (spawn workers): the source pickles its dataset, which ``datasets``
pickles as the paths of its memory-mapped Arrow files (``load_from_disk``,
``load_dataset``: about 1 KB) but as its whole table when it lives in memory
(``Dataset.from_dict``): save such a dataset to disk first for many workers.

Thread/process safety: read-only after construction but for the per-process
Arrow view (made on first read) and what :class:`~mmcache.sources.rows.RowSource`
keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.errors import ConfigError, ManifestError, SampleError
from mmcache.sources import identity
from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.sources.bytesproc import byte_limit
from mmcache.sources.cells import check_image_type, image_cell
from mmcache.sources.rows import IdColumn, RowSource, check_columns, path_column
from mmcache.transforms.pipeline import StagedProcessor

__all__ = ["HFDatasetSource"]


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is in the test environment
        raise ConfigError(
            "reading an HF dataset needs datasets: pip install 'mmcache[datasets]'"
        ) from exc
    return datasets


class HFDatasetSource(RowSource):
    """Image-text samples from the rows of a map-style ``datasets.Dataset``.

    >>> ds = datasets.load_from_disk("coco-hf")                          # doctest: +SKIP
    >>> src = HFDatasetSource(ds, pipeline=pipe, columns={"text": "caption"})  # doctest: +SKIP

    Args:
        dataset: a ``datasets.Dataset`` (not an ``IterableDataset`` nor a
            ``DatasetDict``: pick a split).
        pipeline: how to turn a row into arrays (a :class:`mmcache.Pipeline`).
        columns: the ``"id"``, ``"image"`` and ``"text"`` columns (defaults: the row
            index as id, the first ``Image`` feature, ``"text"``; ``None``: none).
        on_error: ``"raise"``: a row that cannot be produced (a null image, bad
            bytes) raises SampleError naming the dataset, the row and the id;
            ``"skip"``: it is left out and listed in :meth:`rejects`. A repeated id
            (``columns={"id": ...}``): a ManifestError naming both rows under
            ``"raise"``; under ``"skip"`` the first row of the id is served and each
            later one left out and listed in :meth:`rejects`.
    """

    stamp_kind = StampKind.FIXED

    def __init__(
        self,
        dataset: Any,
        *,
        pipeline: StagedProcessor,
        columns: Mapping[str, str | None] | None = None,
        on_error: OnError = "raise",
    ) -> None:
        from mmcache.sources.files import check_on_error

        on_error = check_on_error(on_error)
        hf = _datasets()
        if not isinstance(dataset, hf.Dataset):
            raise ConfigError(
                "HFDatasetSource needs a map-style datasets.Dataset (pick a split of a "
                "DatasetDict; stream-only datasets are not supported), got "
                f"{type(dataset).__name__}"
            )
        features = dataset.features
        image_default = next(
            (name for name, f in features.items() if isinstance(f, hf.Image)), "image"
        )
        self.columns = check_columns(columns, {"id": None, "image": image_default, "text": "text"})
        self.fingerprint_of_data: str = str(dataset._fingerprint)
        self.where = f"<dataset {self.fingerprint_of_data}>"
        for role, column in self.columns.items():
            if column is not None and column not in dataset.column_names:
                raise ManifestError(
                    f"no {role} column {column!r} (columns: {', '.join(dataset.column_names)}; "
                    f"name it with columns={{{role!r}: ...}})",
                    path=self.where,
                )
        image = self.columns["image"]
        if image is not None:
            check_image_type(dataset.data.schema.field(image).type, column=image, path=self.where)
        self.dataset = dataset
        # The bytes behind the fingerprint: an in-memory table has none (its fingerprint
        # hashes the table itself); "" keeps the stamp string of such a dataset as it was.
        files = [identity.file_identity(f["filename"]) for f in dataset.cache_files]
        self.files_identity = xxhash.xxh3_128_hexdigest("|".join(files).encode()) if files else ""
        self._stamp = int(
            np.uint64(
                xxhash.xxh3_64_intdigest(
                    f"{self.fingerprint_of_data}{self.files_identity}".encode()
                )
            ).view(np.int64)
        )
        ids = IdColumn(len(dataset))
        if self.columns["id"]:
            arrow = dataset.with_format("arrow", columns=[self.columns["id"]])
            column = arrow[self.columns["id"]]
            if column.null_count:
                raise ManifestError(f"id column {self.columns['id']!r} is null", path=self.where)
            ids = IdColumn.of_arrow(column)
        ids, repeated = self.first_of_each_id(ids, on_error, lambda row: (self.where, row))
        super().__init__(pipeline=pipeline, ids=ids, on_error=on_error)
        self.open_rejects = repeated
        self._view: Any = None
        self._refs: list[str | None] | None = None

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``int64 [n, 2]``: a hash of the dataset's fingerprint and files, and the row."""
        idx = self._checked(indices)
        out = np.empty((idx.shape[0], 2), dtype=np.int64)
        out[:, 0] = self._stamp
        out[:, 1] = self.rows(idx)
        return out

    def stamp_string(self, index: int, stamp: npt.NDArray[np.int64]) -> str:
        files = f"{self.files_identity}:" if self.files_identity else ""
        return f"hf:{self.fingerprint_of_data}:{files}{self.row(index)}"

    def image_refs(self, indices: npt.NDArray[np.int64]) -> list[str | None]:
        """Files named by an ``Image()`` column of paths (``cast_column`` from paths,
        imagefolder-style): read once from the Arrow table's ``path`` field, no bytes."""
        if self._refs is None:
            self._refs = []
            column = self.columns["image"]
            if column:
                paths = path_column(self.dataset.data.column(column), "")
                if paths is not None:
                    mapping = getattr(self.dataset, "_indices", None)  # select(), shuffle()
                    if mapping is not None:
                        rows = mapping.column(0).to_pylist()
                        paths = [paths[r] for r in rows]
                    self._refs = paths
        if not self._refs:
            return [None] * int(indices.shape[0])
        return [self._refs[r] for r in self.rows(indices).tolist()]

    def read_row(self, index: int) -> tuple[bytes | None, str | None, str | None, str]:
        if self._view is None:
            wanted = [c for c in (self.columns["image"], self.columns["text"]) if c]
            self._view = self.dataset.with_format("arrow", columns=wanted)
        where = f"{self.where} row {self.row(index)}"
        try:
            row = self._view[self.row(index)]
        except Exception as exc:  # an Arrow file gone or cut under the mapping
            raise SampleError(
                f"cannot read the row: {type(exc).__name__}: {exc}",
                sample_id=self._ids.id(index),
                path=where,
            ) from exc
        text = None
        if self.columns["text"]:
            value = row.column(self.columns["text"])[0].as_py()
            text = None if value is None else str(value)
        data, image_file = None, None
        if self.columns["image"]:
            data, image_file = image_cell(
                row.column(self.columns["image"])[0],
                "",
                limit=byte_limit(self.pipeline),
                sample_id=self._ids.id(index),
                where=where,
            )
        return data, image_file, text, where

    def __repr__(self) -> str:
        return f"HFDatasetSource({self.where}, {len(self)} rows, columns={self.columns})"

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_view"] = None
        state["_refs"] = None
        return state


if TYPE_CHECKING:  # mypy checks that HFDatasetSource conforms to the protocol

    def _conforms(source: HFDatasetSource) -> SampleSource:
        return source
