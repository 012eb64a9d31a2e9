"""Bad inputs: every broken manifest line, image file or path, end to end.

One corpus folder per module (the ``corpus`` fixture): six good samples, one
image file per image case and one manifest per case (the six good records, then
the case's records). Every case runs through ``MultimodalDataset`` and
``mmcache.DataLoader`` with a cache (memory and disk tiers, small budgets, shared
by the whole module so hits, evictions and promotions happen too) twice:

* ``on_error="raise"``: a bad record raises ``ManifestError`` naming the file, the
  line and (when readable) the id; a bad sample raises ``SampleError`` naming the
  id, the file and the reason; an accepted case loads and its output is checked.
* ``on_error="skip"``: two epochs complete; every good sample arrives exactly once
  per epoch with the same arrays as an uncached decode; the bad one is skipped,
  counted (``loader.stats()``) and listed (``dataset.rejects()``).

``tests/faults/README.md`` lists every case and what the library does with it.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import resource
import struct
import subprocess
import sys
import textwrap
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from PIL import Image

from mmcache.cache import Cache, _memory_name
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ManifestError, MmcacheError, SampleError
from mmcache.loader import DataLoader
from mmcache.stores.memory import store_dir
from mmcache.transforms import ImageSpec, TextSpec
from mmcache.transforms.pipeline import Pipeline

SIZE = 32
MAX_LENGTH = 16
N_GOOD = 6
GOOD_IDS = tuple(f"good-{i}" for i in range(N_GOOD))
WHITE = (255, 255, 255)

# accept: the case's records load. record: the manifest reader rejects a record
# (ManifestError with its line). sample: the record is read but its sample cannot be
# produced (SampleError). file: the whole manifest is refused under both policies.
# record|sample: rejected either way (the fix may choose where).
Outcome = Literal["accept", "record", "sample", "file", "record|sample"]
Items = dict[str, dict[str, np.ndarray]]


@dataclass
class Case:
    """What one case's manifest holds and what the library must do with it."""

    outcome: Outcome
    reason: str = ""  # substring of the error's reason
    bad_id: str | None = None  # the id the error names (None: the id is unreadable)
    line: int | None = None  # ManifestError.line
    path: str | None = None  # SampleError.path
    extra_ids: tuple[str, ...] = ()  # accepted ids beyond the good ones
    good_ids: tuple[str, ...] = GOOD_IDS
    check: Callable[[Items], None] | None = None  # on the accepted case's arrays
    skip_fatal: str | None = None  # under "skip" the file is refused with this reason
    setup: Callable[[pytest.MonkeyPatch], None] | None = None
    texts: dict[str, str] = field(default_factory=dict)  # good ids whose text differs
    records: list[bytes] = field(default_factory=list)  # for the combined manifest
    manifest: Path = Path()


@dataclass
class Corpus:
    root: Path
    images: Path
    pipeline: Pipeline
    reference: Items  # the good samples, decoded without any cache
    cases: dict[str, Case]
    good_lines: list[bytes]


# ------------------------------------------------------------------------------------------
# building the corpus
# ------------------------------------------------------------------------------------------

CaseBuilder = Callable[[Corpus], Case]
BUILDERS: dict[str, tuple[str, CaseBuilder]] = {}
XFAIL: dict[str, str] = {}


def case(group: str) -> Callable[[CaseBuilder], CaseBuilder]:
    def register(fn: CaseBuilder) -> CaseBuilder:
        BUILDERS[fn.__name__] = (group, fn)
        return fn

    return register


def record(sample_id: Any, image: Any, caption: Any) -> bytes:
    return json.dumps({"id": sample_id, "image_path": image, "caption": caption}).encode()


def noise(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 200, width, dtype=np.float64)[None, :, None]
    pixels = base + rng.integers(0, 55, (height, width, 3))
    return Image.fromarray(pixels.astype(np.uint8))


