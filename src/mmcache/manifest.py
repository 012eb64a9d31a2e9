"""Manifest readers: seed JSONL and LLaVA JSON into columnar :class:`Records`.

A manifest lists the samples of a dataset: an id, an image reference and a text.
:func:`read_manifest` parses one and returns :class:`Records`, which keeps every
column as a pair of numpy arrays (UTF-8 bytes concatenated in a ``uint8`` buffer
plus ``int64`` offsets) instead of a list of dicts or a list of str.

Why columns: DataLoader workers started with ``fork`` share the parent's pages
copy-on-write, but merely *reading* a Python object writes its reference count,
so touching every row of a list of dicts copies every page that holds one, in
every worker (pytorch/pytorch#13246): memory grows with workers and with time.
A numpy buffer is one object whose data pages are only ever read, so they stay
shared. Strings are decoded on access, which costs about a microsecond per field,
negligible next to an image decode.

Supported formats (``format="auto"`` picks LLaVA when the first byte after an
optional UTF-8 BOM and whitespace is ``[``, JSONL otherwise):

* **jsonl** (the seed format): one JSON object per line with ``id`` (string),
  ``image_path`` (string) and ``caption`` (string); other keys are ignored.
* **llava**: a JSON array of ``{"id", "image", "conversations"}`` objects as in
  the LLaVA instruction-tuning data; see :func:`llava_text` for how the text is
  built and :func:`read_manifest` for the details.

>>> import json, os, tempfile
>>> folder = tempfile.mkdtemp()
>>> path = os.path.join(folder, "train.jsonl")
>>> with open(path, "w", encoding="utf-8") as f:
...     _ = f.write(json.dumps({"id": "a", "image_path": "img/a.jpg", "caption": "a cat"}) + "\\n")
>>> records = read_manifest(path)
>>> len(records), records.id(0), records.text(0)
(1, 'a', 'a cat')
>>> records.image_path(0) == os.path.join(folder, "img", "a.jpg")
True
"""

from __future__ import annotations

import array
import itertools
import json
import logging
import operator
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.errors import ConfigError, ManifestError

__all__ = ["IMAGE_TOKEN", "Records", "Reject", "llava_text", "read_manifest"]

_log = logging.getLogger(__name__)

#: The placeholder LLaVA puts in a turn where the image goes; removed from texts.
IMAGE_TOKEN = "<image>"  # noqa: S105 (a placeholder token, not a password)

_BOM = b"\xef\xbb\xbf"
_ON_ERROR = ("raise", "skip")
_FORMATS = ("auto", "jsonl", "llava")
_MISSING = object()

# A NUL (JSON "\u0000") can never be in a file name: os.open would raise a bare
# ValueError when the sample is loaded, far from the manifest line at fault.
_NUL_REASON = "{key!r} contains a NUL byte (\\u0000), which no file name can hold"

# The decoder json.loads uses, called directly: it skips per-call argument checks
# that cost a tenth of the parse time on short lines.
_decode = json.JSONDecoder().decode

