"""SFT samples from a manifest: the sample format, SmartResize and image geometry, several
images and text-only samples, lengths() without decoding, text_report, keys, the
source contract of a chat source."""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chat_support import make_tokenizer, turns, write_image, write_llava
from PIL import Image, ImageFile

import mmcache
from mmcache import ChatSpec, ImageSpec, MultimodalDataset, Pipeline, SmartResize
from mmcache.errors import ConfigError, SampleError
from mmcache.sources.base import OnError, SampleSource
from mmcache.testing.source_contract import SourceContract
from mmcache.testing.stage_contract import StageContract
from mmcache.transforms import Chat
from mmcache.transforms.smart_resize import output_hw, smart_resize

pytest.importorskip("jinja2")

SR = SmartResize(min_pixels=28 * 28, max_pixels=56 * 56 * 4)


def qwen_pipeline(max_length: int = 512) -> Pipeline:
    return Pipeline(
        image=SR,
        text=ChatSpec(make_tokenizer(), "chatml", max_length, image_tokens=SR.image_tokens),
    )


def llava_pipeline(max_length: int = 512) -> Pipeline:
    spec = ImageSpec(size=32, pad_to_square=True)
    return Pipeline(
        image=spec, text=ChatSpec(make_tokenizer(), "vicuna_v1", max_length, image_tokens=9)
    )


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    write_image(tmp_path / "img/a.jpg", (64, 48), shade=10)
    write_image(tmp_path / "img/b.jpg", (40, 90), shade=90)
    q = turns(("human", "<image>\nWhat is in the picture?"), ("gpt", "A cat sits on a mat."))
    return write_llava(
        tmp_path / "m.json",
        [
            {"id": "one", "image": "img/a.jpg", "conversations": q},
            {
                "id": "two",
                "image": ["img/a.jpg", "img/b.jpg"],
                "conversations": turns(("human", "<image> and <image>?"), ("gpt", "Two dogs.")),
            },
            {"id": "text", "conversations": turns(("human", "Hi"), ("gpt", "Hello."))},
        ],
    )


# -- the sample format -----------------------------------------------------------------------


