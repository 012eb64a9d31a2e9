"""mmcache.hf_processor(LlavaNextProcessor) with transformers' default image processor,
the torchvision backend (its resize differs from Pillow's by a level, so the cached
crops must be the processor's own): the loader's ``pixel_values`` equal the processor's
within 1e-5 and its ``image_sizes`` are equal, cold and warm; the token runs equal
``apply_chat_template``'s. LLaVA-OneVision is refused saying why."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from refenv import need

transformers = need("transformers")
need("torchvision")
sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
from chat_support import hf_tokenizer, make_tokenizer  # noqa: E402
from test_hf_llava_next import (  # noqa: E402
    CONVERSATIONS,
    llava_next_processor,
    reference,
    write_dataset,
)

import mmcache as mc  # noqa: E402
from mmcache.transforms.model_inputs import PixelValues  # noqa: E402


def test_torchvision_backend_pixel_values_and_tokens(tmp_path: Path) -> None:
    processor = llava_next_processor(transformers.LlavaNextImageProcessor)
    assert type(processor.image_processor).__name__ == "LlavaNextImageProcessor"
    pipe = mc.hf_processor(processor, max_length=512)
    manifest, pictures = write_dataset(tmp_path)
    ds = mc.MultimodalDataset(manifest, pipeline=pipe)
    for i in range(len(ds)):
        ref = reference(processor, CONVERSATIONS[i % len(CONVERSATIONS)], pictures[i])
        sample = ds.produce(i)
        assert sample["input_ids"].tolist() == ref["input_ids"][0].tolist(), i
        labels = np.where(ref["assistant_masks"][0] == 1, ref["input_ids"][0], -100)
        assert sample["labels"].tolist() == labels.tolist(), i
    hook = PixelValues.from_processor(processor)
    with mc.Cache(tmp_path / "cache", memory="64MiB", disk="64MiB", temporary=True) as cache:
        loader = mc.DataLoader(ds, cache=cache, batch_size=4, shuffle=False, hooks=[hook])
        for epoch in range(2):  # cold, then warm
            for b, batch in enumerate(loader):
                pics = [p for r in range(4 * b, 4 * b + 4) for p in pictures[r]]
                want = processor.image_processor(pics, return_tensors="pt")
                assert batch["pixel_values"].shape == want["pixel_values"].shape
                diff = (batch["pixel_values"] - want["pixel_values"]).abs().max()
                assert diff <= 1e-5, (epoch, b, float(diff))
                assert torch.equal(batch["image_sizes"], want["image_sizes"].to(torch.int64))
        loader.close()


def test_llava_onevision_is_refused_saying_why() -> None:
    tok = hf_tokenizer(make_tokenizer(), "{{ messages }}", bos="<s>", eos="</s>")
    tok.add_special_tokens({"additional_special_tokens": ["<video>"]})
    processor = transformers.LlavaOnevisionProcessor(
        image_processor=transformers.LlavaOnevisionImageProcessor(),
        tokenizer=tok,
        video_processor=transformers.LlavaOnevisionVideoProcessor(),
        chat_template="{{ messages }}",
    )
    with pytest.raises(mc.ConfigError, match="several"):
        mc.hf_processor(processor)
    with pytest.raises(mc.ConfigError, match="no layout"):
        PixelValues.from_processor(processor)