_JSON_TYPE_NAMES: dict[type, str] = {
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


@dataclass(frozen=True)
class Reject:
    """A record that ``on_error="skip"`` left out, and why.

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

    Pickling copies the column buffers (a few bytes per character plus 8 bytes
    per row per column) and drops the :meth:`index_of` table, which a spawned
    worker rebuilds only if it calls :meth:`index_of`.

    Build one with :func:`read_manifest`; the constructor is internal.
    """

    source: str
    """The manifest path as given to :func:`read_manifest`."""
    format: str
    """``"jsonl"`` or ``"llava"``."""
    rejects: list[Reject]
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
        rejects: list[Reject],
    ) -> None:
        self.source = source
        self.format = format
        self.rejects = rejects
        # Absolute folder of the manifest, fixed when it was read, so a worker
        # with another working directory resolves relative image paths the same way.
        self._base_dir = base_dir
        self._id_buf, self._id_off = ids
        self._text_buf, self._text_off = texts
        self._image_buf, self._image_off = images
        self._has_image = has_image
        self._lines = lines
        self._n = len(lines)
        # (sorted xxh3_64 hashes of the ids, row of each); built by index_of.
        self._index: tuple[npt.NDArray[np.uint64], _I64] | None = None

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
        i = self._row(i)
        return _field(self._id_buf, self._id_off, i)

    def ids(self, rows: npt.NDArray[np.integer[Any]]) -> list[str]:
        """Return the ids of ``rows`` (in range, not negative): what a batch's ``"id"`` holds.

        Same as ``[self.id(i) for i in rows]`` with one vectorised offset lookup
        and the bytes decoded straight from the buffer (the loader asks it for
        every batch).
        """
        view = self._id_buf.data
        starts = self._id_off[rows].tolist()
        stops = self._id_off[rows + 1].tolist()
        return [str(view[a:b], "utf-8") for a, b in zip(starts, stops, strict=True)]

    def text(self, i: int) -> str:
        """Return the text of row ``i``: the caption (JSONL) or :func:`llava_text` (LLaVA)."""
        i = self._row(i)
        return _field(self._text_buf, self._text_off, i)

    def has_image(self, i: int) -> bool:
        """Return whether row ``i`` has an image (only LLaVA text-only rows have none)."""
        return bool(self._has_image[self._row(i)])

    def image_path(self, i: int) -> str | None:
        """Return the image of row ``i`` as an absolute path, or ``None`` for a text-only row.

        A relative reference is joined with the manifest's folder; the result goes
        through :func:`os.path.normpath` (so ``"img/../x.jpg"`` becomes ``"x.jpg"``)
        but symlinks are not resolved. References that climb out of the manifest's
        folder (``"../images/x.jpg"``) are allowed: datasets often keep images next
        to the folder of their manifest.
        """
        i = self._row(i)
        if not self._has_image[i]:
            return None
        ref = _field(self._image_buf, self._image_off, i)
        return os.path.normpath(os.path.join(self._base_dir, ref))

    def line(self, i: int) -> int:
        """Return where row ``i`` came from: its 1-based line (JSONL) or record index (LLaVA)."""
        return int(self._lines[self._row(i)])

    # -- ids ----------------------------------------------------------------

    def index_of(self, sample_id: str) -> int:
        """Return the row of ``sample_id``; raise :class:`KeyError` if it is not there.

        The first call builds a table of sorted 64-bit hashes of the ids (16 bytes
        per row, about 0.2 s per million rows); each lookup is then a binary
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

    def ids_digest(self) -> str:
        """Return a digest of every id in row order (16 hex digits, xxh3_64): equal for
        two manifests exactly when they list the same ids in the same order, but for
        a 2**-64 chance. One pass over the id buffer and its offsets (no per-row
        objects); a resumed loader compares it with the one it saved."""
        start, stop = int(self._id_off[0]), int(self._id_off[-1])
        hasher = xxhash.xxh3_64()
        hasher.update(np.ascontiguousarray(self._id_buf[start:stop]).data)
        hasher.update(np.ascontiguousarray(self._id_off - start, dtype="<i8").data)
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
        if self._index is not None:
            arrays.extend(self._index)
        return sum(int(a.nbytes) for a in arrays)

    def __repr__(self) -> str:
        return (
            f"Records(source={self.source!r}, format={self.format!r}, "
            f"len={self._n}, rejects={len(self.rejects)})"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_index"] = None  # cheap to rebuild, doubles the pickle otherwise
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


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


def _describe(value: object) -> str:
    """Name a JSON value's type and show a bounded preview of it, for messages."""
    kind = _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
    if isinstance(value, list):
        return f"{kind} of {len(value)} items"
    if isinstance(value, dict):
        return f"{kind} with {len(value)} keys"
    if isinstance(value, str) and len(value) > 40:
        value = value[:37] + "..."  # cut before dumping: a bad value may be huge
    return f"{kind} {json.dumps(value, ensure_ascii=False)}"


