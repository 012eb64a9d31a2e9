"""mmcache.hf_processor(LlavaNextProcessor) (issue 26): LLaVA-NeXT's any-resolution crops
cached as uint8 by the processor itself, its image-token count from the original size,
checked against the processor: ``input_ids`` and labels equal
``apply_chat_template(..., return_assistant_tokens_mask=True)``, the loader's
``pixel_values`` (``PixelValues.from_processor``) equal the processor's within 1e-5 and
its ``image_sizes`` are equal; lengths, text_report, group_by_length and pack work; a
tiny ``LlavaNextForConditionalGeneration`` trains a step on a batch. Images of several
aspect ratios, so the number of tiles k varies. Built offline (a trained tokenizer,
processors and a model from configs); the Pillow backend (the torchvision one is in
tests/reference/test_hf_llava_next_tv.py)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from chat_support import hf_tokenizer, make_tokenizer, turns, write_llava
from PIL import Image, ImageOps
from test_hf_processor import CONVERSATIONS as ONE_IMAGE_CONVERSATIONS
from test_hf_processor import LLAVA_15_HF, TEMPLATE  # TEMPLATE: {% generation %} on replies
from test_llava_client import PATCH, SIZE, _model_for

import mmcache as mc
from mmcache.loader import SFTBatching
from mmcache.transforms.hf_llava_next import LlavaNextTokens
from mmcache.transforms.model_inputs import PixelValues, llava_next_pixels

pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

CROP = SIZE  # the tiny vision tower's image size (test_llava_client's: 32, patch 8)
PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
# (width, height): wide, tall (3 tiles), large, square, one of each side's extremes
SIZES = [(64, 48), (40, 130), (300, 200), (33, 33), (200, 30)]
CONVERSATIONS = [
    *ONE_IMAGE_CONVERSATIONS,
    [("human", "How many animals are there?"), ("gpt", "There are three animals.")],
    [
        ("human", "<image>\nWhat is in the picture?"),
        ("gpt", "A red car."),
        ("human", "And in this one? <image>"),
        ("gpt", "A cat sits on a mat."),
    ],
]


def image_processor_class() -> Any:
    """The Pillow backend (the default falls back to it without torchvision)."""
    return getattr(transformers, "LlavaNextImageProcessorPil", None) or (
        transformers.LlavaNextImageProcessor
    )


def llava_next_processor(images_cls: Any = None, template: str = TEMPLATE) -> Any:
    tok = hf_tokenizer(make_tokenizer(), template, bos="<s>", eos="</s>")
    images = (images_cls or image_processor_class())(
        size={"shortest_edge": CROP},
        crop_size={"height": CROP, "width": CROP},
        image_grid_pinpoints=PINPOINTS,
    )
    return transformers.LlavaNextProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=template,
    )


def write_dataset(tmp_path: Path) -> tuple[Path, list[list[Image.Image]]]:
    """A LLaVA manifest: CONVERSATIONS cycled over 8 records, noise images of SIZES."""
    rng = np.random.default_rng(0)
    records, pictures = [], []
    k = 0
    for i in range(8):
        conv = CONVERSATIONS[i % len(CONVERSATIONS)]
        n = sum(text.count("<image>") for _, text in conv)
        names, pics = [], []
        for _ in range(n):
            w, h = SIZES[k % len(SIZES)]
            k += 1
            pic = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            pic.save(tmp_path / f"{i}-{len(names)}.png")
            names.append(f"{i}-{len(names)}.png")
            pics.append(pic)
        record: dict[str, Any] = {"id": f"s{i}", "conversations": turns(*conv)}
        if names:
            record["image"] = names if len(names) > 1 else names[0]
        records.append(record)
        pictures.append(pics)
    return write_llava(tmp_path / "m.json", records), pictures


def as_messages(conv: list[tuple[str, str]], images: list[Image.Image]) -> list[dict[str, Any]]:
    """The conversation as a processor user writes it (image parts where <image> was)."""
    out, it = [], iter(images)
    for who, text in conv:
        parts: list[dict[str, Any]] = []
        for j, piece in enumerate(text.split("<image>")):
            if j:
                parts.append({"type": "image", "image": next(it)})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": "user" if who == "human" else "assistant", "content": parts})
    return out


def reference(processor: Any, conv: list[tuple[str, str]], pics: list[Image.Image]) -> Any:
    return processor.apply_chat_template(
        [as_messages(conv, pics)],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        return_tensors="np",
    )


def test_llava_next_pipeline_equals_apply_chat_template(tmp_path: Path) -> None:
    processor = llava_next_processor()
    pipe = mc.hf_processor(processor, max_length=512)
    manifest, pictures = write_dataset(tmp_path)
    ds = mc.MultimodalDataset(manifest, pipeline=pipe)
    crops_seen = set()
    for i in range(len(ds)):
        conv = CONVERSATIONS[i % len(CONVERSATIONS)]
        ref = reference(processor, conv, pictures[i])
        ids = ref["input_ids"][0]
        sample = ds.produce(i)
        assert sample["input_ids"].tolist() == ids.tolist(), i
        labels = np.where(ref["assistant_masks"][0] == 1, ids, -100)
        assert sample["labels"].tolist() == labels.tolist(), i
        if not pictures[i]:
            assert sample["image_crops"].shape == (0,) and sample["images"].size == 0
            continue
        assert sample["image_original_sizes"].tolist() == ref["image_sizes"].tolist()
        crops = sample["image_crops"].tolist()
        crops_seen.update(crops)
        assert sample["image_sizes"].tolist() == [[CROP, CROP]] * sum(crops)
        cached = torch.from_numpy(sample["images"].reshape(-1, 3, CROP, CROP))
        got = llava_next_pixels(cached, crops, pipe.image)
        assert got.shape == ref["pixel_values"].shape
        assert torch.allclose(got, torch.from_numpy(ref["pixel_values"]), atol=1e-5)
    assert len(crops_seen) >= 2  # k varies with the aspect ratio


def test_loader_batches_equal_the_processor_and_train_a_tiny_model(tmp_path: Path) -> None:
    processor = llava_next_processor()
    pipe = mc.hf_processor(processor, max_length=512)
    manifest, pictures = write_dataset(tmp_path)
    ds = mc.MultimodalDataset(manifest, pipeline=pipe)
    hook = PixelValues.from_processor(processor)
    assert hook.layout == "llava_next"
    with mc.Cache(tmp_path / "cache", memory="64MiB", disk="64MiB", temporary=True) as cache:
        loader = mc.DataLoader(ds, cache=cache, batch_size=4, shuffle=False, hooks=[hook])
        for epoch in range(2):  # cold (produced), then warm (read back from the cache)
            for b, batch in enumerate(loader):
                rows = range(4 * b, 4 * b + 4)
                pics = [p for r in rows for p in pictures[r]]
                want = processor.image_processor(pics, return_tensors="pt")
                assert batch["pixel_values"].shape == want["pixel_values"].shape, epoch
                diff = (batch["pixel_values"] - want["pixel_values"]).abs().max()
                assert diff <= 1e-5, (epoch, b, float(diff))
                assert torch.equal(batch["image_sizes"], want["image_sizes"].to(torch.int64))
                assert batch["image_counts"].tolist() == [len(pictures[r]) for r in rows]
                assert "images" not in batch and "image_crops" not in batch
        loader.close()
    model = tiny_model(processor)
    to_model = PixelValues(pipe.image, layout="llava_next", model_only=True)
    model_loader = mc.DataLoader(ds, cache=None, batch_size=4, shuffle=False, hooks=[to_model])
    batch = next(iter(model_loader))
    assert set(batch) == {"input_ids", "attention_mask", "labels", "pixel_values", "image_sizes"}
    out = model(**batch)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model_loader.close()


def tiny_model(processor: Any) -> Any:
    """A LlavaNextForConditionalGeneration of test_llava_client's tiny CLIP tower and
    Llama (random weights, seeded), with this processor's pinpoints and image token."""
    base = _model_for(vocab=len(processor.tokenizer), image_token=processor.image_token_id)
    config = transformers.LlavaNextConfig(
        vision_config=base.config.vision_config,
        text_config=base.config.text_config,
        image_token_index=processor.image_token_id,
        image_grid_pinpoints=PINPOINTS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    return transformers.LlavaNextForConditionalGeneration(config)


def test_lengths_text_report_grouping_and_packing(tmp_path: Path) -> None:
    pipe = mc.hf_processor(llava_next_processor(), max_length=512)
    manifest, _ = write_dataset(tmp_path)
    ds = mc.MultimodalDataset(manifest, pipeline=pipe)
    lengths = ds.lengths()
    produced = [len(ds.produce(i)["input_ids"]) for i in range(len(ds))]
    assert lengths.tolist() == produced
    assert len(set(produced)) > 3  # the counts differ with the original sizes
    report = ds.text_report()
    assert report.samples == 8 and report.with_images == 6 and report.tokens == sum(produced)
    by_length = SFTBatching(group_by_length=True)
    grouped = mc.DataLoader(ds, cache=None, batch_size=2, batching=by_length, seed=1)
    assert sorted(i for b in grouped for i in b["id"]) == sorted(f"s{i}" for i in range(8))
    grouped.close()
    pack = SFTBatching(pack=mc.PackSpec(max_tokens=400))
    packed = mc.DataLoader(ds, cache=None, batch_size=1, batching=pack, seed=1)
    seen = 0
    for batch in packed:  # PackHook checks each row's length against lengths()
        assert batch["input_ids"].shape[1] == int(batch["cu_seqlens"][-1]) <= 400
        seen += len(batch["id"])
    assert seen == 8
    packed.close()


def test_a_truncated_sample_keeps_whole_images_and_their_crops(tmp_path: Path) -> None:
    processor = llava_next_processor()
    full = mc.hf_processor(processor, max_length=512)
    manifest, _ = write_dataset(tmp_path)
    row = 3  # two images, a reply between them
    whole = mc.MultimodalDataset(manifest, pipeline=full).produce(row)
    first = int(whole["image_crops"][0])
    image = np.flatnonzero(whole["input_ids"] == processor.image_token_id)
    second = int(image[np.flatnonzero(np.diff(image) > 1)[0] + 1])  # its run's start
    cut = mc.hf_processor(processor, max_length=second + 3)  # inside the second run
    ds = mc.MultimodalDataset(manifest, pipeline=cut, on_error="skip")
    sample = ds.produce(row)
    assert sample["image_crops"].tolist() == [first]
    assert sample["image_sizes"].shape == (first, 2)
    assert sample["images"].size == first * 3 * CROP * CROP
    assert len(sample["input_ids"]) < second
    assert ds.lengths()[row] == len(sample["input_ids"])


def test_token_rule_is_the_processors_and_plain_data() -> None:
    processor = llava_next_processor()
    rule = LlavaNextTokens.of(processor, (CROP, CROP))
    for h, w in [(48, 64), (130, 40), (1, 1), (999, 17), (640, 480)]:
        want = processor._get_num_multimodal_tokens(image_sizes=[[h, w]])["num_image_tokens"]
        assert rule(h, w) == want[0]
    again = pickle.loads(pickle.dumps(rule))
    assert again == rule and again(130, 40) == rule(130, 40)
    pipe = mc.hf_processor(processor, max_length=512)
    twin = mc.hf_processor(llava_next_processor(), max_length=512)
    assert pipe.fingerprint() == twin.fingerprint()
    other = llava_next_processor()
    other.image_processor.image_grid_pinpoints = [[32, 64], [64, 32]]
    assert mc.hf_processor(other, max_length=512).fingerprint() != pipe.fingerprint()
    assert pickle.loads(pickle.dumps(pipe)).fingerprint() == pipe.fingerprint()


def test_misuse_is_refused_saying_why() -> None:
    processor = llava_next_processor()
    pipe = mc.hf_processor(processor, max_length=512)
    with pytest.raises(mc.ConfigError, match="needs a ChatSpec"):
        mc.Pipeline(image=pipe.image, text=mc.TextSpec(make_tokenizer()))
    with pytest.raises(mc.ConfigError, match="image_crops"):
        PixelValues(pipe.image, layout="llava_next").after_assemble(
            {"images": torch.zeros((2, 3, CROP, CROP), dtype=torch.uint8)}, None
        )
    with pytest.raises(mc.ConfigError, match="crops"):
        llava_next_pixels(torch.zeros((3, 3, CROP, CROP), dtype=torch.uint8), [2, 2])
    processor.patch_size = None
    with pytest.raises(mc.ConfigError, match="patch_size"):
        mc.hf_processor(processor)


def test_crops_that_are_not_whole_numbers_are_refused_never_rounded() -> None:
    base = image_processor_class()

    class Shifted(base):  # type: ignore[misc, valid-type]
        """A processor whose crops come back as floats, off by ``shift``."""

        shift = 0.0

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = super().__call__(*args, **kwargs)
            out["pixel_values"] = np.asarray(out["pixel_values"], np.float32) + self.shift
            return out

    processor = llava_next_processor(Shifted)
    pipe = mc.hf_processor(processor, max_length=512)  # floats of whole values: cast
    crops = pipe.image(Image.new("RGB", (40, 130), (10, 20, 30)))
    assert crops.pixels.dtype == np.uint8 and crops.pixels.shape == (4, 3, CROP, CROP)
    assert crops.original == (130, 40)
    processor.image_processor.shift = 0.5
    with pytest.raises(mc.ConfigError, match=r"not whole numbers 0\.\.255"):
        mc.hf_processor(processor, max_length=512)


def test_a_template_of_content_parts_only(tmp_path: Path) -> None:
    """llava-1.5-hf's template (images first, as "<image>\\n" parts; a string content
    renders as nothing), which LLaVA-NeXT checkpoints share: input_ids equal
    apply_chat_template's, whatever the number of crops."""
    processor = llava_next_processor(template=LLAVA_15_HF)
    pipe = mc.hf_processor(processor, max_length=512)
    assert pipe.text.content_parts is True
    manifest, pictures = write_dataset(tmp_path)
    ds = mc.MultimodalDataset(manifest, pipeline=pipe)
    for i in range(len(ds)):
        conv = CONVERSATIONS[i % len(CONVERSATIONS)]
        messages = as_messages(conv, pictures[i])
        for m in messages:  # what a processor user writes: no newline left by <image>
            for p in m["content"]:
                if p["type"] == "text":
                    p["text"] = p["text"].strip()
        ref = processor.apply_chat_template([messages], tokenize=True, return_dict=True)
        assert ds.produce(i)["input_ids"].tolist() == list(ref["input_ids"][0]), i


def test_an_exif_rotated_image_is_counted_from_its_upright_size(tmp_path: Path) -> None:
    """Stored 130x40 with EXIF orientation 6 (upright 40 wide, 130 tall): the crops, the
    original size and the token count are the upright image's, in the sample and in
    the length pass (which reads only the header)."""
    processor = llava_next_processor()
    pipe = mc.hf_processor(processor, max_length=512)
    rng = np.random.default_rng(1)
    exif = Image.Exif()
    exif[0x0112] = 6
    stored = Image.fromarray(rng.integers(0, 256, (40, 130, 3), dtype=np.uint8))
    stored.save(tmp_path / "r.jpg", quality=95, exif=exif)
    conv = turns(*CONVERSATIONS[0])
    manifest = write_llava(
        tmp_path / "m.json", [{"id": "r", "image": "r.jpg", "conversations": conv}]
    )
    ds = mc.MultimodalDataset(manifest, pipeline=pipe)
    sample = ds.produce(0)
    assert sample["image_original_sizes"].tolist() == [[130, 40]]
    with Image.open(tmp_path / "r.jpg") as im:
        upright = ImageOps.exif_transpose(im).convert("RGB")
    ref = reference(processor, CONVERSATIONS[0], [upright])
    assert sample["input_ids"].tolist() == ref["input_ids"][0].tolist()
    assert sample["image_crops"].tolist() == [ref["pixel_values"].shape[1]]
    assert ds.lengths().tolist() == [len(sample["input_ids"])]


def test_a_batch_without_images(tmp_path: Path) -> None:
    """Text-only rows only: no crops, pixel_values [0, 0, 3, 0, 0] (the model then takes
    none), image_sizes [0, 2], image_counts zeros."""
    pipe = mc.hf_processor(llava_next_processor(), max_length=512)
    hook = PixelValues(pipe.image, layout="llava_next")
    empty = torch.zeros(0, dtype=torch.int32)
    batch = hook.after_assemble(
        {
            "images": [],
            "image_crops": [empty, empty],
            "image_original_sizes": [empty.reshape(0, 2)] * 2,
        },
        None,
    )
    assert batch["pixel_values"].shape == (0, 0, 3, 0, 0)
    assert batch["image_sizes"].shape == (0, 2) and batch["image_counts"].tolist() == [0, 0]
