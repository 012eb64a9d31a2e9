"""A tiny Qwen2.5-VL, built from a config, trains on video batches served by the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_video import video_manifest, video_pipeline, video_tokenizer  # noqa: F401 (fixture)

import mmcache
from mmcache import MultimodalDataset
from mmcache.transforms.video import qwen_video_patches
from support.tiny_qwen import tiny_qwen25_vl

transformers = pytest.importorskip("transformers")
pytest.importorskip("av")


def test_tiny_qwen25_vl_trains_three_steps_on_cached_video_batches(
    video_manifest: Path,  # noqa: F811 (the fixture)
    cache_root: Path,
) -> None:
    tok = video_tokenizer()
    ds = MultimodalDataset(
        video_manifest, pipeline=video_pipeline(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    )
    ids = {name: tok.token_to_id(name) for name in
           ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<image>")}  # fmt: skip
    model = tiny_qwen25_vl(
        tok.get_vocab_size(), video=ids["<|video_pad|>"], image=ids["<image>"],
        vision_start=ids["<|vision_start|>"], vision_end=ids["<|vision_end|>"],
        tokens_per_second=None,
    ).train()  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cache = mmcache.Cache(cache_root, memory="64MiB", disk="128MiB")
    losses = []
    try:
        loader = mmcache.DataLoader(ds, cache=cache, batch_size=3, shuffle=False)
        for _ in range(3):
            (batch,) = list(loader)
            clips = batch["videos"]
            clips = clips if isinstance(clips, list) else list(clips)
            pixels = torch.cat([qwen_video_patches(c) for c in clips])
            grid = batch["video_grid_thw"]
            assert pixels.shape[0] == int(grid.prod(dim=1).sum())
            out = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                labels=batch["labels"],
                pixel_values_videos=pixels,
                video_grid_thw=grid,
                second_per_grid_ts=batch["second_per_grid_ts"],
            )
            assert torch.isfinite(out.loss)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            losses.append(float(out.loss.detach()))
    finally:
        cache.close()
    assert losses[-1] < losses[0]
