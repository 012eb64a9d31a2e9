"""Manifest readers: seed JSONL and LLaVA JSON (and any registered format) into columnar
:class:`~mmcache.sources.records.Records`.

A manifest lists the samples of a dataset: an id, an image reference and a text.
:func:`read_manifest` parses one with the reader registered for its format
(:func:`register_reader`, like the cache's policies) and returns Records.

Built-in formats (``format="auto"`` picks LLaVA when the first byte after an
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

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

from mmcache.errors import ConfigError, ManifestError
from mmcache.rootfiles import open_regular
from mmcache.sources.nodecolumns import load_records
from mmcache.sources.records import Records, RecordsBuilder
from mmcache.transforms.video import FRAME_LIST_KEYS, PART_KEYS

__all__ = [
    "IMAGE_TOKEN",
    "VIDEO_TOKEN",
    "Reader",
    "llava_text",
    "read_manifest",
    "reader_names",
    "register_reader",
]

#: The placeholder LLaVA puts in a turn where the image goes; removed from texts.
IMAGE_TOKEN = "<image>"  # noqa: S105 (a placeholder token, not a password)
#: The placeholder of a video in a turn (Qwen's finetuning data; a ``messages`` video part).
VIDEO_TOKEN = "<video>"  # noqa: S105 (a placeholder token, not a password)

_BOM = b"\xef\xbb\xbf"
_ON_ERROR = ("raise", "skip")
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


def _string_field(obj: Mapping[str, Any], key: str) -> tuple[str | None, str | None]:
    """Return ``(value, None)`` or ``(None, reason)`` for a required string key."""
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        return None, f"missing key {key!r}"
    if not isinstance(value, str):
        return None, f"{key!r} must be a string, got {_describe(value)}"
    return value, None


#: Deepest nesting of arrays/objects a JSONL record may have. Deeper lines are refused
#: before the decoder sees them: the C decoder recurses once per level and would stop
#: at Python's recursion limit, and a finalizer run by the garbage collector that deep
#: fails in turn (an "unraisable" RecursionError far from the manifest).
MAX_JSON_DEPTH = 256
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _too_deep(text: str) -> bool:
    """Whether ``text`` nests arrays/objects deeper than :data:`MAX_JSON_DEPTH` (strings
    ignored). Cheap for ordinary lines: a count of brackets settles it."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False
    depth = deepest = 0
    for ch in _JSON_STRING.sub("", text):
        if ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_JSON_DEPTH:
                    return True
        elif ch in "]}":
            depth -= 1
    return False


def _read_jsonl(f: BinaryIO, builder: RecordsBuilder) -> None:
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
        if _too_deep(line_text):
            builder.reject(
                f"malformed JSON: nested too deeply (more than {MAX_JSON_DEPTH} levels)",
                lineno,
                None,
                None,
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
        if type(obj) is dict and ("conversations" in obj or "messages" in obj):
            _chat_record(obj, lineno, builder)  # a LLaVA / messages record on one line
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


def _read_llava(f: BinaryIO, builder: RecordsBuilder) -> None:
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
        _chat_record(rec, index, builder)


#: LLaVA's and ShareGPT's speaker names -> chat-template roles (others are kept as given).
ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "system": "system",
}


def _images_of(rec: Mapping[str, Any]) -> tuple[list[str] | None, str | None]:
    """The image references of a chat record (``image``: a string or an array of them;
    ``images``: an array), or ``(None, reason)``."""
    key = "images" if "images" in rec and rec.get("image") is None else "image"
    value = rec.get(key)
    if value is None:
        return [], None
    items = value if isinstance(value, list) else [value]
    if not isinstance(value, list) and not isinstance(value, str):
        return None, f"{key!r} must be a string, got {_describe(value)}"
    for k, item in enumerate(items):
        where = key if not isinstance(value, list) else f"{key}[{k}]"
        if not isinstance(item, str):
            return None, f"{where!r} must be a string, got {_describe(item)}"
        if item == "":
            return None, f"{where!r} is empty"
        if "\x00" in item:
            return None, _NUL_REASON.format(key=where)
    return list(items), None


