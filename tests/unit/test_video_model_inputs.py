"""PixelValues with videos (issue 42): the hook the HF-processors page recommends for a
Trainer (``PixelValues(layout="qwen", model_only=True)``) gives a tiny Qwen2.5-VL its
``pixel_values_videos``, ``video_grid_thw`` and ``second_per_grid_ts`` in image-only,
video-only and mixed batches, with ``mm_token_type_ids`` (transformers 5 computes the
3-D positions from it). Before: a mixed batch lost its video fields and the model trained
the ``<|video_pad|>`` tokens as text; a video-only batch failed in ``torch.cat``. The
equality with the processor's own inputs is in tests/reference/test_qwen_video_parity.py
(its video processor needs torchvision)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from chat_support import make_tokenizer, write_image
from video_support import write_clip

import mmcache as mc
from mmcache.errors import ConfigError
from mmcache.transforms import PixelValues, VideoTokens, qwen_patches
from mmcache.transforms.video import qwen_video_patches
from support.tiny_qwen import tiny_qwen25_vl

transformers = pytest.importorskip("transformers")
pytest.importorskip("av")

SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>", "<video>"]


def _tokenizer() -> Any:
    tok = make_tokenizer()
    tok.add_special_tokens(SPECIALS)
    return tok


def _pipeline(tok: Any) -> mc.Pipeline:
    stage = mc.SmartResize(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    chat = mc.ChatSpec(
        tok,
        "chatml",
        4096,
        image_token_id=tok.token_to_id("<|image_pad|>"),
        image_tokens=stage.image_tokens,
        image_prefix="<|vision_start|>",
        image_suffix="<|vision_end|>",
        video=VideoTokens(),
    )
    video = mc.VideoSpec(nframes=4, min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    return mc.Pipeline(image=stage, text=chat, video=video)


def _dataset(tmp_path: Path, tok: Any) -> mc.MultimodalDataset:
    write_image(tmp_path / "i0.jpg", (90, 60), shade=20)
    write_image(tmp_path / "i1.jpg", (50, 120), shade=90)
    write_clip(tmp_path / "v0.mp4", frames=24, fps=12, size=(64, 96))
    write_clip(tmp_path / "v1.mp4", frames=30, fps=15, size=(72, 56))
    ask = {"role": "user", "content": [{"type": "text", "text": "What is it?"}]}

    def record(sid: str, part: dict[str, Any] | None, images: list[str]) -> dict[str, Any]:
        content = ([part] if part else []) + ask["content"]
        reply = {"role": "assistant", "content": f"It is {sid}."}
        out = {"id": sid, "messages": [{"role": "user", "content": content}, reply]}
        return out | ({"images": images} if images else {})

    records = [
        record("img0", {"type": "image"}, ["i0.jpg"]),
        record("vid0", {"type": "video", "video": "v0.mp4"}, []),
        record("img1", {"type": "image"}, ["i1.jpg"]),
        record("vid1", {"type": "video", "video": "v1.mp4"}, []),
    ]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    return mc.MultimodalDataset(path, pipeline=_pipeline(tok))


def _hook(tok: Any, **kw: Any) -> PixelValues:
    return PixelValues(
        "clip",
        layout="qwen",
        image_token_id=tok.token_to_id("<|image_pad|>"),
        video_token_id=tok.token_to_id("<|video_pad|>"),
        **kw,
    )


def _by_hand(batch: dict[str, Any], tok: Any) -> dict[str, Any]:
    """The model's inputs of an unhooked batch, made with the named functions: what a
    user's own 15-line hook did before."""
    ids = batch["input_ids"]
    out = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    types = torch.zeros_like(ids)
    types[ids == tok.token_to_id("<|image_pad|>")] = 1
    types[ids == tok.token_to_id("<|video_pad|>")] = 2
    out["mm_token_type_ids"] = types
    if batch["image_sizes"].shape[0]:
        out["pixel_values"], out["image_grid_thw"] = qwen_patches(batch["images"], "clip")
    clips = batch["videos"]
    if len(clips):
        out["pixel_values_videos"] = torch.cat([qwen_video_patches(c) for c in clips])
        out["video_grid_thw"] = batch["video_grid_thw"]
        out["second_per_grid_ts"] = batch["second_per_grid_ts"]
    return out


