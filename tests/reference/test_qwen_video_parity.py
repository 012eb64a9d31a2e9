"""Qwen2.5-VL with images and videos (issue 42), against transformers' own processor.

The reference is the Qwen user's own code: the chat template rendered by the processor,
the videos sampled and resized by qwen-vl-utils' rules (copied in
``tests/unit/video_support.py``: its package imports torchvision's removed
``read_video``) with torchvision's bicubic antialiased resize, then
``processor(text, images, videos, video_metadata)``. mmcache's side is
``mmcache.hf_processor(processor)`` and ``PixelValues.from_processor(processor,
model_only=True)``: the batch's ``input_ids``, ``pixel_values``, ``image_grid_thw``,
``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts`` and
``mm_token_type_ids`` equal the processor's, and a tiny Qwen2.5-VL's loss on a mixed
batch equals its loss on the processor's inputs. Reference env only: the video
processor needs torchvision."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from refenv import need

torch = need("torch")
transformers = need("transformers")
tvf = need("torchvision.transforms.functional")
need("av")
sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
from chat_support import hf_tokenizer, make_tokenizer  # noqa: E402
from video_support import decoded_frames, qwen_indices_and_size, write_clip  # noqa: E402

import mmcache as mc  # noqa: E402
from mmcache.transforms import PixelValues  # noqa: E402
from mmcache.transforms.video_decode import probe_source  # noqa: E402
from support.tiny_qwen import tiny_qwen25_vl  # noqa: E402

SPECIALS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
# Qwen2-VL's chat template, its media and text parts (the system prompt left out).
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
)
PIXELS = {"min_pixels": 4 * 28 * 28, "max_pixels": 16 * 28 * 28}
QWEN3_PIXELS = {"min_pixels": 4 * 32 * 32, "max_pixels": 16 * 32 * 32}


def qwen25_processor(**video: Any) -> Any:
    tok = make_tokenizer()
    tok.add_special_tokens(SPECIALS)
    hf = hf_tokenizer(tok, TEMPLATE, bos=None, eos="<|im_end|>")
    return transformers.Qwen2_5_VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(**PIXELS),
        tokenizer=hf,
        video_processor=transformers.Qwen2VLVideoProcessor(
            **(PIXELS | video), cap_pixels_per_frame=True
        ),
        chat_template=TEMPLATE,
    )


def tiny_qwen25_vl_of(processor: Any) -> Any:
    tok = processor.tokenizer
    return tiny_qwen25_vl(
        len(tok), video=processor.video_token_id, image=processor.image_token_id,
        vision_start=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end=tok.convert_tokens_to_ids("<|vision_end|>"),
    )  # fmt: skip


def write_data(folder: Path) -> list[dict[str, Any]]:
    """Two images, two clips (one at 24 fps, one at 15 fps with its own fps option) and
    four Qwen ``messages`` records: image, video, image, video."""
    rng = np.random.default_rng(0)
    for name, (w, h) in {"i0.png": (90, 60), "i1.png": (50, 130)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
    write_clip(folder / "v0.mp4", frames=48, fps=24, size=(64, 96))
    write_clip(folder / "v1.mp4", frames=45, fps=15, size=(72, 56))

    def record(sid: str, part: dict[str, Any]) -> dict[str, Any]:
        content = [part, {"type": "text", "text": "What is it?"}]
        reply = {"role": "assistant", "content": f"It is {sid}."}
        return {"id": sid, "messages": [{"role": "user", "content": content}, reply]}

    records = [
        record("img0", {"type": "image", "image": "i0.png"}),
        record("vid0", {"type": "video", "video": "v0.mp4"}),
        record("img1", {"type": "image", "image": "i1.png"}),
        record("vid1", {"type": "video", "video": "v1.mp4", "fps": 1.0}),
    ]
    return records


def mmcache_manifest(folder: Path, records: list[dict[str, Any]]) -> Path:
    """The records as mmcache reads them."""
    path = folder / "qwen.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def reference_inputs(
    processor: Any, folder: Path, records: list[dict[str, Any]], *, patch: int = 14
) -> Any:
    """The processor's inputs for ``records``, as a Qwen user makes them (Qwen3-VL's:
    ``process_vision_info(..., image_patch_size=16)``; the processor then resizes no
    video again, ``videos_kwargs={"do_resize": False}`` as Qwen3-VL's README passes)."""
    # Qwen2-VL's video processor bounds each frame: hf_processor's VideoSpec (and the
    # user's qwen-vl-utils call) take its bounds. Qwen3-VL's bounds a clip: both keep
    # qwen-vl-utils' per-frame defaults.
    pixels = PIXELS if patch == 14 else {}
    texts, images, videos, metas = [], [], [], []
    for rec in records:
        texts.append(processor.apply_chat_template(rec["messages"], tokenize=False))
        for part in rec["messages"][0]["content"]:
            if part["type"] == "image":
                with Image.open(folder / part["image"]) as im:
                    images.append(im.convert("RGB"))
            elif part["type"] == "video":
                path = folder / part["video"]
                info = probe_source(path)
                ele = {k: v for k, v in part.items() if k not in ("type", "video")}
                ele |= pixels
                idx, (h, w), _ = qwen_indices_and_size(
                    ele, info.total_frames, info.fps, info.height, info.width, patch
                )
                every = decoded_frames(path)
                raw = np.stack([every[i] for i in idx]).transpose(0, 3, 1, 2).copy()
                frames = tvf.resize(
                    torch.from_numpy(raw),
                    [h, w],
                    interpolation=tvf.InterpolationMode.BICUBIC,
                    antialias=True,
                )
                videos.append(frames)
                metas.append(
                    transformers.video_utils.VideoMetadata(
                        total_num_frames=info.total_frames, fps=info.fps, frames_indices=idx
                    )
                )
    return processor(
        text=texts,
        images=images or None,
        videos=videos or None,
        video_metadata=metas or None,
        do_sample_frames=False,
        videos_kwargs={"do_resize": False},
        padding=True,
        return_tensors="pt",
    )