def _reference(value: object, where: str, noun: str = "path") -> tuple[str | None, str | None]:
    """A file reference (a path or URL; Qwen's ``file://`` prefix dropped: a local
    path, not an object store URL) or ``(None, reason)``."""
    if not isinstance(value, str) or not value:
        return None, f"{where} must be a non-empty {noun}, got {_describe(value)}"
    if "\x00" in value:
        return None, _NUL_REASON.format(key=where)
    return value.removeprefix("file://"), None


def _frame_list(value: list[Any], where: str) -> tuple[list[str] | None, str | None]:
    """A video given as a list of frame images (qwen-vl-utils, LLaVA-Video's frame
    folders, InternVL, LlamaFactory), or ``(None, reason)``."""
    if not value:
        return None, f"{where} is an empty list of frames"
    frames: list[str] = []
    for k, item in enumerate(value):
        ref, reason = _reference(item, f"{where}[{k}]")
        if ref is None:
            return None, reason
        frames.append(ref)
    return frames, None


def _video_part(part: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """A ``{"type": "video", "video": ref, "fps"...}`` part as the record's video part
    (the reference, or a list of frame images, and the options of
    :data:`~mmcache.transforms.video.PART_KEYS`; a frame list also takes qwen-vl-utils'
    ``sample_fps`` and ``raw_fps``), or ``(None, reason)``."""
    ref = part.get("video")
    video: str | list[str] | None
    if isinstance(ref, list):
        video, reason = _frame_list(ref, "a video part's 'video'")
        keys: tuple[str, ...] = (*PART_KEYS, *FRAME_LIST_KEYS)
    else:
        video, reason = _reference(ref, "a video part's 'video'")
        keys = PART_KEYS
    if video is None:
        return None, reason
    out: dict[str, Any] = {"video": video}
    for key in keys:
        value = part.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            return None, f"a video part's {key!r} must be a number >= 0, got {_describe(value)}"
        if key in FRAME_LIST_KEYS and value <= 0:
            return None, f"a video part's {key!r} must be a number > 0, got {_describe(value)}"
        out[key] = value
    if "fps" in out and "nframes" in out:
        return None, "a video part takes 'fps' or 'nframes', not both"
    return out, None


def _videos_of(rec: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The videos of a LLaVA-style record (``video``: a path, or an array of videos,
    each a path or an array of frame images), as video parts, or ``(None, reason)``."""
    value = rec.get("video")
    if value is None:
        return [], None
    items = value if isinstance(value, list) else [value]
    out: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        where = "'video'" if not isinstance(value, list) else f"'video[{k}]'"
        if isinstance(item, list):
            frames, reason = _frame_list(item, where)
            if frames is None:
                return None, reason
            out.append({"video": frames})
            continue
        ref, reason = _reference(item, where, "string")
        if ref is None:
            return None, reason
        out.append({"video": item})
    return out, None


#: The per-image options of Qwen's image parts that mmcache does not apply per image
#: (refused, so that no image is silently sized otherwise than the record says).
_IMAGE_PART_OPTIONS = ("min_pixels", "max_pixels", "resized_height", "resized_width")


def _image_part(part: Mapping[str, Any], images: list[str | None]) -> None:
    """An image part: its inline reference (Qwen's ``{"type": "image", "image": path}``)
    appended to ``images``, or ``None`` for a bare ``{"type": "image"}`` (its image is
    in the record's ``images``). ValueError with the reason for a bad one."""
    options = [k for k in _IMAGE_PART_OPTIONS if part.get(k) is not None]
    if options:
        raise ValueError(
            f"an image part's {options} are not applied per image: size images with the "
            "pipeline's image stage (SmartResize / hf_processor's min_pixels, max_pixels)"
        )
    if "image" not in part or part["image"] is None:
        images.append(None)
        return
    ref, reason = _reference(part["image"], "an image part's 'image'")
    if ref is None:
        raise ValueError(reason)
    images.append(ref)


def _content_text(
    content: object, videos: list[dict[str, Any]], images: list[str | None]
) -> str | None:
    """A message's content as text: a string, or a list of ``{"type": "text", "text"}``,
    ``{"type": "image"}`` (optionally with its ``"image"`` path, Qwen's inline form)
    and ``{"type": "video", "video": ...}`` parts (an image part becomes
    :data:`IMAGE_TOKEN`, its reference or ``None`` appended to ``images``; a video part
    :data:`VIDEO_TOKEN`, its part appended to ``videos``). A bad image or video part
    raises ValueError with the reason."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            return None
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "image" or (kind is None and "image" in part):
            _image_part(part, images)
            parts.append(IMAGE_TOKEN)
        elif kind == "video" or (kind is None and "video" in part):
            video, reason = _video_part(part)
            if video is None:
                raise ValueError(reason)
            videos.append(video)
            parts.append(VIDEO_TOKEN)
        else:
            return None
    return "".join(parts)


def _messages_turns(
    messages: object, videos: list[dict[str, Any]], images: list[str | None]
) -> tuple[list[dict[str, str]] | None, str | None]:
    """``messages`` (``role``/``content``) as LLaVA turns (``from``/``value``), or a reason;
    the video parts found are appended to ``videos``, the image parts' references (or
    ``None``) to ``images``."""
    if not isinstance(messages, list):
        return None, f"'messages' must be an array, got {_describe(messages)}"
    if not messages:
        return None, "'messages' is empty"
    turns: list[dict[str, str]] = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            return None, f"messages[{k}] must be an object, got {_describe(message)}"
        role, reason = _string_field(message, "role")
        if role is None:
            return None, f"messages[{k}]: {reason}"
        try:
            text = _content_text(message.get("content", _MISSING), videos, images)
        except ValueError as exc:
            return None, f"messages[{k}]: {exc}"
        if text is None:
            return None, (
                f"messages[{k}]: 'content' must be a string or a list of text, image and "
                "video parts"
            )
        turns.append({"from": role, "value": text})
    return turns, None


def _chat_record(rec: object, index: int, builder: RecordsBuilder) -> None:
    """Parse one LLaVA (``conversations``) or ``messages`` record into ``builder``."""
    if not isinstance(rec, dict):
        builder.reject(f"record must be a JSON object, got {_describe(rec)}", index)
        return
    raw_id = rec.get("id", _MISSING)
    if raw_id is _MISSING:
        builder.reject("missing key 'id'", index)
        return
    # LLaVA's own files use string ids, but converted datasets often carry ints.
    if isinstance(raw_id, int) and not isinstance(raw_id, bool):
        raw_id = str(raw_id)
    if not isinstance(raw_id, str):
        builder.reject(f"'id' must be a string or an integer, got {_describe(raw_id)}", index)
        return
    if not raw_id:
        builder.reject("'id' is empty", index)
        return
    images, reason = _images_of(rec)
    if images is None:
        builder.reject(reason or "", index, raw_id)
        return
    videos, problem = _videos_of(rec)
    if videos is None:
        builder.reject(problem or "", index, raw_id)
        return
    if "conversations" not in rec and "messages" in rec:
        parts: list[dict[str, Any]] = []
        inline: list[str | None] = []
        turns, problem = _messages_turns(rec["messages"], parts, inline)
        if parts and videos:
            turns, problem = None, "videos given both as 'video' and as message parts"
        videos = videos or parts
        named = [ref for ref in inline if ref is not None]
        if turns is not None and named:
            # Qwen's inline form: each image part names its image, in placeholder order.
            if len(named) != len(inline):
                turns, problem = (
                    None,
                    (
                        f"{len(named)} of {len(inline)} image parts name their image ('image'): "
                        "name every image in its part, or none (then in 'images')"
                    ),
                )
            elif images:
                turns, problem = None, "images given both as 'images' and as message parts"
            images = named
    else:
        conversations = rec.get("conversations", _MISSING)
        problem = _conversation_problem(conversations)
        turns = conversations if problem is None else None
    if turns is None:
        builder.reject(problem or "", index, raw_id)
        return
    found = sum(t["value"].count(VIDEO_TOKEN) for t in turns)
    if found != len(videos):
        builder.reject(f"{found} {VIDEO_TOKEN!r} placeholders for {len(videos)} videos", index,
                       raw_id)  # fmt: skip
        return
    chat = [(ROLES.get(t["from"], t["from"]), t["value"]) for t in turns]
    builder.add(index, raw_id, llava_text(turns), images, chat=chat, videos=videos)


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


#: A reader: parses an open binary manifest into the builder, calling
#: :meth:`RecordsBuilder.add` for each record and :meth:`RecordsBuilder.reject` for
#: each bad one (it raises ManifestError itself for a whole-file problem).
Reader = Callable[[BinaryIO, RecordsBuilder], None]


@dataclass(frozen=True)
class _Registered:
    read: Reader
    unit: str


_READERS: dict[str, _Registered] = {}


def register_reader(name: str, fn: Reader, *, unit: str = "record") -> None:
    """Make ``fn`` the reader of ``read_manifest(path, format=name)``.

    ``unit`` names what the ``line`` numbers ``fn`` passes to the builder count
    (``"line"``, ``"record"``, ``"row"``), for messages such as "duplicate id (first
    seen at line 3)". Register at import time (the registry is a plain dict). Raises
    ConfigError for a name already registered, ``"auto"`` or an empty name.

    >>> register_reader("jsonl", lambda f, builder: None)
    Traceback (most recent call last):
    ...
    mmcache.errors.ConfigError: manifest reader 'jsonl' is already registered
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ConfigError(f"a manifest reader needs a name other than 'auto', got {name!r}")
    if name in _READERS:
        raise ConfigError(f"manifest reader {name!r} is already registered")
    if not callable(fn):
        raise ConfigError(f"manifest reader {name!r} must be callable, got {type(fn).__name__}")
    _READERS[name] = _Registered(fn, unit)


def reader_names() -> list[str]:
    """Registered manifest formats, sorted (what ``read_manifest(format=...)`` accepts
    besides ``"auto"``)."""
    return sorted(_READERS)


register_reader("jsonl", _read_jsonl, unit="line")
register_reader("llava", _read_llava, unit="record")


def read_manifest(
    path: str | os.PathLike[str],
    *,
    on_error: Literal["raise", "skip"] = "raise",
    format: str = "auto",
    image_root: str | os.PathLike[str] | None = None,
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
    of it), or to ``image_root`` when given (LLaVA's ``--image_folder``), or absolute;
    see :meth:`Records.image_path`.

    ``format="auto"`` reads LLaVA when the first byte after a BOM and whitespace
    is ``[``, JSONL otherwise; another registered name (:func:`register_reader`)
    reads with that reader.

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
    formats = ("auto", *reader_names())
    if format not in formats:
        raise ConfigError(f"format must be one of {formats}, got {format!r}")
    source = os.fspath(path)
    if not isinstance(source, str):
        raise ConfigError(f"path must be a str or os.PathLike[str], got {source!r}")
    root = None if image_root is None else os.fspath(image_root)
    base_dir = (
        os.path.abspath(root) if root is not None else os.path.dirname(os.path.abspath(source))
    )
    try:
        fd, st = open_regular(source)  # never blocks on a FIFO; refuses /dev/zero
        with open(fd, "rb", closefd=True) as f:
            kind = _sniff(f) if format == "auto" else format
            reader = _READERS[kind]

            def parse() -> Records:
                f.seek(0)
                builder = RecordsBuilder(source, on_error, reader.unit)
                reader.read(f, builder)
                return builder.finish(kind, image_root=root)

            # Mapped from this node's column file when it holds this manifest as it is.
            return load_records(
                source, fd, st, fmt=kind, on_error=on_error, base_dir=base_dir, parse=parse
            )
    except FileNotFoundError as exc:
        raise ManifestError("file not found", path=source) from exc
    except OSError as exc:
        raise ManifestError(f"cannot read the file: {exc.strerror or exc}", path=source) from exc
