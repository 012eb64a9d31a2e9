"""A video given as a list of frame images (:func:`load_frame_list`), as qwen-vl-utils,
LLaVA-Video's frame folders, InternVL and LlamaFactory take them.

The rules are qwen-vl-utils' ``fetch_video`` for a list (0.0.14, Qwen3-VL's repository):

- **Which frames**: every frame, in order, the last one repeated once when the count is
  odd (frames go to the model in pairs). The list's frame rate is the part's
  ``sample_fps`` (default 2.0): ``second_per_grid_t = 2 / sample_fps``; each frame's time
  (Qwen3-VL's timestamps) is its position / ``raw_fps`` (default ``sample_fps``).
  mmcache adds one thing qwen-vl-utils lacks: a part that gives ``fps``, ``nframes``,
  ``video_start`` or ``video_end`` is sampled by :class:`~mmcache.VideoSpec`'s rules
  as a clip of that many frames at ``sample_fps`` (a frame folder dumped at 30 fps,
  ``sample_fps=30, fps=2``, keeps 2 a second).
- **What size**: each frame as ``fetch_image`` makes it (RGB as stored: RGBA composited
  on white, no EXIF rotation; smart-resized at the spec's factor between 4 and 16384
  tokens, or the part's ``min_pixels``/``max_pixels``; Pillow's bicubic), then the clip
  to :meth:`VideoSpec.frame_size` with :func:`~mmcache.transforms.video.resize_frames`
  (torchvision's bicubic antialias), each frame as it is read: the memory of one frame
  at a time beside the output. Frames of different sizes are a SampleError
  (qwen-vl-utils stacks them and fails too).

Every failure (a missing or bad frame, too large, mixed sizes) is a
:class:`~mmcache.errors.SampleError` naming the sample and the frame.

Thread safety: each call has its own image objects; safe from any number of threads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image

from mmcache.errors import SampleError
from mmcache.transforms.image import image_header, open_image, read_file
from mmcache.transforms.pixels import DECODE_ERRORS
from mmcache.transforms.stage import DEFAULT_MAX_BYTES
from mmcache.transforms.video import VideoSpec, qwen_smart_resize, resize_frames
from mmcache.transforms.video_decode import Clip

__all__ = ["SAMPLED_BY", "frame_list_plan", "load_frame_list"]

#: A frame list's part options that make it sampled by VideoSpec's rules (else every
#: frame is kept, as qwen-vl-utils keeps them).
SAMPLED_BY = ("fps", "nframes", "video_start", "video_end")
# qwen-vl-utils' image bounds, in tokens of factor x factor (fetch_image's defaults).
_IMAGE_MIN_TOKENS = 4
_IMAGE_MAX_TOKENS = 16384
_DEFAULT_FPS = 2.0


def _plan(
    spec: VideoSpec, part: Mapping[str, Any], count: int, *, sample_id: str
) -> tuple[list[int], float, tuple[float, ...]]:
    """The frames kept (indices into the list), the kept frames' rate and their times."""
    stated = float(part.get("sample_fps") or _DEFAULT_FPS)
    raw = float(part.get("raw_fps") or stated)
    if any(part.get(k) is not None for k in SAMPLED_BY):
        try:
            indices = spec.frame_indices(count, stated)
            fps = spec.sample_fps(count, stated)
        except ValueError as exc:
            raise SampleError(f"cannot sample the frame list: {exc}", sample_id=sample_id) from exc
        return indices, fps, tuple(i / raw for i in indices)
    indices = list(range(count)) + [count - 1] * (count % 2)
    # qwen-vl-utils' metadata numbers the padded list 0..n-1: the repeated frame's time
    # is one step after the last's.
    return indices, stated, tuple(k / raw for k in range(len(indices)))


def _image_bounds(spec: VideoSpec, part: Mapping[str, Any]) -> tuple[float, float]:
    f2 = spec.factor * spec.factor
    low = part.get("min_pixels")
    high = part.get("max_pixels")
    return (
        float(low) if low is not None else _IMAGE_MIN_TOKENS * f2,
        float(high) if high is not None else _IMAGE_MAX_TOKENS * f2,
    )


def _image_size(
    spec: VideoSpec, part: Mapping[str, Any], height: int, width: int, *, sample_id: str, path: str
) -> tuple[int, int]:
    """The ``(h, w)`` fetch_image resizes a ``height x width`` frame to."""
    low, high = _image_bounds(spec, part)
    try:
        if high < low:
            raise ValueError(f"max_pixels {high:g} is below min_pixels {low:g}")
        return qwen_smart_resize(height, width, factor=spec.factor, min_pixels=low,
                                 max_pixels=high)  # fmt: skip
    except ValueError as exc:
        raise SampleError(f"cannot size the frame: {exc}", sample_id=sample_id, path=path) from exc