class _Builder:
    """Collects validated rows as UTF-8 bytes and applies the ``on_error`` policy.

    Duplicate ids are found with a dict from the id's UTF-8 bytes to the line of
    its first occurrence: exact (no hash collisions to handle), O(1) per record,
    and it lives only while parsing.
    """

    def __init__(self, source: str, on_error: str, where: str) -> None:
        self.source = source
        self.on_error = on_error
        self.where = where  # "line" (JSONL) or "record" (LLaVA), for messages
        self.ids = _Column()
        self.texts = _Column()
        self.images = _Column()
        self.has_image = bytearray()
        self.lines = array.array("q")
        self.first_line: dict[bytes, int] = {}
        self.count = 0
        self.rejects: list[Reject] = []

    def reject(
        self,
        reason: str,
        line: int | None,
        sample_id: str | None = None,
        cause: BaseException | None = None,
    ) -> None:
        if self.on_error == "raise":
            raise ManifestError(reason, path=self.source, line=line, sample_id=sample_id) from cause
        self.rejects.append(Reject(self.source, line, sample_id, reason))

    def add(self, line: int, sample_id: str, text: str, image: str | None) -> None:
        try:
            id_bytes = sample_id.encode("utf-8")
        except UnicodeEncodeError as exc:
            self.reject("'id' contains an unpaired surrogate (\\u escape)", line, None, exc)
            return
        try:
            text_bytes = text.encode("utf-8")
            image_bytes = b"" if image is None else image.encode("utf-8")
        except UnicodeEncodeError as exc:
            self.reject("a field contains an unpaired surrogate (\\u escape)", line, sample_id, exc)
            return
        first = self.first_line.get(id_bytes)
        if first is not None:
            self.reject(f"duplicate id (first seen at {self.where} {first})", line, sample_id)
            return
        self.first_line[id_bytes] = line
        self.ids.append(id_bytes)
        self.texts.append(text_bytes)
        self.images.append(image_bytes)
        self.has_image.append(image is not None)
        self.lines.append(line)
        self.count += 1

    def finish(self, format: str) -> Records:
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
            base_dir=os.path.dirname(os.path.abspath(self.source)),
            ids=self.ids.build(),
            texts=self.texts.build(),
            images=self.images.build(),
            has_image=np.frombuffer(self.has_image, dtype=np.bool_).copy(),
            lines=np.frombuffer(self.lines, dtype=np.int64).copy(),
            rejects=self.rejects,
        )


def _string_field(obj: Mapping[str, Any], key: str) -> tuple[str | None, str | None]:
    """Return ``(value, None)`` or ``(None, reason)`` for a required string key."""
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        return None, f"missing key {key!r}"
    if not isinstance(value, str):
        return None, f"{key!r} must be a string, got {_describe(value)}"
    return value, None


def _read_jsonl(f: BinaryIO, builder: _Builder) -> None:
    # Iterating a binary file splits on b"\n" only, so U+2028 or U+0085 inside a
    # caption (legal raw in JSON strings) never splits a record, and a line of any
    # length is read in linear time. A trailing "\r" (CRLF) is JSON whitespace.
    for lineno, physical in enumerate(f, 1):
        raw = physical[len(_BOM) :] if lineno == 1 and physical.startswith(_BOM) else physical
        if not raw or raw.isspace():
            continue
        try:
            line_text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = raw[exc.start : exc.start + 1]
            builder.reject(
                f"line is not valid UTF-8 (byte {bad!r} at offset {exc.start} of the line)",
                lineno,
                None,
                exc,
            )
            continue
        try:
            obj = _decode(line_text)
        except json.JSONDecodeError as exc:
            builder.reject(f"malformed JSON: {exc.msg} (column {exc.colno})", lineno, None, exc)
            continue
        except RecursionError as exc:
            builder.reject("malformed JSON: nested too deeply", lineno, None, exc)
            continue
        if type(obj) is dict:
            sample_id = obj.get("id")
            image = obj.get("image_path")
            caption = obj.get("caption")
            # Fast path for the common, valid record (json only makes exact str).
            if (
                type(sample_id) is str
                and sample_id
                and type(image) is str
                and image
                and "\x00" not in image
                and type(caption) is str
            ):
                builder.add(lineno, sample_id, caption, image)
                continue
        reason, known_id = _jsonl_problem(obj)
        builder.reject(reason, lineno, known_id)