def _rows(ds: mc.MultimodalDataset, ids: list[str]) -> dict[str, Any]:
    """One padded batch of the samples ``ids`` (PadHook's form), no PixelValues."""
    from mmcache.loader.padding import PadHook

    order = ["img0", "vid0", "img1", "vid1"]
    samples = [ds.produce(order.index(i)) for i in ids]
    raw: dict[str, Any] = {"id": ids}
    for name in samples[0]:
        raw[name] = [torch.from_numpy(s[name]) for s in samples]
    pad = ds.pipeline.chat.pad_id
    return PadHook(ds, pad_token_id=pad, pad_to_multiple_of=1).after_assemble(raw, None)


@pytest.mark.parametrize(
    "ids",
    [["img0", "vid0"], ["vid0", "vid1"], ["img0", "img1"], ["vid1", "img1", "vid0", "img0"]],
    ids=["mixed", "video-only", "image-only", "mixed-4"],
)
def test_model_only_batches_keep_the_videos_and_the_loss_is_the_models(
    tmp_path: Path, ids: list[str]
) -> None:
    tok = _tokenizer()
    ds = _dataset(tmp_path, tok)
    model = tiny_qwen25_vl(
        tok.get_vocab_size(), video=tok.token_to_id("<|video_pad|>"),
        image=tok.token_to_id("<|image_pad|>"), vision_start=tok.token_to_id("<|vision_start|>"),
        vision_end=tok.token_to_id("<|vision_end|>"),
    )  # fmt: skip
    batch = _rows(ds, ids)
    n_videos = int(batch["video_counts"].sum())
    got = _hook(tok, model_only=True).after_assemble(dict(batch), None)
    video_keys = {"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"}
    image_keys = {"pixel_values", "image_grid_thw"}
    assert video_keys <= set(got) if n_videos else not video_keys & set(got)
    assert image_keys <= set(got) if n_videos < len(ids) else not image_keys & set(got)
    assert set(got) - video_keys - image_keys == {
        "input_ids", "attention_mask", "labels", "mm_token_type_ids"
    }  # fmt: skip
    want = _by_hand(batch, tok)
    assert set(got) == set(want)
    with torch.no_grad():
        loss = model(**got).loss
        assert torch.isfinite(loss)
        assert torch.equal(loss, model(**want).loss)
        if n_videos:  # the old hook's batch (videos dropped, 1-D positions): another loss
            old = video_keys | {"mm_token_type_ids"}
            dropped = {k: v for k, v in want.items() if k not in old}
            assert not torch.equal(loss, model(**dropped).loss)


def test_the_hook_in_a_loader_and_its_refusals(tmp_path: Path) -> None:
    tok = _tokenizer()
    ds = _dataset(tmp_path, tok)
    loader = mc.DataLoader(
        ds, cache=None, batch_size=4, shuffle=False, hooks=[_hook(tok, model_only=True)]
    )
    try:
        (batch,) = list(loader)
    finally:
        loader.close()
    assert batch["pixel_values_videos"].shape[0] == int(batch["video_grid_thw"].prod(-1).sum())
    assert batch["second_per_grid_ts"].shape == (2,)
    assert set(torch.unique(batch["mm_token_type_ids"]).tolist()) == {0, 1, 2}
    raw = _rows(ds, ["img0", "vid0"])
    # Another layout has no video input: refused, never dropped.
    with pytest.raises(ConfigError, match="1 video clips"):
        PixelValues("clip", model_only=True).after_assemble(dict(raw), None)
    # A geometry that disagrees with the cached grid is named.
    with pytest.raises(ConfigError, match="video_grid_thw"):
        _hook(tok, temporal_patch_size=1).after_assemble(dict(raw), None)
