"""The video decoder choice (issue 42): ``VideoSpec(decoder="auto")`` decodes with
torchcodec where it loads and with PyAV otherwise; the frames are the same (within a
level: equal to the bit on these clips), so the decoder is not in the key.

torchcodec loads beside a CUDA-enabled torch with FFmpeg's shared libraries installed
(its PyPI wheels link CUDA's libraries); the parity test runs where it does and is
skipped, with the reason, elsewhere (the core venv's CPU torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from video_support import write_clip

import mmcache as mc
from mmcache.errors import ConfigError
from mmcache.transforms import video_decode, video_torchcodec
from mmcache.transforms.video_decode import load_clip

pytest.importorskip("av")

_CLIPS: list[tuple[str, dict[str, Any], mc.VideoSpec]] = [
    ("h264", {"frames": 48, "fps": 24, "size": (64, 96)}, mc.VideoSpec()),
    ("h264-444-odd", {"frames": 30, "fps": 15, "size": (61, 97), "pix_fmt": "yuv444p"},
     mc.VideoSpec(nframes=6)),
    ("vp9", {"frames": 30, "fps": 15, "size": (48, 80), "codec": "libvpx-vp9"},
     mc.VideoSpec(fps=4.0)),
    ("vfr", {"frames": 40, "fps": 30, "size": (64, 64),
             "vfr_times_ms": [int(i * 33 + (i // 10) * 200) for i in range(40)]},
     mc.VideoSpec(fps=3.0)),
    ("long-gop", {"frames": 90, "fps": 30, "size": (72, 128), "gop": 90},
     mc.VideoSpec(fps=2.0, start=0.5)),
]  # fmt: skip


def test_the_decoder_is_a_checked_option_outside_the_key() -> None:
    assert mc.VideoSpec().decoder == "auto"
    assert mc.VideoSpec(decoder="pyav").fingerprint() == mc.VideoSpec().fingerprint()
    assert mc.VideoSpec(decoder="torchcodec").fingerprint() == mc.VideoSpec().fingerprint()
    with pytest.raises(ConfigError, match="decoder must be"):
        mc.VideoSpec(decoder="decord")  # type: ignore[arg-type]


def test_auto_falls_back_to_pyav_and_a_forced_torchcodec_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torchcodec does not load, "auto" decodes with PyAV (the same frames as
    "pyav"), and "torchcodec" is a ConfigError naming why: never a SampleError, which
    ``on_error="skip"`` would turn into every video sample skipped."""
    path = write_clip(tmp_path / "a.mp4", frames=24, fps=12, size=(64, 96))
    monkeypatch.setattr(video_torchcodec, "torchcodec_loads", lambda: False)
    monkeypatch.setattr(video_decode, "torchcodec_loads", lambda: False)
    monkeypatch.setitem(video_torchcodec._state, "reason", "OSError: no libavcodec")
    auto = load_clip(mc.VideoSpec(), path, sample_id="a")
    pyav = load_clip(mc.VideoSpec(decoder="pyav"), path, sample_id="a")
    assert np.array_equal(auto.frames, pyav.frames)
    with pytest.raises(ConfigError, match="no libavcodec"):
        load_clip(mc.VideoSpec(decoder="torchcodec"), path, sample_id="a")


@pytest.mark.parametrize("case", _CLIPS, ids=lambda c: c[0])
def test_torchcodec_frames_equal_pyavs(
    tmp_path: Path, case: tuple[str, dict[str, Any], mc.VideoSpec]
) -> None:
    if not video_torchcodec.torchcodec_loads():
        pytest.skip(
            "torchcodec does not load here "
            f"({video_torchcodec.unavailable_reason() or 'not installed'}): it needs a "
            "CUDA-enabled torch (or its CPU wheels) and FFmpeg's shared libraries"
        )
    from dataclasses import replace

    name, options, spec = case
    suffix = ".webm" if options.get("codec") == "libvpx-vp9" else ".mp4"
    path = write_clip(tmp_path / f"{name}{suffix}", **options)
    ours = load_clip(replace(spec, decoder="torchcodec"), path, sample_id=name)
    ref = load_clip(replace(spec, decoder="pyav"), path, sample_id=name)
    assert ours.indices == ref.indices and ours.frames.shape == ref.frames.shape
    diff = np.abs(ours.frames.astype(np.int16) - ref.frames.astype(np.int16))
    assert int(diff.max()) <= 1, (name, int(diff.max()))
    # and from the file's bytes (a shard member, an object store's body)
    data = path.read_bytes()
    again = load_clip(replace(spec, decoder="torchcodec"), data, sample_id=name)
    assert np.array_equal(again.frames, ours.frames)
    # repeats and any order, as a frame sampler may ask
    from mmcache.transforms.video_decode import probe_source
    from mmcache.transforms.video_torchcodec import decode_frames_torchcodec

    info = probe_source(path)
    wanted = [info.total_frames - 1, 0, 3, 3, info.total_frames // 2]
    got = decode_frames_torchcodec(path, wanted, None, pts=info.pts,
                                   keyframes=info.keyframes,
                                   stored=(info.height, info.width))  # fmt: skip
    import av

    with av.open(str(path)) as container:
        want = video_decode.decode_frames(container, info, wanted)
    assert int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max()) <= 1
