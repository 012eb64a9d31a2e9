"""Columnar records: the rows of a manifest held in numpy buffers (:class:`Records`).

Every column is a pair of numpy arrays (UTF-8 bytes concatenated in a ``uint8``
buffer plus ``int64`` offsets) instead of a list of dicts or a list of str.

Why columns: DataLoader workers started with ``fork`` share the parent's pages
copy-on-write, but merely *reading* a Python object writes its reference count,
so touching every row of a list of dicts copies every page that holds one, in
every worker (pytorch/pytorch#13246): memory grows with workers and with time.
A numpy buffer is one object whose data pages are only ever read, so they stay
shared. Strings are decoded on access, negligible next to an image decode.

A reader (:mod:`mmcache.sources.readers`) fills a :class:`RecordsBuilder`, which
validates ids, applies the ``on_error`` policy and builds the columns.

Chat records (LLaVA ``conversations``, ``messages``) also keep their structured
conversation in a column of its own (:meth:`Records.chat`: ``(role, content)`` pairs with
the ``<image>`` placeholders left in), and may list several images (held in the image
column NUL-separated, since no path can hold a NUL; :meth:`Records.image_paths`).
"""

from __future__ import annotations

import array
import copy
import itertools
import json
import logging
import operator
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.errors import ManifestError
from mmcache.sources.colfile import ColumnFileError, Mapped
from mmcache.sources.ids import IdColumn, duplicate_message

#: An image reference that is a URL (``scheme://``, but not a Windows drive ``C:\\``).
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")