@pytest.mark.parametrize(
    "rows", [[0, 1], [1, 3], [0, 2], [0, 1, 2, 3]], ids=["mixed", "videos", "images", "all"]
)
def test_qwen25_vl_batches_equal_the_processors_and_the_loss_too(
    tmp_path: Path, rows: list[int]
) -> None:
    processor = qwen25_processor()
    records = [write_data(tmp_path)[r] for r in rows]
    pipe = mc.hf_processor(processor, 4096)
    assert pipe.video is not None  # the video processor's VideoSpec
    ds = mc.MultimodalDataset(mmcache_manifest(tmp_path, records), pipeline=pipe)
    hook = PixelValues.from_processor(processor, model_only=True)
    loader = mc.DataLoader(ds, cache=None, batch_size=len(rows), shuffle=False, hooks=[hook])
    try:
        (batch,) = list(loader)
    finally:
        loader.close()
    want = reference_inputs(processor, tmp_path, records)
    keys = set(want) - {"labels"}
    assert set(batch) == keys | {"labels"}
    for r, n in enumerate(want["attention_mask"].sum(dim=1).tolist()):  # each row unpadded
        assert int(batch["attention_mask"][r].sum()) == n
        for name in ("input_ids", "mm_token_type_ids"):
            assert torch.equal(batch[name][r, :n], want[name][r, :n]), (name, r)
    for name in ("image_grid_thw", "video_grid_thw"):
        if name in want:
            assert batch[name].tolist() == want[name].tolist(), name
    for name in ("pixel_values", "pixel_values_videos"):
        if name in want:
            diff = float((batch[name] - want[name]).abs().max())
            assert diff <= 1e-5, (name, diff)
    if "second_per_grid_ts" in want:
        seconds = torch.as_tensor(want["second_per_grid_ts"], dtype=torch.float32)
        assert torch.allclose(batch["second_per_grid_ts"], seconds)
    model = tiny_qwen25_vl_of(processor)
    labels = batch["labels"][:, : want["input_ids"].shape[1]]  # mmcache pads wider
    reference = {k: want[k] for k in keys} | {"labels": labels}
    reference["second_per_grid_ts"] = torch.as_tensor(
        want.get("second_per_grid_ts", []), dtype=torch.float32
    )
    if "second_per_grid_ts" not in want:
        del reference["second_per_grid_ts"]
    with torch.no_grad():
        ours, theirs = model(**batch).loss, model(**reference).loss
    assert torch.isfinite(ours)
    assert torch.allclose(ours, theirs, atol=1e-5), (float(ours), float(theirs))


def qwen3_processor() -> Any:
    """Qwen3-VL's processor as its configs build it: patch 16 (frame and image sides
    multiples of 32), mean and std 0.5, timestamped video tokens."""
    tok = make_tokenizer()
    tok.add_special_tokens(SPECIALS)
    hf = hf_tokenizer(tok, TEMPLATE, bos=None, eos="<|im_end|>")
    images = transformers.Qwen2VLImageProcessor(
        patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3, **QWEN3_PIXELS
    )
    videos = transformers.Qwen3VLVideoProcessor(cap_pixels_per_frame=True)
    return transformers.Qwen3VLProcessor(
        image_processor=images, tokenizer=hf, video_processor=videos, chat_template=TEMPLATE
    )


