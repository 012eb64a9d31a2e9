"""hf_image_processor with lengths(), text_report(), group_by_length and pack (issue 26).

The processor's size rule (crop_size, size height/width or shortest_edge) is read from
its configuration, checked on two probes when the stage is built, and sizes images
from their headers: the lengths equal the produced samples', no pixel decoded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chat_support import make_tokenizer, turns, write_image, write_llava
from PIL import Image, ImageFile

import mmcache as mc
from mmcache import ChatSpec, MultimodalDataset, Pipeline
from mmcache.loader import SFTBatching

pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")


def clip_processor(**kw: Any) -> Any:
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, **kw)


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    write_image(tmp_path / "img/a.jpg", (64, 48), shade=10)
    write_image(tmp_path / "img/b.jpg", (40, 90), shade=90)
    q = turns(("human", "<image>\nWhat is in the picture?"), ("gpt", "A cat sits on a mat."))
    records = [
        {"id": f"s{i}", "image": "img/a.jpg" if i % 2 else "img/b.jpg", "conversations": q}
        for i in range(6)
    ]
    records.append({"id": "text", "conversations": turns(("human", "Hi"), ("gpt", "Hello."))})
    return write_llava(tmp_path / "m.json", records)


@pytest.mark.parametrize(
    "image_tokens", [9, lambda h, w: (h // 16) * (w // 16)], ids=["fixed", "size-rule"]
)
@pytest.mark.parametrize("crop", [True, False], ids=["crop", "shortest-edge"])
def test_lengths_and_text_report_without_decoding(
    manifest: Path, monkeypatch: pytest.MonkeyPatch, image_tokens: Any, crop: bool
) -> None:
    stage = mc.hf_image_processor(clip_processor(do_center_crop=crop))
    spec = ChatSpec(make_tokenizer(), "vicuna_v1", 256, image_tokens=image_tokens)
    ds = MultimodalDataset(manifest, pipeline=Pipeline(image=stage, text=spec))
    expected = [len(ds.produce(i)["input_ids"]) for i in range(len(ds))]
    fresh = MultimodalDataset(manifest, pipeline=Pipeline(image=stage, text=spec))

    def no_decode(self: Any) -> Any:
        raise AssertionError("lengths() decoded an image")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    assert fresh.lengths().tolist() == expected
    report = fresh.text_report()
    assert (report.samples, report.with_images, report.tokens) == (7, 6, sum(expected))


def test_output_size_matches_the_processor() -> None:
    for crop in (True, False):
        stage = mc.hf_image_processor(clip_processor(do_center_crop=crop))
        for w, h in [(64, 48), (40, 90), (33, 517), (100, 100)]:
            im = Image.new("RGB", (w, h), (1, 2, 3))
            assert stage.output_size(h, w) == tuple(stage(im).shape[1:]), (crop, w, h)


def test_group_by_length_and_pack_with_a_processor_stage(manifest: Path, tmp_path: Path) -> None:
    stage = mc.hf_image_processor(clip_processor())
    spec = ChatSpec(make_tokenizer(), "vicuna_v1", 256, image_tokens=9)
    ds = MultimodalDataset(manifest, pipeline=Pipeline(image=stage, text=spec))
    with mc.Cache(tmp_path / "c", memory=0, disk="64MiB") as cache:
        grouped = mc.DataLoader(
            ds, cache=cache, batch_size=2, seed=1, batching=SFTBatching(group_by_length=True)
        )
        seen = sorted(i for b in grouped for i in b["id"])
        assert seen == sorted(ds.ids(range(len(ds))))
        packed = mc.DataLoader(
            ds,
            cache=cache,
            batch_size=1,
            seed=1,
            batching=SFTBatching(pack=mc.PackSpec(max_tokens=256)),
        )
        rows = [b for b in packed]
        assert sorted(i for b in rows for i in b["id"]) == sorted(ds.ids(range(len(ds))))
        assert all(b["input_ids"].shape[-1] <= 256 for b in rows)


def test_normalize_takes_the_stage_or_a_preset() -> None:
    import torch

    stage = mc.hf_image_processor(clip_processor())
    x = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    assert torch.equal(mc.normalize(x, stage), mc.normalize(x, stage.mean, stage.std))
    assert torch.allclose(mc.normalize(x, "siglip"), x.float() / 127.5 - 1)
    assert torch.equal(mc.normalize(x, "clip"), mc.normalize(x))
    with pytest.raises(mc.ConfigError, match="siglip"):
        mc.normalize(x, "sigclip")
    assert np.isfinite(mc.normalize(x, "imagenet").numpy()).all()