def _jsonl_problem(obj: object) -> tuple[str, str | None]:
    """Return why a decoded JSONL line is not a valid record, and its id if readable."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {_describe(obj)}", None
    sample_id, reason = _string_field(obj, "id")
    if sample_id is None:
        return reason or "", None
    if not sample_id:
        return "'id' is empty", None
    for key in ("image_path", "caption"):
        value, reason = _string_field(obj, key)
        if value is None:
            return reason or "", sample_id
        if key == "image_path" and not value:
            return "'image_path' is empty", sample_id
        if key == "image_path" and "\x00" in value:
            return _NUL_REASON.format(key="image_path"), sample_id
    raise AssertionError(f"a valid record reached _jsonl_problem: {obj!r}")  # pragma: no cover


def llava_text(conversations: Iterable[Mapping[str, str]]) -> str:
    """Return the text of a LLaVA record: one line per turn, ``"{from}: {value}"``.

    Turns are joined with ``"\\n"``. In each value every :data:`IMAGE_TOKEN`
    (``"<image>"``) is removed, then leading and trailing newlines are stripped
    (LLaVA writes ``"<image>\\nQuestion"`` or ``"Question\\n<image>"``); nothing
    else is changed, so ``value`` is ``turn["value"].replace("<image>", "").strip("\\n")``.

    >>> llava_text([{"from": "human", "value": "<image>\\nWhat is this?"},
    ...             {"from": "gpt", "value": "A cat."}])
    'human: What is this?\\ngpt: A cat.'
    """
    return "\n".join(
        f"{turn['from']}: {turn['value'].replace(IMAGE_TOKEN, '').strip(chr(10))}"
        for turn in conversations
    )


def _conversation_problem(conversations: object) -> str | None:
    if conversations is _MISSING:
        return "missing key 'conversations'"
    if not isinstance(conversations, list):
        return f"'conversations' must be an array, got {_describe(conversations)}"
    if not conversations:
        return "'conversations' is empty"
    for k, turn in enumerate(conversations):
        if not isinstance(turn, dict):
            return f"conversations[{k}] must be an object, got {_describe(turn)}"
        for key in ("from", "value"):
            value, reason = _string_field(turn, key)
            if value is None:
                return f"conversations[{k}]: {reason}"
    return None


def _read_llava(f: BinaryIO, builder: _Builder) -> None:
    data = f.read()
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    if not data.strip():
        return  # finish() reports the empty manifest
    # One JSON document: an error anywhere makes the whole file unreadable, so
    # these are whole-file errors (line=None) even under on_error="skip".
    try:
        document = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        text_line = data.count(b"\n", 0, exc.start) + 1
        raise ManifestError(
            f"file is not valid UTF-8 (byte {data[exc.start : exc.start + 1]!r} "
            f"at byte offset {exc.start}, text line {text_line})",
            path=builder.source,
        ) from exc
    except json.JSONDecodeError as exc:
        raise ManifestError(
            f"malformed JSON: {exc.msg} (text line {exc.lineno}, column {exc.colno})",
            path=builder.source,
        ) from exc
    except RecursionError as exc:
        raise ManifestError("malformed JSON: nested too deeply", path=builder.source) from exc
    if not isinstance(document, list):
        raise ManifestError(
            f"expected a JSON array of LLaVA records, got {_describe(document)}",
            path=builder.source,
        )
    for index, rec in enumerate(document, 1):
        if not isinstance(rec, dict):
            builder.reject(f"record must be a JSON object, got {_describe(rec)}", index)
            continue
        raw_id = rec.get("id", _MISSING)
        if raw_id is _MISSING:
            builder.reject("missing key 'id'", index)
            continue
        # LLaVA's own files use string ids, but converted datasets often carry ints.
        if isinstance(raw_id, int) and not isinstance(raw_id, bool):
            raw_id = str(raw_id)
        if not isinstance(raw_id, str):
            builder.reject(f"'id' must be a string or an integer, got {_describe(raw_id)}", index)
            continue
        if not raw_id:
            builder.reject("'id' is empty", index)
            continue
        image = rec.get("image")
        if isinstance(image, list):
            builder.reject(
                "'image' is an array: multi-image records are not supported", index, raw_id
            )
            continue
        if image is not None and not isinstance(image, str):
            builder.reject(f"'image' must be a string, got {_describe(image)}", index, raw_id)
            continue
        if image == "":
            builder.reject("'image' is empty", index, raw_id)
            continue
        if image is not None and "\x00" in image:
            builder.reject(_NUL_REASON.format(key="image"), index, raw_id)
            continue
        conversations = rec.get("conversations", _MISSING)
        problem = _conversation_problem(conversations)
        if problem is not None:
            builder.reject(problem, index, raw_id)
            continue
        builder.add(index, raw_id, llava_text(conversations), image)


def _sniff(f: BinaryIO) -> str:
    """Return "llava" if the first byte past a BOM and whitespace is ``[``, else "jsonl"."""
    first = True
    while True:
        chunk = f.read(1 << 16)
        if not chunk:
            break
        if first and chunk.startswith(_BOM):
            chunk = chunk[len(_BOM) :]
        first = False
        chunk = chunk.lstrip()
        if chunk:
            f.seek(0)
            return "llava" if chunk.startswith(b"[") else "jsonl"
    f.seek(0)
    return "jsonl"  # blank file: the JSONL reader reports "no records"


def read_manifest(
    path: str | os.PathLike[str],
    *,
    on_error: Literal["raise", "skip"] = "raise",
    format: Literal["auto", "jsonl", "llava"] = "auto",
) -> Records:
    """Read a manifest into :class:`Records`.

    **JSONL** (the seed format): one JSON object per line with ``id`` (non-empty
    string), ``image_path`` (non-empty string) and ``caption`` (string, may be
    empty); other keys are ignored. A UTF-8 BOM at the start, CRLF line ends and
    blank or whitespace-only lines are accepted; ``line`` numbers count every
    physical line, blank ones included. Lines have no length limit.

    **LLaVA**: a JSON array of objects with ``id`` (string, or an integer, which
    is converted with ``str``), ``image`` (string; absent or ``null`` makes a
    text-only record whose :meth:`Records.image_path` is ``None``; a list of
    images is rejected) and ``conversations`` (a non-empty array of
    ``{"from": str, "value": str}``), whose text is :func:`llava_text`. Row
    ``line`` is the 1-based index of the record in the array.

    Image references are relative to the manifest's folder (``../`` may climb out
    of it) or absolute; see :meth:`Records.image_path`.

    ``format="auto"`` reads LLaVA when the first byte after a BOM and whitespace
    is ``[``, JSONL otherwise.

    Errors: with ``on_error="raise"`` the first bad record raises
    :class:`~mmcache.errors.ManifestError` naming the file, the line and the id
    when it could be read. Bad records are: a line that is not UTF-8 or not JSON
    or not an object, a missing key, a key of the wrong type, an empty id or image
    path, an image path containing a NUL character (``\\u0000``), and a duplicate
    id. With ``on_error="skip"`` such records are left out and listed in
    :attr:`Records.rejects` (for a duplicate id the first record is kept), and one
    warning with the count is logged. Whole-file problems raise
    ``ManifestError`` (``line=None``) under both policies: a missing or unreadable
    file, a LLaVA file that is not one valid JSON array, and a manifest with no
    valid record at all.

    Thread-safe and reentrant (no shared state). Raises
    :class:`~mmcache.errors.ConfigError` for an unknown ``on_error`` or ``format``.
    """
    if on_error not in _ON_ERROR:
        raise ConfigError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
    if format not in _FORMATS:
        raise ConfigError(f"format must be one of {_FORMATS}, got {format!r}")
    source = os.fspath(path)
    if not isinstance(source, str):
        raise ConfigError(f"path must be a str or os.PathLike[str], got {source!r}")
    try:
        with open(source, "rb") as f:
            kind = _sniff(f) if format == "auto" else format
            if kind == "llava":
                builder = _Builder(source, on_error, "record")
                _read_llava(f, builder)
            else:
                builder = _Builder(source, on_error, "line")
                _read_jsonl(f, builder)
    except FileNotFoundError as exc:
        raise ManifestError("file not found", path=source) from exc
    except OSError as exc:
        raise ManifestError(f"cannot read the file: {exc.strerror or exc}", path=source) from exc
    return builder.finish(kind)