def png_header_only(path: Path, width: int, height: int) -> None:
    """A PNG that claims ``width x height`` pixels and holds none (a bomb's header)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def write_manifest(
    corpus: Corpus, name: str, extra: list[bytes], *, goods: bool = True, sep: bytes = b"\n"
) -> tuple[Path, int]:
    """Write ``good lines + extra`` as ``name.jsonl``; return it and the first extra line."""
    lines = (corpus.good_lines if goods else []) + extra
    path = corpus.root / f"{name}.jsonl"
    path.write_bytes(sep.join(lines) + sep)
    return path, (N_GOOD if goods else 0) + 1


def colour_check(
    sample_id: str, colour: tuple[int, int, int], tol: int = 3
) -> Callable[[Items], None]:
    def check(items: Items) -> None:
        image = items[sample_id]["image"].astype(np.int16)
        expected = np.array(colour, dtype=np.int16)[:, None, None]
        assert np.abs(image - expected).max() <= tol, image[:, SIZE // 2, SIZE // 2]

    return check


def tokens_check(corpus: Corpus, sample_id: str, caption: str) -> Callable[[Items], None]:
    def check(items: Items) -> None:
        ids, mask = corpus.pipeline.tokenize(caption)
        np.testing.assert_array_equal(items[sample_id]["input_ids"], ids)
        np.testing.assert_array_equal(items[sample_id]["attention_mask"], mask)

    return check


def bad_record_case(
    corpus: Corpus, name: str, line: bytes, reason: str, bad_id: str | None
) -> Case:
    path, first = write_manifest(corpus, name, [line])
    return Case("record", reason, bad_id=bad_id, line=first, manifest=path, records=[line])


def bad_image_case(
    corpus: Corpus, name: str, image: str, reason: str, *, outcome: Outcome = "sample"
) -> Case:
    line = record(name, image, f"a bad {name}")
    path, first = write_manifest(corpus, name, [line])
    target = os.path.normpath(os.path.join(corpus.root, image))
    return Case(
        outcome, reason, bad_id=name, line=first, path=target, manifest=path, records=[line]
    )


def good_image_case(
    corpus: Corpus, name: str, image: str, check: Callable[[Items], None] | None
) -> Case:
    line = record(name, image, f"an unusual {name}")
    path, _ = write_manifest(corpus, name, [line])
    return Case("accept", extra_ids=(name,), check=check, manifest=path, records=[line])


# -- manifest cases ----------------------------------------------------------------------------


@case("manifest")
def malformed_json(c: Corpus) -> Case:
    return bad_record_case(
        c, "malformed_json", b'{"id": "x", "image_path": ', "malformed JSON", None
    )


@case("manifest")
def truncated_last_line(c: Corpus) -> Case:
    # a writer killed mid-line: the file ends without the closing brace or newline
    line = record("cut", "images/good-0.jpg", "cut off")[:-9]
    path = c.root / "truncated_last_line.jsonl"
    path.write_bytes(b"\n".join([*c.good_lines, line]))
    return Case("record", "malformed JSON", line=N_GOOD + 1, manifest=path, records=[line])


@case("manifest")
def not_an_object(c: Corpus) -> Case:
    return bad_record_case(c, "not_an_object", b'"just a string"', "expected a JSON object", None)


@case("manifest")
def missing_id(c: Corpus) -> Case:
    line = json.dumps({"image_path": "images/good-0.jpg", "caption": "no id"}).encode()
    return bad_record_case(c, "missing_id", line, "missing key 'id'", None)


@case("manifest")
def missing_image_path(c: Corpus) -> Case:
    line = json.dumps({"id": "noimg", "caption": "no image"}).encode()
    return bad_record_case(c, "missing_image_path", line, "missing key 'image_path'", "noimg")


@case("manifest")
def missing_caption(c: Corpus) -> Case:
    line = json.dumps({"id": "nocap", "image_path": "images/good-0.jpg"}).encode()
    return bad_record_case(c, "missing_caption", line, "missing key 'caption'", "nocap")


@case("manifest")
def id_is_a_number(c: Corpus) -> Case:
    line = record(17, "images/good-0.jpg", "numeric id")
    return bad_record_case(c, "id_is_a_number", line, "'id' must be a string, got number 17", None)


@case("manifest")
def id_is_empty(c: Corpus) -> Case:
    return bad_record_case(
        c, "id_is_empty", record("", "images/good-0.jpg", "empty id"), "'id' is empty", None
    )


@case("manifest")
def caption_is_a_list(c: Corpus) -> Case:
    line = record("listcap", "images/good-0.jpg", ["a", "b"])
    reason = "'caption' must be a string, got array of 2 items"
    return bad_record_case(c, "caption_is_a_list", line, reason, "listcap")


@case("manifest")
def caption_is_null(c: Corpus) -> Case:
    line = record("nullcap", "images/good-0.jpg", None)
    reason = "'caption' must be a string, got null"
    return bad_record_case(c, "caption_is_null", line, reason, "nullcap")


@case("manifest")
def image_path_is_a_number(c: Corpus) -> Case:
    line = record("numpath", 3, "numeric path")
    reason = "'image_path' must be a string, got number 3"
    return bad_record_case(c, "image_path_is_a_number", line, reason, "numpath")


@case("manifest")
def image_path_is_empty(c: Corpus) -> Case:
    line = record("emptypath", "", "empty path")
    return bad_record_case(c, "image_path_is_empty", line, "'image_path' is empty", "emptypath")


@case("manifest")
def duplicate_id(c: Corpus) -> Case:
    # the first occurrence is kept; the duplicate (another caption) is the bad record
    line = record("good-2", "images/good-3.jpg", "a second good-2")
    return bad_record_case(c, "duplicate_id", line, "duplicate id (first seen at line 3)", "good-2")


@case("manifest")
def non_utf8_bytes(c: Corpus) -> Case:
    line = record("latin1", "images/good-0.jpg", "caf__").replace(b"__", b"\xe9\xff")
    return bad_record_case(c, "non_utf8_bytes", line, "not valid UTF-8", None)


@case("manifest")
def nested_too_deeply(c: Corpus) -> Case:
    line = b'{"id": "deep", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return bad_record_case(c, "nested_too_deeply", line, "nested too deeply", None)


@case("manifest")
def lone_surrogate_in_id(c: Corpus) -> Case:
    line = b'{"id": "x\\ud800", "image_path": "images/good-0.jpg", "caption": "c"}'
    return bad_record_case(c, "lone_surrogate_in_id", line, "unpaired surrogate", None)


@case("manifest")
def empty_file(c: Corpus) -> Case:
    path = c.root / "empty_file.jsonl"
    path.write_bytes(b"")
    return Case("file", "the manifest has no records", good_ids=(), manifest=path)


@case("manifest")
def only_blank_lines(c: Corpus) -> Case:
    path = c.root / "only_blank_lines.jsonl"
    path.write_bytes(b"\n  \n\t\r\n\n")
    return Case("file", "the manifest has no records", good_ids=(), manifest=path)


@case("manifest")
def every_record_bad(c: Corpus) -> Case:
    path = c.root / "every_record_bad.jsonl"
    path.write_bytes(b"{not json\n" + record(5, "x.jpg", "c") + b"\n")
    return Case(
        "record",
        "malformed JSON",
        line=1,
        good_ids=(),
        skip_fatal="no valid records: all 2 were rejected",
        manifest=path,
    )


@case("manifest")
def blank_lines(c: Corpus) -> Case:
    lines = [c.good_lines[0], b"", b"   ", *c.good_lines[1:3], b"\t", *c.good_lines[3:]]
    path = c.root / "blank_lines.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n\n\n")

    def check(items: Items) -> None:
        ds = MultimodalDataset(path, pipeline=c.pipeline)
        # line numbers count physical lines, blank ones included
        assert [ds.records.line(i) for i in range(len(ds))] == [1, 4, 5, 7, 8, 9]

    return Case("accept", check=check, manifest=path)


@case("manifest")
def utf8_bom(c: Corpus) -> Case:
    path = c.root / "utf8_bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(c.good_lines) + b"\n")
    return Case("accept", manifest=path)  # "good-0", not "\ufeffgood-0", must arrive


@case("manifest")
def crlf_line_ends(c: Corpus) -> Case:
    path, _ = write_manifest(c, "crlf_line_ends", [], sep=b"\r\n")
    return Case(
        "accept", check=tokens_check(c, "good-5", "a photo of thing number 5"), manifest=path
    )


@case("manifest")
def unicode_captions(c: Corpus) -> Case:
    captions = {
        "cjk": "一只猫坐在垫子上 猫の写真 고양이",
        "emoji": "a cat 🐈‍⬛ on a mat 😀👍🏽",
        "rtl": "قطة على السجادة חתול על השטיח",
        "combining": "cafe\u0301 nai\u0308ve Z\u0351\u0353a\u0308\u0301l\u0336go\u0489",
    }
    lines = [record(f"uni-{k}", "images/good-1.jpg", v) for k, v in captions.items()]
    path, _ = write_manifest(c, "unicode_captions", lines)

    def check(items: Items) -> None:
        for k, v in captions.items():
            tokens_check(c, f"uni-{k}", v)(items)
        ids = {k: tuple(items[f"uni-{k}"]["input_ids"].tolist()) for k in captions}
        assert len(set(ids.values())) == len(captions)  # not all collapsed to [UNK]

    return Case("accept", extra_ids=tuple(f"uni-{k}" for k in captions), check=check, manifest=path)


@case("manifest")
def empty_caption(c: Corpus) -> Case:
    line = record("nocaption", "images/good-0.jpg", "")
    path, _ = write_manifest(c, "empty_caption", [line])

    def check(items: Items) -> None:
        assert int(items["nocaption"]["attention_mask"].sum()) == 2  # [CLS] [SEP]
        tokens_check(c, "nocaption", "")(items)

    return Case("accept", extra_ids=("nocaption",), check=check, manifest=path)


@case("manifest")
def nul_and_controls_in_caption(c: Corpus) -> Case:
    caption = "nul\u0000 bell\u0007 ls\u2028 ps\u2029 nel\u0085 end"
    line = record("controls", "images/good-0.jpg", caption)
    path, _ = write_manifest(c, "nul_and_controls_in_caption", [line])
    return Case(
        "accept", extra_ids=("controls",), check=tokens_check(c, "controls", caption), manifest=path
    )


@case("manifest")
def extra_keys_ignored(c: Corpus) -> Case:
    line = json.dumps(
        {"id": "extra", "image_path": "images/good-0.jpg", "caption": "c", "meta": {"a": [1]}}
    ).encode()
    path, _ = write_manifest(c, "extra_keys_ignored", [line])
    return Case("accept", extra_ids=("extra",), manifest=path)


LLAVA_TEXTS = {
    sid: f"human: What is this?\ngpt: thing number {i}" for i, sid in enumerate(GOOD_IDS)
}


def llava(c: Corpus, name: str, extra: list[Any]) -> Path:
    goods = [
        {
            "id": f"good-{i}",
            "image": f"images/good-{i}.jpg",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat is this?"},
                {"from": "gpt", "value": f"thing number {i}"},
            ],
        }
        for i in range(N_GOOD)
    ]
    path = c.root / f"{name}.json"
    path.write_text(json.dumps(goods + extra, ensure_ascii=False), encoding="utf-8")
    return path


@case("manifest")
def llava_integer_ids(c: Corpus) -> Case:
    extra = [
        {
            "id": 12,
            "image": "images/good-0.jpg",
            "conversations": [{"from": "human", "value": "hi"}],
        }
    ]
    path = llava(c, "llava_integer_ids", extra)
    check = tokens_check(c, "12", "human: hi")
    return Case("accept", extra_ids=("12",), check=check, texts=LLAVA_TEXTS, manifest=path)


@case("manifest")
def llava_text_only_record(c: Corpus) -> Case:
    # allowed by the reader; a Pipeline with an ImageSpec cannot produce it
    extra = [{"id": "textonly", "conversations": [{"from": "human", "value": "no picture"}]}]
    path = llava(c, "llava_text_only_record", extra)
    reason = "record has no image"
    return Case("sample", reason, bad_id="textonly", path=None, texts=LLAVA_TEXTS, manifest=path)


@case("manifest")
def llava_multi_image(c: Corpus) -> Case:
    # multi-image records are read (issue 15); an entry that is not a path is refused
    turns = [{"from": "human", "value": "<image><image>"}]
    extra = [{"id": "multi", "image": ["a.jpg", 7], "conversations": turns}]
    path = llava(c, "llava_multi_image", extra)
    reason = "'image[1]' must be a string"
    line = N_GOOD + 1
    return Case("record", reason, bad_id="multi", line=line, texts=LLAVA_TEXTS, manifest=path)


@case("manifest")
def llava_malformed_file(c: Corpus) -> Case:
    path = c.root / "llava_malformed_file.json"
    path.write_text('[{"id": "a", "image": "x.jpg", "conversations": [', encoding="utf-8")
    return Case("file", "malformed JSON", good_ids=(), manifest=path)


# -- image cases -------------------------------------------------------------------------------


@case("image")
def missing_file(c: Corpus) -> Case:
    return bad_image_case(c, "missing_file", "images/nope.jpg", "file not found")


@case("image")
def directory(c: Corpus) -> Case:
    (c.images / "adir.jpg").mkdir()
    return bad_image_case(c, "directory", "images/adir.jpg", "is a directory")


@case("image")
def zero_bytes(c: Corpus) -> Case:
    (c.images / "zero.jpg").write_bytes(b"")
    return bad_image_case(c, "zero_bytes", "images/zero.jpg", "empty file")


@case("image")
def truncated_jpeg(c: Corpus) -> Case:
    buf = io.BytesIO()
    noise(160, 120, 7).save(buf, "JPEG", quality=90)
    (c.images / "truncated.jpg").write_bytes(buf.getvalue()[: buf.tell() // 2])
    return bad_image_case(c, "truncated_jpeg", "images/truncated.jpg", "truncated or corrupt image")


@case("image")
def corrupt_png(c: Corpus) -> Case:
    # one flipped bit inside the compressed pixel data (bit rot): zlib's check fails
    buf = io.BytesIO()
    noise(64, 48, 8).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[data.find(b"IDAT") + 100] ^= 0x01
    (c.images / "corrupt.png").write_bytes(bytes(data))
    return bad_image_case(c, "corrupt_png", "images/corrupt.png", "corrupt")


@case("image")
def corrupt_png_header(c: Corpus) -> Case:
    buf = io.BytesIO()
    noise(64, 48, 9).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[data.find(b"IHDR") + 4 + 13] ^= 0xFF  # the IHDR chunk's CRC
    (c.images / "badheader.png").write_bytes(bytes(data))
    return bad_image_case(c, "corrupt_png_header", "images/badheader.png", "not an image")


@case("image")
def text_saved_as_jpg(c: Corpus) -> Case:
    (c.images / "notes.jpg").write_text("this is a text file, not a JPEG\n")
    return bad_image_case(c, "text_saved_as_jpg", "images/notes.jpg", "not an image")


@case("image")
def cmyk_jpeg(c: Corpus) -> Case:
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(c.images / "cmyk.jpg", quality=95)
    return good_image_case(
        c, "cmyk_jpeg", "images/cmyk.jpg", colour_check("cmyk_jpeg", (255, 0, 0))
    )


@case("image")
def progressive_jpeg(c: Corpus) -> Case:
    img = noise(80, 60, 10)
    img.save(c.images / "progressive.jpg", quality=90, progressive=True)
    img.save(c.images / "baseline.jpg", quality=90)
    baseline = c.pipeline.load_image(c.images / "baseline.jpg", sample_id="baseline")

    def check(items: Items) -> None:
        diff = np.abs(items["progressive_jpeg"]["image"].astype(np.int16) - baseline)
        assert diff.max() <= 2

    return good_image_case(c, "progressive_jpeg", "images/progressive.jpg", check)


@case("image")
def png_16bit(c: Corpus) -> Case:
    Image.fromarray(np.full((30, 40), 128 * 257, dtype=np.uint16)).save(c.images / "deep.png")
    with Image.open(c.images / "deep.png") as img:
        assert img.mode.startswith("I")
    return good_image_case(
        c, "png_16bit", "images/deep.png", colour_check("png_16bit", (128,) * 3, 1)
    )


def left_right(width: int, height: int, mode: str, left: Any, right: Any) -> Image.Image:
    img = Image.new(mode, (width, height), left)
    img.paste(right, (width // 2, 0, width, height))
    return img


def halves_check(
    sample_id: str, left: tuple[int, ...], right: tuple[int, ...]
) -> Callable[[Items], None]:
    def check(items: Items) -> None:
        image = items[sample_id]["image"].astype(np.int16)
        assert np.abs(image[:, :, :6] - np.array(left)[:, None, None]).max() <= 3
        assert np.abs(image[:, :, -6:] - np.array(right)[:, None, None]).max() <= 3

    return check


@case("image")
def palette_png_transparency(c: Corpus) -> Case:
    img = left_right(64, 48, "P", 0, 1)
    img.putpalette([0, 0, 0, 10, 200, 30] + [0, 0, 0] * 254)
    img.info["transparency"] = 0  # index 0 (black) is transparent: composited on white
    img.save(c.images / "palette.png")
    check = halves_check("palette_png_transparency", WHITE, (10, 200, 30))
    return good_image_case(c, "palette_png_transparency", "images/palette.png", check)


@case("image")
def grayscale(c: Corpus) -> Case:
    Image.new("L", (40, 30), 100).save(c.images / "gray.jpg", quality=95)
    return good_image_case(c, "grayscale", "images/gray.jpg", colour_check("grayscale", (100,) * 3))


@case("image")
def rgba(c: Corpus) -> Case:
    # transparent pixels hide black: composited on white, they must come out white
    left_right(64, 48, "RGBA", (0, 0, 0, 0), (10, 20, 230, 255)).save(c.images / "rgba.png")
    return good_image_case(c, "rgba", "images/rgba.png", halves_check("rgba", WHITE, (10, 20, 230)))


def animation(path: Path, **kwargs: Any) -> None:
    frames = [Image.new("RGB", (50, 40), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, loop=0, **kwargs)
    with Image.open(path) as img:
        assert img.n_frames == 3


@case("image")
def animated_gif(c: Corpus) -> Case:
    animation(c.images / "anim.gif")
    return good_image_case(
        c, "animated_gif", "images/anim.gif", colour_check("animated_gif", (255, 0, 0))
    )


@case("image")
def animated_webp(c: Corpus) -> Case:
    animation(c.images / "anim.webp", lossless=True)
    check = colour_check("animated_webp", (255, 0, 0))
    return good_image_case(c, "animated_webp", "images/anim.webp", check)


@case("image")
def exif_rotated_jpeg(c: Corpus) -> Case:
    # stored 64x32, left half red, right half blue; orientation 6 = rotate 90 degrees
    # clockwise to display, so upright the red half is on top
    exif = Image.Exif()
    exif[0x0112] = 6
    stored = left_right(64, 32, "RGB", (255, 0, 0), (0, 0, 255))
    stored.save(c.images / "exif6.jpg", quality=95, exif=exif.tobytes())

    def check(items: Items) -> None:
        image = items["exif_rotated_jpeg"]["image"].astype(np.int16)
        assert np.abs(image[:, :6, :] - np.array([255, 0, 0])[:, None, None]).max() <= 4
        assert np.abs(image[:, -6:, :] - np.array([0, 0, 255])[:, None, None]).max() <= 4

    return good_image_case(c, "exif_rotated_jpeg", "images/exif6.jpg", check)


@case("image")
def one_pixel(c: Corpus) -> Case:
    Image.new("RGB", (1, 1), (200, 100, 50)).save(c.images / "dot.png")
    return good_image_case(
        c, "one_pixel", "images/dot.png", colour_check("one_pixel", (200, 100, 50))
    )


@case("image")
def extreme_aspect_ratio(c: Corpus) -> Case:
    Image.new("RGB", (10_000, 10), (0, 128, 255)).save(c.images / "strip.png")
    check = colour_check("extreme_aspect_ratio", (0, 128, 255))
    return good_image_case(c, "extreme_aspect_ratio", "images/strip.png", check)


@case("image")
def decompression_bomb(c: Corpus) -> Case:
    png_header_only(c.images / "bomb.png", 100_000, 100_000)
    reason = "image has 10000000000 pixels, over the limit of"
    return bad_image_case(c, "decompression_bomb", "images/bomb.png", reason)


@case("image")
def huge_file(c: Corpus) -> Case:
    # A video or tar shard listed as an image: 1 TiB, sparse (no disk used). Read
    # whole it was a MemoryError that on_error="skip" did not catch.
    size = 1 << 40
    with open(c.images / "shard.jpg", "wb") as f:
        os.truncate(f.fileno(), size)
    reason = f"file is {size} bytes, over the limit of {256 << 20} bytes (ImageSpec.max_bytes)"
    return bad_image_case(c, "huge_file", "images/shard.jpg", reason)


@case("image")
def symlink_loop(c: Corpus) -> Case:
    (c.images / "loop-a.jpg").symlink_to("loop-b.jpg")
    (c.images / "loop-b.jpg").symlink_to("loop-a.jpg")
    return bad_image_case(c, "symlink_loop", "images/loop-a.jpg", "symlink loop")


@case("image")
def dangling_symlink(c: Corpus) -> Case:
    (c.images / "dangling.jpg").symlink_to("gone.jpg")
    return bad_image_case(c, "dangling_symlink", "images/dangling.jpg", "file not found")


@case("image")
def no_read_permission(c: Corpus) -> Case:
    path = c.images / "secret.jpg"
    noise(40, 30, 11).save(path)
    path.chmod(0)

    def deny(monkeypatch: pytest.MonkeyPatch) -> None:
        if os.geteuid() != 0:
            return  # chmod 0 is enough
        # root reads anything: simulate the permission error where the pipeline opens it
        real_open = os.open

        def open_denied(p: Any, flags: int, *args: Any) -> int:
            if os.fspath(p) == str(path):
                raise PermissionError(13, "Permission denied", str(p))
            return real_open(p, flags, *args)

        monkeypatch.setattr(os, "open", open_denied)

    out = bad_image_case(c, "no_read_permission", "images/secret.jpg", "permission denied")
    out.setup = deny
    return out


@case("image")
def fifo(c: Corpus) -> Case:
    os.mkfifo(c.images / "pipe.jpg")
    return bad_image_case(c, "fifo", "images/pipe.jpg", "not a regular file")


@case("image")
def path_through_a_file(c: Corpus) -> Case:
    return bad_image_case(c, "path_through_a_file", "images/good-0.jpg/x.jpg", "Not a directory")


@case("image")
def nul_in_image_path(c: Corpus) -> Case:
    out = bad_image_case(c, "nul_in_image_path", "images/good-0.jpg\u0000.png", "NUL")
    out.outcome = "record|sample"
    return out


# -- path cases --------------------------------------------------------------------------------


@case("path")
def climbs_out_of_the_manifest_folder(c: Corpus) -> Case:
    # allowed (documented in Records.image_path): datasets often keep images beside
    # the folder of their manifest
    outside = c.root.parent / "outside-images"
    outside.mkdir()
    Image.new("RGB", (40, 30), (20, 220, 20)).save(outside / "climb.png")
    sub = c.root / "sub"
    sub.mkdir()
    path = sub / "climb.jsonl"
    lines = [
        record(f"good-{i}", f"../images/good-{i}.jpg", f"a photo of thing number {i}")
        for i in range(N_GOOD)
    ]
    lines.append(record("climber", "../../outside-images/climb.png", "from outside"))
    path.write_bytes(b"\n".join(lines) + b"\n")
    check = colour_check("climber", (20, 220, 20))
    return Case("accept", extra_ids=("climber",), check=check, manifest=path)


@case("path")
def absolute_path(c: Corpus) -> Case:
    elsewhere = c.root.parent / "elsewhere"
    elsewhere.mkdir()
    Image.new("RGB", (40, 30), (220, 20, 20)).save(elsewhere / "abs.png")
    return good_image_case(
        c, "absolute_path", str(elsewhere / "abs.png"), colour_check("absolute_path", (220, 20, 20))
    )


@case("path")
def spaces_and_unicode_in_names(c: Corpus) -> Case:
    folder = c.images / "dossier été"
    folder.mkdir()
    Image.new("RGB", (40, 30), (20, 20, 220)).save(folder / "photo – 猫 😀 .png")
    check = colour_check("spaces_and_unicode_in_names", (20, 20, 220))
    return good_image_case(
        c, "spaces_and_unicode_in_names", "images/dossier été/photo – 猫 😀 .png", check
    )


@case("path")
def dot_segments(c: Corpus) -> Case:
    return good_image_case(c, "dot_segments", "images/./dossier été/../good-4.jpg", None)


# ------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path) -> Corpus:
    root = tmp_path_factory.mktemp("bad-inputs") / "corpus"
    images = root / "images"
    images.mkdir(parents=True)
    pipeline = Pipeline(
        image=ImageSpec(size=SIZE), text=TextSpec(tokenizer_json, max_length=MAX_LENGTH)
    )
    good_lines = []
    reference: Items = {}
    for i, sid in enumerate(GOOD_IDS):
        noise(48 + 8 * i, 40, seed=i).save(images / f"{sid}.jpg", quality=90)
        caption = f"a photo of thing number {i}"
        good_lines.append(record(sid, f"images/{sid}.jpg", caption))
        reference[sid] = pipeline.process(images / f"{sid}.jpg", caption, sample_id=sid)
    out = Corpus(root, images, pipeline, reference, {}, good_lines)
    for name, (_group, build) in BUILDERS.items():
        built = build(out)
        out.cases[name] = built
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cache]:
    """One cache for the module: 128 KiB of memory (about 37 samples), 1 MiB of disk,
    so cases evict, promote from disk and hit entries made by earlier cases."""
    root = tmp_path_factory.mktemp("bad-inputs-cache") / "cache"
    c = Cache(root, memory="128KiB", disk="1MiB", policy="lru", temporary=True)
    yield c
    c.close()
    remove_segments(root)


def remove_segments(root: Path) -> None:
    for path in glob.glob(f"{store_dir()}/mmcache-{_memory_name(root.absolute())}*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def run(
    ds: MultimodalDataset, cache: Cache | None, *, epochs: int, workers: int = 0
) -> tuple[list[list[str]], Items, DataLoader]:
    loader = DataLoader(ds, cache=cache, batch_size=4, seed=0, num_workers=workers)
    order: list[list[str]] = []
    items: Items = {}
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        ids: list[str] = []
        for batch in loader:
            for row, sid in enumerate(batch["id"]):
                ids.append(sid)
                arrays = {
                    k: batch[k][row].numpy().copy()
                    for k in ("image", "input_ids", "attention_mask")
                }
                if sid in items:  # the same arrays every epoch, from whichever tier
                    for k, v in arrays.items():
                        np.testing.assert_array_equal(v, items[sid][k], err_msg=f"{sid} {k}")
                items[sid] = arrays
        order.append(ids)
    return order, items, loader


def assert_goods_exact(
    corpus: Corpus, items: Items, good_ids: tuple[str, ...], texts: dict[str, str] | None = None
) -> None:
    """The good samples' arrays equal an uncached decode (whichever tier served them)."""
    for sid in good_ids:
        expected = dict(corpus.reference[sid])
        if texts and sid in texts:
            expected["input_ids"], expected["attention_mask"] = corpus.pipeline.tokenize(texts[sid])
        for k, v in expected.items():
            np.testing.assert_array_equal(items[sid][k], v, err_msg=f"{sid} {k}")