def test_sample_format_with_smart_resize(manifest: Path) -> None:
    ds = MultimodalDataset(manifest, pipeline=qwen_pipeline())
    image_id = make_tokenizer().token_to_id("<image>")
    for i, n in enumerate((1, 2, 0)):
        s = ds.produce(i)
        assert list(s)[:2] == ["input_ids", "labels"]  # small fields first
        assert set(s) == {"input_ids", "labels", "images", "image_sizes", "image_grid_thw"}
        assert s["input_ids"].dtype == np.int32 and s["labels"].dtype == np.int32
        assert s["input_ids"].shape == s["labels"].shape and s["input_ids"].ndim == 1
        assert s["images"].dtype == np.uint8 and s["images"].ndim == 1
        assert s["image_sizes"].dtype == np.int32 and s["image_sizes"].shape == (n, 2)
        assert s["image_grid_thw"].dtype == np.int32 and s["image_grid_thw"].shape == (n, 3)
        sizes = s["image_sizes"].tolist()
        assert s["images"].size == sum(3 * h * w for h, w in sizes)
        for (h, w), (t, gh, gw) in zip(sizes, s["image_grid_thw"].tolist(), strict=True):
            assert h % 28 == 0 and w % 28 == 0
            assert (t, gh, gw) == (1, h // 14, w // 14)  # Qwen2-VL: patch 14
        runs = int(np.count_nonzero(s["input_ids"] == image_id))
        assert runs == sum((h // 28) * (w // 28) for h, w in sizes)
    # the images are the stage's outputs, concatenated in order
    two = ds.produce(1)
    parts = [ds.pipeline.load_image(p, sample_id="two") for p in ds.records.image_paths(1)]
    np.testing.assert_array_equal(two["images"], np.concatenate([p.reshape(-1) for p in parts]))
    assert [list(p.shape[1:]) for p in parts] == two["image_sizes"].tolist()
    assert ds.pipeline.varying_fields == {
        "input_ids",
        "labels",
        "images",
        "image_sizes",
        "image_grid_thw",
    }


def test_llava_pad_to_square_sample(manifest: Path) -> None:
    ds = MultimodalDataset(manifest, pipeline=llava_pipeline())
    s = ds.produce(0)
    assert set(s) == {"input_ids", "labels", "images", "image_sizes"}
    assert s["image_sizes"].tolist() == [[32, 32]] and s["images"].size == 3 * 32 * 32
    image_id = make_tokenizer().token_to_id("<image>")
    assert int(np.count_nonzero(s["input_ids"] == image_id)) == 9
    text = ds.produce(2)
    assert text["images"].shape == (0,) and text["image_sizes"].shape == (0, 2)


def test_text_only_pipeline_and_a_record_with_images(manifest: Path) -> None:
    ds = MultimodalDataset(
        manifest, pipeline=Pipeline(text=ChatSpec(make_tokenizer(), "chatml", 64))
    )
    assert set(ds.produce(2)) == {"input_ids", "labels"}
    with pytest.raises(SampleError, match="no image stage"):
        ds.produce(0)
    with pytest.raises(ConfigError, match="process_chat"):
        ds.pipeline.process(None, "text", sample_id="x")


def test_loader_serves_chat_samples_as_padded_batches(manifest: Path, cache_root: Path) -> None:
    ds = MultimodalDataset(manifest, pipeline=qwen_pipeline())
    pad = ds.pad_token_id
    assert pad is not None and pad == ds.pipeline.chat.pad_id  # type: ignore[union-attr]
    produced = [ds.produce(i) for i in range(3)]
    cache = mmcache.Cache(cache_root, memory="16MiB", disk="64MiB")
    try:
        loader = mmcache.DataLoader(ds, cache=cache, batch_size=3, shuffle=False)
        for _ in range(2):  # cold, then from the cache
            (batch,) = list(loader)
            assert batch["id"] == ["one", "two", "text"]
            ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
            longest = max(len(p["input_ids"]) for p in produced)
            assert ids.shape == labels.shape == mask.shape == (3, -(-longest // 8) * 8)
            for i, p in enumerate(produced):
                n = len(p["input_ids"])
                np.testing.assert_array_equal(ids[i, :n].numpy(), p["input_ids"])
                np.testing.assert_array_equal(labels[i, :n].numpy(), p["labels"])
                assert (ids[i, n:] == pad).all() and (labels[i, n:] == -100).all()
                assert mask[i, :n].all() and not mask[i, n:].any()
            assert batch["image_counts"].tolist() == [1, 2, 0]
            sizes = np.concatenate([p["image_sizes"] for p in produced])
            np.testing.assert_array_equal(batch["image_sizes"].numpy(), sizes)
            flat = np.concatenate([p["images"] for p in produced])
            got = batch["images"]
            listed = got if isinstance(got, list) else list(got)
            np.testing.assert_array_equal(np.concatenate([t.numpy().ravel() for t in listed]), flat)
            np.testing.assert_array_equal(
                batch["image_grid_thw"].numpy(),
                np.concatenate([p["image_grid_thw"] for p in produced]),
            )
    finally:
        cache.close()


# -- SmartResize -------------------------------------------------------------------------------


def _transformers_smart_resize() -> Callable[..., tuple[int, int]]:
    """transformers' own ``smart_resize``, taken from its source (importing the module
    needs torchvision)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        pytest.skip("transformers is not installed")
    path = os.path.join(
        os.path.dirname(spec.origin), "models/qwen2_vl/image_processing_qwen2_vl.py"
    )
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    namespace: dict[str, Any] = {"math": math}
    exec(compile(ast.Module([fn], []), path, "exec"), namespace)
    out: Callable[..., tuple[int, int]] = namespace["smart_resize"]
    return out


def test_smart_resize_is_transformers_rule() -> None:
    ref = _transformers_smart_resize()
    rng = random.Random(0)
    for _ in range(5000):
        h = rng.randint(1, 4000)
        w = rng.randint(max(1, h // 150), min(h * 150, 4000))
        factor = rng.choice([28, 32, 14])
        lo = rng.choice([1, 56 * 56, 256 * 28 * 28])
        hi = rng.choice([28 * 28 * 4, 1024 * 1024, 28 * 28 * 1280])
        if hi < lo:
            continue
        kw = {"factor": factor, "min_pixels": lo, "max_pixels": hi}
        assert smart_resize(h, w, **kw) == ref(h, w, **kw), (h, w, kw)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, factor=28, min_pixels=1, max_pixels=10**6)


def test_smart_resize_stage_output_and_orientation(tmp_path: Path) -> None:
    im = Image.new("RGB", (120, 60), (200, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 120x60, upright 60x120
    path = tmp_path / "r.jpg"
    im.save(path, quality=95, exif=exif)
    spec = SmartResize(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    out = Pipeline(image=spec).load_image(path, sample_id="r")
    h, w = spec.output_size(120, 60)
    assert out.shape == (3, h, w) and out.dtype == np.uint8 and out.flags.c_contiguous
    assert h > w
    with pytest.raises(SampleError, match="aspect ratio"):
        spec(Image.new("RGB", (300, 1)))
    with pytest.raises(ConfigError):
        SmartResize(min_pixels=100, max_pixels=10)


@pytest.mark.parametrize(
    "stage",
    [
        ImageSpec(size=32),
        ImageSpec(size=32, crop=None, max_size=48),
        ImageSpec(size=40, pad_to_square=True),
        ImageSpec(size=40, crop=None, pad_to_square=True),
        SmartResize(min_pixels=28 * 28, max_pixels=28 * 28 * 9),
    ],
)
@pytest.mark.parametrize("orientation", [1, 6])
def test_output_hw_from_the_header_is_the_processed_shape(
    tmp_path: Path, stage: Any, orientation: int
) -> None:
    im = Image.new("RGB", (150, 70), (1, 2, 3))
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / "x.jpg"
    im.save(path, quality=90, exif=exif)
    out = Pipeline(image=stage).load_image(path, sample_id="x")
    assert output_hw(stage, 150, 70, orientation) == tuple(out.shape[1:])


class TestSmartResizeContract(StageContract):
    __test__ = True

    def make_stage(self) -> Any:
        return SmartResize(min_pixels=28 * 28, max_pixels=28 * 28 * 16)

    def variants(self) -> Sequence[Any]:
        return [
            SmartResize(min_pixels=28 * 28, max_pixels=28 * 28 * 4),
            SmartResize(min_pixels=28 * 28 * 9, max_pixels=28 * 28 * 16),
            SmartResize(min_pixels=28 * 28, max_pixels=28 * 28 * 16, factor=32),
            SmartResize(min_pixels=28 * 28, max_pixels=28 * 28 * 16, interpolation="bilinear"),
        ]

    def make_input(self) -> Any:
        arr = np.random.default_rng(0).integers(0, 255, (90, 150, 3), dtype=np.uint8)
        return Image.fromarray(arr)


# -- lengths, modalities, text_report --------------------------------------------------------


def test_lengths_equal_the_produced_samples_without_decoding(
    manifest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = MultimodalDataset(manifest, pipeline=qwen_pipeline())
    expected = [len(ds.produce(i)["input_ids"]) for i in range(len(ds))]
    trainable = sum(int(np.count_nonzero(ds.produce(i)["labels"] != -100)) for i in range(3))

    def no_decode(self: Any) -> Any:
        raise AssertionError("lengths() decoded an image")

    fresh = MultimodalDataset(manifest, pipeline=qwen_pipeline())
    calls = []
    real_encode = ChatSpec.encode

    def counting(self: ChatSpec, chat: Any, **kw: Any) -> Any:
        calls.append(1)
        return real_encode(self, chat, **kw)

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    monkeypatch.setattr(ChatSpec, "encode", counting)
    lengths = fresh.lengths()
    assert lengths.dtype == np.int64 and lengths.tolist() == expected
    assert fresh.modalities().tolist() == [True, True, False]
    assert fresh.lengths() is lengths and len(calls) == 3  # once per source
    report = fresh.text_report()
    assert (report.samples, report.with_images, report.truncated, report.fully_masked) == (
        3,
        2,
        0,
        0,
    )
    assert report.tokens == sum(expected)
    assert report.length_percentiles["max"] == max(expected)
    assert report.trainable_tokens == trainable


def test_truncation_drops_the_image_in_the_sample_and_in_lengths(tmp_path: Path) -> None:
    write_image(tmp_path / "a.jpg", (64, 64))
    conv = turns(
        ("human", "What is in the picture?"),
        ("gpt", "A cat sits on a mat."),
        ("human", "<image>\nAnd this one?"),
        ("gpt", "Two dogs."),
    )
    path = write_llava(tmp_path / "m.json", [{"id": "t", "image": "a.jpg", "conversations": conv}])
    spec = ImageSpec(size=28)
    tok = make_tokenizer()
    full = ChatSpec(tok, "chatml", 4096, image_tokens=40)
    chat = MultimodalDataset(path, pipeline=Pipeline(image=spec, text=full)).records.chat(0)
    assert chat is not None
    ((a, b),) = full.encode(Chat(tuple(chat), ((28, 28),))).image_runs
    short = Pipeline(image=spec, text=ChatSpec(tok, "chatml", (a + b) // 2, image_tokens=40))
    ds = MultimodalDataset(path, pipeline=short)
    s = ds.produce(0)
    assert s["image_sizes"].shape == (0, 2) and s["images"].size == 0
    assert tok.token_to_id("<image>") not in s["input_ids"].tolist()
    assert ds.lengths().tolist() == [len(s["input_ids"])]
    assert ds.modalities().tolist() == [False]
    assert ds.text_report().truncated == 1


def test_fully_masked_sample_under_raise_and_skip(manifest: Path, tmp_path: Path) -> None:
    # vicuna's system prompt + 9 image tokens leave no room for the image samples'
    # replies at 115 tokens; the text-only sample (113 tokens) fits
    pipe = llava_pipeline(max_length=115)
    strict = MultimodalDataset(manifest, pipeline=pipe)
    with pytest.raises(SampleError, match="fully masked after truncation") as info:
        strict.produce(0)
    assert info.value.sample_id == "one"
    with pytest.raises(SampleError, match="fully masked"):
        strict.lengths()
    lenient = MultimodalDataset(manifest, pipeline=pipe, on_error="skip")
    assert lenient[0] is None
    lengths = lenient.lengths()
    assert lengths[0] == 0 and lengths[2] > 0
    report = lenient.text_report(root=tmp_path / "root")
    assert report.fully_masked == 2 and report.samples == 3 and report.with_images == 0
    assert "one" in {r.sample_id for r in lenient.rejects()}
    reasons = {r.sample_id: r.reason for r in lenient.rejects()}
    assert reasons["one"] == "fully masked after truncation"


def test_text_report_is_printed_by_mmcache_stats(
    manifest: Path, cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mmcache.cli import main

    mmcache.Cache(cache_root, memory=0, disk="16MiB").close()
    ds = MultimodalDataset(manifest, pipeline=qwen_pipeline())
    report = ds.text_report(root=cache_root)
    assert main(["stats", "--cache", str(cache_root)]) == 0
    out = capsys.readouterr().out
    assert str(report) in out and "3 samples, 2 with images" in out
    assert main(["stats", "--cache", str(cache_root), "--json"]) == 0
    assert '"trainable_tokens"' in capsys.readouterr().out


def test_lengths_need_a_known_image_geometry(manifest: Path) -> None:
    pipe = Pipeline(
        image=mmcache.stage(lambda im: np.zeros((3, 8, 8), np.uint8), version="1"),
        text=ChatSpec(make_tokenizer(), "chatml", 64),
    )
    with pytest.raises(ConfigError, match="resize rule"):
        MultimodalDataset(manifest, pipeline=pipe).lengths()
    with pytest.raises(ConfigError, match="ChatSpec"):
        MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=8))).lengths()


# -- keys ------------------------------------------------------------------------------------


def test_keys_follow_the_conversation_and_every_image(manifest: Path, tmp_path: Path) -> None:
    ds = MultimodalDataset(manifest, pipeline=qwen_pipeline())
    before = ds.key_rows([0, 1, 2]).copy()
    assert [r.tobytes() for r in before] == [ds.key(i) for i in range(3)]
    # a placeholder moved: the flattened text is the same, the key is not
    moved = write_llava(
        tmp_path / "moved.json",
        [
            {
                "id": "one",
                "image": "img/a.jpg",
                "conversations": turns(
                    ("human", "What is in the picture?\n<image>"), ("gpt", "A cat sits on a mat.")
                ),
            }
        ],
    )
    other = MultimodalDataset(moved, pipeline=qwen_pipeline())
    assert other.records.text(0) == ds.records.text(0)
    assert other.key(0) != ds.key(0)
    # the second image of "two" changes: only that key changes, in key_rows as in key
    b = tmp_path / "img/b.jpg"
    st = b.stat()
    write_image(b, (40, 90), shade=200)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    after = ds.key_rows([0, 1, 2])
    assert after[1].tobytes() != before[1].tobytes() and after[1].tobytes() == ds.key(1)
    np.testing.assert_array_equal(after[[0, 2]], before[[0, 2]])
    # another pipeline option: every key changes
    other_pipe = MultimodalDataset(manifest, pipeline=qwen_pipeline(max_length=511))
    assert not set(map(bytes, other_pipe.key_rows([0, 1, 2]))) & set(map(bytes, after))


# -- the source contract ----------------------------------------------------------------------


class TestChatSourceContract(SourceContract):
    """A chat source whose samples each have two images (the second one is changed)."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path) -> None:
        self.root = tmp_path
        self.pipeline = qwen_pipeline()

    def make_source(
        self, n: int, *, on_error: OnError = "raise", bad: int | None = None
    ) -> SampleSource:
        records = []
        for i in range(n):
            for k in (0, 1):
                path = self.root / f"img/s{i}-{k}.jpg"
                if not path.exists():
                    write_image(path, (40 + 8 * k, 30), shade=(i * 20 + k) % 200)
            second = f"img/s{i}-1.jpg" if i != bad else "img/missing.jpg"
            conv = turns(("human", f"<image> vs <image> {i}?"), ("gpt", f"Answer {i}."))
            records.append(
                {"id": f"s{i}", "image": [f"img/s{i}-0.jpg", second], "conversations": conv}
            )
        path = write_llava(self.root / f"m-{n}-{bad}.json", records)
        return MultimodalDataset(path, pipeline=self.pipeline, on_error=on_error)

    def change_input(self, source: SampleSource, index: int) -> None:
        path = self.root / f"img/s{index}-1.jpg"
        st = path.stat()
        write_image(path, (48, 30), shade=199)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_lengths_saved_under_the_root_are_reused_by_the_next_run(
    manifest: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    first = MultimodalDataset(manifest, pipeline=qwen_pipeline())
    lengths = first.lengths(root=root).copy()
    report = first.text_report()
    assert list((root / "reports").glob("lengths-*.npz"))
    calls: list[str] = []
    real_encode = ChatSpec.encode

    def counting(self: ChatSpec, chat: Any, *, sample_id: str = "") -> Any:
        calls.append(sample_id)
        return real_encode(self, chat, sample_id=sample_id)

    monkeypatch.setattr(ChatSpec, "encode", counting)
    second = MultimodalDataset(manifest, pipeline=qwen_pipeline())  # the next run
    assert second.lengths(root=root).tolist() == lengths.tolist() and calls == []
    assert second.modalities().tolist() == [True, True, False]
    assert second.text_report() == report
    # an image of "two" changes: only that sample is measured again
    b = tmp_path / "img/b.jpg"
    st = b.stat()
    write_image(b, (400, 90), shade=3)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    third = MultimodalDataset(manifest, pipeline=qwen_pipeline())
    new = third.lengths(root=root)
    assert calls == ["two"]
    assert new[1] != lengths[1] and new[[0, 2]].tolist() == lengths[[0, 2]].tolist()
    assert new.tolist() == [len(third.produce(i)["input_ids"]) for i in range(3)]
    # another pipeline does not read this one's saved pass
    calls.clear()
    MultimodalDataset(manifest, pipeline=qwen_pipeline(max_length=300)).lengths(root=root)
    assert calls == ["one", "two", "text"]


def test_which_samples_have_several_files_is_found_once_not_per_sample(
    manifest: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new process keys every sample of its first epoch: asking the records per sample
    whether it has several files cost ~5 us twice a sample (its stamps, then its
    identities; main). Found once for every record instead, with the same stamps and keys
    (the two-image sample's stamp row is its files' combined one)."""
    from mmcache.sources.records import Records

    ds = MultimodalDataset(manifest, pipeline=qwen_pipeline())
    one_by_one = [ds.key(i) for i in range(3)]
    stamps = ds.stamps(np.arange(3))
    fresh = MultimodalDataset(manifest, pipeline=qwen_pipeline())
    asked: list[int] = []
    count = Records.image_count

    def counted(self: Records, i: int) -> int:
        asked.append(i)
        return count(self, i)

    monkeypatch.setattr(Records, "image_count", counted)
    for _ in range(2):  # an epoch's file check, then its keys, twice
        np.testing.assert_array_equal(fresh.stamps(np.arange(3)), stamps)
        fresh._memo_keys = None  # keyed anew, as in a new process
        assert [r.tobytes() for r in fresh.key_rows(np.array([2, 1, 0]))] == one_by_one[::-1]
    assert asked == []
    assert stamps[1].tolist() != stamps[0].tolist() and stamps[2, 0] == -2
