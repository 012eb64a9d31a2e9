"""A tiny Qwen2.5-VL with random weights, built from a config (no download), for the
tests that train on or compare against mmcache's video batches."""

from __future__ import annotations

from typing import Any


def tiny_qwen25_vl(
    vocab: int,
    *,
    video: int,
    image: int,
    vision_start: int,
    vision_end: int,
    tokens_per_second: int | None = 2,
) -> Any:
    """A 2-layer Qwen2.5-VL (64-wide text, 32-wide vision) whose special token ids are
    the tokenizer's; seeded, in eval mode. ``tokens_per_second=None`` keeps the config's
    default (the Qwen2.5-VL rule of time positions)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision: dict[str, Any] = {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 64, "fullatt_block_indexes": [1], "window_size": 56,
    }  # fmt: skip
    if tokens_per_second is not None:
        vision["tokens_per_second"] = tokens_per_second
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 3, 3]},
        },
        vision_config=vision,
        video_token_id=video,
        image_token_id=image,
        vision_start_token_id=vision_start,
        vision_end_token_id=vision_end,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()