CASE_PARAMS = [
    pytest.param(
        name,
        id=f"{group}-{name}",
        marks=[pytest.mark.xfail(strict=True, reason=XFAIL[name])] if name in XFAIL else [],
    )
    for name, (group, _) in BUILDERS.items()
]


# ------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------


def test_the_corpus_has_at_least_30_cases() -> None:
    groups = Counter(group for group, _ in BUILDERS.values())
    assert len(BUILDERS) >= 30 and groups["manifest"] >= 12 and groups["image"] >= 19, groups


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_raise_mode(
    name: str, corpus: Corpus, cache: Cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = corpus.cases[name]
    if c.setup is not None:
        c.setup(monkeypatch)
    if c.outcome in ("file", "record"):
        with pytest.raises(ManifestError) as info:
            MultimodalDataset(c.manifest, pipeline=corpus.pipeline, on_error="raise")
        err = info.value
        assert err.path == str(c.manifest)
        assert err.line == (None if c.outcome == "file" else c.line)
        assert err.sample_id == c.bad_id
        assert c.reason in err.reason and c.reason in str(err)
        assert str(c.manifest) in str(err)
        if err.line is not None:
            assert f"{c.manifest}:{err.line}" in str(err)
        return
    try:
        ds = MultimodalDataset(c.manifest, pipeline=corpus.pipeline, on_error="raise")
        order, items, _ = run(ds, cache, epochs=1)
    except MmcacheError as exc:
        if c.outcome == "accept":
            raise
        got: MmcacheError = exc
    except Exception as exc:
        pytest.fail(f"a bad input raised {type(exc).__name__} without mmcache's context: {exc}")
    else:
        if c.outcome != "accept":
            pytest.fail(f"{name}: no error under on_error='raise'")
        assert Counter(order[0]) == Counter(c.good_ids + c.extra_ids)
        assert_goods_exact(corpus, items, c.good_ids, c.texts)
        if c.check is not None:
            c.check(items)
        return
    if isinstance(got, ManifestError):
        assert c.outcome == "record|sample", got
        assert got.path == str(c.manifest) and got.line == c.line and got.sample_id == c.bad_id
    else:
        assert isinstance(got, SampleError) and type(got) is SampleError, got
        assert got.sample_id == c.bad_id
        assert got.path == c.path
        if c.path is not None:
            assert c.path in str(got)
    assert c.reason in got.reason and c.reason in str(got)
    if c.bad_id is not None:
        assert repr(c.bad_id) in str(got)


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_skip_mode(
    name: str, corpus: Corpus, cache: Cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = corpus.cases[name]
    if c.setup is not None:
        c.setup(monkeypatch)
    fatal = c.skip_fatal or (c.reason if c.outcome == "file" else None)
    if fatal is not None:
        with pytest.raises(ManifestError) as info:
            MultimodalDataset(c.manifest, pipeline=corpus.pipeline, on_error="skip")
        assert info.value.line is None and fatal in info.value.reason
        assert str(c.manifest) in str(info.value)
        return
    ds = MultimodalDataset(c.manifest, pipeline=corpus.pipeline, on_error="skip")
    order, items, loader = run(ds, cache, epochs=2)
    expected = Counter(c.good_ids + c.extra_ids)
    for ids in order:  # every good sample exactly once per epoch, the bad one never
        assert Counter(ids) == expected
    assert_goods_exact(corpus, items, c.good_ids, c.texts)
    if c.check is not None:
        c.check(items)
    rejects = ds.rejects()
    epochs = loader.stats().epochs
    if c.outcome == "accept":
        assert rejects == [] and ds.records.rejects == []
        assert [e.rejects for e in epochs] == [0, 0]
        return
    assert len(rejects) == 1, rejects
    rej = rejects[0]
    assert c.reason in rej.reason
    in_manifest = bool(ds.records.rejects)
    if in_manifest:  # rejected by the reader: listed with its line, never loaded
        assert c.outcome in ("record", "record|sample")
        (read_reject,) = ds.records.rejects
        assert read_reject.line == c.line and read_reject.sample_id == c.bad_id
        assert rej.sample_id == (c.bad_id if c.bad_id is not None else f"<line {c.line}>")
        assert [e.rejects for e in epochs] == [0, 0]
    else:  # skipped by the loader each epoch: counted every time, listed once
        assert c.outcome in ("sample", "record|sample")
        assert rej.sample_id == c.bad_id and rej.path == c.path
        assert [e.rejects for e in epochs] == [1, 1]
        assert all(e.samples == len(expected) for e in epochs)


def test_all_image_cases_at_once_with_workers(corpus: Corpus, cache: Cache) -> None:
    """Every image and path case in one manifest, decoded by two forked workers: the
    errors cross the process boundary with their id, path and reason."""
    cases = {
        n: c
        for n, c in corpus.cases.items()
        if BUILDERS[n][0] in ("image", "path") and c.records and c.setup is None and n not in XFAIL
    }
    lines = corpus.good_lines + [line for c in cases.values() for line in c.records]
    path = corpus.root / "all_images.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    ds = MultimodalDataset(path, pipeline=corpus.pipeline, on_error="skip")
    order, items, loader = run(ds, cache, epochs=2, workers=2)
    accepted = [i for c in cases.values() for i in c.extra_ids]
    for ids in order:
        assert Counter(ids) == Counter(GOOD_IDS + tuple(accepted))
    assert_goods_exact(corpus, items, GOOD_IDS)
    for c in cases.values():
        if c.check is not None:
            c.check(items)
    bad = {n: c for n, c in cases.items() if c.outcome in ("sample", "record|sample")}
    rejects = {r.sample_id: r for r in ds.rejects()}
    assert set(rejects) == set(bad)
    # a record|sample case the manifest reader rejected is listed with the manifest's
    # path and never reaches the loader (not counted per epoch)
    read = {r.sample_id for r in ds.records.rejects}
    assert read <= {n for n, c in bad.items() if c.outcome == "record|sample"}
    for n, c in bad.items():
        assert c.reason in rejects[n].reason
        assert rejects[n].path == (str(path) if n in read else c.path)
    loaded = len(bad) - len(read)
    assert [e.rejects for e in loader.stats().epochs] == [loaded, loaded]

    ds = MultimodalDataset(corpus.cases["truncated_jpeg"].manifest, pipeline=corpus.pipeline)
    with pytest.raises(SampleError) as info:
        run(ds, cache, epochs=1, workers=2)
    assert info.value.sample_id == "truncated_jpeg"
    assert info.value.path == corpus.cases["truncated_jpeg"].path
    assert "truncated or corrupt image" in info.value.reason


HUGE_CAPTION_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from mmcache.cache import Cache
    from mmcache.dataset import MultimodalDataset
    from mmcache.loader import DataLoader
    from mmcache.transforms import ImageSpec, TextSpec
    from mmcache.transforms.pipeline import Pipeline

    manifest, tokenizer, root = sys.argv[1:4]
    t0 = time.perf_counter()
    pipe = Pipeline(image=ImageSpec(size=32), text=TextSpec(tokenizer, max_length=16))
    ds = MultimodalDataset(manifest, pipeline=pipe, on_error="raise")
    cache = Cache(root, memory="1MiB", disk="4MiB", temporary=True)
    loader = DataLoader(ds, cache=cache, batch_size=4, seed=0)
    got = {}
    for epoch in range(2):  # the second epoch reads the huge sample back from the cache
        loader.set_epoch(epoch)
        for batch in loader:
            for r, sid in enumerate(batch["id"]):
                got[sid] = batch["input_ids"][r].tolist()
    cache.close()
    head = ds.records.text(ds.records.index_of("huge"))[:200]
    expected = pipe.tokenize(head)[0].tolist()
    print(json.dumps({"seconds": time.perf_counter() - t0, "ok": got["huge"] == expected,
                      "n": len(got)}))
    """
)


@pytest.mark.slow
def test_a_100_mb_caption_line(corpus: Corpus, tokenizer_json: Path, tmp_path: Path) -> None:
    """A real 100 MB caption line: read, keyed, tokenized (truncated to 16 tokens) and
    cached within 4 GiB of address space, and never a hang (run in a child to bound both;
    the time bound is a hang guard with room for a loaded machine, not a speed target:
    quiet, it takes a few seconds)."""
    path = corpus.root / "huge.jsonl"  # beside the images its good records name
    words = "a red bicycle leaning on a wall near the sea "
    with path.open("wb") as f:
        f.write(b"\n".join(corpus.good_lines) + b"\n")
        f.write(b'{"id": "huge", "image_path": "' + str(corpus.images / "good-0.jpg").encode())
        f.write(b'", "caption": "')
        chunk = (words * (1 << 14)).encode()
        for _ in range((100 << 20) // len(chunk) + 1):
            f.write(chunk)
        f.write(b'"}\n')
    assert path.stat().st_size > 100 << 20
    root = tmp_path / "cache"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    try:
        proc = subprocess.run(
            [sys.executable, "-c", HUGE_CAPTION_SCRIPT, str(path), str(tokenizer_json), str(root)],
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=limit,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a 100 MB caption line hung (more than 300 s)")
    finally:
        remove_segments(root)
        path.unlink()
    assert proc.returncode == 0, proc.stderr[:1500]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["n"] == N_GOOD + 1
    assert result["seconds"] < 10, result
