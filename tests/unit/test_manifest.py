"""Manifest readers: seed JSONL and LLaVA JSON into columnar Records."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmcache.sources.records as records_module
from mmcache.errors import ConfigError, ManifestError
from mmcache.sources.readers import IMAGE_TOKEN, llava_text, read_manifest
from mmcache.sources.records import RecordReject as Reject
from mmcache.sources.records import Records

# -- helpers ------------------------------------------------------------------


def row(i: int | str, caption: str = "a caption", image: str | None = None) -> dict[str, Any]:
    sid = str(i) if isinstance(i, str) else f"s{i}"
    return {"id": sid, "image_path": image or f"img/{sid}.jpg", "caption": caption}


def write_lines(path: Path, lines: list[str | bytes | dict[str, Any]], end: bytes = b"\n") -> Path:
    """Write one manifest line per item: dicts as JSON, str as UTF-8, bytes verbatim."""
    out = bytearray()
    for item in lines:
        if isinstance(item, dict):
            out += json.dumps(item, ensure_ascii=False).encode("utf-8")
        elif isinstance(item, str):
            out += item.encode("utf-8")
        else:
            out += item
        out += end
    path.write_bytes(bytes(out))
    return path


def write_llava(path: Path, records: list[Any], *, prefix: bytes = b"") -> Path:
    path.write_bytes(prefix + json.dumps(records, ensure_ascii=False, indent=1).encode("utf-8"))
    return path


def llava_record(i: Any, *, image: Any = "img/x.jpg", **extra: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "id": i,
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"},
            {"from": "gpt", "value": "A cat."},
        ],
    }
    if image is not None:
        rec["image"] = image
    rec.update(extra)
    return rec


def all_rows(records: Records) -> list[tuple[str, str | None, str, int]]:
    return [
        (records.id(i), records.image_path(i), records.text(i), records.line(i))
        for i in range(len(records))
    ]


# -- JSONL: the good path -------------------------------------------------------


def test_jsonl_reads_every_field(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "train.jsonl", [row(0, "a dog"), row(1, "two cats")])
    records = read_manifest(str(path))
    assert len(records) == 2
    assert records.source == str(path)
    assert records.format == "jsonl"
    assert records.rejects == []
    assert all_rows(records) == [
        ("s0", str(tmp_path / "img" / "s0.jpg"), "a dog", 1),
        ("s1", str(tmp_path / "img" / "s1.jpg"), "two cats", 2),
    ]
    assert records.has_image(0) and records.has_image(1)


def test_jsonl_ignores_extra_keys_and_accepts_pathlike(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "m.jsonl", [{**row(0), "width": 640, "tags": ["x"]}])
    records = read_manifest(path)
    assert records.source == str(path)
    assert records.id(0) == "s0"


def test_bom_crlf_and_blank_lines(tmp_path: Path) -> None:
    body = (
        b"\xef\xbb\xbf"
        + json.dumps(row(0)).encode()
        + b"\r\n\r\n   \t \r\n"
        + json.dumps(row(1)).encode()
        + b"\r\n\n"
        + json.dumps(row(2)).encode()  # last line without a line end
    )
    path = tmp_path / "m.jsonl"
    path.write_bytes(body)
    records = read_manifest(path)
    assert [records.id(i) for i in range(3)] == ["s0", "s1", "s2"]
    # Blank lines still count: line numbers are physical lines of the file.
    assert [records.line(i) for i in range(3)] == [1, 4, 6]
    assert records.text(1) == "a caption"  # no stray "\r"


def test_first_line_blank_then_bom_is_only_stripped_at_file_start(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(json.dumps(row(0)).encode() + b"\n\xef\xbb\xbf" + json.dumps(row(1)).encode())
    with pytest.raises(ManifestError) as info:
        read_manifest(path)
    assert info.value.line == 2


UNICODE_CAPTIONS = [
    "一只猫坐在键盘上",  # CJK
    "👩‍👩‍👧‍👦 family 🇫🇷 flag 🐈‍⬛",  # emoji with ZWJ sequences and flags
    "مرحبا بالعالم שלום",  # RTL Arabic and Hebrew
    "e\u0301 vs \u00e9, a\u0308\u0323",  # combining marks, NFD kept as NFD
    "line\u2028separator\u2029para\x85nel\x1c\x1d\x1e",  # not line ends for a JSONL reader
    'tab\tquote" backslash\\ cr\r nl\n nul\x00',  # characters JSON must escape
    "\U0010fffd\ufeff",  # last plane, a BOM inside a string
    "",  # an empty caption is allowed
]


@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_unicode_round_trips_exactly(tmp_path: Path, ensure_ascii: bool) -> None:
    lines = [
        json.dumps(
            {"id": f"{i}-{cap[:3]}", "image_path": f"图片/{i}.jpg", "caption": cap},
            ensure_ascii=ensure_ascii,
        )
        for i, cap in enumerate(UNICODE_CAPTIONS)
    ]
    records = read_manifest(write_lines(tmp_path / "m.jsonl", list(lines)))
    assert len(records) == len(UNICODE_CAPTIONS)
    for i, cap in enumerate(UNICODE_CAPTIONS):
        assert records.text(i) == cap
        assert records.id(i) == f"{i}-{cap[:3]}"
        assert records.image_path(i) == str(tmp_path / "图片" / f"{i}.jpg")
        assert records.line(i) == i + 1


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    rows=st.lists(
        st.tuples(st.text(min_size=1, max_size=20), st.text(max_size=60)),
        min_size=1,
        max_size=15,
        unique_by=lambda r: r[0],
    ),
    ensure_ascii=st.booleans(),
)
def test_property_arbitrary_unicode_round_trips(
    tmp_path: Path, rows: list[tuple[str, str]], ensure_ascii: bool
) -> None:
    path = tmp_path / "prop.jsonl"
    with open(path, "w", encoding="utf-8", newline="") as f:
        for sid, caption in rows:
            obj = {"id": sid, "image_path": "x.jpg", "caption": caption}
            f.write(json.dumps(obj, ensure_ascii=ensure_ascii) + "\n")
    records = read_manifest(path)
    assert [(records.id(i), records.text(i)) for i in range(len(records))] == rows
    assert [records.index_of(sid) for sid, _ in rows] == list(range(len(rows)))


def test_all_captions_empty(tmp_path: Path) -> None:
    records = read_manifest(write_lines(tmp_path / "m.jsonl", [row(0, ""), row(1, "")]))
    assert [records.text(0), records.text(1)] == ["", ""]


def test_five_megabyte_caption(tmp_path: Path) -> None:
    caption = "猫と犬 cat " * 400_000  # 5.6 MB of UTF-8
    path = write_lines(tmp_path / "m.jsonl", [row(0), row(1, caption), row(2)])
    assert path.stat().st_size > 5_000_000
    records = read_manifest(path)
    assert records.text(1) == caption
    assert records.id(2) == "s2"
    assert records.line(2) == 3


# -- image paths -----------------------------------------------------------------


def test_image_paths_relative_absolute_and_parent(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    absolute = str(tmp_path / "elsewhere" / "abs.jpg")
    path = write_lines(
        folder / "m.jsonl",
        [
            row("rel", image="img/a.jpg"),
            row("dot", image="./img//b.jpg"),
            row("up", image="../images/c.jpg"),
            row("abs", image=absolute),
            row("mid", image="img/../d.jpg"),
        ],
    )
    records = read_manifest(path)
    assert [records.image_path(i) for i in range(5)] == [
        str(folder / "img" / "a.jpg"),
        str(folder / "img" / "b.jpg"),
        str(tmp_path / "images" / "c.jpg"),  # climbing out of the folder is allowed
        absolute,
        str(folder / "d.jpg"),
    ]


def test_relative_manifest_path_resolves_against_cwd_at_read_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sub").mkdir()
    write_lines(tmp_path / "sub" / "m.jsonl", [row(0, image="a.jpg")])
    monkeypatch.chdir(tmp_path)
    records = read_manifest(os.path.join("sub", "m.jsonl"))
    assert records.source == os.path.join("sub", "m.jsonl")
    monkeypatch.chdir(tmp_path / "sub")  # a later chdir (or a worker elsewhere) changes nothing
    assert records.image_path(0) == str(tmp_path / "sub" / "a.jpg")


def test_symlinks_are_not_resolved(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    write_lines(real / "m.jsonl", [row(0, image="a.jpg")])
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    records = read_manifest(link / "m.jsonl")
    assert records.image_path(0) == str(link / "a.jpg")


# -- access -----------------------------------------------------------------------


def test_indices_follow_sequence_rules(tmp_path: Path) -> None:
    records = read_manifest(write_lines(tmp_path / "m.jsonl", [row(i) for i in range(3)]))
    assert records.id(-1) == "s2"
    assert records.text(np.int64(1)) == "a caption"
    assert records.line(np.int32(2)) == 3
    for bad in (3, -4):
        with pytest.raises(IndexError, match="out of range"):
            records.id(bad)
    with pytest.raises(TypeError):
        records.id(1.0)  # type: ignore[arg-type]


def test_index_of_finds_every_id_and_rejects_absent(tmp_path: Path) -> None:
    ids = ["a", "b", "猫", "🐈", "a " * 50, "A"]
    records = read_manifest(write_lines(tmp_path / "m.jsonl", [row(s) for s in ids]))
    assert [records.index_of(s) for s in ids] == list(range(len(ids)))
    with pytest.raises(KeyError, match="'nope' is not in manifest"):
        records.index_of("nope")
    with pytest.raises(KeyError):
        records.index_of("a ")
    with pytest.raises(TypeError):
        records.index_of(0)  # type: ignore[arg-type]


class _ConstantHash:
    @staticmethod
    def xxh3_64_intdigest(data: object) -> int:
        return 7


def test_index_of_survives_hash_collisions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every id gets the same hash: lookups must still compare the ids themselves.
    monkeypatch.setattr(records_module, "xxhash", _ConstantHash())
    ids = [f"id{i}" for i in range(20)]
    records = read_manifest(write_lines(tmp_path / "m.jsonl", [row(s) for s in ids]))
    assert [records.index_of(s) for s in ids] == list(range(20))
    with pytest.raises(KeyError):
        records.index_of("id20")


def test_ids_array(tmp_path: Path) -> None:
    ids = ["x", "漢", "🐈‍⬛"]
    records = read_manifest(write_lines(tmp_path / "m.jsonl", [row(s) for s in ids]))
    array = records.ids_array()
    assert isinstance(array, np.ndarray)
    assert array.shape == (3,)
    assert array.tolist() == ids
    assert records.ids(np.array([2, 0, 2])) == [ids[2], ids[0], ids[2]]
    assert records.ids(np.array([], dtype=np.int64)) == []


def test_no_per_row_python_objects(tmp_path: Path) -> None:
    records = read_manifest(write_lines(tmp_path / "m.jsonl", [row(i) for i in range(1000)]))
    arrays = [v for v in vars(records).values() if isinstance(v, np.ndarray)]
    assert arrays and all(a.dtype != object for a in arrays)
    containers = [k for k, v in vars(records).items() if isinstance(v, (list, tuple, dict, set))]
    assert containers == ["rejects"]
    # Bytes held are about the UTF-8 text plus 8 bytes per row per column.
    assert records.nbytes < 1000 * (len(json.dumps(row(999))) + 4 * 8 + 1)


def test_pickle_round_trip(tmp_path: Path) -> None:
    lines: list[str | bytes | dict[str, Any]] = [row(0, "猫"), "not json", row(1), row(0)]
    records = read_manifest(write_lines(tmp_path / "m.jsonl", lines), on_error="skip")
    records.index_of("s1")  # build the lookup table; it is not pickled
    copy = pickle.loads(pickle.dumps(records))
    assert all_rows(copy) == all_rows(records)
    assert (copy.source, copy.format, copy.rejects) == (
        records.source,
        records.format,
        records.rejects,
    )
    assert copy.nbytes < records.nbytes  # the index was dropped from the pickle
    assert copy.index_of("s1") == 1


# -- bad JSONL records --------------------------------------------------------------

# (name, bad line, id the error names or None, fragment of the reason)
BAD_LINES: list[tuple[str, str | bytes | dict[str, Any], str | None, str]] = [
    ("malformed", '{"id": "s9", "image_path": "a.jpg", "caption": "x"', None, "malformed JSON"),
    ("not-object", '["s9", "a.jpg", "x"]', None, "expected a JSON object, got array"),
    ("missing-id", {"image_path": "a.jpg", "caption": "x"}, None, "missing key 'id'"),
    ("missing-image", {"id": "s9", "caption": "x"}, "s9", "missing key 'image_path'"),
    ("missing-caption", {"id": "s9", "image_path": "a.jpg"}, "s9", "missing key 'caption'"),
    ("id-number", {"id": 9, "image_path": "a.jpg", "caption": "x"}, None, "'id' must be a string"),
    (
        "caption-list",
        {"id": "s9", "image_path": "a.jpg", "caption": ["x"]},
        "s9",
        "'caption' must be a string, got array",
    ),
    (
        "image-number",
        {"id": "s9", "image_path": 3, "caption": "x"},
        "s9",
        "'image_path' must be a string, got number 3",
    ),
    (
        "image-null",
        {"id": "s9", "image_path": None, "caption": "x"},
        "s9",
        "got null",
    ),
    ("id-empty", {"id": "", "image_path": "a.jpg", "caption": "x"}, None, "'id' is empty"),
    ("image-empty", {"id": "s9", "image_path": "", "caption": "x"}, "s9", "'image_path' is empty"),
    (
        "image-nul",  # JSON "\u0000": os.open would raise a bare ValueError at load time
        {"id": "s9", "image_path": "a.jpg\x00.png", "caption": "x"},
        "s9",
        "'image_path' contains a NUL byte",
    ),
    ("duplicate", row(0, "second"), "s0", "duplicate id (first seen at line 1)"),
    (
        "not-utf8",
        b'{"id": "s9", "image_path": "a.jpg", "caption": "caf\xe9"}',
        None,
        "line is not valid UTF-8",
    ),
    (
        "surrogate",
        '{"id": "s\\ud800", "image_path": "a.jpg", "caption": "x"}',
        None,
        "unpaired surrogate",
    ),
]


@pytest.mark.parametrize(("bad", "sample_id", "fragment"), [b[1:] for b in BAD_LINES])
def test_bad_line_raises_with_path_line_and_id(
    tmp_path: Path, bad: str | bytes | dict[str, Any], sample_id: str | None, fragment: str
) -> None:
    path = write_lines(tmp_path / "m.jsonl", [row(0), "", bad, row(1)])
    with pytest.raises(ManifestError) as info:
        read_manifest(path)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.path, err.line, err.sample_id) == (str(path), 3, sample_id)
    assert fragment in err.reason
    message = str(err)
    assert f"{path}:3" in message
    if sample_id is not None:
        assert repr(sample_id) in message


@pytest.mark.parametrize(("bad", "sample_id", "fragment"), [b[1:] for b in BAD_LINES])
def test_bad_line_is_skipped_and_listed(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    bad: str | bytes | dict[str, Any],
    sample_id: str | None,
    fragment: str,
) -> None:
    path = write_lines(tmp_path / "m.jsonl", [row(0, "first"), "", bad, row(1, "猫")])
    with caplog.at_level(logging.WARNING, logger="mmcache.sources"):
        records = read_manifest(path, on_error="skip")
    assert all_rows(records) == [
        ("s0", str(tmp_path / "img" / "s0.jpg"), "first", 1),  # the first of a duplicate is kept
        ("s1", str(tmp_path / "img" / "s1.jpg"), "猫", 4),
    ]
    assert len(records.rejects) == 1
    reject = records.rejects[0]
    assert (reject.path, reject.line, reject.sample_id) == (str(path), 3, sample_id)
    assert fragment in reject.reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 1 of 3 records" in warnings[0].getMessage()


def test_nul_elsewhere_than_the_image_path_is_kept(tmp_path: Path) -> None:
    # only a file name cannot hold a NUL: captions and ids keep theirs
    path = write_lines(tmp_path / "m.jsonl", [row("s\x00id", "nul\x00 in caption", "a.jpg")])
    records = read_manifest(path)
    assert (records.id(0), records.text(0)) == ("s\x00id", "nul\x00 in caption")
    llava = write_llava(
        tmp_path / "l.json",
        [llava_record("a", conversations=[{"from": "human", "value": "x\x00y"}])],
    )
    assert read_manifest(llava).text(0) == "human: x\x00y"


def test_skip_many_counts_once_and_keeps_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lines: list[str | bytes | dict[str, Any]] = []
    for i in range(30):
        lines.append(row(i))
        if i % 3 == 0:
            lines.append(row(i, "duplicate"))
    lines.append(b"\xff\xfe")
    with caplog.at_level(logging.WARNING, logger="mmcache.sources"):
        records = read_manifest(write_lines(tmp_path / "m.jsonl", lines), on_error="skip")
    assert [records.id(i) for i in range(len(records))] == [f"s{i}" for i in range(30)]
    assert all(records.text(i) == "a caption" for i in range(30))
    assert [r.sample_id for r in records.rejects] == [f"s{i}" for i in range(0, 30, 3)] + [None]
    assert [r.line for r in records.rejects][:2] == [2, 6]
    assert len(caplog.records) == 1
    assert "skipped 11 of 41 records" in caplog.records[0].getMessage()


def test_no_warning_without_rejects(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="mmcache.sources"):
        read_manifest(write_lines(tmp_path / "m.jsonl", [row(0)]), on_error="skip")
    assert caplog.records == []


def test_reject_formats_like_manifest_error() -> None:
    reject = Reject(path="m.jsonl", line=3, sample_id="x", reason="bad")
    error = ManifestError("bad", path="m.jsonl", line=3, sample_id="x")
    assert str(reject) == str(error) == "m.jsonl:3 (id 'x'): bad"


# -- whole-file problems --------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"\n\n  \r\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf  \n"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_empty_manifest(tmp_path: Path, content: bytes, on_error: Any) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(ManifestError, match="no records") as info:
        read_manifest(path, on_error=on_error)
    assert info.value.line is None
    assert str(path) in str(info.value)


def test_all_records_rejected_is_an_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "m.jsonl", ["{", {"id": 1}])
    with pytest.raises(ManifestError, match="all 2 were rejected") as info:
        read_manifest(path, on_error="skip")
    assert info.value.line is None
    assert "m.jsonl:1" in str(info.value)  # names the first reject


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_missing_file(tmp_path: Path, on_error: Any) -> None:
    path = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(ManifestError, match="file not found") as info:
        read_manifest(path, on_error=on_error)
    assert str(path) in str(info.value)
    assert info.value.line is None
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_directory_is_not_a_manifest(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read") as info:
        read_manifest(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_invalid_options() -> None:
    with pytest.raises(ConfigError, match="on_error"):
        read_manifest("x.jsonl", on_error="warn")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="format"):
        read_manifest("x.jsonl", format="csv")  # type: ignore[arg-type]


# -- LLaVA ---------------------------------------------------------------------------------


def test_llava_template() -> None:
    turns = [
        {"from": "human", "value": "<image>\nWhat is in the picture?"},
        {"from": "gpt", "value": "Two cats.\nOne is black."},
        {"from": "human", "value": "And the colour?\n<image>"},
        {"from": "gpt", "value": "  grey  "},
    ]
    assert llava_text(turns) == (
        "human: What is in the picture?\n"
        "gpt: Two cats.\nOne is black.\n"
        "human: And the colour?\n"
        "gpt:   grey  "
    )
    assert llava_text([{"from": "human", "value": "a\n<image>\nb"}]) == "human: a\n\nb"
    assert IMAGE_TOKEN == "<image>"


def test_llava_reads_records(tmp_path: Path) -> None:
    data = [
        llava_record("000000033471", image="coco/train2017/000000033471.jpg"),
        llava_record(42, image="/abs/x.jpg"),  # int id: converted with str
        llava_record("text-only", image=None),  # no "image": a text-only record
        {**llava_record("null-image"), "image": None},
    ]
    path = write_llava(tmp_path / "llava.json", data)
    records = read_manifest(path)
    assert records.format == "llava"
    assert len(records) == 4
    assert [records.id(i) for i in range(4)] == ["000000033471", "42", "text-only", "null-image"]
    assert records.image_path(0) == str(tmp_path / "coco" / "train2017" / "000000033471.jpg")
    assert records.image_path(1) == "/abs/x.jpg"
    assert [records.has_image(i) for i in range(4)] == [True, True, False, False]
    assert records.image_path(2) is None and records.image_path(3) is None
    assert records.text(0) == "human: What is this?\ngpt: A cat."
    assert [records.line(i) for i in range(4)] == [1, 2, 3, 4]  # record index in the array
    assert records.index_of("42") == 1
    copy = pickle.loads(pickle.dumps(records))
    assert all_rows(copy) == all_rows(records)


def test_llava_detected_after_bom_and_whitespace(tmp_path: Path) -> None:
    path = write_llava(tmp_path / "x.txt", [llava_record("a")], prefix=b"\xef\xbb\xbf\r\n  \n")
    assert read_manifest(path).format == "llava"
    assert read_manifest(path, format="llava").id(0) == "a"


def test_explicit_format_overrides_detection(tmp_path: Path) -> None:
    llava = write_llava(tmp_path / "llava.json", [llava_record("a")])
    with pytest.raises(ManifestError) as info:
        read_manifest(llava, format="jsonl")
    assert info.value.line == 1
    jsonl = write_lines(tmp_path / "m.jsonl", [row(0), row(1)])
    with pytest.raises(ManifestError, match="malformed JSON") as info:
        read_manifest(jsonl, format="llava")
    assert info.value.line is None


BAD_LLAVA: list[tuple[Any, str | None, str]] = [
    ("not an object", None, "record must be a JSON object, got string"),
    ({"conversations": []}, None, "missing key 'id'"),
    (llava_record(1.5), None, "'id' must be a string or an integer, got number 1.5"),
    (llava_record(True), None, "'id' must be a string or an integer, got boolean"),
    (llava_record(""), None, "'id' is empty"),
    (llava_record("b", image=["a.jpg", 7]), "b", "'image[1]' must be a string, got number 7"),
    (llava_record("b", image=["a.jpg", ""]), "b", "'image[1]' is empty"),
    (llava_record("b", image=7), "b", "'image' must be a string, got number 7"),
    (llava_record("b", image=""), "b", "'image' is empty"),
    (llava_record("b", image="x.jpg\x00"), "b", "'image' contains a NUL byte"),
    ({"id": "b", "image": "x.jpg"}, "b", "missing key 'conversations'"),
    (llava_record("b", conversations=[]), "b", "'conversations' is empty"),
    (llava_record("b", conversations="hi"), "b", "'conversations' must be an array"),
    (llava_record("b", conversations=["hi"]), "b", "conversations[0] must be an object"),
    (
        llava_record("b", conversations=[{"from": "human"}]),
        "b",
        "conversations[0]: missing key 'value'",
    ),
    (
        llava_record(
            "b", conversations=[{"from": "human", "value": "x"}, {"from": 1, "value": ""}]
        ),
        "b",
        "conversations[1]: 'from' must be a string",
    ),
    (llava_record("a"), "a", "duplicate id (first seen at record 1)"),
    (llava_record(7), "7", "duplicate id (first seen at record 2)"),  # int 7 == "7"
]


@pytest.mark.parametrize(("bad", "sample_id", "fragment"), BAD_LLAVA)
def test_llava_bad_record_raise_and_skip(
    tmp_path: Path, bad: Any, sample_id: str | None, fragment: str
) -> None:
    path = write_llava(tmp_path / "llava.json", [llava_record("a"), llava_record("7"), bad])
    with pytest.raises(ManifestError) as info:
        read_manifest(path)
    err = info.value
    assert (err.path, err.line, err.sample_id) == (str(path), 3, sample_id)
    assert fragment in err.reason
    assert f"{path}:3" in str(err)

    records = read_manifest(path, on_error="skip")
    assert [records.id(i) for i in range(len(records))] == ["a", "7"]
    assert [(r.line, r.sample_id) for r in records.rejects] == [(3, sample_id)]
    assert fragment in records.rejects[0].reason


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b'[{"id": "a"},', "malformed JSON"),
        (b'{"id": "a"}', "expected a JSON array"),
        (b'[{"id": "caf\xe9"}]', "not valid UTF-8"),
        (b"[]", "no records"),
    ],
)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_llava_whole_file_errors(
    tmp_path: Path, content: bytes, fragment: str, on_error: Any
) -> None:
    path = tmp_path / "llava.json"
    path.write_bytes(content)
    with pytest.raises(ManifestError, match=fragment) as info:
        read_manifest(path, on_error=on_error, format="llava")
    assert info.value.line is None
    assert str(path) in str(info.value)


def test_stat_paths_are_the_image_paths_encoded(tmp_path: Path) -> None:
    """The file check stats exactly the files the decoder opens, text-only rows included."""
    import os

    import numpy as np

    (tmp_path / "img").mkdir()
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    data = [
        {"id": "a", "image": "img/../img/a.jpg", "conversations": conv},
        {"id": "b", "conversations": conv},
        {"id": "c", "image": "ü/c.jpg", "conversations": conv},
    ]
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    records = read_manifest(path, on_error="skip")
    rows = np.array([2, 0, 1, 0])
    expected = [
        None if records.image_path(i) is None else os.fsencode(records.image_path(i))
        for i in rows.tolist()
    ]
    assert records.stat_paths(rows) == expected
    assert expected[1] == os.fsencode(str(tmp_path / "img" / "a.jpg")) and expected[2] is None


def test_deep_nesting_is_refused_by_depth_but_brackets_in_strings_are_text(
    tmp_path: Path,
) -> None:
    """Nesting deeper than MAX_JSON_DEPTH is a ManifestError naming the line (the decoder
    never recurses that deep); brackets inside strings and moderate nesting load."""
    from mmcache.sources.readers import MAX_JSON_DEPTH

    caption = "[{" * 2000 + ' \\" ' + "]}" * 2000
    ok = {"id": "a", "image_path": "a.jpg", "caption": caption}
    nested = json.dumps({**ok, "id": "b", "x": [[[[{"y": [1]}]]]]})
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(ok) + "\n" + nested + "\n", encoding="utf-8")
    records = read_manifest(path)
    assert len(records) == 2 and records.text(0) == caption
    deep = '{"id": "c", "x": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1) + "}"
    path.write_text(json.dumps(ok) + "\n" + deep + "\n", encoding="utf-8")
    with pytest.raises(ManifestError, match="nested too deeply") as info:
        read_manifest(path)
    assert str(info.value).startswith(f"{path}:2: ")
