"""ImageSpec and TextSpec pass the Stage contract; the decode step and user stages in a Pipeline."""

from __future__ import annotations

import doctest
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

import mmcache.sources.readers
import mmcache.sources.records
import mmcache.transforms.image
import mmcache.transforms.normalize
import mmcache.transforms.text
from mmcache.errors import ConfigError
from mmcache.synth import synth_captions
from mmcache.testing.stage_contract import StageContract
from mmcache.transforms import ImageSpec, Stage, TextSpec, train_tokenizer
from mmcache.transforms.image import ReducedDecode, load_image
from mmcache.transforms.pipeline import Pipeline


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(synth_captions(200, seed=0), vocab_size=200)


def _gradient(width: int, height: int) -> Image.Image:
    xs = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    ys = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    arr = np.stack([xs + 0 * ys, ys + 0 * xs, (xs + ys) / 2], axis=-1).astype(np.uint8)
    return Image.fromarray(arr)


class TestImageSpecContract(StageContract):
    __test__ = True

    def make_stage(self) -> Stage:
        return ImageSpec(size=32)

    def variants(self) -> Sequence[Stage]:
        return [
            ImageSpec(size=48),
            ImageSpec(size=32, resize=40),
            ImageSpec(size=32, interpolation="bilinear"),
            ImageSpec(size=32, draft=False),
        ]

    def same_config(self) -> Sequence[Stage]:
        # resize 37 is the default for 32; the limits decide which samples fail, not pixels
        return [ImageSpec(size=32, resize=37), ImageSpec(size=32, max_pixels=10, max_bytes=None)]

    def make_input(self) -> Any:
        return _gradient(120, 90)

    def check_output(self, stage: Stage, output: Any) -> None:
        super().check_output(stage, output)
        assert isinstance(stage, ImageSpec)
        assert output.shape == (3, stage.size, stage.size)


class TestTextSpecContract(StageContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _tokenizer(self, tokenizer: Tokenizer, tmp_path: Path) -> None:
        self.tokenizer = tokenizer
        self.path = tmp_path / "tokenizer.json"
        tokenizer.save(str(self.path))

    def make_stage(self) -> Stage:
        return TextSpec(self.tokenizer, max_length=12)

    def variants(self) -> Sequence[Stage]:
        other = train_tokenizer(synth_captions(200, seed=1), vocab_size=200)
        return [
            TextSpec(self.tokenizer, max_length=16),
            TextSpec(self.tokenizer, max_length=12, pad_id=1),
            TextSpec(other, max_length=12),
        ]

    def same_config(self) -> Sequence[Stage]:
        padded = Tokenizer.from_str(self.tokenizer.to_str())
        padded.enable_padding(length=99)  # overridden by TextSpec
        return [TextSpec(self.path, max_length=12), TextSpec(padded, max_length=12)]

    def make_input(self) -> Any:
        return "a red dog on a bench"

    def check_output(self, stage: Stage, output: Any) -> None:
        super().check_output(stage, output)
        assert isinstance(stage, TextSpec)
        assert set(output) == {"input_ids", "attention_mask"}
        for array in output.values():
            assert array.dtype == np.int32 and array.shape == (stage.max_length,)


# --------------------------------------------------------------------------------------------
# the decode step and ImageSpec
# --------------------------------------------------------------------------------------------


def test_draft_size_asks_for_a_reduced_decode_only_when_one_applies() -> None:
    spec = ImageSpec(size=224)  # resize 256
    assert spec.draft_size(512, 700) == (256, 256)
    assert spec.draft_size(511, 700) is None
    assert ImageSpec(size=224, draft=False).draft_size(4000, 3000) is None


def test_stage_on_a_decoded_image_equals_the_file_path(tmp_path: Path) -> None:
    spec = ImageSpec(size=64)
    png = tmp_path / "a.png"
    _gradient(300, 200).save(png)
    with Image.open(png) as im:
        im.load()
        assert np.array_equal(spec(im), load_image(spec, png, sample_id="a"))
    # a JPEG large enough for a reduced decode: the stage is told what the decoder did
    jpeg = tmp_path / "b.jpg"
    _gradient(1203, 901).save(jpeg, quality=90)
    with Image.open(jpeg) as im:
        want = spec.draft_size(*im.size)
        assert want is not None
        drafted = im.draft("RGB", want)
        assert drafted is not None
        im.load()
        reduced = ReducedDecode(size=(1203, 901), scale=1203 / drafted[1][2])
        assert reduced.scale == 8  # 901 // 73 (resize of 64) = 12: the largest DCT scale
        out = spec(im, reduced=reduced)
    assert np.array_equal(out, Pipeline(image=spec).load_image(jpeg, sample_id="b"))


def test_a_user_stage_in_a_pipeline(tmp_path: Path, tokenizer: Tokenizer) -> None:
    class Grey:
        kind = "image"

        def __init__(self, side: int) -> None:
            self.side = side

        def fingerprint(self) -> str:
            return f"grey-{self.side}"

        def __call__(self, im: Image.Image, /) -> np.ndarray:
            out = np.asarray(im.convert("L").resize((self.side, self.side)))
            return np.ascontiguousarray(out[None])

    path = tmp_path / "a.png"
    _gradient(50, 40).save(path)
    pipe = Pipeline(image=Grey(8), text=TextSpec(tokenizer, max_length=8))  # type: ignore[arg-type]
    out = pipe.process(path, "a dog", sample_id="a")
    assert list(out) == ["input_ids", "attention_mask", "image"]
    assert out["image"].shape == (1, 8, 8) and out["image"].dtype == np.uint8
    assert pipe.stages == (pipe.image, pipe.text)
    fingerprints = {
        pipe.fingerprint(),
        Pipeline(image=Grey(9), text=TextSpec(tokenizer, max_length=8)).fingerprint(),  # type: ignore[arg-type]
        Pipeline(image=ImageSpec(size=8), text=TextSpec(tokenizer, max_length=8)).fingerprint(),
    }
    assert len(fingerprints) == 3
    with pytest.raises(ConfigError, match=r"Pipeline\.text must be a TextSpec"):
        Pipeline(text=ImageSpec())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Pipeline\.image must be an ImageSpec"):
        Pipeline(image="resize")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "module",
    [
        mmcache.transforms.image,
        mmcache.transforms.text,
        mmcache.transforms.normalize,
        mmcache.sources.readers,
        mmcache.sources.records,
    ],
)
def test_docstring_examples_run(module: Any) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_stage_fingerprint_is_the_digest_of_its_fields(tokenizer: Tokenizer) -> None:
    import xxhash

    for stage in (ImageSpec(size=32), TextSpec(tokenizer, max_length=8)):
        blob = json.dumps(stage.fingerprint_fields(), sort_keys=True, separators=(",", ":"))
        assert stage.fingerprint() == xxhash.xxh3_128_hexdigest(blob.encode())
