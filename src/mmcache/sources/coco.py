"""COCO captions: ``captions_*.json`` (``images`` + ``annotations``) into Records, and
``CocoSource``, the :class:`~mmcache.sources.files.FileSource` over them.

The images are loose files under an image root (default: the JSON's folder),
so a COCO source is a file source like a JSONL manifest: ``stat`` stamps,
warm-epoch checks and error reports are the same. :func:`read_coco` builds its
:class:`~mmcache.sources.records.Records`: one sample per annotation (``per=
"caption"``: id = the annotation's id, text = its caption) or one per image
(``per="image"``: id = the image's id, text = its captions joined by newlines,
in file order).

Errors: an annotation whose ``image_id`` is not in ``images``, an entry without
an id or a file name, a caption that is not a string, a duplicate id, and
(with ``per="image"``) an image without a caption raise ManifestError naming
the file, the entry (``annotations[12]``, its 1-based place as ``line``) and the
id under ``on_error="raise"``, and are left out and listed in ``rejects()``
under ``"skip"``. Two ``images`` entries with one id raise ManifestError naming both,
under ``"skip"`` too: which file that id's captions belong to cannot be known. A missing
image *file* is found when the sample is produced:
a SampleError naming the file.

Thread/process safety: :func:`read_coco` is reentrant; a ``CocoSource`` is a
``FileSource``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

from mmcache.errors import ConfigError, ManifestError
from mmcache.rootfiles import open_regular
from mmcache.sources.base import OnError
from mmcache.sources.files import FileSource, check_on_error
from mmcache.sources.freshness import Freshness
from mmcache.sources.records import Records, RecordsBuilder
from mmcache.transforms.pipeline import RecordProcessor

__all__ = ["CocoSource", "looks_like_coco", "read_coco"]

#: One sample per (image, caption) pair, or one per image with all its captions.
Per = Literal["caption", "image"]


def looks_like_coco(head: bytes) -> bool:
    """Whether the first bytes of a JSON file look like a COCO object (an object with an
    ``"images"`` or ``"annotations"`` key near the start), not a LLaVA array."""
    text = head.lstrip(b"\xef\xbb\xbf").lstrip()
    return text.startswith(b"{") and (b'"images"' in text or b'"annotations"' in text)


def _id_of(value: object) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and value:
        return value
    return None


def read_coco(
    path: str | os.PathLike[str],
    *,
    image_root: str | os.PathLike[str] | None = None,
    per: Per = "caption",
    on_error: OnError = "raise",
) -> Records:
    """The :class:`Records` of a COCO captions file (see the module docstring).

    ``image_root``: the folder the images' ``file_name`` are relative to (default:
    the JSON file's folder). Raises ManifestError (file not found, not JSON, not
    a COCO object, no valid sample) and, under ``"raise"``, for a bad entry.
    """
    check_on_error(on_error)
    if per not in ("caption", "image"):
        raise ConfigError(f"per must be 'caption' or 'image', got {per!r}")
    source = os.fspath(path)
    try:
        fd, _ = open_regular(source)  # never blocks on a FIFO; refuses /dev/zero
        with open(fd, "rb", closefd=True) as f:
            document = json.loads(f.read().decode("utf-8-sig"))
    except FileNotFoundError as exc:
        raise ManifestError("file not found", path=source) from exc
    except OSError as exc:
        raise ManifestError(f"cannot read the file: {exc.strerror or exc}", path=source) from exc
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ManifestError(f"not a JSON file: {exc}", path=source) from exc
    if not isinstance(document, dict) or not isinstance(document.get("images"), list):
        raise ManifestError(
            "not a COCO file: expected an object with an 'images' array", path=source
        )
    annotations = document.get("annotations")
    if not isinstance(annotations, list):
        raise ManifestError("not a COCO file: no 'annotations' array", path=source)
    root = os.path.abspath(os.path.dirname(source) if image_root is None else image_root)
    builder = RecordsBuilder(source, on_error, "entry")
    files: dict[str, str] = {}  # image id -> absolute image path
    entry: dict[str, int] = {}  # image id -> its entry in 'images'
    order: list[tuple[int, str]] = []
    for k, image in enumerate(document["images"]):
        iid = _id_of(image.get("id")) if isinstance(image, dict) else None
        name = image.get("file_name") if isinstance(image, dict) else None
        if iid is None or not isinstance(name, str) or not name or "\x00" in name:
            builder.reject(f"images[{k}]: needs an id and a file_name", k + 1, iid)
            continue
        if iid in entry:
            # Under both on_error modes (as Parquet's and HF's duplicate ids): which file the
            # annotations of this id mean cannot be known, and keeping either one pairs
            # captions with the other image's file (G8).
            first = entry[iid]
            raise ManifestError(
                f"duplicate image id {iid}: images[{first}] "
                f"({document['images'][first].get('file_name')!r}) and images[{k}] ({name!r})",
                path=source,
                sample_id=iid,
            )
        entry[iid] = k
        files[iid] = os.path.join(root, name)
        order.append((k, iid))
    captions: dict[str, list[str]] = {}
    for k, ann in enumerate(annotations):
        problem, sid, iid, caption = _annotation(ann, k)
        if problem is None and iid not in files:
            problem = f"annotations[{k}]: image_id {iid} is not in 'images'"
        if problem is not None:
            builder.reject(problem, k + 1, sid)
            continue
        assert iid is not None and sid is not None and caption is not None
        if per == "caption":
            builder.add(k + 1, sid, caption, files[iid])
        else:
            captions.setdefault(iid, []).append(caption)
    if per == "image":
        for k, iid in order:
            if iid not in captions:
                builder.reject(f"images[{k}]: image {iid} has no caption", k + 1, iid)
                continue
            builder.add(k + 1, iid, "\n".join(captions[iid]), files[iid])
    return builder.finish("coco")


def _annotation(ann: Any, k: int) -> tuple[str | None, str | None, str | None, str | None]:
    """``(problem, annotation id, image id, caption)`` of ``annotations[k]``."""
    if not isinstance(ann, dict):
        return f"annotations[{k}] must be an object", None, None, None
    sid = _id_of(ann.get("id"))
    if sid is None:
        return f"annotations[{k}]: needs an integer or string 'id'", None, None, None
    iid = _id_of(ann.get("image_id"))
    if iid is None:
        return f"annotations[{k}]: needs an 'image_id'", sid, None, None
    caption = ann.get("caption")
    if not isinstance(caption, str):
        return f"annotations[{k}]: 'caption' must be a string", sid, iid, None
    return None, sid, iid, caption


class CocoSource(FileSource):
    """Image-caption samples of a COCO captions file, images read from ``image_root``.

    >>> src = CocoSource("annotations/captions_val2017.json", "val2017",  # doctest: +SKIP
    ...                  pipeline=pipe, per="caption")

    Args:
        annotations: the captions JSON.
        image_root: the images' folder (default: the JSON's folder).
        pipeline: how to turn a record into arrays.
        per: ``"caption"`` (one sample per annotation) or ``"image"`` (one per image,
            its captions joined by newlines).
        on_error, content_stamp, freshness, recheck: as for
            :class:`~mmcache.sources.files.FileSource`.
    """

    def __init__(
        self,
        annotations: str | os.PathLike[str],
        image_root: str | os.PathLike[str] | None = None,
        *,
        pipeline: RecordProcessor,
        per: Per = "caption",
        on_error: OnError = "raise",
        content_stamp: bool = False,
        freshness: Freshness = "epoch",
        recheck: float = 0.0,
    ) -> None:
        records = read_coco(annotations, image_root=image_root, per=per, on_error=on_error)
        super().__init__(
            records,
            pipeline=pipeline,
            on_error=on_error,
            content_stamp=content_stamp,
            freshness=freshness,
            recheck=recheck,
        )
