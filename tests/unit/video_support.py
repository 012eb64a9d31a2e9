# ruff: noqa: PLR1716, SIM300, PLR0917  (copied reference code kept as written upstream)
"""Shared pieces of the video tests: clips written with PyAV (H.264 and others, any
frame rate, odd sizes, variable frame rate), and the frame rules of ``qwen-vl-utils``
as its own code computes them.

The reference functions below are copied from ``qwen_vl_utils/vision_process.py`` of
``qwen-vl-utils`` 0.0.14 (Apache-2.0, the Qwen team), unchanged but for type hints
dropped and logging removed: the package imports torchvision at module level, which
the test environment does not install, so its rules are compared from its source.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch

# -- qwen-vl-utils 0.0.14, vision_process.py (copied) ----------------------------------
MAX_RATIO = 200
SPATIAL_MERGE_SIZE = 2
VIDEO_MIN_TOKEN_NUM = 128
VIDEO_MAX_TOKEN_NUM = 768
FPS = 2.0
FRAME_FACTOR = 2
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
MODEL_SEQ_LEN = 128000


def round_by_factor(number, factor):
    return round(number / factor) * factor


def ceil_by_factor(number, factor):
    return math.ceil(number / factor) * factor


def floor_by_factor(number, factor):
    return math.floor(number / factor) * factor


def smart_resize(height, width, factor, min_pixels=None, max_pixels=None):
    max_pixels = max_pixels if max_pixels is not None else (16384 * factor**2)
    min_pixels = min_pixels if min_pixels is not None else (4 * factor**2)
    assert max_pixels >= min_pixels
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError("absolute aspect ratio must be smaller than 200")
    h_bar = max(factor, round_by_factor(height, factor))
    w_bar = max(factor, round_by_factor(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = floor_by_factor(height / beta, factor)
        w_bar = floor_by_factor(width / beta, factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = ceil_by_factor(height * beta, factor)
        w_bar = ceil_by_factor(width * beta, factor)
    return h_bar, w_bar


def smart_nframes(ele, total_frames, video_fps):
    assert not ("fps" in ele and "nframes" in ele), "Only accept either `fps` or `nframes`"
    if "nframes" in ele:
        nframes = round_by_factor(ele["nframes"], FRAME_FACTOR)
    else:
        fps = ele.get("fps", FPS)
        min_frames = ceil_by_factor(ele.get("min_frames", FPS_MIN_FRAMES), FRAME_FACTOR)
        max_frames = floor_by_factor(
            ele.get("max_frames", min(FPS_MAX_FRAMES, total_frames)), FRAME_FACTOR
        )
        nframes = total_frames / video_fps * fps
        nframes = min(min(max(nframes, min_frames), max_frames), total_frames)
        nframes = floor_by_factor(nframes, FRAME_FACTOR)
    if not (FRAME_FACTOR <= nframes and nframes <= total_frames):
        raise ValueError(f"nframes should in interval [{FRAME_FACTOR}, {total_frames}]")
    return nframes


def calculate_video_frame_range(ele, total_frames, video_fps):
    if video_fps <= 0:
        raise ValueError("video_fps must be a positive number")
    if total_frames <= 0:
        raise ValueError("total_frames must be a positive integer")
    video_start = ele.get("video_start", None)
    video_end = ele.get("video_end", None)
    if video_start is None and video_end is None:
        return 0, total_frames - 1, total_frames
    max_duration = total_frames / video_fps
    if video_start is not None:
        video_start_clamped = max(0.0, min(video_start, max_duration))
        start_frame = math.ceil(video_start_clamped * video_fps)
    else:
        start_frame = 0
    if video_end is not None:
        video_end_clamped = max(0.0, min(video_end, max_duration))
        end_frame = math.floor(video_end_clamped * video_fps)
        end_frame = min(end_frame, total_frames - 1)
    else:
        end_frame = total_frames - 1
    if start_frame >= end_frame:
        raise ValueError("Invalid time range")
    return start_frame, end_frame, end_frame - start_frame + 1


def qwen_indices_and_size(ele, total_frames, video_fps, height, width, image_patch_size=14):
    """What ``_read_video_torchcodec``/``_read_video_decord`` and ``fetch_video`` compute:
    the kept frame indices, the resized (h, w) and ``sample_fps``."""
    start_frame, end_frame, total_frames = calculate_video_frame_range(ele, total_frames, video_fps)
    nframes = smart_nframes(ele, total_frames=total_frames, video_fps=video_fps)
    idx = torch.linspace(start_frame, end_frame, nframes).round().long().tolist()
    sample_fps = nframes / max(total_frames, 1e-6) * video_fps
    image_factor = image_patch_size * SPATIAL_MERGE_SIZE
    video_frame_min_pixels = VIDEO_MIN_TOKEN_NUM * image_factor * image_factor
    video_frame_max_pixels = VIDEO_MAX_TOKEN_NUM * image_factor * image_factor
    min_pixels = ele.get("min_pixels", video_frame_min_pixels)
    total_pixels = ele.get("total_pixels", MODEL_SEQ_LEN * image_factor * image_factor * 0.9)
    max_pixels = max(
        min(video_frame_max_pixels, total_pixels / nframes * FRAME_FACTOR),
        int(min_pixels * 1.05),
    )
    max_pixels = min(ele.get("max_pixels", max_pixels), max_pixels)
    size = smart_resize(
        height, width, factor=image_factor, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return idx, size, sample_fps


# -- clips ---------------------------------------------------------------------------------


def frame_image(i: int, height: int, width: int) -> np.ndarray:
    """Frame ``i``: a moving gradient with a bright square, so every frame differs."""
    y = np.arange(height)[:, None]
    x = np.arange(width)[None, :]
    img = np.zeros((height, width, 3), dtype=np.uint8)
    img[..., 0] = (x * 3 + i * 7) % 256
    img[..., 1] = (y * 5 + i * 11) % 256
    img[..., 2] = ((x + y) * 2 + i * 13) % 256
    s = max(2, min(height, width) // 4)
    top, left = (i * 3) % max(1, height - s), (i * 5) % max(1, width - s)
    img[top : top + s, left : left + s] = 255
    return img


def write_clip(
    path: Path,
    *,
    frames: int = 48,
    fps: int = 24,
    size: tuple[int, int] = (64, 96),
    codec: str = "h264",
    pix_fmt: str = "yuv420p",
    gop: int = 12,
    vfr_times_ms: list[int] | None = None,
    bframes: int = 2,
) -> Path:
    """A clip of ``frames`` frames of ``size`` (h, w) at ``fps``; with ``vfr_times_ms``,
    each frame's presentation time in milliseconds instead (a variable frame rate)."""
    height, width = size
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = "webm" if codec in ("libvpx", "libvpx-vp9") else "mp4"
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        options = {"g": str(gop)}
        if codec == "h264":
            options["bf"] = str(bframes)
        stream.options = options
        if vfr_times_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_image(i, height, width), format="rgb24")
            if vfr_times_ms is not None:
                frame.pts = vfr_times_ms[i]
                frame.time_base = Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def decoded_frames(path: Path) -> list[np.ndarray]:
    """Every frame of ``path`` in presentation order, decoded start to end by PyAV
    (``rgb24``, HWC): the decoder's own frames, without any seek."""
    with av.open(str(path)) as container:
        frames = [(f.pts, f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    return [f for _, f in sorted(frames, key=lambda pf: pf[0])]


# -- runs ----------------------------------------------------------------------------------


def run_epochs(
    make: Callable[[], Any],
    record: Callable[[int, dict[str, Any]], Any],
    *,
    epochs: int = 2,
    resume_after: int | None = None,
) -> list[Any]:
    """``record(epoch, batch)`` of every batch of ``epochs`` epochs of the loader ``make()``
    gives; with ``resume_after``, the loader is stopped after that many batches and a new
    one resumes from its ``state_dict``. Every loader made is closed."""
    out, loader, done, epoch = [], make(), 0, 0
    try:
        while epoch < epochs:
            loader.set_epoch(epoch)
            for batch in loader:
                out.append(record(epoch, batch))
                done += 1
                if resume_after is not None and done == resume_after:
                    state = loader.state_dict()
                    break
            else:
                epoch += 1
                continue
            loader.close()
            loader = make()
            loader.load_state_dict(state)
            resume_after = None
    finally:
        loader.close()
    return out


def video_chat_pipeline(max_bytes: int | None = None, *, video: Any = None) -> Any:
    """A small Qwen2.5-VL-style video SFT pipeline (frames of 4-16 tokens of 28 x 28, or
    the given ``video`` spec) whose ``ImageSpec(max_bytes=)`` bounds every member or
    object a source reads."""
    from chat_support import make_tokenizer

    from mmcache import ChatSpec, ImageSpec, Pipeline, VideoSpec
    from mmcache.transforms import VideoTokens

    tok = make_tokenizer()
    tok.add_special_tokens(["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<video>"])
    return Pipeline(
        image=ImageSpec(size=28, max_bytes=max_bytes),
        text=ChatSpec(tok, "chatml", 4096, video=VideoTokens()),
        video=video or VideoSpec(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28),
    )
