"""mmcache's video frames against torchvision itself: ``load_clip``'s frames equal
``torchvision.transforms.functional.resize(frames, [h, w], BICUBIC, antialias=True)`` of
the decoder's own frames at the same indices (what ``qwen-vl-utils``' ``fetch_video``
does to a uint8 ``[T, 3, H, W]`` clip): bitwise with the pinned torchvision (it resizes
uint8 in float32, clamps and rounds, as ``resize_frames`` does). Reference env only:
torchvision is not in the core venv."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from refenv import need

torch = need("torch")
tvf = need("torchvision.transforms.functional")
need("av")
sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
from video_support import decoded_frames, write_clip  # noqa: E402

from mmcache import VideoSpec  # noqa: E402
from mmcache.transforms.video_decode import load_clip, probe_source  # noqa: E402

_CLIPS = [
    # (frames, fps, (h, w), pixel format, spec): upscales, downscales, odd sizes (4:4:4:
    # x264 refuses odd sides in 4:2:0), both aspect ratios
    (48, 24, (64, 96), "yuv420p", VideoSpec()),
    (30, 15, (61, 97), "yuv444p", VideoSpec(nframes=6)),
    (40, 25, (360, 640), "yuv420p", VideoSpec(fps=1.0, max_pixels=160 * 28 * 28)),
    (24, 24, (200, 90), "yuv420p", VideoSpec(nframes=4, min_pixels=40 * 28 * 28)),
]


@pytest.mark.parametrize("case", _CLIPS, ids=lambda c: f"{c[2][0]}x{c[2][1]}")
def test_frames_equal_torchvision_bicubic_antialias_of_the_decoders_frames(
    tmp_path: Path, case: tuple[int, int, tuple[int, int], str, VideoSpec]
) -> None:
    frames, fps, size, pix_fmt, spec = case
    path = write_clip(tmp_path / "c.mp4", frames=frames, fps=fps, size=size, pix_fmt=pix_fmt)
    every = decoded_frames(path)
    info = probe_source(path)
    clip = load_clip(spec, path, sample_id="c")
    idx = spec.frame_indices(info.total_frames, info.fps)
    raw = torch.from_numpy(np.stack([every[i] for i in idx]).transpose(0, 3, 1, 2).copy())
    h, w = spec.frame_size(size[0], size[1], nframes=len(idx))
    want = tvf.resize(raw, [h, w], interpolation=tvf.InterpolationMode.BICUBIC, antialias=True)
    assert want.dtype == torch.uint8 and tuple(want.shape) == clip.frames.shape
    # bitwise with the pinned torchvision: the same float32 kernel, clamp and rounding
    diff = (torch.from_numpy(clip.frames).int() - want.int()).abs()
    assert int(diff.max()) == 0, f"max difference {int(diff.max())} levels"
