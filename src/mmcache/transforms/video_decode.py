"""Decoding the kept frames of a clip once, seeking to them: :func:`probe` and
:func:`load_video` (PyAV).

Why PyAV and not torchcodec: torchcodec's wheels on PyPI are built against CUDA (its
image library needs ``libnvrtc``) and do not load on a CPU-only install; PyAV's wheels
bundle FFmpeg and run everywhere. Both read the same FFmpeg decoders, so the frames are
the same pixels; the frame count and rate are those a demux pass finds (what
torchcodec's exact mode and decord count), the rate the stream's average rate.

- :func:`probe` demuxes the video stream without decoding: every packet's presentation
  time and keyframe flag. Frame ``i`` is the ``i``-th presentation time in order, so an
  index maps to a time exactly, for constant and variable frame rates alike.
- :func:`decode_frames` decodes only what the wanted frames need: for each wanted frame
  it seeks to the last keyframe at or before it, unless decoding on from where it is
  reaches it first (the next wanted frame lies before the next keyframe), and keeps
  the wanted frames as RGB (FFmpeg's ``rgb24`` conversion, as every reader does).
- :func:`load_clip` is the whole stage: the size check before a byte is parsed
  (``max_bytes``), the probe, :class:`~mmcache.transforms.video.VideoSpec`'s indices and
  size, the decode and the resize, with any failure (truncated, damaged, not a video)
  a :class:`~mmcache.errors.SampleError` naming the sample and the file.

Thread safety: each call opens its own container; safe from any number of threads.
"""

from __future__ import annotations

import bisect
import io
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from mmcache.errors import ConfigError, SampleError

if TYPE_CHECKING:
    from mmcache.transforms.video import VideoSpec

__all__ = [
    "VIDEO_FIELDS",
    "Clip",
    "VideoInfo",
    "decode_frames",
    "load_clip",
    "probe",
    "probe_source",
    "video_fields",
    "video_shape",
]

#: The fields a video SFT sample caches (:func:`video_fields`).
VIDEO_FIELDS = ("videos", "video_sizes", "video_grid_thw", "second_per_grid_ts")

VideoInput = str | os.PathLike[str] | bytes | memoryview


def _av() -> Any:
    try:
        import av
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError("video decoding needs PyAV: pip install 'mmcache[video]'") from exc
    return av


@dataclass(frozen=True)
class VideoInfo:
    """What a demux pass finds: ``pts`` (int64, every frame's presentation time in
    stream units, sorted: frame ``i`` is ``pts[i]``), ``keyframes`` (the keyframes'
    times, sorted), ``fps`` (the stream's average rate), ``height``, ``width``."""

    pts: npt.NDArray[np.int64]
    keyframes: npt.NDArray[np.int64]
    fps: float
    height: int
    width: int

    @property
    def total_frames(self) -> int:
        """The number of frames in the stream."""
        return int(self.pts.size)


@dataclass(frozen=True)
class Clip:
    """One processed clip: ``frames`` uint8 ``[T, 3, h, w]``, the ``indices`` kept,
    ``sample_fps`` (the kept frames' rate) and the ``spec`` that chose them."""

    frames: npt.NDArray[np.uint8]
    indices: list[int]
    sample_fps: float
    spec: VideoSpec

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(t, h, w)``."""
        t, _, h, w = self.frames.shape
        return int(t), int(h), int(w)


def _open(source: VideoInput) -> Any:
    av = _av()
    if isinstance(source, (bytes, memoryview)):
        return av.open(io.BytesIO(bytes(source)), mode="r")
    return av.open(os.fspath(source), mode="r")


def probe(container: Any) -> VideoInfo:
    """Demux the first video stream of an open PyAV container (no decoding). ValueError
    when it has no video stream or no frame; PyAV's errors for damaged data."""
    if not container.streams.video:
        raise ValueError("no video stream")
    stream = container.streams.video[0]
    pts: list[int] = []
    keys: list[int] = []
    for packet in container.demux(stream):
        if packet.size == 0 or packet.pts is None:
            continue  # the flush packet; a packet without a time cannot be sought to
        pts.append(int(packet.pts))
        if packet.is_keyframe:
            keys.append(int(packet.pts))
    if not pts:
        raise ValueError("the video stream has no frames with timestamps")
    rate = stream.average_rate or stream.guessed_rate
    if not rate:
        raise ValueError("the video stream has no frame rate")
    ordered = np.unique(np.asarray(pts, dtype=np.int64))
    keyframes = np.unique(np.asarray(keys or [int(ordered[0])], dtype=np.int64))
    ctx = stream.codec_context
    return VideoInfo(ordered, keyframes, float(rate), int(ctx.height), int(ctx.width))


def probe_source(source: VideoInput) -> VideoInfo:
    """:func:`probe` of a file or of its bytes."""
    with _open(source) as container:
        return probe(container)


