"""What a clip may cost and what a VideoSpec may ask for: frames resized one by one as
they are decoded (the pixels of the whole clip's resize), ``max_source_pixels`` refused
from the stream's declared size before a frame is decoded, and the VideoSpec fields no
clip can satisfy refused at construction, not clip by clip after each decode."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from video_support import decoded_frames, video_chat_pipeline, write_clip

from mmcache import MultimodalDataset, VideoSpec
from mmcache.errors import ConfigError, SampleError
from mmcache.transforms import video_decode
from mmcache.transforms.video import resize_frames
from mmcache.transforms.video_decode import decode_frames, load_clip, probe, video_shape

av = pytest.importorskip("av")


@pytest.mark.parametrize(
    ("codec", "size"), [("h264", (72, 128)), ("libvpx-vp9", (48, 80))], ids=["h264", "vp9"]
)
def test_frames_resized_as_decoded_equal_the_resize_of_the_stacked_clip(
    tmp_path: Path, codec: str, size: tuple[int, int]
) -> None:
    ext = "webm" if codec == "libvpx-vp9" else "mp4"
    path = write_clip(tmp_path / f"c.{ext}", frames=60, fps=30, size=size, codec=codec, gop=7)
    every = decoded_frames(path)
    wanted = [59, 3, 30, 30, 10, 0, 44]  # any order, a repeat, across keyframes
    stacked = np.stack([every[i] for i in wanted]).transpose(0, 3, 1, 2)
    for hw in ((56, 112), (112, 196), size):  # down, up, and the source size (no resize)
        with av.open(str(path)) as container:
            got = decode_frames(container, probe(container), wanted, hw)
        assert got.shape == (len(wanted), 3, *hw) and got.flags.c_contiguous
        np.testing.assert_array_equal(got, resize_frames(stacked, hw), err_msg=f"{hw}")


def test_frames_over_max_source_pixels_are_refused_before_one_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_clip(tmp_path / "c.mp4", frames=24, fps=24, size=(64, 96))
    decoded: list[int] = []
    real = video_decode.decode_frames

    def counted(*args: Any, **kwargs: Any) -> Any:
        decoded.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(video_decode, "decode_frames", counted)
    small = VideoSpec(max_source_pixels=64 * 96 - 1)
    for source, name in ((path, str(path)), (path.read_bytes(), "shard.tar:c.mp4")):
        with pytest.raises(SampleError) as info:
            load_clip(small, source, sample_id="c", name=name)
        reason = info.value.reason
        assert "96x64 (6144 pixels; 4 of 24 kept)" in reason, reason
        assert "max_source_pixels=6143" in reason and info.value.path == name
    with pytest.raises(SampleError, match="max_source_pixels=6143"):  # lengths plan alike
        video_shape(small, str(path), sample_id="c")
    assert decoded == []
    exact = VideoSpec(max_source_pixels=64 * 96)
    assert load_clip(exact, path, sample_id="c").shape == video_shape(exact, str(path),
                                                                      sample_id="c")  # fmt: skip
    assert load_clip(VideoSpec(max_source_pixels=None), path, sample_id="c").shape[0] == 4
    # which clips fail, never what one holds: existing caches keep their keys
    assert exact.fingerprint() == small.fingerprint() == VideoSpec().fingerprint()
    assert VideoSpec().fingerprint() == "9bf97a9816029e0c5d45b7b3d3a858c4"


def test_a_frame_smaller_than_a_patch_is_a_sample_error(tmp_path: Path) -> None:
    """Bounds under one 28 x 28 patch for this many frames (here 3000 * 2 / 8 = 750
    pixels) floor a side to 0: refused as the sample's error, not a RuntimeError from
    the resize, nor 0 tokens planned."""
    path = write_clip(tmp_path / "c.mp4", frames=24, fps=24, size=(64, 96))
    spec = VideoSpec(min_pixels=100, total_pixels=3000, nframes=8)
    for call in (load_clip, video_shape):
        with pytest.raises(SampleError, match="become 28x0 under max_pixels 750 for 8 frames"):
            call(spec, str(path), sample_id="c")
    assert load_clip(VideoSpec(min_pixels=100, total_pixels=3000, nframes=4), path,
                     sample_id="c").shape == (4, 28, 28)  # fmt: skip


_IMPOSSIBLE: list[tuple[dict[str, Any], list[str]]] = [
    # H9: below the default min_pixels (128 tokens of 28 x 28 = 100352)
    ({"max_pixels": 64 * 28 * 28},
     ["max_pixels (50176)", "default min_pixels (100352",
      "pass min_pixels <= 50176 or max_pixels >= 100352"]),
    ({"min_pixels": 256 * 28 * 28, "max_pixels": 128 * 28 * 28},
     ["max_pixels (100352)", "min_pixels (200704)"]),
    # under one 28 x 28 patch: every frame would get a side of 0
    ({"min_pixels": 100, "max_pixels": 500}, ["at most 500 pixels", "(784 pixels)"]),
    ({"min_pixels": 100, "total_pixels": 300}, ["at most 300 pixels", "total_pixels=300"]),
    ({"patch_size": 16, "min_pixels": 100, "max_pixels": 1000}, ["32 x 32 patch (1024"]),
    # counts that round to no frame (kept counts are multiples of 2)
    ({"nframes": 1}, ["VideoSpec.nframes must be >= 2, got 1"]),
    ({"max_frames": 1}, ["VideoSpec.max_frames must be >= 2, got 1"]),
    # NaN passes every comparison; an infinite start is past every clip's end
    ({"fps": math.nan}, ["VideoSpec.fps must be a finite number"]),
    ({"start": math.inf}, ["VideoSpec.start must be a finite number"]),
    ({"end": math.nan}, ["VideoSpec.end must be a finite number"]),
    ({"max_source_pixels": 0}, ["VideoSpec.max_source_pixels must be >= 1, got 0"]),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "words"), _IMPOSSIBLE, ids=lambda v: str(v)[:40])
def test_specs_no_clip_can_satisfy_are_config_errors(
    fields: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        VideoSpec(**fields)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_a_records_impossible_part_refuses_that_record_not_the_run(tmp_path: Path) -> None:
    """A part's ``max_pixels`` below the spec's ``min_pixels``: the record is refused
    when lengths are planned and when it is made, naming the sample and the clip; the
    other records are served."""
    write_clip(tmp_path / "clips/a.mp4", frames=24, fps=24, size=(64, 96))
    turns = [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "A square."}]
    part = {"type": "video", "video": "clips/a.mp4", "max_pixels": 2 * 28 * 28}
    records = [
        {"id": "ok", "video": "clips/a.mp4", "conversations": turns},
        {"id": "bad", "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A square."}]},
    ]  # fmt: skip
    (tmp_path / "m.json").write_text(json.dumps(records))
    pipe = video_chat_pipeline()  # min_pixels 4 * 28 * 28 = 3136
    ds = MultimodalDataset(tmp_path / "m.json", pipeline=pipe, on_error="skip")
    assert ds.produce(0)["videos"].size > 0
    with pytest.raises(SampleError, match=r"max_pixels \(1568\) is below min_pixels \(3136\)"):
        ds.produce(1)
    lengths = ds.lengths()
    assert lengths[0] > 0 and lengths[1] == 0
    assert [r.sample_id for r in ds.rejects()] == ["bad"]
