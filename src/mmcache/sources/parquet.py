"""``ParquetSource``: image-text rows of Parquet files read in place, one row group at a time.

A row holds the image as encoded bytes (a ``binary`` column) or as the HF
``Image`` struct ``{bytes, path}`` (what ``datasets`` writes), a text column and,
optionally, an id column (default: the row's position in the source); names via
``columns={"id": ..., "image": ..., "text": ...}``.

Reading: the files' footers are read at open (row counts, schema; the id column
if there is one). A sample then reads only its row group's image, text and id
column chunks (``ParquetFile.read_row_group``, memory-mapped for local files),
never the whole file; decoded row groups are kept per process up to
``row_group_memory`` bytes (LRU), so rows read in file order, shuffled within a
group, or shuffled over data smaller than that decode each group once. Under a
shuffle over more data than that, the loader tells each producing process the
samples it produces next (:meth:`ParquetSource.foresee`, the ``ForeseesReads``
capability): a group read then keeps, within the same budget, the rows of that
group still to come, the one needed last evicted first
(:class:`~mmcache.sources.foresight.Foresight`), so a cold epoch reads each group
about ``(its rows' bytes) / row_group_memory`` times per process instead of once per
row.

Stamps (``StampKind.FILE`` for local files): each row's stamp is its file's
``stat`` (:data:`mmcache.keys.STAT_FIELDS`) and its key adds the row's place in
the file, so a rewritten file changes the keys of all its rows at the next
check (the loader re-``stat``-s before a warm epoch serves cached entries), and a
worker that finds the file changed since it opened it opens it again (and
refuses a row whose id moved). Remote files (a URL, opened through
:class:`~mmcache.sources.blobs.objects.Remote` with ``storage_options``: the retry
policy and circuit breaker of every remote call) are ``StampKind.FIXED``: their size,
mtime and ETag read at open, and checked again at each epoch by
:meth:`ParquetSource.revalidate` (which
:class:`~mmcache.sources.blobs.prefetch.RemotePrefetch` calls, batched: one listing per
folder of files; :mod:`~mmcache.sources.blobs.tables`): a file rewritten during a run
gets a new stamp, so its rows get new keys in every process, and its new version is
read. A remote row's key holds its file's identity, as a remote image's does
(:func:`~mmcache.sources.blobs.objects.object_identity`): an S3 ETag names the bytes, so
the same file copied under another bucket or prefix keeps its rows' keys; an HTTP ETag
or a GCS generation keeps the URL; a file whose server gives no version keeps the URL
and its size and mtime. (Until the blobs layer, the key held the URL whatever the
store: every copy was a miss.) Such a source claims the ``Revalidating`` and
``SharesStamps`` capabilities (a local one does not: its files are ``stat``-ed at every
batch).

Thread/process safety: read-only after construction but for the per-process
readers (behind a lock), what :class:`~mmcache.sources.rows.RowSource` keeps and the
revalidated stamps of remote files (replaced whole, one thread revalidates); pickles as
file names and columns (readers are opened again in each process).
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from mmcache import keys
from mmcache.errors import ConfigError, ManifestError, RemoteError, SampleError
from mmcache.rootfiles import open_regular
from mmcache.sources import identity
from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.sources.blobs.objects import Remote, object_identity, object_stamp
from mmcache.sources.blobs.raw import fetch_bytes
from mmcache.sources.blobs.state import SharedStamps
from mmcache.sources.blobs.tables import GONE, TableFiles, file_stamp
from mmcache.sources.bytesproc import byte_limit
from mmcache.sources.cells import check_image_type, image_cell
from mmcache.sources.foresight import Foresight
from mmcache.sources.rejects import Reject
from mmcache.sources.rows import IdColumn, RowSource, check_columns, path_column
from mmcache.transforms.pipeline import StagedProcessor
from mmcache.units import parse_size

__all__ = ["ParquetSource"]

logger = logging.getLogger(__name__)

_DEFAULT_COLUMNS: dict[str, str | None] = {"id": None, "image": "image", "text": "text"}
_GLOB_CHARS = frozenset("*?[")
#: Files a process keeps open for reading rows (least recently read closed first).
_OPEN_FILES = 32
#: Bytes a kept row costs beyond its cells' bytes (its Python objects and tuple, its
#: entries in the foresight's dict and heaps): what the budget counts it at (measured
#: with tiny samples: ~600 B a row beside the image, caption and id bytes).
_KEPT_OVERHEAD = 600


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is in the test environment
        raise ConfigError("reading Parquet needs pyarrow: pip install 'mmcache[parquet]'") from exc
    return pq


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _expand(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """Local or remote file names from a path, a directory, a glob or a list of them."""
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    out: list[str] = []
    for item in items:
        name = os.fspath(item)
        if not isinstance(name, str):
            raise ConfigError(f"a Parquet path must be a str, got {name!r}")
        if _is_url(name):
            out.append(name)  # globs are expanded through the store at open
        elif _GLOB_CHARS & set(name):
            found = sorted(glob.glob(name, recursive=True))
            if not found:
                raise ManifestError("no Parquet file matches this pattern", path=name)
            out.extend(os.path.abspath(f) for f in found)
        elif os.path.isdir(name):
            found = sorted(glob.glob(os.path.join(name, "**", "*.parquet"), recursive=True))
            if not found:
                raise ManifestError("no *.parquet file in this folder", path=name)
            out.extend(os.path.abspath(f) for f in found)
        else:
            out.append(os.path.abspath(name))
    if not out:
        raise ConfigError("ParquetSource needs at least one file")
    return out


class _Reader:
    """One open file in one process: the ParquetFile, the stamp it was opened at (and a
    remote file's version: its ETag or generation), and the first row of each of its
    row groups."""

    def __init__(
        self, pf: Any, stamp: tuple[int, ...], handle: Any, version: str | None = None
    ) -> None:
        self.pf = pf
        self.stamp = stamp
        self.handle = handle
        self.version = version
        counts = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def close(self) -> None:
        self.pf.close()
        if self.handle is not None:
            self.handle.close()


class ParquetSource(RowSource):
    """Image-text samples from the rows of Parquet files, read in place.

    >>> src = ParquetSource("data/*.parquet", pipeline=pipe,              # doctest: +SKIP
    ...                     columns={"image": "jpg", "text": "caption", "id": "key"})

    Args:
        paths: a file, a folder (its ``*.parquet``, recursively), a glob, an object store
            URL (``s3://bucket/train-*.parquet``) or a list of them; rows are
            numbered in file order.
        pipeline: how to turn a row into arrays (a :class:`mmcache.Pipeline`).
        columns: names of the ``"id"``, ``"image"`` and ``"text"`` columns (defaults
            ``None``: the row position, ``"image"``, ``"text"``; ``None`` for image
            or text: no such column, for an image-only or text-only pipeline).
        on_error: ``"raise"``: a file that is not Parquet (a corrupt footer), lacks a
            column or has a null id raises ManifestError naming it; a row that cannot
            be produced (a null image, bad bytes) raises SampleError naming the file,
            the row and the id. ``"skip"``: such files and rows are left out and
            listed in :meth:`rejects`. A repeated id: a ManifestError naming both rows
            (file and row) under ``"raise"``; under ``"skip"`` the first row of the id
            is served and each later one left out and listed in :meth:`rejects`.
        storage_options: the object store's options for URLs (credentials, endpoint:
            :class:`~mmcache.sources.blobs.objects.Remote`).
        row_group_memory: bytes of decoded row groups, and of rows kept for their
            turn, per process (an int or ``"128MiB"``; at least the last group read is
            kept, whatever its size): rows read in file order or shuffled within a
            group decode their group once; under a global shuffle over files larger
            than this, the loader's producing processes keep the rows they were told
            come next, so each reads a group about ``(its rows' bytes) /
            row_group_memory`` times an epoch (without that foresight, e.g. ``ds[i]``
            in a torch DataLoader, a group for most rows).

    A source of remote files has :attr:`remote` (their store, under mmcache's retry
    policy), :attr:`raw` (``None``: rows are read through pyarrow, not fetched ahead) and
    :attr:`shared_stamps`, and :meth:`revalidate` checks its files again: pass it to
    ``RemotePrefetch`` so that this happens at each epoch. A source of local files has
    none of the three (it claims neither capability; its files are ``stat``-ed at every
    batch).
    """

    #: Remote files only (see above): the store, no raw tier, the stamps' shared file.
    remote: Remote
    raw: None
    shared_stamps: SharedStamps
    #: Rows are read by pyarrow, never fetched ahead: a prefetcher only revalidates.
    fetches_ahead = False
    #: Row groups this process has read (decoded), for tests and benchmarks.
    group_reads = 0

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        pipeline: StagedProcessor,
        columns: Mapping[str, str | None] | None = None,
        on_error: OnError = "raise",
        storage_options: Mapping[str, Any] | None = None,
        row_group_memory: int | str = "128MiB",
    ) -> None:
        from mmcache.sources.files import check_on_error

        on_error = check_on_error(on_error)
        self.row_group_memory = parse_size(row_group_memory)
        self.columns = check_columns(columns, _DEFAULT_COLUMNS)
        if self.columns["image"] is None and self.columns["text"] is None:
            raise ConfigError("columns: a ParquetSource needs an image or a text column")
        self.storage_options = dict(storage_options or {})
        # The store of remote files: the one door (retry policy, circuit breaker). Named
        # ``remote`` only on a source of remote files (the Revalidating capability).
        self._store = Remote(self.storage_options)
        self._readers: OrderedDict[int, _Reader] = OrderedDict()
        # Per process: the identity of each file version, and its path-only image cells.
        self._idents: dict[tuple[int, ...], str] = {}
        self._refs: dict[int, tuple[tuple[int, ...] | None, list[str | None] | None]] = {}
        self._groups: OrderedDict[tuple[int, int, tuple[int, ...]], Any] = OrderedDict()
        self._group_bytes = 0
        # The rows this process produces next and the rows kept for them (the loader's
        # foresight, sharing row_group_memory with the groups above).
        self._foresight = Foresight(self.row_group_memory)
        self._lock = threading.Lock()
        rejects: list[Reject] = []
        files, stamps, versions, counts, id_parts = [], [], [], [], []
        #: Row groups of all the files, and bytes and number of those this process decoded:
        #: whether the groups would all fit ``row_group_memory`` (then no row is kept).
        self._group_count = self._decoded_bytes = 0
        for name in self._resolve(_expand(paths)):
            try:
                stamp, version, count, ids = self._read_footer(name)
            except ManifestError as err:
                if on_error == "raise":
                    raise
                rejects.append(Reject(f"<file {name}>", name, err.reason))
                continue
            files.append(name)
            stamps.append(stamp)
            versions.append(version)
            counts.append(count)
            id_parts.append(ids)
        if not files:
            raise ManifestError(
                f"no readable Parquet file (first problem: {rejects[0].reason})"
                if rejects
                else "no Parquet file",
                path=os.fspath(paths) if isinstance(paths, str | os.PathLike) else str(paths),
            )
        self.files: list[str] = files
        on_urls = any(_is_url(f) for f in files)
        if on_urls and not all(_is_url(f) for f in files):
            raise ConfigError("a ParquetSource reads local files or URLs, not both at once")
        self.stamp_kind = StampKind.FIXED if on_urls else StampKind.FILE
        #: Remote files: their stamps and versions, checked again by :meth:`revalidate`.
        self._tables: TableFiles | None = None
        if on_urls:
            self._tables = TableFiles(files, self._store, stamps, versions)
            self.remote = self._store
            self.raw = None
            self.shared_stamps = self._tables.state
        self._file_start = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        ids, repeated = self.first_of_each_id(self._id_column(id_parts), on_error, self._name_row)
        super().__init__(pipeline=pipeline, ids=ids, on_error=on_error)
        self.open_rejects = rejects + repeated

    # -- opening ------------------------------------------------------------------------
    def _resolve(self, names: list[str]) -> list[str]:
        """Expand remote globs through the store (local ones were expanded already)."""
        out: list[str] = []
        for name in names:
            if _is_url(name) and _GLOB_CHARS & set(name):
                try:
                    found = self._store.glob(name)
                except RemoteError as exc:
                    raise ManifestError(f"cannot list the files ({exc})", path=name) from exc
                if not found:
                    raise ManifestError("no Parquet file matches this pattern", path=name)
                out.extend(found)
            else:
                out.append(name)
        return out

    def _stat(self, name: str) -> tuple[int, ...] | None:
        """The file's stamp now (local: its stat fields; remote: None, fixed at open)."""
        if _is_url(name):
            return None
        try:
            return keys.stat_fields(os.stat(name))
        except OSError:
            return None

    def _open_new(self, name: str) -> _Reader:
        pq = _pyarrow()
        import pyarrow as pa

        try:
            version = None
            if _is_url(name):
                # A fresh info (never a listing kept from before a rewrite), then the
                # file, both under the retry policy and the circuit breaker.
                info = self._store.info(name)
                handle = self._store.open(name)
                stamp: tuple[int, ...] = file_stamp(name, info)
                version = object_stamp(info)
                pf = pq.ParquetFile(handle)
            else:
                handle = None
                fd, st = open_regular(name)  # a FIFO would block pyarrow's open forever
                os.close(fd)
                stamp = keys.stat_fields(st)
                pf = pq.ParquetFile(name, memory_map=True)
        except FileNotFoundError as exc:
            raise ManifestError("file not found", path=name) from exc
        except RemoteError as exc:
            why = "file not found" if exc.status == 404 else f"cannot open it ({exc})"
            raise ManifestError(why, path=name) from exc
        except (pa.ArrowException, OSError) as exc:
            raise ManifestError(f"not a readable Parquet file ({exc})", path=name) from exc
        return _Reader(pf, stamp, handle, version)

    def _read_footer(self, name: str) -> tuple[tuple[int, ...], str | None, int, Any]:
        """``(stamp, version, rows, ids or None)`` of one file, closed afterwards (rows are
        read through readers opened where they are needed: no fd kept per file); its row
        groups are counted in ``_group_count``."""
        reader = self._open_new(name)
        try:
            self._check_schema(reader.pf, name)
            ids = self._read_ids(reader.pf, name) if self.columns["id"] else None
            self._group_count += len(reader.starts) - 1
            return reader.stamp, reader.version, int(reader.starts[-1]), ids
        finally:
            reader.close()

    def _check_schema(self, pf: Any, name: str) -> None:
        have = pf.schema_arrow.names
        for role, column in self.columns.items():
            if column is not None and column not in have:
                raise ManifestError(
                    f"no {role} column {column!r} (columns: {', '.join(have)}; name it "
                    f"with columns={{{role!r}: ...}})",
                    path=name,
                )
        image = self.columns["image"]
        if image is not None:
            check_image_type(pf.schema_arrow.field(image).type, column=image, path=name)

    def _read_ids(self, pf: Any, name: str) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        column = self.columns["id"]
        try:
            ids = pc.cast(pf.read(columns=[column]).column(0), pa.large_string())
        except (pa.ArrowException, OSError) as exc:
            raise ManifestError(f"cannot read id column {column!r} ({exc})", path=name) from exc
        if ids.null_count:
            row = int(pc.index(pc.is_null(ids), True).as_py())
            raise ManifestError(f"id column {column!r} is null", path=name, line=row)
        return ids

    def _id_column(self, parts: list[Any]) -> IdColumn:
        n = int(self._file_start[-1])
        if not self.columns["id"]:
            return IdColumn(n)
        import pyarrow as pa

        return IdColumn.of_arrow(pa.chunked_array(parts))

    # -- where a row is -----------------------------------------------------------------
    def _locate(self, row: int) -> tuple[int, int]:
        """``(file, row in it)`` of row ``row`` of all the files."""
        f = int(np.searchsorted(self._file_start, row, side="right")) - 1
        return f, row - int(self._file_start[f])

    def _name_row(self, row: int) -> tuple[str, int]:
        f, r = self._locate(row)
        return self.files[f], r

    def _place(self, index: int) -> tuple[int, int]:
        """``(file, row in it)`` of sample ``index``."""
        return self._locate(self.row(index))

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Each row's file stamp as ``int64 [n, 4]``: the file's stat fields (one ``stat``
        per distinct file), ``-2`` where it is gone; remote files: size, mtime, ETag and
        URL hashes read at open or at the last :meth:`revalidate` (of any process)."""
        idx = self._checked(indices)
        files = np.searchsorted(self._file_start, self.rows(idx), side="right") - 1
        if self._tables is not None:
            self._refresh()
            out: np.ndarray = self._tables.stamps[files]
            return out
        stamps = np.full((idx.shape[0], len(keys.STAT_FIELDS)), -2, dtype=np.int64)
        for f in np.unique(files).tolist():
            now = self._stat(self.files[f])
            if now is not None:
                stamps[files == f] = now
        return stamps

    def _unsettled(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64], taken: float
    ) -> npt.NDArray[np.bool_] | None:
        """Local files' rows changed too recently for their stamp to vouch for their key
        (:meth:`BaseSource._unsettled`); a remote file's stamp holds its ETag."""
        return identity.racy_rows(stamps, taken) if self._tables is None else None

    def stamp_string(self, index: int, stamp: npt.NDArray[np.int64]) -> str:
        """A local file's row: the identity of the file's bytes
        (:mod:`mmcache.sources.identity`: equal on a ``cp -a`` copy, new when the bytes
        change) and the row; a remote one's: the identity of its object
        (:func:`~mmcache.sources.blobs.objects.object_identity` of the version read at
        open or at the last revalidation; without a version, its URL and stamp)."""
        f, r = self._place(index)
        if int(stamp[0]) == -2:
            return f"parquet:missing:{r}"
        if self._tables is not None:
            version = self._tables.versions[f]
            if version is None:  # no change detector but the size and mtime: keep them
                return f"parquet:obj:{self.files[f]}:{keys.fields_stamp(stamp.tolist())}:{r}"
            return f"parquet:{object_identity(self.files[f], version, int(stamp[0]))}:{r}"
        seen = (f, *stamp.tolist())
        ident = self._idents.get(seen)
        if ident is None:
            book = identity.ledger()
            taken = book.clock()  # before the bytes are read, as the ledger's rule wants
            # No cap: the source reads the whole file's row groups anyway.
            one = stamp.reshape(1, -1)
            ident = identity.file_identities([self.files[f]], one, max_bytes=None)[0]
            # Remembered only once the stamp can vouch for it (the ledger's racy rule): a
            # file rewritten at the same size in its stamp's tick keeps every stat field.
            if book.vouches(int(stamp[1]), int(stamp[2]), taken):
                self._idents[seen] = ident
        return f"parquet:{ident}:{r}"

    def image_refs(self, indices: npt.NDArray[np.int64]) -> list[str | None]:
        """Files named by path-only image cells (G7), read once per file version from the
        column's ``path`` field (no image bytes)."""
        if self._tables is not None or not self.columns["image"]:
            return [None] * int(indices.shape[0])
        out: list[str | None] = []
        for index in indices.tolist():
            f, r = self._place(index)
            now = self._stat(self.files[f])
            refs = self._refs.get(f)
            if refs is None or refs[0] != now:
                refs = self._refs[f] = (now, self._read_refs(self.files[f]))
            out.append(refs[1][r] if refs[1] is not None and r < len(refs[1]) else None)
        return out

    def _read_refs(self, name: str) -> list[str | None] | None:
        try:
            table = _pyarrow().ParquetFile(name).read(columns=[f"{self.columns['image']}.path"])
        except Exception:  # not a struct column, or unreadable: read_row reports it
            return None
        if not table.num_columns:
            return None
        return path_column(table.column(0), os.path.dirname(name))

    # -- reading a row ------------------------------------------------------------------
    def _reader(self, f: int) -> _Reader:
        """This process's reader of file ``f``, opened again if the file changed."""
        name = self.files[f]
        reader = self._readers.get(f)
        if _is_url(name):
            if reader is not None:
                self._readers.move_to_end(f)
                return reader  # FIXED: until revalidated (_forget drops it then)
        else:
            now = self._stat(name)
            if now is None:  # never the rows of a file that is gone from an old mapping
                raise SampleError("the file is gone or unreadable", sample_id="<file>", path=name)
            if reader is not None and reader.stamp == now:
                self._readers.move_to_end(f)
                return reader
        if reader is not None:
            self._readers.pop(f).close()
        try:
            reader = self._open_new(name)
            self._check_schema(reader.pf, name)
        except ManifestError as err:
            raise SampleError(err.reason, sample_id="<file>", path=name) from err
        self._readers[f] = reader
        while len(self._readers) > _OPEN_FILES:
            self._readers.popitem(last=False)[1].close()
        return reader

    # -- the rows this process produces next ----------------------------------------
    def foresee(self, indices: Sequence[int] | np.ndarray) -> None:
        """The samples this process produces next, in order (``ForeseesReads``): a row
        group read from now on keeps its rows still to come (see the module docstring)."""
        rows = self.rows(self._checked(indices))
        with self._lock:
            self._foresight.foresee(rows)

    def reached(self, position: int) -> None:
        """Production has got to ``position`` of the samples foreseen."""
        with self._lock:
            self._foresight.reached(position)

    def _group(self, f: int, reader: _Reader, g: int) -> Any:
        """Row group ``g`` of file ``f``, decoded (from the LRU, else read: then its rows
        foreseen are kept for their turn). Caller holds the lock."""
        key = (f, g, reader.stamp)
        table = self._groups.get(key)
        if table is not None:
            self._groups.move_to_end(key)
            return table
        wanted = [c for c in (self.columns["image"], self.columns["text"], self.columns["id"]) if c]
        table = reader.pf.read_row_group(g, columns=list(dict.fromkeys(wanted)))
        self.group_reads += 1
        self._decoded_bytes += table.nbytes
        # Kept rows only where the groups outgrow the budget: where they all fit, the LRU
        # reads each group once and copying rows out of it would only cost.
        every_group = self._decoded_bytes / self.group_reads * self._group_count
        if self._foresight.active and every_group > self.row_group_memory:
            self._keep_foreseen(f, reader, g, table)
        self._groups[key] = table
        self._group_bytes += table.nbytes
        # The rows kept for their turn come first: the groups get what they leave.
        room = self.row_group_memory - self._foresight.nbytes
        while len(self._groups) > 1 and self._group_bytes > room:
            self._group_bytes -= self._groups.popitem(last=False)[1].nbytes
        return table

    def _keep_foreseen(self, f: int, reader: _Reader, g: int, table: Any) -> None:
        """Keep the rows of a group just read that this process produces later, soonest
        first, while the foresight's budget has room: each row's cells as Python values
        (its own bytes, freed at its turn: rows taken out of the group together would
        hold their shared buffers until the last one's turn, ~2x what they count). An
        image cell over the pipeline's byte limit is not kept (read in place at its turn,
        refused there before its bytes are copied). Caller holds the lock."""
        import pyarrow as pa

        lo = int(self._file_start[f]) + int(reader.starts[g])
        hi = min(lo + table.num_rows, int(self._file_start[f + 1]))  # (a file that grew)
        rows, turns = self._foresight.wanted(lo, hi)
        if not rows.size:
            return
        image = self.columns["image"]
        if image is not None:
            sizes = _cell_sizes(table.column(image))
            if sizes is None:
                return  # cells image_cell refuses: read in place, refused there
            limit = byte_limit(self.pipeline)
            if limit is not None:
                small = sizes[rows - lo] <= limit
                rows, turns = rows[small], turns[small]
        by_turn = np.argsort(turns, kind="stable")
        rows, turns = rows[by_turn], turns[by_turn]
        taken = pa.array(rows - lo)
        cells = [
            table.column(c).take(taken).to_pylist() if c else [None] * rows.size
            for c in (self.columns["id"], self.columns["text"], image)
        ]
        kind = table.column(image).type if image is not None else None
        for row, turn, rid, text, cell in zip(rows.tolist(), turns.tolist(), *cells, strict=True):
            size = _py_size(rid) + _py_size(text) + _py_size(cell) + _KEPT_OVERHEAD
            if not self._foresight.keep(row, turn, (reader.stamp, rid, text, cell, kind), size):
                break  # every kept row comes sooner than this one and the ones after it

    def _cells(self, table: Any, k: int) -> tuple[Any, Any, Any]:
        """Row ``k`` of a decoded group: its id and text (Python values) and its image cell
        (a pyarrow scalar, for :func:`image_cell`); None where there is no such column."""
        column = self.columns
        rid = table.column(column["id"])[k].as_py() if column["id"] else None
        text = table.column(column["text"])[k].as_py() if column["text"] else None
        image = table.column(column["image"])[k] if column["image"] else None
        return rid, text, image

    def read_row(self, index: int) -> tuple[bytes | None, str | None, str | None, str]:
        import pyarrow as pa

        f, r = self._place(index)
        name = self.files[f]
        where = f"{name} row {r}"
        sid = self._ids.id(index)
        self._refresh()
        if self._tables is not None and tuple(self._tables.stamps[f].tolist()) == GONE:
            raise SampleError(
                "the file is gone or unreadable (found at this epoch's check)",
                sample_id=sid,
                path=where,
            )
        with self._lock:
            try:
                reader = self._reader(f)
            except SampleError as err:
                raise SampleError(err.reason, sample_id=sid, path=where) from err
            if r >= int(reader.starts[-1]):
                raise SampleError(
                    f"the file now has {int(reader.starts[-1])} rows (it was rewritten "
                    "since the source was opened; open it again)",
                    sample_id=sid,
                    path=where,
                )
            g = int(np.searchsorted(reader.starts, r, side="right")) - 1
            k = r - int(reader.starts[g])
            row = int(self._file_start[f]) + r
            kept = self._foresight.take(row)
            if kept is not None and kept[0] == reader.stamp:  # kept from this file version
                _, now_id, value, cell, kind = kept
                image = None if kind is None else pa.scalar(cell, type=kind)
            else:
                try:
                    table = self._group(f, reader, g)
                except (pa.ArrowException, OSError) as exc:
                    raise SampleError(
                        f"cannot read row group {g}: {exc}", sample_id=sid, path=where
                    ) from exc
                self._foresight.take(row)  # the read kept this row too: it is read now
                now_id, value, image = self._cells(table, k)
        if self.columns["id"] and str(now_id) != sid:
            raise SampleError(
                f"the row's id is now {now_id!r} (the file was rewritten since the "
                "source was opened; open it again)",
                sample_id=sid,
                path=where,
            )
        text = None if value is None else str(value)
        data, image_file = None, None
        if image is not None:
            base = "" if _is_url(name) else os.path.dirname(name)
            data, image_file = image_cell(
                image,
                base,
                limit=byte_limit(self.pipeline),
                sample_id=sid,
                where=where,
            )
        return data, image_file, text, where

    # -- remote files: checked again at each epoch ---------------------------------------
    def revalidate(self) -> list[str]:
        """Check each remote file's version again (one listing per folder of files; a HEAD
        for a changed one) and take the changed files' new stamps, here and, through
        :attr:`shared_stamps`, in every process: their rows get new keys and are read
        from the new version (a row whose id moved, or that is gone, is a SampleError).
        Returns the URLs that changed (local files: none, their ``stat`` is checked at
        every batch). Raises :class:`~mmcache.errors.RemoteError` when the store cannot
        be reached."""
        if self._tables is None:
            return []
        changed = self._tables.revalidate()
        self._forget(changed)
        return [self.files[f] for f in changed]

    def _refresh(self) -> None:
        """Take the stamps another process revalidated (one ``stat`` when none did)."""
        if self._tables is not None:
            self._forget(self._tables.refresh())

    def _forget(self, changed: list[int]) -> None:
        """Close this process's readers of the ``changed`` files and drop their row
        groups: their next row is read from the new version."""
        if not changed:
            return
        with self._lock:
            for f in changed:
                reader = self._readers.pop(f, None)
                if reader is not None:
                    reader.close()
            for key in [k for k in self._groups if k[0] in changed]:
                self._group_bytes -= self._groups.pop(key).nbytes
        for f in changed:
            logger.warning("%s changed: its rows are read again", self.files[f])

    def remote_version(self) -> tuple[str, ...]:
        """The remote files' stamps (what a memory of fetched rows would depend on)."""
        if self._tables is None:
            return ()
        return tuple(keys.fields_stamp(row) for row in self._tables.stamps.tolist())

    def remote_span(self, index: int) -> tuple[str, str, int, int] | None:
        """``None``: a row's bytes are not one span of its file (they are column chunks
        of its row group, which pyarrow reads), so nothing is fetched ahead."""
        return None

    def fetch(
        self, url: str, stamp: str, start: int, end: int, *, sample_id: str, wait: bool = True
    ) -> bytes:
        """Bytes ``[start, end)`` of the remote file ``url``: one ranged GET under the
        retry policy (there is no raw tier). A ConfigError for a source of local files."""
        if self._tables is None:
            raise ConfigError(f"{self!r} reads local files: there is nothing to fetch")
        return fetch_bytes(self.remote, None, (url, stamp, start, end), sample_id=sample_id)

    def __repr__(self) -> str:
        return f"ParquetSource({len(self.files)} files, {len(self)} rows, columns={self.columns})"

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_readers"], state["_groups"], state["_lock"] = OrderedDict(), OrderedDict(), None
        state["_group_bytes"] = 0
        state["_foresight"] = Foresight(self.row_group_memory)
        state.pop("group_reads", None)  # this process's own count
        state["_decoded_bytes"] = 0
        state["_idents"], state["_refs"] = {}, {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._lock = threading.Lock()


def _cell_sizes(column: Any) -> npt.NDArray[np.int64] | None:
    """Bytes of each image cell of a decoded column (a struct's ``bytes`` field; 0 for a
    null), without copying them; None for a type whose cells are not bytes."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_struct(array.type):
        if array.type.get_field_index("bytes") < 0:
            return np.zeros(len(array), dtype=np.int64)  # paths only
        array = array.field("bytes")
    if not (pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type)):
        return None
    sizes: npt.NDArray[np.int64] = (
        pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    )
    return sizes


def _py_size(value: object) -> int:
    """Bytes of a kept cell's payload: its bytes or text (a struct's ``bytes`` and
    ``path``); the objects around it are :data:`_KEPT_OVERHEAD`."""
    if isinstance(value, bytes | str):
        return len(value)
    if isinstance(value, dict):
        return sum(_py_size(v) for v in value.values())
    return 0


if TYPE_CHECKING:  # mypy checks that ParquetSource conforms to the protocol

    def _conforms(source: ParquetSource) -> SampleSource:
        return source