def decode_frames(container: Any, info: VideoInfo, indices: list[int]) -> npt.NDArray[np.uint8]:
    """The frames at ``indices`` (any order, repeats allowed) as uint8 ``[T, 3, H, W]``,
    seeking to keyframes (see the module docstring). ValueError when a frame cannot be
    decoded (the stream ends, or a frame comes out without its time)."""
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    wanted = sorted({int(info.pts[i]) for i in indices})
    keys = info.keyframes.tolist()
    got: dict[int, npt.NDArray[np.uint8]] = {}
    k = 0
    while k < len(wanted):
        target = wanted[k]
        key = keys[max(0, bisect.bisect_right(keys, target) - 1)]
        container.seek(key, stream=stream, backward=True, any_frame=False)
        last = None
        for frame in container.decode(stream):
            if frame.pts is None:
                raise ValueError("a decoded frame has no timestamp")
            last = int(frame.pts)
            if last in got or last < wanted[k]:
                continue
            if last > wanted[k]:
                raise ValueError(f"frame at time {wanted[k]} could not be decoded")
            got[last] = frame.to_ndarray(format="rgb24")
            k += 1
            if k == len(wanted):
                break
            # Seek rather than decode through a keyframe that lies before the next one.
            if keys[bisect.bisect_right(keys, wanted[k]) - 1] > last:
                break
        else:
            if last is None or (k < len(wanted) and last < wanted[k]):
                raise ValueError(f"the stream ends before frame time {wanted[k]} (truncated?)")
    frames = np.stack([got[int(info.pts[i])] for i in indices])
    return np.ascontiguousarray(frames.transpose(0, 3, 1, 2))


def load_clip(
    spec: VideoSpec,
    source: VideoInput,
    *,
    sample_id: str,
    max_bytes: int | None = None,
    name: str | None = None,
) -> Clip:
    """Decode ``source`` (a path or the file's bytes) to ``spec``'s frames, resized
    (:func:`~mmcache.transforms.video.resize_frames`). ``max_bytes``: a larger file is
    refused before it is opened. Every failure is a SampleError naming ``sample_id`` and
    ``name`` (default: the path)."""
    from mmcache.transforms.video import resize_frames

    path = None if isinstance(source, (bytes, memoryview)) else os.fspath(source)
    where = name if name is not None else path
    try:
        size = os.stat(path).st_size if path is not None else len(cast(bytes, source))
    except OSError as exc:
        raise SampleError(f"cannot read the video: {exc.strerror or exc}", sample_id=sample_id,
                          path=where) from exc  # fmt: skip
    if max_bytes is not None and size > max_bytes:
        raise SampleError(
            f"video of {size} bytes is over max_bytes={max_bytes}", sample_id=sample_id, path=where
        )
    av = _av()
    try:
        with _open(source) as container:
            info = probe(container)
            indices = spec.frame_indices(info.total_frames, info.fps)
            fps = spec.sample_fps(info.total_frames, info.fps)
            frames = decode_frames(container, info, indices)
    except (ValueError, av.error.FFmpegError, OSError, EOFError) as exc:
        raise SampleError(f"cannot decode the video: {exc}", sample_id=sample_id,
                          path=where) from exc  # fmt: skip
    try:
        hw = spec.frame_size(int(frames.shape[2]), int(frames.shape[3]), nframes=len(indices))
    except ValueError as exc:
        raise SampleError(str(exc), sample_id=sample_id, path=where) from exc
    return Clip(resize_frames(frames, hw), indices, fps, spec)


def video_fields(spec: VideoSpec, clips: list[Clip]) -> dict[str, npt.NDArray[Any]]:
    """What a sample caches of its clips: ``videos`` (uint8, each clip's C-contiguous
    ``[t, 3, h, w]`` bytes one after the other), ``video_sizes`` (int32 ``[n, 3]``: t, h,
    w), ``video_grid_thw`` (int32 ``[n, 3]``, Qwen2-VL's) and ``second_per_grid_ts``
    (float32 ``[n]``, Qwen2.5-VL's)."""
    n = len(clips)
    flat = [c.frames.reshape(-1) for c in clips]
    return {
        "videos": np.concatenate(flat) if flat else np.zeros(0, np.uint8),
        "video_sizes": np.array([c.shape for c in clips], dtype=np.int32).reshape(n, 3),
        "video_grid_thw": np.array(
            [c.spec.grid_thw(*c.shape) for c in clips], dtype=np.int32
        ).reshape(n, 3),
        "second_per_grid_ts": np.array(
            [c.spec.second_per_grid_t(c.sample_fps) for c in clips], dtype=np.float32
        ),
    }


def video_shape(spec: VideoSpec, path: str, *, sample_id: str) -> tuple[int, int, int]:
    """The ``(t, h, w)`` :func:`load_clip` makes of the video at ``path``, from a demux pass
    only (no frame decoded): what a sample's length is planned from. SampleError as
    :func:`load_clip` raises it."""
    av = _av()
    try:
        info = probe_source(path)
        t = len(spec.frame_indices(info.total_frames, info.fps))
        h, w = spec.frame_size(info.height, info.width, nframes=t)
    except (ValueError, av.error.FFmpegError, OSError, EOFError) as exc:
        raise SampleError(f"cannot read the video: {exc}", sample_id=sample_id, path=path) from exc
    return t, h, w
