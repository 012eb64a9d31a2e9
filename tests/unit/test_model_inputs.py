"""mmcache.transforms.qwen_patches / PixelValues (issue 26): the cached uint8 images of
``hf_processor(Qwen2VLProcessor)``'s SmartResize become exactly the processor's flattened
``pixel_values`` and ``image_grid_thw``, and a loader hook names them ``pixel_values``.
Checked against transformers' own Qwen2-VL image processor (built from its constructor)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mmcache as mc
from mmcache.transforms import PixelValues, qwen_patches
from mmcache.transforms.hf import processor_mean_std

transformers = pytest.importorskip("transformers")


def qwen_image_processor(**kw: object) -> object:
    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or (
        transformers.Qwen2VLImageProcessor
    )
    return cls(min_pixels=56 * 56, max_pixels=28 * 28 * 16, **kw)


def photo(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("merge", [2, 1])
def test_qwen_patches_equal_the_processors_pixel_values(merge: int) -> None:
    images = qwen_image_processor(merge_size=merge)
    stage = mc.SmartResize(min_pixels=56 * 56, max_pixels=28 * 28 * 16, factor=14 * merge)
    pics = [photo(90, 60, 0), photo(40, 130, 1), photo(300, 200, 2)]
    want = images(pics, return_tensors="np")
    cached = [torch.from_numpy(stage(p)) for p in pics]
    mean, std = processor_mean_std(images)
    pixels, grid = qwen_patches(cached, mean, std, merge_size=merge)
    assert grid.tolist() == want["image_grid_thw"].tolist()
    assert pixels.shape == want["pixel_values"].shape
    assert torch.allclose(pixels, torch.from_numpy(want["pixel_values"]), atol=1e-5)


def test_qwen_patches_refuses_a_size_off_the_grid() -> None:
    with pytest.raises(mc.ConfigError, match="image 1 is 28x30"):
        qwen_patches(
            [torch.zeros(3, 28, 28, dtype=torch.uint8), torch.zeros(3, 28, 30, dtype=torch.uint8)]
        )


def test_pixel_values_hook_in_a_loader(tmp_path: Path) -> None:
    from chat_support import make_tokenizer, turns, write_image, write_llava

    images = qwen_image_processor()
    hook = PixelValues.from_processor(images)
    assert hook.layout == "qwen"
    make_tokenizer().save(str(tmp_path / "tok.json"))
    records = []
    for i, size in enumerate([(90, 60), (40, 130), (64, 64)]):
        write_image(tmp_path / f"{i}.png", size, shade=30 * i)
        conv = turns(("human", "<image>\nWhat is in the picture?"), ("gpt", "A cat."))
        records.append({"id": f"s{i}", "image": f"{i}.png", "conversations": conv})
    stage = mc.SmartResize(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    text = mc.ChatSpec(str(tmp_path / "tok.json"), "chatml", 256, image_tokens=stage.image_tokens)
    ds = mc.MultimodalDataset(
        write_llava(tmp_path / "m.json", records), pipeline=mc.Pipeline(image=stage, text=text)
    )
    with mc.Cache(tmp_path / "cache", memory="16MiB", temporary=True) as cache:
        loader = mc.DataLoader(ds, cache=cache, batch_size=3, shuffle=False, hooks=[hook])
        batch = next(iter(loader))
        loader.close()
    assert "images" not in batch
    pics = []
    for i in range(3):
        with Image.open(tmp_path / f"{i}.png") as im:
            pics.append(im.convert("RGB"))
    want = images(pics, return_tensors="np")
    assert batch["image_grid_thw"].tolist() == want["image_grid_thw"].tolist()
    assert torch.allclose(batch["pixel_values"], torch.from_numpy(want["pixel_values"]), atol=1e-5)


def test_model_only_keeps_the_models_inputs() -> None:
    batch = {
        "id": ["a", "b"],
        "input_ids": torch.ones(2, 4, dtype=torch.int64),
        "labels": torch.ones(2, 4, dtype=torch.int64),
        "attention_mask": torch.ones(2, 4, dtype=torch.int64),
        "images": torch.full((2, 3, 4, 4), 255, dtype=torch.uint8),
        "image_sizes": torch.full((2, 2), 4),
        "image_counts": torch.ones(2, dtype=torch.int64),
    }
    out = PixelValues("siglip", model_only=True).after_assemble(dict(batch), None)
    assert set(out) == {"input_ids", "labels", "attention_mask", "pixel_values"}
    assert torch.equal(out["pixel_values"], torch.ones(2, 3, 4, 4))
    kept = PixelValues("siglip").after_assemble(dict(batch), None)
    assert set(kept) == set(batch) - {"images"} | {"pixel_values"}


def test_qwen_image_stage_caches_the_processors_own_resize() -> None:
    import pickle

    from mmcache.transforms.hf_qwen import QwenImageStage

    images = qwen_image_processor()
    stage = QwenImageStage(56 * 56, 28 * 28 * 16, 28, processor=images)
    plain = mc.SmartResize(56 * 56, 28 * 28 * 16, 28)
    assert stage.fingerprint() != plain.fingerprint()
    again = pickle.loads(pickle.dumps(stage))
    for pic in (photo(90, 60, 4), photo(40, 130, 5)):
        got = stage(pic)
        assert got.dtype == np.uint8 and got.shape[1:] == plain.output_size(pic.height, pic.width)
        np.testing.assert_array_equal(got, plain(pic))  # the Pillow backend: Pillow's resize
        np.testing.assert_array_equal(again(pic), got)
        mean, std = processor_mean_std(images)
        pixels, _ = qwen_patches([torch.from_numpy(got)], mean, std)
        want = images(pic, return_tensors="np")["pixel_values"]
        assert torch.allclose(pixels, torch.from_numpy(want), atol=1e-5)
