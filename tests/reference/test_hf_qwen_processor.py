"""mmcache.hf_processor(Qwen2VLProcessor): the SmartResize grid and the image-token runs
equal the processor's own (Qwen2VLProcessor needs its video processor, which needs
torchvision: reference env only)."""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image
from refenv import need

transformers = need("transformers")
need("torchvision")
sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
from chat_support import hf_tokenizer, make_tokenizer  # noqa: E402

import mmcache as mc  # noqa: E402


def test_qwen2_vl_grid_and_token_count_equal_the_processor() -> None:
    tok = hf_tokenizer(make_tokenizer(), "{{ messages }}", bos="<s>", eos="</s>")
    specials = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    images = transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    processor = transformers.Qwen2VLProcessor(
        image_processor=images,
        tokenizer=tok,
        video_processor=transformers.Qwen2VLVideoProcessor(),
        chat_template="{{ messages }}",
    )
    pipe = mc.hf_processor(processor, 512)
    for width, height in [(90, 60), (300, 200), (40, 400), (1000, 700)]:
        out = processor(
            images=[Image.new("RGB", (width, height))],
            text=["<|vision_start|><|image_pad|><|vision_end|>"],
        )
        h, w = pipe.image.output_size(height, width)
        assert list(pipe.image.grid_thw(h, w)) == out["image_grid_thw"][0].tolist()
        assert pipe.text.image_tokens(h, w) == len(out["input_ids"][0]) - 2


def test_qwen_processors_pixel_values_from_the_cached_images() -> None:
    """Qwen2-VL and Qwen2.5-VL (their default image processor: the torchvision backend):
    hf_processor's cached SmartResize images -> qwen_patches == the processor's
    pixel_values within 1e-5, and the same image_grid_thw."""
    import numpy as np
    import torch

    from mmcache.transforms import PixelValues

    tok = hf_tokenizer(make_tokenizer(), "{{ messages }}", bos="<s>", eos="</s>")
    specials = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    rng = np.random.default_rng(0)
    pics = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for w, h in [(90, 60), (40, 130), (300, 200)]
    ]
    for cls in (transformers.Qwen2VLProcessor, transformers.Qwen2_5_VLProcessor):
        processor = cls(
            image_processor=transformers.Qwen2VLImageProcessor(
                min_pixels=56 * 56, max_pixels=28 * 28 * 16
            ),
            tokenizer=tok,
            video_processor=transformers.Qwen2VLVideoProcessor(),
            chat_template="{{ messages }}",
        )
        pipe = mc.hf_processor(processor, 512)
        want = processor.image_processor(pics, return_tensors="pt")
        hook = PixelValues.from_processor(processor)
        batch = hook.after_assemble(
            {"images": [torch.from_numpy(pipe.image(p)) for p in pics]}, None
        )
        assert batch["image_grid_thw"].tolist() == want["image_grid_thw"].tolist()
        diff = (batch["pixel_values"] - want["pixel_values"]).abs().max()
        assert diff <= 1e-5, (cls.__name__, float(diff))
