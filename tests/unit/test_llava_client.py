"""A real client: a tiny transformers LlavaForConditionalGeneration (random weights, built
offline from configs) trains on mmcache.DataLoader batches; fully masked samples never
reach it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import mmcache
from mmcache import Cache, DataLoader, PackSpec
from mmcache.loader import SFTBatching
from mmcache.testing.sft import SyntheticSFTSource

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 3
SIZE, PATCH = 32, 8
PATCHES = (SIZE // PATCH) ** 2  # image features per image ("default" drops CLS)


def _model() -> Any:
    return _model_for(vocab=256, image_token=IMAGE_TOKEN)


def _model_for(*, vocab: int, image_token: int) -> Any:
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(
        image_size=SIZE,
        patch_size=PATCH,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=32,
    )
    text = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        image_seq_length=PATCHES,
        vision_feature_layer=-1,
    )
    return transformers.LlavaForConditionalGeneration(config)


def _source(**kw: Any) -> SyntheticSFTSource:
    return SyntheticSFTSource(
        16,
        seed=3,
        vocab=256,
        image_token_id=IMAGE_TOKEN,
        image_tokens=lambda h, w: (h // PATCH) * (w // PATCH),
        image_counts=(1, 0, 2),
        shapes=((SIZE, SIZE),),
        **kw,
    )


def _inputs(batch: dict[str, Any]) -> dict[str, Any]:
    images = batch["images"]
    assert isinstance(images, torch.Tensor)  # one shape: one uint8 tensor
    n_image_tokens = int((batch["input_ids"] == IMAGE_TOKEN).sum())
    assert n_image_tokens == PATCHES * int(batch["image_counts"].sum())
    out = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": batch["labels"],
    }
    if len(images):
        out["pixel_values"] = mmcache.normalize(images)
    return out


def test_tiny_llava_trains_on_cached_batches(cache_root: Path) -> None:
    model = _model()
    model.train()
    src = _source(masked=(4, 9), on_error="skip")
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(src, cache=cache, batch_size=4, seed=1)
        for epoch in range(2):  # cold, then warm from memory
            loader.set_epoch(epoch)
            for batch in loader:
                # Fully masked samples never reach the model.
                assert ((batch["labels"] != -100).sum(dim=1) > 0).all()
                assert not {"sft-000004", "sft-000009"} & set(batch["id"])
                model.zero_grad()
                out = model(**_inputs(batch))
                assert torch.isfinite(out.loss)
                out.loss.backward()
                grads = [p.grad for p in model.parameters() if p.requires_grad]
                assert any(g is not None and g.abs().sum() > 0 for g in grads)
                vision = next(p for n, p in model.named_parameters() if "patch_embedding" in n)
                if "pixel_values" in _inputs(batch):
                    assert vision.grad is not None and vision.grad.abs().sum() > 0
        assert loader.stats().epochs[-1].hits == 14


def test_tiny_llava_takes_a_packed_batch() -> None:
    model = _model()
    src = _source()
    loader = DataLoader(
        src, cache=None, batch_size=1, batching=SFTBatching(pack=PackSpec(max_tokens=256))
    )
    batch = next(iter(loader))
    assert len(batch["id"]) > 1  # several samples in the row
    inputs = {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "position_ids": batch["position_ids"],
    }
    if len(batch["images"]):
        inputs["pixel_values"] = mmcache.normalize(batch["images"])
    out = model(**inputs)
    assert torch.isfinite(out.loss)
    out.loss.backward()


def test_tiny_llava_trains_on_chatspec_samples_from_a_llava_manifest(
    tmp_path: Path, cache_root: Path
) -> None:
    """The whole path: LLaVA records (one image, two images, text only) -> ChatSpec +
    ImageSpec(pad_to_square) cached -> padded batches -> the model's forward and backward."""
    from chat_support import make_tokenizer, turns, write_image, write_llava

    tok = make_tokenizer()
    image_id = tok.token_to_id("<image>")
    write_image(tmp_path / "a.jpg", (48, 32), shade=20)
    write_image(tmp_path / "b.jpg", (30, 60), shade=120)
    records = []
    for i in range(8):
        kind = i % 3
        if kind == 0:
            q, extra = "<image>\nWhat is this?", {"image": "a.jpg"}
        elif kind == 1:
            q, extra = "<image> or <image>?", {"image": ["a.jpg", "b.jpg"]}
        else:
            q, extra = "Say hello.", {}
        conv = turns(("human", q), ("gpt", f"Answer number {i}."))
        records.append({"id": f"r{i}", "conversations": conv, **extra})
    manifest = write_llava(tmp_path / "llava.json", records)
    spec = mmcache.ChatSpec(tok, "chatml", 256, image_tokens=PATCHES)
    pipe = mmcache.Pipeline(image=mmcache.ImageSpec(size=SIZE, pad_to_square=True), text=spec)
    ds = mmcache.MultimodalDataset(manifest, pipeline=pipe)
    model = _model_for(vocab=tok.get_vocab_size(), image_token=image_id)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=4, seed=0)
        for epoch in range(2):  # cold, then warm
            loader.set_epoch(epoch)
            for batch in loader:
                ids = batch["input_ids"]
                assert int((ids == image_id).sum()) == PATCHES * int(batch["image_counts"].sum())
                inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
                if len(batch["images"]):
                    inputs["pixel_values"] = mmcache.normalize(batch["images"])
                model.zero_grad()
                out = model(**inputs)
                assert torch.isfinite(out.loss)
                out.loss.backward()
        assert loader.stats().epochs[-1].misses == 0
