"""The chat side of a file source: placeholder checks, multi-image stamps and keys, and
sample lengths computed without decoding an image (:func:`chat_lengths`,
:class:`~mmcache.stats.TextReport`).

A :class:`~mmcache.sources.files.FileSource` whose pipeline has a
:class:`~mmcache.transforms.chat.ChatSpec` uses these helpers:

- :func:`check_placeholders` at construction: a record whose ``<image>`` count differs
  from its number of images is a ManifestError naming the file, line and id (under
  ``on_error="skip"`` it is left out and listed in ``rejects()``);
- :func:`chat_lengths`: each sample's token count (image tokens included, after
  truncation) and whether it keeps an image, from a render and a tokenization per
  sample and each image's header (``PIL.Image.open`` reads only that) through the
  image stage's resize rule (:func:`~mmcache.transforms.smart_resize.output_hw`; the
  original size for LLaVA-NeXT's any-resolution stage, whose token count is a
  function of it): what length grouping and packing plan from, with the
  :class:`~mmcache.stats.TextReport` of the same pass.

Thread safety: pure functions; a :class:`~mmcache.stats.TextReport` is immutable.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mmcache.errors import ConfigError, ManifestError, SampleError
from mmcache.sources import identity
from mmcache.sources.freshness import stat_rows
from mmcache.sources.records import RecordReject, Records
from mmcache.stats import REPORTS, TextReport, write_report
from mmcache.transforms.chat import Chat, ChatSpec, FullyMaskedError
from mmcache.transforms.frame_lists import frame_list_plan
from mmcache.transforms.hf_llava_next import LlavaNextImageStage
from mmcache.transforms.image import image_header
from mmcache.transforms.pixels import DECODE_ERRORS, applies_orientation, orientation
from mmcache.transforms.smart_resize import output_hw
from mmcache.transforms.stage import ImageTraits
from mmcache.transforms.video import VideoSpec
from mmcache.transforms.video_decode import video_plan

__all__ = [
    "ChatLengths",
    "chat_lengths",
    "check_placeholders",
]

# What reading an image header can raise.
_HEADER_ERRORS: tuple[type[BaseException], ...] = (*DECODE_ERRORS, SampleError)


def check_placeholders(records: Records, image_token: str, on_error: str) -> tuple[Records, int]:
    """``records`` without the rows whose ``image_token`` count differs from their number
    of images, and how many there were. Under ``on_error="raise"`` the first one raises
    ManifestError (file, line, id); rows without a conversation are left to ``produce``."""
    found = records.placeholder_counts(image_token)
    images = records.image_counts()
    wrong = np.flatnonzero(found != images)
    bad: list[RecordReject] = []
    keep = np.ones(len(records), dtype=bool)
    for i in wrong.tolist():
        if records.chat(i) is None:
            continue  # a caption record: produce says what is wrong with it
        keep[i] = False
        reason = f"{found[i]} {image_token!r} placeholders for {images[i]} images"
        if on_error == "raise":
            raise ManifestError(
                reason, path=records.source, line=records.line(i), sample_id=records.id(i)
            )
        bad.append(RecordReject(records.source, records.line(i), records.id(i), reason))
    good = np.flatnonzero(keep).tolist()
    if not bad:
        return records, 0
    if not good:
        raise ManifestError(
            f"no valid records: all {len(bad)} have mismatched placeholders (first: {bad[0]})",
            path=records.source,
        )
    return records.select(good, bad), len(bad)


def any_racy(paths: Sequence[str], taken: float) -> bool:
    """Whether one of ``paths`` changed too recently (or cannot be ``stat``-ed) for a
    multi-file stamp to vouch for bytes read after ``taken`` (see
    :func:`mmcache.sources.identity.racy_rows`)."""
    fields = stat_rows([os.fsencode(p) for p in paths])
    if (fields[:, 0] == -2).any():
        return True
    return bool(identity.racy_rows(fields, taken).any())


@dataclass(frozen=True)
class ChatLengths:
    """The length pass's per-sample results: ``lengths`` int64 ``[N]`` (0 for a refused
    sample), ``has_image`` bool ``[N]`` and the :class:`~mmcache.stats.TextReport`."""

    lengths: npt.NDArray[np.int64]
    has_image: npt.NDArray[np.bool_]
    report: TextReport


# Per-sample status of the length pass (saved with the lengths).
_OK, _TRUNCATED, _MASKED, _UNREADABLE, _REFUSED = range(5)


def _image_hw(stage: object, path: str, sample_id: str) -> tuple[int, int]:
    """The processed ``(h, w)`` of the image at ``path``, from its header only, opened
    through the guarded open (:func:`~mmcache.transforms.image.image_header`: never
    blocking on a FIFO or a device; over ``max_bytes`` or a decompression bomb by
    Pillow's limit: a SampleError for this sample). The stage's own ``max_pixels`` is
    not applied here: it is checked after a reduced (draft) decode, which a header
    read cannot reproduce."""
    with image_header(
        path,
        sample_id=sample_id,
        max_bytes=ImageTraits.of(stage).max_bytes,
        max_pixels=None,
    ) as im:
        turn = orientation(im) if applies_orientation(stage) else 1
        width, height = im.size
    hw = _chat_hw(stage, width, height, turn)
    if hw is None:
        raise SampleError(
            f"{width}x{height} image: no size under this stage's rule", sample_id=sample_id
        )
    return hw


def _chat_hw(stage: object, width: int, height: int, turn: int) -> tuple[int, int] | None:
    """The ``(h, w)`` a chat counts an image's tokens from: the processed size
    (:func:`~mmcache.transforms.smart_resize.output_hw`), or for LLaVA-NeXT's
    any-resolution stage the original upright size (its count is a function of it)."""
    if isinstance(stage, LlavaNextImageStage):  # (turn is 1 for an as-stored stage)
        return (width, height) if turn >= 5 else (height, width)
    return output_hw(stage, width, height, turn)


def _measure(
    records: Records,
    chat: ChatSpec,
    image_stage: object | None,
    rows: Sequence[int],
    columns: dict[str, npt.NDArray[Any]],
    *,
    on_error: str,
    record_reject: Callable[[SampleError], None],
    video: VideoSpec | None = None,
) -> None:
    """Fill ``columns`` (lengths, has_image, trainable, status) for ``rows``; a video's
    tokens are counted from its demux pass alone
    (:func:`~mmcache.transforms.video_decode.video_plan`)."""
    for i in rows:
        sample_id = records.id(i)
        messages = records.chat(i)
        status = _REFUSED
        try:
            if messages is None:
                raise SampleError(
                    "record has no conversation, but the pipeline has a ChatSpec",
                    sample_id=sample_id,
                )
            sizes: list[tuple[int, int]] = []
            for path in records.image_paths(i):
                if image_stage is None:
                    raise SampleError(
                        "record has images, but the pipeline has no image stage",
                        sample_id=sample_id,
                    )
                try:
                    sizes.append(_image_hw(image_stage, path, sample_id))
                except _HEADER_ERRORS as exc:
                    status = _UNREADABLE
                    raise SampleError(
                        f"cannot read the image header: {exc}", sample_id=sample_id, path=path
                    ) from exc
            clips: list[tuple[int, int, int]] = []
            times: list[tuple[float, ...]] = []
            for part in records.videos(i):
                if video is None:
                    raise SampleError(
                        "record has videos, but the pipeline has no VideoSpec",
                        sample_id=sample_id,
                    )
                if isinstance(part["video"], list):  # frame images: their headers
                    status = _UNREADABLE
                    shape, clip_times = frame_list_plan(video, part, sample_id=sample_id)
                else:
                    spec = video.for_sample(part, sample_id=sample_id, path=part["video"])
                    status = _UNREADABLE
                    shape, clip_times = video_plan(spec, part["video"], sample_id=sample_id)
                clips.append(shape)
                times.append(clip_times)
                status = _REFUSED
            enc = chat.encode(
                Chat(tuple(messages), tuple(sizes), tuple(clips), tuple(times)),
                sample_id=sample_id,
            )
        except SampleError as err:
            if isinstance(err, FullyMaskedError):
                status = _MASKED
            if err.sample_id != sample_id:
                err = SampleError(err.reason, sample_id=sample_id, path=err.path)
            if on_error == "raise":
                raise err from None
            record_reject(err)
            columns["lengths"][i], columns["has_image"][i] = 0, False
            columns["trainable"][i], columns["status"][i] = 0, status
            continue
        columns["lengths"][i] = len(enc.input_ids)
        columns["has_image"][i] = enc.n_images > 0
        columns["trainable"][i] = enc.trainable
        columns["status"][i] = _TRUNCATED if enc.truncated else _OK


def _report(
    columns: dict[str, npt.NDArray[Any]], *, fingerprint: str, mismatched: int
) -> TextReport:
    lengths, status = columns["lengths"], columns["status"]
    measured = lengths[lengths > 0]
    pct: dict[str, int] = {}
    if measured.size:
        for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
            pct[name] = int(np.percentile(measured, q, method="higher"))
        pct["max"] = int(measured.max())
    return TextReport(
        fingerprint=fingerprint,
        samples=len(lengths),
        with_images=int(columns["has_image"].sum()),
        truncated=int(np.count_nonzero(status == _TRUNCATED)),
        fully_masked=int(np.count_nonzero(status == _MASKED)),
        mismatched_placeholders=mismatched,
        unreadable=int(np.count_nonzero(status == _UNREADABLE)),
        trainable_tokens=int(columns["trainable"].sum()),
        tokens=int(lengths.sum()),
        length_percentiles=pct,
    )


def chat_lengths(
    records: Records,
    chat: ChatSpec,
    image_stage: object | None,
    *,
    fingerprint: str,
    on_error: str,
    mismatched: int,
    record_reject: Callable[[SampleError], None],
    stamps: Callable[[], npt.NDArray[np.int64]] | None = None,
    root: str | os.PathLike[str] | None = None,
    video: VideoSpec | None = None,
) -> ChatLengths:
    """Measure every sample (see the module docstring). A sample that cannot be made
    (unreadable image header, fully masked) raises its SampleError under
    ``on_error="raise"``; under ``"skip"`` it gets length 0, is counted and
    ``record_reject`` is called with it. ConfigError when the image stage's geometry is
    not known without decoding (a user or HF stage).

    With a cache ``root`` (and ``stamps``: the source's per-sample stamps), the results
    are saved there (``reports/lengths-<fingerprint>-<content digest>.npz``, no pickle)
    and a later pass over the same records reuses them, measuring again only the
    samples whose image files' stamps changed (and, under ``"raise"``, refused ones)."""
    if image_stage is not None and _chat_hw(image_stage, 64, 48, 1) is None:
        raise ConfigError(
            "lengths() needs the image stage's resize rule to size images from their "
            "headers: ImageSpec, SmartResize or an hf_image_processor whose size rule is "
            f"known, got {type(image_stage).__name__}"
        )
    n = len(records)
    columns: dict[str, npt.NDArray[Any]] = {
        "lengths": np.zeros(n, dtype=np.int64),
        "has_image": np.zeros(n, dtype=bool),
        "trainable": np.zeros(n, dtype=np.int64),
        "status": np.zeros(n, dtype=np.uint8),
    }
    path = None
    now = None
    rows: Sequence[int] = range(n)
    if root is not None and stamps is not None:
        path = Path(root) / REPORTS / f"lengths-{fingerprint}-{records.content_digest()}.npz"
        now = stamps()
        saved = _load(path, n, now.shape[1])
        if saved is not None:
            stale = (saved["stamps"] != now).any(axis=1)
            if on_error == "raise":
                stale |= saved["status"] >= _MASKED
            for name, column in columns.items():
                column[:] = saved[name]
            rows = np.flatnonzero(stale).tolist()
    _measure(
        records,
        chat,
        image_stage,
        rows,
        columns,
        on_error=on_error,
        record_reject=record_reject,
        video=video,
    )
    if path is not None and now is not None and (len(rows) or not path.exists()):
        _save(path, {**columns, "stamps": now})
    report = _report(columns, fingerprint=fingerprint, mismatched=mismatched)
    return ChatLengths(columns["lengths"], columns["has_image"], report)


def _load(path: Path, n: int, width: int) -> dict[str, npt.NDArray[Any]] | None:
    """The arrays saved at ``path`` if they are whole and of this shape, else None."""
    try:
        with np.load(path, allow_pickle=False) as data:
            out = {k: data[k] for k in ("lengths", "has_image", "trainable", "status", "stamps")}
    except (OSError, ValueError, KeyError, EOFError):
        return None
    if out["stamps"].shape != (n, width) or any(out[k].shape != (n,) for k in list(out)[:4]):
        return None
    return out


def _save(path: Path, arrays: dict[str, npt.NDArray[Any]]) -> None:
    """Write ``arrays`` to ``path`` atomically (a failure to write is not an error)."""
    buf = io.BytesIO()
    savez: Any = np.savez  # its **kwds overlap allow_pickle for mypy
    savez(buf, **arrays)
    with contextlib.suppress(OSError):
        write_report(path, buf.getvalue())
