"""Decoding the kept frames of a clip once, seeking to them: :func:`probe` and
:func:`load_clip` (torchcodec where it loads, else PyAV).

The decoder is :attr:`VideoSpec.decoder <mmcache.transforms.video.VideoSpec.decoder>`:
``"auto"`` (the default) decodes with torchcodec where it loads
(:mod:`mmcache.transforms.video_torchcodec`: transformers' video processors,
qwen-vl-utils, HF ``datasets`` and LitData default to it) and with PyAV otherwise.
torchcodec's PyPI wheels link CUDA's libraries (``libc10_cuda``, ``libnvrtc``) and
need FFmpeg's shared libraries installed: beside a CPU-only torch they do not load
(checked with torchcodec 0.17.0 and torch 2.13.0+cpu), where PyAV's wheels bundle
FFmpeg and run everywhere. Both run the same FFmpeg decoders, so the frames are the
same pixels (equal to the bit on the tests' clips; stated: within one level); the plan
(which frames, what size) comes from PyAV's demux pass in both cases: the frame count
and rate are those a demux pass finds (what torchcodec's exact mode and decord count),
the rate the stream's average rate.

- :func:`probe` demuxes the video stream without decoding: every packet's presentation
  time and keyframe flag. Frame ``i`` is the ``i``-th presentation time in order, so an
  index maps to a time exactly, for constant and variable frame rates alike.
- :func:`decode_frames` decodes only what the wanted frames need: for each wanted frame
  it seeks to the last keyframe at or before it, unless decoding on from where it is
  reaches it first (the next wanted frame lies before the next keyframe), and keeps
  the wanted frames as RGB (FFmpeg's ``rgb24`` conversion, as every reader does),
  each resized as it comes out of the decoder into the clip's preallocated output.
- :func:`load_clip` is the whole stage: the size check before a byte is parsed
  (``max_bytes``), the probe, :class:`~mmcache.transforms.video.VideoSpec`'s indices and
  size and its ``max_source_pixels`` check on the frame size the stream declares, then
  the decode, with any failure (truncated, damaged, not a video, too large) a
  :class:`~mmcache.errors.SampleError` naming the sample and the file.

Why resize frame by frame: a clip's memory is then its output plus one source frame.
Decoding every kept frame at its source size first, then stacking and resizing them,
made a 26 KB clip of 400 black 1080p frames (all kept at ``fps=2``) take 7.4 GB; the
spec bounds the output (``max_pixels`` per frame, ``total_pixels`` over the clip), not
the source. The resize is the same function on a batch of one, and
``torch.nn.functional.interpolate`` resizes each image of a batch on its own, so the
pixels are those of the whole clip's resize (checked bitwise by the tests).

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
from mmcache.transforms.video_torchcodec import decode_frames_torchcodec, torchcodec_loads
from mmcache.units import format_size

if TYPE_CHECKING:
    from mmcache.transforms.video import VideoSpec

__all__ = [
    "VIDEO_FIELDS",
    "Clip",
    "VideoInfo",
    "decode_frames",
    "frame_times",
    "load_clip",
    "probe",
    "probe_source",
    "video_fields",
    "video_plan",
    "video_shape",
]

#: The fields a video SFT sample caches (:func:`video_fields`).
VIDEO_FIELDS = ("videos", "video_sizes", "video_grid_thw", "second_per_grid_ts")

VideoInput = str | os.PathLike[str] | bytes | memoryview
#: About what one source frame costs while it is decoded and resized: the decoder's own
#: frames (1.5 bytes a pixel each), RGB (3), its planar copy (3), float32 (12) and the
#: resize's intermediate. Measured: 26-31 for one 4K and one 8K frame (peak RSS).
_BYTES_PER_SOURCE_PIXEL = 30


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
    ``sample_fps`` (the kept frames' rate), the ``spec`` that chose them and ``times``:
    each kept frame's time in seconds, its index / the clip's average frame rate (what
    Qwen3-VL's timestamps are made of)."""

    frames: npt.NDArray[np.uint8]
    indices: list[int]
    sample_fps: float
    spec: VideoSpec
    times: tuple[float, ...] = ()

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
    when it has no video stream, no frame or no frame size; PyAV's errors for damaged
    data."""
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
    if ctx.height <= 0 or ctx.width <= 0:
        raise ValueError(f"the video stream declares no frame size ({ctx.width}x{ctx.height})")
    return VideoInfo(ordered, keyframes, float(rate), int(ctx.height), int(ctx.width))


def probe_source(source: VideoInput) -> VideoInfo:
    """:func:`probe` of a file or of its bytes."""
    with _open(source) as container:
        return probe(container)


def decode_frames(
    container: Any,
    info: VideoInfo,
    indices: list[int],
    size: tuple[int, int] | None = None,
) -> npt.NDArray[np.uint8]:
    """The frames at ``indices`` (any order, repeats allowed) as uint8 ``[T, 3, h, w]``,
    seeking to keyframes (see the module docstring). ``size``: ``(h, w)`` each frame is
    resized to as it is decoded (:func:`~mmcache.transforms.video.resize_frames`);
    ``None``: the source size. Memory: the output and one source frame. ValueError when
    a frame cannot be decoded (the stream ends, or a frame comes out without its time)
    or differs in size from what the stream declares (the output was sized from it)."""
    from mmcache.transforms.video import resize_frames

    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    # Each wanted time, and where its frame goes in the output (repeats go twice).
    slots: dict[int, list[int]] = {}
    for k, i in enumerate(indices):
        slots.setdefault(int(info.pts[i]), []).append(k)
    wanted = sorted(slots)
    keys = info.keyframes.tolist()
    h, w = size if size is not None else (info.height, info.width)
    out = np.empty((len(indices), 3, h, w), dtype=np.uint8)
    done: set[int] = set()
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
            if last in done or last < wanted[k]:
                continue
            if last > wanted[k]:
                raise ValueError(f"frame at time {wanted[k]} could not be decoded")
            if (frame.height, frame.width) != (info.height, info.width):
                raise ValueError(
                    f"frame at time {last} is {frame.width}x{frame.height}, but the stream "
                    f"declares {info.width}x{info.height} (a size change mid-stream)"
                )
            pixels = np.ascontiguousarray(frame.to_ndarray(format="rgb24").transpose(2, 0, 1))
            if size is not None:
                pixels = resize_frames(pixels[None], size)[0]
            out[slots[last]] = pixels
            done.add(last)
            k += 1
            if k == len(wanted):
                break
            # Seek rather than decode through a keyframe that lies before the next one.
            if keys[bisect.bisect_right(keys, wanted[k]) - 1] > last:
                break
        else:
            if last is None or (k < len(wanted) and last < wanted[k]):
                raise ValueError(f"the stream ends before frame time {wanted[k]} (truncated?)")
    return out


def _plan(
    spec: VideoSpec, info: VideoInfo, *, sample_id: str, path: str | None
) -> tuple[list[int], tuple[int, int]]:
    """The kept frames' indices and their ``(h, w)``, from the demux pass alone, and the
    ``max_source_pixels`` check on the declared frame size: what decoding will cost is
    known, and refused, before a frame is decoded. SampleError naming the figures."""
    try:
        indices = spec.frame_indices(info.total_frames, info.fps)
        hw = spec.frame_size(info.height, info.width, nframes=len(indices))
    except ValueError as exc:
        raise SampleError(f"cannot use the video: {exc}", sample_id=sample_id,
                          path=path) from exc  # fmt: skip
    pixels = info.height * info.width
    limit = spec.max_source_pixels
    if limit is not None and pixels > limit:
        raise SampleError(
            f"video frames of {info.width}x{info.height} ({pixels} pixels; {len(indices)} of "
            f"{info.total_frames} kept) are over VideoSpec.max_source_pixels={limit}: "
            f"decoding one takes about {format_size(pixels * _BYTES_PER_SOURCE_PIXEL)}; raise "
            f"max_source_pixels (None: no limit) to accept such clips",
            sample_id=sample_id,
            path=path,
        )
    return indices, hw


def load_clip(
    spec: VideoSpec,
    source: VideoInput,
    *,
    sample_id: str,
    max_bytes: int | None = None,
    name: str | None = None,
) -> Clip:
    """Decode ``source`` (a path or the file's bytes) to ``spec``'s frames, resized
    (:func:`~mmcache.transforms.video.resize_frames`) frame by frame as they are decoded.
    ``max_bytes``: a larger file is refused before it is opened; frames larger than
    ``spec.max_source_pixels`` are refused before one is decoded. Every failure is a
    SampleError naming ``sample_id`` and ``name`` (default: the path)."""
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
    torchcodec = _uses_torchcodec(spec)
    try:
        with _open(source) as container:
            info = probe(container)
            indices, hw = _plan(spec, info, sample_id=sample_id, path=where)
            fps = spec.sample_fps(info.total_frames, info.fps)
            if not torchcodec:
                frames = decode_frames(container, info, indices, hw)
        if torchcodec:
            frames = decode_frames_torchcodec(
                source,
                indices,
                hw,
                pts=info.pts,
                keyframes=info.keyframes,
                stored=(info.height, info.width),
            )
    except (SampleError, ConfigError):
        raise  # from _plan (it names the figures already), or torchcodec not loading
    except (ValueError, RuntimeError, IndexError, av.error.FFmpegError, OSError,
            EOFError) as exc:  # fmt: skip
        which = " (torchcodec)" if torchcodec else ""
        raise SampleError(f"cannot decode the video{which}: {exc}", sample_id=sample_id,
                          path=where) from exc  # fmt: skip
    return Clip(frames, indices, fps, spec, frame_times(indices, info.fps))


def _uses_torchcodec(spec: VideoSpec) -> bool:
    """Whether ``spec`` decodes with torchcodec: ``"torchcodec"`` always (ConfigError
    at the decode where it does not load), ``"auto"`` where it loads
    (:func:`~mmcache.transforms.video_torchcodec.torchcodec_loads`), ``"pyav"`` never."""
    if spec.decoder == "pyav":
        return False
    return spec.decoder == "torchcodec" or torchcodec_loads()


def video_fields(spec: VideoSpec, clips: list[Clip]) -> dict[str, npt.NDArray[Any]]:
    """What a sample caches of its clips: ``videos`` (uint8, each clip's C-contiguous
    ``[t, 3, h, w]`` bytes one after the other), ``video_sizes`` (int32 ``[n, 3]``: t, h,
    w), ``video_grid_thw`` (int32 ``[n, 3]``, Qwen2-VL's) and ``second_per_grid_ts``
    (float32 ``[n]``, Qwen2.5-VL's). One clip's ``videos`` is a view of its frames, not
    a copy (the usual sample: a clip can be hundreds of MB)."""
    n = len(clips)
    flat = [c.frames.reshape(-1) for c in clips]
    # One clip (the usual sample) is a view of its frames, not a copy of them.
    videos = flat[0] if n == 1 else np.concatenate(flat or [np.zeros(0, np.uint8)])
    return {
        "videos": videos,
        "video_sizes": np.array([c.shape for c in clips], dtype=np.int32).reshape(n, 3),
        "video_grid_thw": np.array(
            [c.spec.grid_thw(*c.shape) for c in clips], dtype=np.int32
        ).reshape(n, 3),
        "second_per_grid_ts": np.array(
            [c.spec.second_per_grid_t(c.sample_fps) for c in clips], dtype=np.float32
        ),
    }


def frame_times(indices: list[int], fps: float) -> tuple[float, ...]:
    """Each kept frame's time in seconds: its index / the clip's average frame rate
    (Qwen's ``VideoMetadata.timestamps``)."""
    return tuple(i / fps for i in indices)


def video_shape(spec: VideoSpec, path: str, *, sample_id: str) -> tuple[int, int, int]:
    """The ``(t, h, w)`` :func:`load_clip` makes of the video at ``path``, from a demux pass
    only (no frame decoded): what a sample's length is planned from. SampleError as
    :func:`load_clip` raises it."""
    return video_plan(spec, path, sample_id=sample_id)[0]


def video_plan(
    spec: VideoSpec, path: str, *, sample_id: str
) -> tuple[tuple[int, int, int], tuple[float, ...]]:
    """:func:`video_shape` and the kept frames' times (:func:`frame_times`)."""
    av = _av()
    try:
        info = probe_source(path)
    except (ValueError, av.error.FFmpegError, OSError, EOFError) as exc:
        raise SampleError(f"cannot read the video: {exc}", sample_id=sample_id, path=path) from exc
    indices, (h, w) = _plan(spec, info, sample_id=sample_id, path=path)
    return (len(indices), h, w), frame_times(indices, info.fps)