def tiny_qwen3_vl(processor: Any) -> Any:
    tok = processor.tokenizer
    config = transformers.Qwen3VLConfig(
        text_config={
            "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "out_hidden_size": 64, "deepstack_visual_indexes": [1],
            "num_position_embeddings": 64,
        },
        image_token_id=processor.image_token_id,
        video_token_id=processor.video_token_id,
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3VLForConditionalGeneration(config).eval()


def test_qwen3_vl_patch_16_and_timestamped_video_tokens_equal_the_processors(
    tmp_path: Path,
) -> None:
    """Qwen3-VL (and Qwen3.5, which use its processor): images and frames in multiples of
    32, each temporal step's ``<t seconds>`` text, the processor's mean and std; the
    batch equals the processor's inputs and a tiny Qwen3-VL's loss is the same."""
    processor = qwen3_processor()
    records = write_data(tmp_path)
    pipe = mc.hf_processor(processor, 4096)
    assert pipe.video is not None and pipe.video.factor == 32 and pipe.image.factor == 32
    ds = mc.MultimodalDataset(mmcache_manifest(tmp_path, records), pipeline=pipe)
    hook = PixelValues.from_processor(processor, model_only=True)
    loader = mc.DataLoader(ds, cache=None, batch_size=4, shuffle=False, hooks=[hook])
    try:
        (batch,) = list(loader)
    finally:
        loader.close()
    want = reference_inputs(processor, tmp_path, records, patch=16)
    assert set(batch) == set(want) | {"labels"}  # no second_per_grid_ts: not Qwen3's
    for r, n in enumerate(want["attention_mask"].sum(dim=1).tolist()):
        assert int(batch["attention_mask"][r].sum()) == n
        for name in ("input_ids", "mm_token_type_ids"):
            assert torch.equal(batch[name][r, :n], want[name][r, :n]), (name, r)
    for name in ("image_grid_thw", "video_grid_thw"):
        assert batch[name].tolist() == want[name].tolist(), name
    for name in ("pixel_values", "pixel_values_videos"):
        diff = float((batch[name] - want[name]).abs().max())
        assert diff <= 1e-5, (name, diff)
    model = tiny_qwen3_vl(processor)
    labels = batch["labels"][:, : want["input_ids"].shape[1]]
    with torch.no_grad():
        ours = model(**batch).loss
        theirs = model(**dict(want), labels=labels).loss
    assert torch.isfinite(ours)
    assert torch.allclose(ours, theirs, atol=1e-5), (float(ours), float(theirs))


def test_frame_list_frames_equal_qwen_vl_utils_with_torchvision(tmp_path: Path) -> None:
    """A video given as frame images: mmcache's clip equals qwen-vl-utils' ``fetch_video``
    of the list (each frame through ``fetch_image``: RGB, image smart_resize, Pillow's
    bicubic; the last repeated to an even count; the clip's smart_resize and
    torchvision's bicubic antialias), computed here with torchvision itself."""
    from video_support import smart_resize

    from mmcache.transforms.frame_lists import load_frame_list

    rng = np.random.default_rng(3)
    paths = []
    for k in range(5):
        path = tmp_path / f"{k}.png"
        Image.fromarray(rng.integers(0, 256, (61, 97, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    spec = mc.VideoSpec()
    clip = load_frame_list(spec, {"video": paths}, sample_id="f")
    images = []
    for p in paths:
        with Image.open(p) as im:
            rgb = im.convert("RGB")
        h, w = smart_resize(rgb.height, rgb.width, 28, 4 * 28 * 28, 16384 * 28 * 28)
        images.append(torch.from_numpy(np.asarray(rgb.resize((w, h))).transpose(2, 0, 1).copy()))
    images.append(images[-1])
    video = torch.stack(images)
    n, _, height, width = video.shape
    low = 128 * 28 * 28
    high = max(min(768 * 28 * 28, 128000 * 28 * 28 * 0.9 / n * 2), int(low * 1.05))
    size = smart_resize(height, width, 28, low, high)
    want = tvf.resize(video, list(size), interpolation=tvf.InterpolationMode.BICUBIC,
                      antialias=True)  # fmt: skip
    assert tuple(want.shape) == clip.frames.shape
    assert torch.equal(torch.from_numpy(clip.frames), want)


def test_a_trainer_trains_qwen25_vl_on_image_and_video_batches(tmp_path: Path) -> None:
    """The video recipe's trainer (docs/recipes/video.md): ``hf_processor(processor)``,
    ``PixelValues.from_processor(processor, model_only=True)`` and a
    ``transformers.Trainer`` whose ``get_train_dataloader`` returns the mmcache loader; 3
    steps over image, video and mixed batches, each step's inputs the model's (the
    videos' ``pixel_values_videos`` among them)."""
    need("accelerate")
    processor = qwen25_processor()
    records = write_data(tmp_path)
    ds = mc.MultimodalDataset(
        mmcache_manifest(tmp_path, records), pipeline=mc.hf_processor(processor, 4096)
    )
    hook = PixelValues.from_processor(processor, model_only=True)
    loader = mc.DataLoader(ds, cache=None, batch_size=2, seed=3, hooks=[hook])
    seen: list[set[str]] = []

    class MmcacheTrainer(transformers.Trainer):  # type: ignore[misc]
        def get_train_dataloader(self) -> Any:
            return loader

        def compute_loss(self, model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            seen.append(set(inputs))
            return super().compute_loss(model, inputs, *a, **kw)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
        learning_rate=1e-3, report_to=[], use_cpu=True, logging_steps=1,
        save_strategy="no", dataloader_num_workers=0,
    )  # fmt: skip
    try:
        MmcacheTrainer(model=tiny_qwen25_vl_of(processor), args=args).train()
    finally:
        loader.close()
    assert len(seen) == 3 and any("pixel_values_videos" in keys for keys in seen)
