"""mmcache's video frames against torchvision itself: ``load_clip``'s frames equal
``torchvision.transforms.functional.resize(frames, [h, w], BICUBIC, antialias=True)`` of
the decoder's own frames at the same indices (what ``qwen-vl-utils``' ``fetch_video``
does to a uint8 ``[T, 3, H, W]`` clip), within 1 level (torchvision resizes uint8 in
float32 and rounds; the bound allows a last-bit difference in a future torchvision's
uint8 kernel). Reference env only: torchvision is not in the core venv."""

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
    # (frames, fps, (h, w), spec): upscales, downscales, odd sizes, both aspect ratios
    (48, 24, (64, 96), VideoSpec()),
    (30, 15, (61, 97), VideoSpec(nframes=6)),
    (40, 25, (360, 640), VideoSpec(fps=1.0, max_pixels=160 * 28 * 28)),
    (24, 24, (200, 90), VideoSpec(nframes=4, min_pixels=40 * 28 * 28)),
]


@pytest.mark.parametrize(("frames", "fps", "size", "spec"), _CLIPS)
def test_frames_equal_torchvision_bicubic_antialias_of_the_decoders_frames(
    tmp_path: Path, frames: int, fps: int, size: tuple[int, int], spec: VideoSpec
) -> None:
    path = write_clip(tmp_path / "c.mp4", frames=frames, fps=fps, size=size)
    every = decoded_frames(path)
    info = probe_source(path)
    clip = load_clip(spec, path, sample_id="c")
    idx = spec.frame_indices(info.total_frames, info.fps)
    raw = torch.from_numpy(np.stack([every[i] for i in idx]).transpose(0, 3, 1, 2).copy())
    h, w = spec.frame_size(size[0], size[1], nframes=len(idx))
    want = tvf.resize(raw, [h, w], interpolation=tvf.InterpolationMode.BICUBIC, antialias=True)
    assert want.dtype == torch.uint8 and tuple(want.shape) == clip.frames.shape
    diff = (torch.from_numpy(clip.frames).int() - want.int()).abs()
    assert int(diff.max()) <= 1, f"max difference {int(diff.max())} levels"