def _rgb(im: Image.Image) -> Image.Image:
    """qwen-vl-utils' ``to_rgb``: RGBA composited on white, any other mode converted."""
    if im.mode == "RGBA":
        background = Image.new("RGB", im.size, (255, 255, 255))
        background.paste(im, mask=im.split()[3])
        return background
    return im.convert("RGB")


def _read_frame(
    spec: VideoSpec, part: Mapping[str, Any], path: str, *, sample_id: str
) -> npt.NDArray[np.uint8]:
    """One frame as fetch_image makes it: uint8 ``[3, h, w]``."""
    max_bytes = part.get("max_bytes", DEFAULT_MAX_BYTES)
    data = read_file(path, sample_id, max_bytes)
    with open_image(data, max_pixels=None, sample_id=sample_id, path=path) as im:
        try:
            im.load()
            rgb = _rgb(im)
        except DECODE_ERRORS as exc:
            raise SampleError(
                f"truncated or corrupt frame: {exc}", sample_id=sample_id, path=path
            ) from exc
        h, w = _image_size(spec, part, rgb.height, rgb.width, sample_id=sample_id, path=path)
        out = rgb.resize((w, h), Image.Resampling.BICUBIC)
    return np.ascontiguousarray(np.asarray(out).transpose(2, 0, 1))


def load_frame_list(
    spec: VideoSpec, part: Mapping[str, Any], *, sample_id: str, name: str | None = None
) -> Clip:
    """The clip a frame-list video part makes (see the module docstring): ``spec`` is
    the pipeline's, the part's own options applied here. SampleError for every bad
    frame, naming it."""
    paths: Sequence[str] = part["video"]
    where = name if name is not None else (paths[0] if paths else None)
    spec = spec.for_sample(part, sample_id=sample_id, path=where or "<frames>")
    indices, fps, times = _plan(spec, part, len(paths), sample_id=sample_id)
    out: npt.NDArray[np.uint8] | None = None
    first: tuple[int, int] | None = None
    done: dict[int, int] = {}
    for k, i in enumerate(indices):
        if out is not None and i in done:
            out[k] = out[done[i]]
            continue
        path = os.fspath(paths[i])
        frame = _read_frame(spec, part, path, sample_id=sample_id)
        hw = (int(frame.shape[1]), int(frame.shape[2]))
        if first is None:
            first = hw
            try:
                size = spec.frame_size(*hw, nframes=len(indices))
            except ValueError as exc:
                raise SampleError(f"cannot size the frames: {exc}", sample_id=sample_id,
                                  path=path) from exc  # fmt: skip
            out = np.empty((len(indices), 3, *size), dtype=np.uint8)
        elif hw != first:
            raise SampleError(
                f"frame {i} is {hw[1]}x{hw[0]} once resized, the first {first[1]}x{first[0]}: "
                "a frame list's frames must share one size",
                sample_id=sample_id,
                path=path,
            )
        assert out is not None
        out[k] = resize_frames(frame[None], (out.shape[2], out.shape[3]))[0]
        done[i] = k
    assert out is not None  # a frame list is never empty (the reader refuses one)
    return Clip(out, indices, fps, spec, times)


def frame_list_plan(
    spec: VideoSpec, part: Mapping[str, Any], *, sample_id: str
) -> tuple[tuple[int, int, int], tuple[float, ...]]:
    """The ``(t, h, w)`` and the frame times :func:`load_frame_list` makes, from the
    frames' headers only (what a sample's length is planned from)."""
    paths: Sequence[str] = part["video"]
    spec = spec.for_sample(part, sample_id=sample_id, path=paths[0] if paths else "<frames>")
    indices, _, times = _plan(spec, part, len(paths), sample_id=sample_id)
    first: tuple[int, int] | None = None
    for i in sorted(set(indices)):
        path = os.fspath(paths[i])
        max_bytes = part.get("max_bytes", DEFAULT_MAX_BYTES)
        with image_header(path, sample_id=sample_id, max_bytes=max_bytes, max_pixels=None) as im:
            width, height = im.size
        hw = _image_size(spec, part, height, width, sample_id=sample_id, path=path)
        if first is None:
            first = hw
        elif hw != first:
            raise SampleError(
                "a frame list's frames must share one size", sample_id=sample_id, path=path
            )
    assert first is not None
    try:
        h, w = spec.frame_size(*first, nframes=len(indices))
    except ValueError as exc:
        raise SampleError(f"cannot size the frames: {exc}", sample_id=sample_id) from exc
    return (len(indices), h, w), times
