"""Qwen's own record forms (issue 42): inline image parts (``{"type": "image", "image":
path}``, what qwen-vl-utils reads; before, ``2 '<image>' placeholders for 0 images``),
videos given as lists of frame images (qwen-vl-utils' ``fetch_video`` for a list; before,
refused) in the ``messages`` and the LLaVA forms, and Qwen3-VL's timestamped video
tokens (``VideoTokens(timestamps=True)``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from chat_support import make_tokenizer
from PIL import Image
from video_support import smart_resize

import mmcache as mc
from mmcache.errors import ManifestError, SampleError
from mmcache.sources.readers import read_manifest
from mmcache.transforms import VideoTokens
from mmcache.transforms.chat import Chat
from mmcache.transforms.video import resize_frames

pytest.importorskip("jinja2")

SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>", "<video>"]


def _tokenizer() -> Any:
    tok = make_tokenizer()
    tok.add_special_tokens(SPECIALS)
    return tok


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def _photo(path: Path, size: tuple[int, int], seed: int) -> str:
    rng = np.random.default_rng(seed)
    w, h = size
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path.name


def _pipeline(tok: Any, *, timestamps: bool = False) -> mc.Pipeline:
    stage = mc.SmartResize(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    chat = mc.ChatSpec(
        tok, "chatml", 4096, image_token_id=tok.token_to_id("<|image_pad|>"),
        image_tokens=stage.image_tokens, image_prefix="<|vision_start|>",
        image_suffix="<|vision_end|>", video=VideoTokens(timestamps=timestamps),
    )  # fmt: skip
    video = mc.VideoSpec(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    return mc.Pipeline(image=stage, text=chat, video=video)


def _messages(content: list[dict[str, Any]], reply: str = "Two cats.") -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}, {"role": "assistant", "content": reply}]


# -- inline image parts -------------------------------------------------------------------------


def test_inline_image_parts_are_the_records_images(tmp_path: Path) -> None:
    a, b = _photo(tmp_path / "a.png", (90, 60), 0), _photo(tmp_path / "b.png", (50, 120), 1)
    ask = {"type": "text", "text": "Same?"}
    inline = {"id": "inline", "messages": _messages(
        [{"type": "image", "image": a}, {"type": "image", "image": f"file://{tmp_path / b}"}, ask]
    )}  # fmt: skip
    listed = {"id": "listed", "images": [a, b],
              "messages": _messages([{"type": "image"}, {"type": "image"}, ask])}  # fmt: skip
    turns = [{"from": "human", "value": "<image><image>Same?"},
             {"from": "gpt", "value": "Two cats."}]  # fmt: skip
    llava = {"id": "llava", "image": [a, b], "conversations": turns}
    m = _write(tmp_path / "m.json", [inline, listed, llava])
    rec = read_manifest(m)
    want = [str(tmp_path / a), str(tmp_path / b)]
    assert [rec.image_paths(i) for i in range(3)] == [want, want, want]
    assert rec.chat(0) == rec.chat(1) == rec.chat(2)
    # The placeholders are counted the same way in every form: one sample, three ids.
    ds = mc.MultimodalDataset(m, pipeline=_pipeline(_tokenizer()))
    samples = [ds.produce(i) for i in range(3)]
    for s in samples[1:]:
        assert set(s) == set(samples[0])
        for name, value in s.items():
            assert np.array_equal(value, samples[0][name]), name


@pytest.mark.parametrize(
    ("content", "extra", "reason"),
    [
        ([{"type": "image", "image": "a.png"}, {"type": "image"}], {},
         "1 of 2 image parts name their image"),
        ([{"type": "image", "image": "a.png"}], {"images": ["a.png"]},
         "images given both as 'images' and as message parts"),
        ([{"type": "image", "image": "a.png", "max_pixels": 1000}], {},
         "are not applied per image"),
        ([{"type": "image", "image": ""}], {}, "'image' must be a non-empty path"),
    ],
)  # fmt: skip
def test_bad_inline_image_parts_are_manifest_errors(
    tmp_path: Path, content: list[dict[str, Any]], extra: dict[str, Any], reason: str
) -> None:
    m = _write(tmp_path / "m.json", [{"id": "bad", "messages": _messages(content), **extra}])
    with pytest.raises(ManifestError, match=reason):
        read_manifest(m)


# -- videos as frame lists ------------------------------------------------------------------------


def _frames(folder: Path, n: int, size: tuple[int, int] = (96, 64)) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return [f"{folder.name}/{_photo(folder / f'{k:04d}.png', size, 10 + k)}" for k in range(n)]


def _qwen_frame_list(paths: list[Path], spec: mc.VideoSpec) -> np.ndarray:
    """qwen-vl-utils' ``fetch_video`` for a list, from its rules: each frame through
    ``fetch_image`` (RGB, smart_resize 4..16384 tokens, Pillow's default bicubic), the
    last repeated to an even count, then the clip's smart_resize and torchvision's
    bicubic antialias (``resize_frames``: equal to it bitwise, tests/reference)."""
    images = []
    for p in paths:
        with Image.open(p) as im:
            rgb = im.convert("RGB")
            h, w = smart_resize(rgb.height, rgb.width, 28, 4 * 28 * 28, 16384 * 28 * 28)
            images.append(np.asarray(rgb.resize((w, h))).transpose(2, 0, 1))
    if len(images) % 2:
        images.append(images[-1])
    stack = np.stack(images)
    size = spec.frame_size(stack.shape[2], stack.shape[3], nframes=len(images))
    return resize_frames(stack, size)


def test_frame_list_videos_in_both_forms_are_qwen_vl_utils_clips(tmp_path: Path) -> None:
    frames = _frames(tmp_path / "f", 5)
    ask = {"type": "text", "text": "What moves?"}
    records = [
        {"id": "msg", "messages": _messages(
            [{"type": "video", "video": frames, "sample_fps": 1.0}, ask], "A square.")},
        {"id": "llava", "video": [frames], "conversations": [
            {"from": "human", "value": "<video>What moves?"},
            {"from": "gpt", "value": "A square."}]},
        {"id": "sampled", "messages": _messages(
            [{"type": "video", "video": frames + frames, "sample_fps": 5.0, "fps": 2.0}, ask])},
    ]  # fmt: skip
    m = _write(tmp_path / "m.json", records)
    rec = read_manifest(m)
    assert rec.videos(0) == [{"video": [str(tmp_path / f) for f in frames], "sample_fps": 1.0}]
    assert rec.videos(1) == [{"video": [str(tmp_path / f) for f in frames]}]
    pipe = _pipeline(_tokenizer())
    ds = mc.MultimodalDataset(m, pipeline=pipe)
    spec = pipe.video
    assert spec is not None
    want = _qwen_frame_list([tmp_path / f for f in frames], spec)
    for i, fps in ((0, 1.0), (1, 2.0)):
        s = ds.produce(i)
        t, h, w = s["video_sizes"][0].tolist()
        assert (t, h, w) == want.shape[:1] + want.shape[2:] and t == 6  # 5 frames, 1 repeated
        assert np.array_equal(s["videos"].reshape(want.shape), want)
        assert s["video_grid_thw"].tolist() == [[3, h // 14, w // 14]]
        assert s["second_per_grid_ts"].tolist() == [pytest.approx(2 / fps)]
    # a part's own fps samples the list as a clip at its sample_fps: 10 frames at 5 fps
    # are 2 s, 4 frames at 2 fps (min_frames 4)
    s = ds.produce(2)
    assert s["video_sizes"][0, 0] == 4
    assert s["second_per_grid_ts"].tolist() == [pytest.approx(2 / (4 / 10 * 5.0))]
    # lengths are planned from the frames' headers, equal to the samples made
    fresh = mc.MultimodalDataset(m, pipeline=pipe)
    assert fresh.lengths().tolist() == [len(ds.produce(i)["input_ids"]) for i in range(3)]


def test_frame_lists_of_mixed_sizes_and_missing_frames_are_sample_errors(tmp_path: Path) -> None:
    frames = _frames(tmp_path / "f", 2) + _frames(tmp_path / "g", 1, size=(40, 120))
    ask = {"type": "text", "text": "?"}
    m = _write(tmp_path / "m.json", [
        {"id": "mixed", "messages": _messages([{"type": "video", "video": frames}, ask])},
        {"id": "missing", "messages": _messages(
            [{"type": "video", "video": [frames[0], "f/nope.png"]}, ask])},
        {"id": "empty", "messages": _messages([{"type": "video", "video": []}, ask])},
    ])  # fmt: skip
    ds = mc.MultimodalDataset(m, pipeline=_pipeline(_tokenizer()), on_error="skip")
    assert len(ds) == 2 and "empty list of frames" in ds.rejects()[0].reason
    with pytest.raises(SampleError, match="must share one size"):
        ds.produce(0)
    with pytest.raises(SampleError, match="file not found") as info:
        ds.produce(1)
    assert info.value.path is not None and info.value.path.endswith("nope.png")


# -- Qwen3-VL's timestamped video tokens ---------------------------------------------------------


def _qwen3_timestamps(indices: list[int], video_fps: float, merge_size: int = 2) -> list[float]:
    """``Qwen3VLProcessor._calculate_timestamps`` (transformers 5.24, copied)."""
    indices = list(indices)
    if len(indices) % merge_size != 0:
        indices.extend(indices[-1] for _ in range(merge_size - len(indices) % merge_size))
    timestamps = [idx / video_fps for idx in indices]
    return [
        (timestamps[i] + timestamps[i + merge_size - 1]) / 2
        for i in range(0, len(timestamps), merge_size)
    ]


def test_timestamped_video_tokens_are_qwen3_vls_layout() -> None:
    tok = _tokenizer()
    spec = mc.ChatSpec(tok, "chatml", 4096, video=VideoTokens(factor=32, timestamps=True))
    indices, fps = [0, 16, 31, 47, 63, 79], 24.0
    times = tuple(i / fps for i in indices)
    assert VideoTokens(timestamps=True).step_times(times) == _qwen3_timestamps(indices, fps)
    chat = Chat((("user", "<video>Go"), ("assistant", "Ok")), (), ((6, 64, 96),), (times,))
    ids = spec.encode(chat, sample_id="s").input_ids.tolist()
    start, end = tok.token_to_id("<|vision_start|>"), tok.token_to_id("<|vision_end|>")
    pad = tok.token_to_id("<|video_pad|>")
    block: list[int] = [start]
    for seconds in _qwen3_timestamps(indices, fps):
        block += tok.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False).ids
        block += [start] + [pad] * (2 * 3) + [end]
    block.append(end)
    at = ids.index(start)
    assert ids[at : at + len(block)] == block
    with pytest.raises(SampleError, match="needs each of the video's 6 frames' times"):
        spec.encode(Chat(chat.messages, (), chat.video_sizes), sample_id="s")
    # not in the fingerprint of the specs made before it
    plain = VideoTokens().fingerprint_fields()
    assert (
        "timestamps" not in plain
        and VideoTokens(timestamps=True).fingerprint_fields()["timestamps"]
    )


def test_timestamped_tokens_through_a_dataset_and_its_lengths(tmp_path: Path) -> None:
    frames = _frames(tmp_path / "f", 4)
    m = _write(tmp_path / "m.json", [{"id": "v", "messages": _messages(
        [{"type": "video", "video": frames, "sample_fps": 2.0, "raw_fps": 4.0},
         {"type": "text", "text": "?"}])}])  # fmt: skip
    tok = _tokenizer()
    ds = mc.MultimodalDataset(m, pipeline=_pipeline(tok, timestamps=True))
    ids = ds.produce(0)["input_ids"].tolist()
    text = tok.decode(ids, skip_special_tokens=False)
    # frames 0..3 at raw_fps 4: steps at (0 + 0.25) / 2 and (0.5 + 0.75) / 2 seconds
    assert "<0.1 seconds>" in text and "<0.6 seconds>" in text
    assert mc.MultimodalDataset(m, pipeline=_pipeline(tok, timestamps=True)).lengths().tolist() == [
        len(ids)
    ]
    assert torch.is_tensor(torch.as_tensor(ids))


def test_the_frame_sampler_refuses_timestamped_tokens() -> None:
    from mmcache.errors import ConfigError
    from mmcache.loader.video_frames import VideoFrameSampler

    spec = mc.ChatSpec(_tokenizer(), "chatml", 4096, video=VideoTokens(timestamps=True))
    with pytest.raises(ConfigError, match="timestamped"):
        VideoFrameSampler.for_chat(spec, 4, pad_token_id=0)