__all__ = ["RecordReject", "Records", "RecordsBuilder"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecordReject:
    """A manifest record that ``on_error="skip"`` left out at read time, and why.

    ``line`` is the 1-based line (JSONL) or 1-based record index (LLaVA array);
    ``sample_id`` is ``None`` when the id could not be read.
    """

    path: str
    line: int | None
    sample_id: str | None
    reason: str

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        ident = "" if self.sample_id is None else f" (id {self.sample_id!r})"
        return f"{where}{ident}: {self.reason}"


_U8 = npt.NDArray[np.uint8]
_I64 = npt.NDArray[np.int64]


class Records:
    """The records of one manifest, held in numpy buffers (no per-row Python objects).

    Row ``i`` has an id (:meth:`id`), an image path (:meth:`image_path`, ``None``
    for text-only LLaVA records), a text (:meth:`text`) and the place it came from
    (:meth:`line`). Indices follow sequence rules: negative ones count from the end,
    numpy integers are accepted, out-of-range ones raise :class:`IndexError`.

    Thread and process safety: a ``Records`` is immutable once built, so any number
    of threads and forked processes may read it at once; reads never write to the
    shared buffers, so forked workers do not copy them. The lookup table behind
    :meth:`index_of` is built on first use in each process (two threads racing on
    the first call both build it; one copy wins; results are the same).

    Records read by :func:`~mmcache.sources.readers.read_manifest` usually map this
    node's column file of the manifest (:mod:`mmcache.sources.nodecolumns`): their
    buffers are the page cache's, shared by every process, and they pickle as the
    file's path (a spawned worker maps it again). Other Records pickle their column
    buffers (a few bytes per character plus 8 bytes per row per column). Either way
    the :meth:`index_of` table is dropped, and rebuilt only where :meth:`index_of` is
    called.

    Build one with :func:`~mmcache.sources.readers.read_manifest` (or a
    :class:`RecordsBuilder`); the constructor is internal.
    """

    source: str
    """The manifest path as given to :func:`~mmcache.sources.readers.read_manifest`."""
    format: str
    """The reader that parsed it: ``"jsonl"``, ``"llava"`` or a registered one."""
    rejects: list[RecordReject]
    """Records skipped under ``on_error="skip"`` (empty under ``"raise"``)."""

    def __init__(
        self,
        *,
        source: str,
        format: str,
        base_dir: str,
        ids: tuple[_U8, _I64],
        texts: tuple[_U8, _I64],
        images: tuple[_U8, _I64],
        has_image: npt.NDArray[np.bool_],
        lines: _I64,
        rejects: list[RecordReject],
        chats: tuple[_U8, _I64] | None = None,
        videos: tuple[_U8, _I64] | None = None,
        video_dir: str | None = None,
        paths: tuple[_U8, _I64] | None = None,
        mapped: Mapped | None = None,
    ) -> None:
        self.source = source
        self.format = format
        self.rejects = rejects
        # Absolute folder of the manifest, fixed when it was read, so a worker
        # with another working directory resolves relative image paths the same way.
        self._base_dir = base_dir
        # Where relative video references resolve (LLaVA's --video_folder): base_dir
        # unless a reader of a recipe's file names another (see with_video_dir).
        self._video_dir = base_dir if video_dir is None else video_dir
        self._id_buf, self._id_off = ids
        # The ids as every source holds them (sources/ids.py): id, ids and their digest.
        self._id_col = IdColumn(len(lines), self._id_buf, self._id_off)
        self._text_buf, self._text_off = texts
        self._image_buf, self._image_off = images
        self._has_image = has_image
        self._lines = lines
        self._n = len(lines)
        # The structured conversations as JSON ([[role, content], ...]; b"" for a row
        # that has none), or None when no row has one.
        self._chats = chats
        # The video parts as JSON ([{"video": ref, "fps": ...}, ...]; b"" for a row that
        # has none), or None when no row has one.
        self._videos = videos
        # (sorted xxh3_64 hashes of the ids, row of each); built by index_of.
        self._index: tuple[npt.NDArray[np.uint64], _I64] | None = None
        # The absolute paths of image_path, encoded, as one buffer + offsets: read from
        # the node's column file (mapped), or built by stat_paths (the per-epoch file
        # check) on first use, in each process.
        # (Two attributes, not a pair: no container is held beside the arrays.)
        self._path_buf: _U8 | None = None if paths is None else paths[0]
        self._path_off: _I64 | None = None if paths is None else paths[1]
        # The column file every buffer above maps (None: they are this process's own);
        # pickled as its path, so a spawned worker maps the file instead of copying.
        self._mapped = mapped

    # -- rows ---------------------------------------------------------------

    def __len__(self) -> int:
        return self._n

    def _row(self, i: int) -> int:
        i = operator.index(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"record index {i} is out of range for {self._n} records")
        return i

    def id(self, i: int) -> str:
        """Return the id of row ``i``."""
        return self._id_col.id(self._row(i))

    def ids(self, rows: npt.NDArray[np.integer[Any]]) -> list[str]:
        """Return the ids of ``rows`` (in range, not negative): what a batch's ``"id"`` holds.

        Same as ``[self.id(i) for i in rows]`` with one vectorised offset lookup
        and the bytes decoded straight from the buffer (the loader asks it for
        every batch).
        """
        return self._id_col.ids(np.asarray(rows, dtype=np.int64))

    def text(self, i: int) -> str:
        """Return the text of row ``i``: the caption (JSONL) or
        :func:`~mmcache.sources.readers.llava_text` (LLaVA)."""
        i = self._row(i)
        return _field(self._text_buf, self._text_off, i)

    def has_image(self, i: int) -> bool:
        """Return whether row ``i`` has an image (only LLaVA text-only rows have none)."""
        return bool(self._has_image[self._row(i)])

    def image_path(self, i: int) -> str | None:
        """Return the image of row ``i`` as an absolute path, or ``None`` for a text-only row
        (the first one of a multi-image row: :meth:`image_paths` lists them all).

        A relative reference is joined with the manifest's folder; the result goes
        through :func:`os.path.normpath` (so ``"img/../x.jpg"`` becomes ``"x.jpg"``)
        but symlinks are not resolved. References that climb out of the manifest's
        folder (``"../images/x.jpg"``) are allowed: datasets often keep images next
        to the folder of their manifest.
        """
        i = self._row(i)
        if not self._has_image[i]:
            return None
        ref = _field(self._image_buf, self._image_off, i).split("\x00", 1)[0]
        if _URL_RE.match(ref):  # s3://, gs://, https://...: read through blobs, never joined
            return ref
        return os.path.normpath(os.path.join(self._base_dir, ref))

    def stat_paths(self, rows: npt.NDArray[np.integer[Any]]) -> list[bytes | None]:
        """:meth:`image_path` of ``rows`` (in range, not negative) as encoded bytes, for
        ``os.stat``: what the loader's file check asks for every sample of every epoch.

        The joined, normalised paths are built once (one buffer and its offsets, no
        per-row Python objects) and sliced afterwards: joining and normalising a
        path costs more than the ``stat`` itself (measured ~5 us against ~3 us).
        """
        buf, off = self._path_table()
        view, has = buf.data, self._has_image
        starts = off[rows].tolist()
        stops = off[rows + 1].tolist()
        return [
            bytes(view[a:b]) if has[r] else None
            for r, a, b in zip(np.asarray(rows).tolist(), starts, stops, strict=True)
        ]

    def _path_table(self) -> tuple[_U8, _I64]:
        """The joined paths of :meth:`stat_paths`, built on first use in this process
        unless the column file holds them."""
        if self._path_buf is None or self._path_off is None:
            self._path_buf, self._path_off = self._joined_paths()
        return self._path_buf, self._path_off

    def _joined_paths(self) -> tuple[_U8, _I64]:
        """The table behind :meth:`stat_paths`: each row's :meth:`image_path`, encoded
        (``b""`` for a text-only row). A plain relative reference (no ``.``, ``..`` or
        empty component, no trailing ``/``) is the folder's bytes, ``/`` and its own:
        what ``normpath(join(...))`` gives it, at a fifth of the cost; any other goes
        through :meth:`image_path`."""
        base = os.fsencode(self._base_dir)
        prefix = base if base.endswith(b"/") else base + b"/"
        data = self._image_buf.tobytes()
        ends = self._image_off.tolist()
        has = self._has_image.tolist()
        col = _Column()
        for i in range(self._n):
            if not has[i]:
                col.append(b"")
                continue
            ref = data[ends[i] : ends[i + 1]].split(b"\x00", 1)[0]
            if _plain(ref):
                col.append(prefix + ref)
            else:
                col.append(os.fsencode(self.image_path(i) or ""))
        return col.build()

    def image_paths(self, i: int) -> list[str]:
        """Return every image of row ``i`` as absolute paths (see :meth:`image_path`), in
        the record's order: one for a single-image row, none for a text-only one."""
        i = self._row(i)
        if not self._has_image[i]:
            return []
        refs = _field(self._image_buf, self._image_off, i).split("\x00")
        return [os.path.normpath(os.path.join(self._base_dir, ref)) for ref in refs]

    def image_count(self, i: int) -> int:
        """Return how many images row ``i`` has (0 for a text-only row)."""
        i = self._row(i)
        if not self._has_image[i]:
            return 0
        a, b = int(self._image_off[i]), int(self._image_off[i + 1])
        return 1 + int(np.count_nonzero(self._image_buf[a:b] == 0))

    @property
    def has_chats(self) -> bool:
        """Whether the rows carry structured conversations (LLaVA or ``messages`` records)."""
        return self._chats is not None

    def chat(self, i: int) -> list[tuple[str, str]] | None:
        """Return row ``i``'s conversation as ``(role, content)`` pairs, roles normalised
        (``human`` -> ``user``, ``gpt`` -> ``assistant``) and the ``<image>`` placeholders
        kept; ``None`` for a row without one (a JSONL caption record)."""
        i = self._row(i)
        if self._chats is None:
            return None
        raw = _field(*self._chats, i)
        if not raw:
            return None
        return [(str(r), str(c)) for r, c in json.loads(raw)]

    def placeholder_counts(self, token: str) -> _I64:
        """Return how often ``token`` occurs in each row's conversation (int64 ``[N]``, 0
        for a row without one), counted in the stored JSON without decoding it: a
        token is stored as itself unless it holds a character JSON escapes, which this
        encodes the same way. (A role that contains ``token`` counts too.)"""
        out = np.zeros(self._n, dtype=np.int64)
        if self._chats is None:
            return out
        needle = json.dumps(token, ensure_ascii=False)[1:-1].encode("utf-8")
        buf, off = self._chats
        data = buf.tobytes()
        starts, stops = off[:-1].tolist(), off[1:].tolist()
        for i, (a, b) in enumerate(zip(starts, stops, strict=True)):
            out[i] = data.count(needle, a, b)
        return out

    def image_counts(self) -> _I64:
        """Return :meth:`image_count` of every row (int64 ``[N]``)."""
        nul = np.concatenate([[0], np.cumsum(self._image_buf == 0, dtype=np.int64)])
        extra = nul[self._image_off[1:]] - nul[self._image_off[:-1]]
        return np.where(self._has_image, 1 + extra, 0).astype(np.int64)

    def videos(self, i: int) -> list[dict[str, Any]]:
        """Return row ``i``'s video parts in placeholder order: ``{"video": reference, ...}``
        with the part's own options (``fps``, ``nframes``, ``video_start``...), the
        reference (or each of a frame list's) resolved as :meth:`image_path` resolves an
        image's (against the video folder when one was given, :meth:`with_video_dir`);
        ``[]`` for none."""
        i = self._row(i)
        if self._videos is None:
            return []
        raw = _field(*self._videos, i)
        parts: list[dict[str, Any]] = json.loads(raw) if raw else []
        for part in parts:
            ref = part["video"]
            if isinstance(ref, list):  # a video given as its frame images
                part["video"] = [self._resolved(r, self._video_dir) for r in ref]
            else:
                part["video"] = self._resolved(ref, self._video_dir)
        return parts

    @staticmethod
    def _resolved(ref: str, base: str) -> str:
        """A reference as :meth:`image_path` resolves it against ``base`` (a URL is kept as
        is)."""
        return ref if _URL_RE.match(ref) else os.path.normpath(os.path.join(base, ref))

    def video_json(self, i: int) -> str:
        """Return row ``i``'s video parts as the canonical JSON they are stored as (``""``
        for none): part of a video sample's cache key."""
        i = self._row(i)
        return "" if self._videos is None else _field(*self._videos, i)

    @property
    def has_videos(self) -> bool:
        """Whether any row may have video parts (their :meth:`video_json` is stored)."""
        return self._videos is not None

    def may_name_urls(self) -> bool:
        """Whether any image or video reference may be a URL (``://`` in their buffers:
        one scan of each, no per-row object); ``False`` is certain."""
        videos = self._videos[0] if self._videos is not None else np.empty(0, np.uint8)
        return any(b"://" in buf.tobytes() for buf in (self._image_buf, videos))

    def video_counts(self) -> _I64:
        """Return how many videos each row has (int64 ``[N]``)."""
        if self._videos is None:
            return np.zeros(self._n, dtype=np.int64)
        return np.array([len(self.videos(i)) for i in range(self._n)], dtype=np.int64)

    def chat_json(self, i: int) -> str:
        """Return row ``i``'s conversation as the canonical JSON it is stored as (``""``
        when it has none): what a chat pipeline's cache key is made of."""
        i = self._row(i)
        return "" if self._chats is None else _field(*self._chats, i)

    def select(self, rows: list[int], rejects: list[RecordReject]) -> Records:
        """Return the records of ``rows`` (in that order), with ``rejects`` added to
        :attr:`rejects`: how a source leaves out records it refuses after reading."""
        sources: list[tuple[_U8, _I64]] = [
            (self._id_buf, self._id_off),
            (self._text_buf, self._text_off),
            (self._image_buf, self._image_off),
        ]
        if self._chats is not None:
            sources.append(self._chats)
        if self._videos is not None:
            sources.append(self._videos)
        columns = [_Column() for _ in sources]
        for r in rows:
            for col, (buf, off) in zip(columns, sources, strict=True):
                col.append(buf[off[r] : off[r + 1]].tobytes())
        built = [c.build() for c in columns]
        picked = np.asarray(rows, dtype=np.int64)
        return Records(
            source=self.source,
            format=self.format,
            base_dir=self._base_dir,
            ids=built[0],
            texts=built[1],
            images=built[2],
            has_image=self._has_image[picked].copy(),
            lines=self._lines[picked].copy(),
            rejects=[*self.rejects, *rejects],
            chats=built[3] if self._chats is not None else None,
            videos=built[-1] if self._videos is not None else None,
            video_dir=self._video_dir,
        )

    def with_video_dir(self, folder: str | os.PathLike[str]) -> Records:
        """The same records with relative video references resolved against ``folder``
        (LLaVA-NeXT's ``--video_folder`` beside its ``--image_folder``); the buffers are
        shared, not copied."""
        out = copy.copy(self)
        out._video_dir = os.path.abspath(os.fspath(folder))
        out._index = None
        return out

    def line(self, i: int) -> int:
        """Return where row ``i`` came from: its 1-based line (JSONL) or record index (LLaVA)."""
        return int(self._lines[self._row(i)])

    # -- ids ----------------------------------------------------------------

    def index_of(self, sample_id: str) -> int:
        """Return the row of ``sample_id``; raise :class:`KeyError` if it is not there.

        The first call builds a table of sorted 64-bit hashes of the ids (16 bytes
        per row, built once per process); each lookup is then a binary
        search plus one comparison of the id itself, so hash collisions are harmless.
        """
        if not isinstance(sample_id, str):
            raise TypeError(f"sample_id must be a str, got {type(sample_id).__name__}")
        index = self._index
        if index is None:
            index = self._index = self._build_index()
        hashes, rows = index
        key = sample_id.encode("utf-8", "surrogatepass")
        h = np.uint64(xxhash.xxh3_64_intdigest(key))
        lo = int(np.searchsorted(hashes, h, side="left"))
        hi = int(np.searchsorted(hashes, h, side="right"))
        for row in rows[lo:hi].tolist():
            a, b = int(self._id_off[row]), int(self._id_off[row + 1])
            if self._id_buf[a:b].tobytes() == key:
                return int(row)
        raise KeyError(f"sample id {sample_id!r} is not in manifest {self.source}")

    def _build_index(self) -> tuple[npt.NDArray[np.uint64], _I64]:
        view = self._id_buf.data  # a memoryview: slicing it copies nothing
        offsets = self._id_off.tolist()
        hashes = np.fromiter(
            (xxhash.xxh3_64_intdigest(view[a:b]) for a, b in itertools.pairwise(offsets)),
            dtype=np.uint64,
            count=self._n,
        )
        rows = np.argsort(hashes, kind="stable").astype(np.int64)
        return hashes[rows], rows

    @property
    def id_column(self) -> IdColumn:
        """The ids as one column (what a source on the chassis names its samples by)."""
        return self._id_col

    def ids_digest(self) -> str:
        """Return a digest of every id in row order (16 hex digits, xxh3_64): equal for
        two manifests exactly when they list the same ids in the same order, but for
        a 2**-64 chance. One pass over the id buffer and its offsets (no per-row
        objects); a resumed loader compares it with the one it saved."""
        return self._id_col.digest()

    def content_digest(self) -> str:
        """Return a digest (16 hex digits) of every row's id, image references, text and
        conversation, in order: what a saved per-sample result (``lengths()``) was made
        from, besides the image files themselves."""
        hasher = xxhash.xxh3_64()
        columns = [
            (self._id_buf, self._id_off),
            (self._image_buf, self._image_off),
            (self._text_buf, self._text_off),
        ]
        if self._chats is not None:
            columns.append(self._chats)
        if self._videos is not None:
            columns.append(self._videos)
        for buf, off in columns:
            hasher.update(np.ascontiguousarray(buf).data)
            hasher.update(np.ascontiguousarray(off, dtype="<i8").data)
        hasher.update(self._base_dir.encode("utf-8", "surrogateescape"))
        if self._video_dir != self._base_dir:
            hasher.update(self._video_dir.encode("utf-8", "surrogateescape"))
        return hasher.hexdigest()

    def ids_array(self) -> npt.NDArray[np.object_]:
        """Return every id as a numpy array of ``str`` objects (built on each call, not kept).

        Meant for one-off work in the main process (joins, splits, reports): the
        result is exactly the per-row Python objects that :class:`Records` avoids
        holding, so do not keep it in a Dataset that forked workers will read.
        """
        data = self._id_buf.tobytes()
        offsets = self._id_off.tolist()
        out = np.empty(self._n, dtype=object)
        out[:] = [data[a:b].decode("utf-8") for a, b in itertools.pairwise(offsets)]
        return out

    # -- misc ---------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes held by the column buffers (the :meth:`index_of` table included once built)."""
        arrays: list[npt.NDArray[Any]] = [
            self._id_buf,
            self._id_off,
            self._text_buf,
            self._text_off,
            self._image_buf,
            self._image_off,
            self._has_image,
            self._lines,
        ]
        if self._chats is not None:
            arrays.extend(self._chats)
        if self._videos is not None:
            arrays.extend(self._videos)
        if self._index is not None:
            arrays.extend(self._index)
        return sum(int(a.nbytes) for a in arrays)

    def __repr__(self) -> str:
        return (
            f"Records(source={self.source!r}, format={self.format!r}, "
            f"len={self._n}, rejects={len(self.rejects)})"
        )

    # -- the column file -----------------------------------------------------------------

    def column_file(self) -> tuple[str, int, str] | None:
        """``(path, header digest, video folder)`` of the node's column file every buffer
        maps, or None when they are this process's own: what names these rows, every id,
        text and path of them, without reading them (a key table's identity,
        :mod:`~mmcache.sources.keytable`). The video folder is there because
        :meth:`with_video_dir` changes where the same rows' videos resolve."""
        if self._mapped is None:
            return None
        return self._mapped.path, self._mapped.digest, self._video_dir

    def column_arrays(self) -> dict[str, npt.NDArray[Any]]:
        """Every column as named arrays, the joined paths of :meth:`stat_paths` included:
        what a column file holds (:meth:`from_mapped` reads them back)."""
        pairs = {
            "ids": (self._id_buf, self._id_off),
            "texts": (self._text_buf, self._text_off),
            "images": (self._image_buf, self._image_off),
            "paths": self._path_table(),
            "chats": self._chats,
            "videos": self._videos,
        }
        out: dict[str, npt.NDArray[Any]] = {}
        for name, pair in pairs.items():
            if pair is not None:
                out[name], out[name + "_off"] = pair
        out["has_image"], out["lines"] = self._has_image, self._lines
        return out

    def column_meta(self) -> dict[str, Any]:
        """What a column file's header holds besides the arrays (JSON-able)."""
        return {
            "n": self._n,
            "format": self.format,
            "base_dir": self._base_dir,
            "rejects": [[r.line, r.sample_id, r.reason] for r in self.rejects],
        }

    @classmethod
    def from_mapped(cls, mapped: Mapped, source: str, *, warn: bool = True) -> Records:
        """The records of a column file (written from :meth:`column_arrays` and
        :meth:`column_meta`), over its mapping: no row is copied. Raises
        :class:`~mmcache.sources.colfile.ColumnFileError` when a column is missing or its
        offsets do not fit its bytes (a damaged or foreign file)."""
        meta = mapped.meta
        try:
            n, fmt, base = int(meta["n"]), str(meta["format"]), str(meta["base_dir"])
            rejects = [
                RecordReject(source, line, sid, str(why)) for line, sid, why in meta["rejects"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise ColumnFileError(f"column file {mapped.path}: malformed header ({exc})") from exc
        names = set(mapped.names())

        def pair(name: str) -> tuple[_U8, _I64] | None:
            if name not in names:
                return None
            buf = mapped.array(name, "|u1")
            return buf, mapped.offsets(name + "_off", n, int(buf.shape[0]))

        ids, texts, images, paths = pair("ids"), pair("texts"), pair("images"), pair("paths")
        if ids is None or texts is None or images is None or paths is None:
            raise ColumnFileError(f"column file {mapped.path} lacks a column of records")
        has_image, lines = mapped.array("has_image", "|b1"), mapped.array("lines", "<i8")
        if has_image.shape[0] != n or lines.shape[0] != n:
            raise ColumnFileError(f"column file {mapped.path}: columns of other lengths than {n}")
        if rejects and warn:  # as the parse that built the file warned
            _log.warning(
                "%s: skipped %d of %d records (first: %s); see Records.rejects",
                source,
                len(rejects),
                len(rejects) + n,
                rejects[0],
            )
        return cls(
            source=source,
            format=fmt,
            base_dir=base,
            ids=ids,
            texts=texts,
            images=images,
            has_image=has_image,
            lines=lines,
            rejects=rejects,
            chats=pair("chats"),
            videos=pair("videos"),
            paths=paths,
            mapped=mapped,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_index"] = None  # cheap to rebuild, doubles the pickle otherwise
        if self._mapped is None:
            state["_path_buf"] = state["_path_off"] = None
            return state
        # Mapped: the file travels as its path and the other process maps it again.
        for attr in _MAPPED_ATTRS:
            state[attr] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._mapped is not None:
            again = Records.from_mapped(self._mapped, self.source, warn=False)
            for attr in _MAPPED_ATTRS:
                setattr(self, attr, getattr(again, attr))


#: What makes a relative reference other than plain (see Records._joined_paths).
_NOT_PLAIN = (b"//", b"/./", b"/../")


def _plain(ref: bytes) -> bool:
    """Whether ``normpath(join(folder, ref))`` is ``folder + "/" + ref`` for a normalised
    absolute folder: a relative reference with no empty, ``.`` or ``..`` component and
    no ``scheme://`` (a URL is kept as it is)."""
    if not ref or ref[0] == 0x2F or ref in (b".", b".."):  # 0x2F: "/"
        return False
    if ref.startswith((b"./", b"../")) or ref.endswith((b"/", b"/.", b"/..")):
        return False
    return not any(part in ref for part in _NOT_PLAIN) and b"://" not in ref


#: What a mapped Records holds of its file (dropped when pickled, mapped again after).
_MAPPED_ATTRS = (
    "_id_buf",
    "_id_off",
    "_id_col",
    "_text_buf",
    "_text_off",
    "_image_buf",
    "_image_off",
    "_has_image",
    "_lines",
    "_chats",
    "_videos",
    "_path_buf",
    "_path_off",
)


def _field(buf: _U8, offsets: _I64, i: int) -> str:
    return buf[offsets[i] : offsets[i + 1]].tobytes().decode("utf-8")


class _Column:
    """A growing string column: UTF-8 bytes appended to one bytearray, plus end offsets.

    Appending to a bytearray (amortised growth) instead of keeping a list of bytes
    saves one Python object per field while parsing and the final join copy, which
    keeps the transient peak near the size of the result.
    """

    def __init__(self) -> None:
        self.data = bytearray()
        self.ends = array.array("q")

    def append(self, value: bytes) -> None:
        self.data += value
        self.ends.append(len(self.data))

    def build(self) -> tuple[_U8, _I64]:
        offsets = np.zeros(len(self.ends) + 1, dtype=np.int64)
        offsets[1:] = np.frombuffer(self.ends, dtype=np.int64)
        # frombuffer shares the bytearray (no copy); read-only suits an immutable table.
        buf = np.frombuffer(self.data, dtype=np.uint8)
        buf.flags.writeable = False
        return buf, offsets


class RecordsBuilder:
    """Collects validated rows as UTF-8 bytes and applies the ``on_error`` policy.

    A reader (:func:`~mmcache.sources.readers.register_reader`) calls :meth:`add`
    for each record it parsed and :meth:`reject` for each bad one; ``source`` is the
    manifest path, for whole-file errors the reader raises itself. ``unit`` names
    what a reader's ``line`` numbers count (``"line"``, ``"record"``), for messages.

    Duplicate ids are found with a dict from the id's UTF-8 bytes to the line of
    its first occurrence: exact (no hash collisions to handle), O(1) per record,
    and it lives only while parsing. One builder per read; not thread-safe.
    """

    def __init__(self, source: str, on_error: str, unit: str) -> None:
        self.source = source
        self.on_error = on_error
        self.where = unit
        self.ids = _Column()
        self.texts = _Column()
        self.images = _Column()
        self.has_image = bytearray()
        self.chats = _Column()
        self.any_chat = False
        self.videos = _Column()
        self.any_video = False
        self.lines = array.array("q")
        self.first_line: dict[bytes, int] = {}
        self.count = 0
        self.rejects: list[RecordReject] = []

    def reject(
        self,
        reason: str,
        line: int | None,
        sample_id: str | None = None,
        cause: BaseException | None = None,
    ) -> None:
        """Record that the record at ``line`` is bad: raises ManifestError under
        ``on_error="raise"``, else lists it in :attr:`Records.rejects`."""
        if self.on_error == "raise":
            raise ManifestError(reason, path=self.source, line=line, sample_id=sample_id) from cause
        self.rejects.append(RecordReject(self.source, line, sample_id, reason))

    def add(
        self,
        line: int,
        sample_id: str,
        text: str,
        image: str | list[str] | None,
        *,
        chat: list[tuple[str, str]] | None = None,
        videos: list[dict[str, Any]] | None = None,
    ) -> None:
        """Append a parsed record (``image``: a path relative to the manifest's folder
        or absolute, a list of them for a multi-image record, ``None`` or ``[]`` for a
        text-only record; ``chat``: its structured conversation, if it has one;
        ``videos``: its video parts, ``{"video": reference, option: value}``); a
        duplicate id or a string that is not valid Unicode is rejected
        (:meth:`reject`) instead."""
        if isinstance(image, list):
            image = "\x00".join(image) if image else None
        try:
            id_bytes = sample_id.encode("utf-8")
        except UnicodeEncodeError as exc:
            self.reject("'id' contains an unpaired surrogate (\\u escape)", line, None, exc)
            return
        try:
            text_bytes = text.encode("utf-8")
            image_bytes = b"" if image is None else image.encode("utf-8")
            chat_bytes = (
                b""
                if chat is None
                else json.dumps(
                    [list(turn) for turn in chat], ensure_ascii=False, separators=(",", ":")
                ).encode("utf-8")
            )
            video_bytes = (
                json.dumps(videos, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
                if videos
                else ""
            ).encode("utf-8")
        except UnicodeEncodeError as exc:
            self.reject("a field contains an unpaired surrogate (\\u escape)", line, sample_id, exc)
            return
        first = self.first_line.get(id_bytes)
        if first is not None:
            self.reject(duplicate_message(f"{self.where} {first}"), line, sample_id)
            return
        self.first_line[id_bytes] = line
        self.ids.append(id_bytes)
        self.texts.append(text_bytes)
        self.images.append(image_bytes)
        self.has_image.append(image is not None)
        self.chats.append(chat_bytes)
        self.any_chat = self.any_chat or chat is not None
        self.videos.append(video_bytes)
        self.any_video = self.any_video or bool(videos)
        self.lines.append(line)
        self.count += 1

    def finish(self, format: str, *, image_root: str | None = None) -> Records:
        """The :class:`Records` of everything added; ManifestError if there is none.
        Relative image references resolve against ``image_root`` when given, else the
        manifest's folder."""
        if not self.count:
            if not self.rejects:
                raise ManifestError("the manifest has no records", path=self.source)
            raise ManifestError(
                f"no valid records: all {len(self.rejects)} were rejected "
                f"(first: {self.rejects[0]})",
                path=self.source,
            )
        if self.rejects:
            _log.warning(
                "%s: skipped %d of %d records (first: %s); see Records.rejects",
                self.source,
                len(self.rejects),
                len(self.rejects) + self.count,
                self.rejects[0],
            )
        return Records(
            source=self.source,
            format=format,
            base_dir=os.path.abspath(image_root)
            if image_root is not None
            else os.path.dirname(os.path.abspath(self.source)),
            ids=self.ids.build(),
            texts=self.texts.build(),
            images=self.images.build(),
            has_image=np.frombuffer(self.has_image, dtype=np.bool_).copy(),
            lines=np.frombuffer(self.lines, dtype=np.int64).copy(),
            rejects=self.rejects,
            chats=self.chats.build() if self.any_chat else None,
            videos=self.videos.build() if self.any_video else None,
        )
