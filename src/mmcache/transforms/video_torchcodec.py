"""Decoding the kept frames with torchcodec (:func:`decode_frames_torchcodec`), the decoder
transformers' video processors, qwen-vl-utils, HF ``datasets`` and LitData default to.

Which frames and at what size are planned from mmcache's own demux pass
(:func:`~mmcache.transforms.video_decode.probe`: every frame's presentation time and
the keyframes), so both decoders keep the same frames and the plan never depends on the
decoder. torchcodec then opens the clip with that pass as its ``custom_frame_mappings``
(exact seeks by frame index, without the scan of its ``seek_mode="exact"``; its
``"approximate"`` mode counts frames from the average rate, which a variable-rate clip
breaks) and decodes the kept frames by index. Frames come a few at a time
(:data:`CHUNK`) and are resized as they come, into the clip's preallocated output: a
clip's memory is its output plus a chunk of source frames.

Both decoders run FFmpeg's decoders and convert to RGB with swscale; on the clips of the
tests (H.264 4:2:0 and 4:4:4, VP9, constant and variable rates) the frames are equal to
the bit. mmcache states "within one level" (another FFmpeg build may round the
colour conversion otherwise), so the decoder is not in the cache key.

Where torchcodec loads: its PyPI wheels link CUDA's libraries (``libc10_cuda``,
``libnvrtc``) and need FFmpeg 4-9's shared libraries installed; beside a CPU-only torch
(or without FFmpeg) it does not, and ``VideoSpec(decoder="auto")`` decodes with PyAV
(whose wheels bundle FFmpeg), logging why once per process.

Thread safety: each call opens its own decoder; the availability check is per process.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from mmcache.errors import ConfigError

__all__ = ["CHUNK", "decode_frames_torchcodec", "torchcodec_loads"]

logger = logging.getLogger(__name__)

#: Kept frames decoded per torchcodec call (its batch calls sort and seek forward only).
CHUNK = 8

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "module": the decoders module, or "reason": why not


def torchcodec_loads() -> bool:
    """Whether torchcodec imports and its FFmpeg libraries load in this process (found
    once; a failure is logged once). Thread-safe."""
    with _lock:
        if "module" in _state:
            return True
        if "reason" in _state:
            return False
        try:
            from torchcodec import decoders
            from torchcodec._core import ops

            # torchcodec imports without FFmpeg (its image decoders need none) and
            # fails at the first video decoded: ask for the FFmpeg-linked libraries
            # now, once, for their error (no public API tells; a later version
            # without these names is taken as loaded, and its first decode says).
            if getattr(ops, "_FFMPEG_AVAILABLE", True) is False:
                ops.load_core_libraries()
                raise OSError("torchcodec's FFmpeg libraries do not load")
        except (ImportError, OSError, RuntimeError) as exc:
            _state["reason"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            logger.info("torchcodec does not load (%s): decoding video with PyAV", _state["reason"])
            return False
        _state["module"] = decoders
        return True


def unavailable_reason() -> str:
    """Why :func:`torchcodec_loads` said no (empty when it loads or was not asked)."""
    return str(_state.get("reason", ""))


def frame_mappings(pts: npt.NDArray[np.int64], keyframes: npt.NDArray[np.int64]) -> str:
    """torchcodec's ``custom_frame_mappings`` (ffprobe's ``-show_frames`` JSON: each
    frame's ``pts``, ``duration`` and ``key_frame``) of mmcache's demux pass: exact
    seeks by index with no scan of the file."""
    times = [int(t) for t in pts.tolist()]
    keys = {int(k) for k in keyframes.tolist()}
    steps = [b - a for a, b in itertools.pairwise(times)]
    steps.append(steps[-1] if steps else 1)
    frames = [
        {"pts": t, "duration": d, "key_frame": int(t in keys)}
        for t, d in zip(times, steps, strict=True)
    ]
    return json.dumps({"frames": frames})


def decode_frames_torchcodec(
    source: str | os.PathLike[str] | bytes | memoryview,
    indices: list[int],
    size: tuple[int, int] | None = None,
    *,
    pts: npt.NDArray[np.int64],
    keyframes: npt.NDArray[np.int64],
    stored: tuple[int, int],
) -> npt.NDArray[np.uint8]:
    """The frames at ``indices`` (any order, repeats allowed) of ``source`` (a path or
    the file's bytes), whose frame ``i`` has presentation time ``pts[i]`` (``keyframes``:
    the keyframes' times) and size ``stored`` ``(h, w)``, as uint8 ``[T, 3, h, w]``,
    resized to ``size`` as they are decoded
    (:func:`~mmcache.transforms.video.resize_frames`). ConfigError when torchcodec does
    not load; ValueError (or torchcodec's RuntimeError, IndexError) for a frame it
    cannot decode."""
    from mmcache.transforms.video import resize_frames

    if not torchcodec_loads():
        raise ConfigError(
            f"VideoSpec(decoder='torchcodec') but torchcodec does not load here "
            f"({unavailable_reason()}): its wheels need a CUDA-enabled torch (or the CPU "
            "wheels of download.pytorch.org/whl/cpu) and FFmpeg 4-9's shared libraries; "
            "use decoder='auto' or 'pyav'"
        )
    decoders = _state["module"]
    data = bytes(source) if isinstance(source, memoryview) else source
    if not isinstance(data, bytes):
        data = os.fspath(data)
    decoder = decoders.VideoDecoder(
        data, dimension_order="NCHW", custom_frame_mappings=frame_mappings(pts, keyframes)
    )
    h, w = size if size is not None else stored
    out = np.empty((len(indices), 3, h, w), dtype=np.uint8)
    slots: dict[int, list[int]] = {}
    for k, i in enumerate(indices):
        slots.setdefault(int(i), []).append(k)
    wanted = sorted(slots)
    for start in range(0, len(wanted), CHUNK):
        chunk = wanted[start : start + CHUNK]
        frames = decoder.get_frames_at(chunk).data
        if tuple(frames.shape[2:]) != tuple(stored):
            raise ValueError(
                f"frames are {frames.shape[3]}x{frames.shape[2]}, but the stream declares "
                f"{stored[1]}x{stored[0]} (a size change mid-stream)"
            )
        pixels = np.ascontiguousarray(frames.numpy())
        if size is not None:
            pixels = resize_frames(pixels, size)
        for j, i in enumerate(chunk):
            out[slots[i]] = pixels[j]
    return out
