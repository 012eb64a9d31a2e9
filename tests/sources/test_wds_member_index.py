"""WebDataset member indexes as binary arrays (issue 41): the fast header walk gives what
tarfile gives on every shard it takes and leaves every other to tarfile; the two ways of
grouping members give the answer of the JSON-index code they replace; a damaged member
index file is refused, naming it, and rebuilt; ``.json`` members that are too deep or
hold numbers too large for int64 leave the sample's size unknown instead of failing the
open; duplicate ids are found without a Python object per sample."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import struct
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.sources.ids import IdColumn
from mmcache.sources.wds import WebDatasetSource, headers, tablefile
from mmcache.sources.wds import index as index_mod
from mmcache.sources.wds.grouping import group, split_name
from mmcache.sources.wds.home import sweep_indexes
from mmcache.sources.wds.table import ShardTable
from mmcache.testing.hostile import tar_header, tar_member
from mmcache.transforms.pipeline import Pipeline

EXTS = (("jpg", "jpeg", "png"), ("txt", "caption"), ("json",))


# -- the fast walk against tarfile ----------------------------------------------------------


def _tar(members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT, **kw: Any) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            for k, v in kw.items():
                setattr(info, k, v)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _samples(
    n: int, *, key: Callable[[int], str] = lambda i: f"{i:06d}"
) -> list[tuple[str, bytes]]:
    out = []
    for i in range(n):
        out += [
            (f"{key(i)}.jpg", bytes([i % 251]) * (100 + 37 * i)),
            (f"{key(i)}.json", json.dumps({"width": i, "height": 2 * i}).encode()),
            (f"{key(i)}.txt", f"caption {i}".encode()),
        ]
    return out


def _with_dir_and_link() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("a.jpg"), io.BytesIO(b""))
        folder = tarfile.TarInfo("dir")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        link = tarfile.TarInfo("b.jpg")
        link.type = tarfile.SYMTYPE
        link.linkname = "a.jpg"
        tar.addfile(link)
    return buf.getvalue()


def _spaced_numbers() -> bytes:
    """A member whose numbers are padded with spaces (as some writers do): plain octal
    still, but not the usual field; then one whose checksum is the signed sum."""
    head = bytearray(tar_header("000001.txt", 5))
    head[124:136] = b"         5 \0"
    head[148:156] = b" " * 8
    head[148:156] = b"%06o\0 " % sum(head)
    signed = bytearray(tar_header("000002.txt", 3))
    signed[300] = 200  # a byte over 127 in an unused field: the signed sum differs
    signed[148:156] = b" " * 8
    total = sum(signed) - 256 * sum(1 for b in signed if b >= 128)
    signed[148:156] = b"%06o\0 " % total
    return bytes(head) + b"hello" + b"\0" * 507 + bytes(signed) + b"abc" + b"\0" * 509


def _bad_checksum(data: bytes, *, at: int) -> bytes:
    """``data`` with the checksum of the header at byte ``at`` off by one."""
    out = bytearray(data)
    digit = at + 153  # the last of its six digits
    out[digit] = ord("1") if out[digit] != ord("1") else ord("2")
    return bytes(out)


SHARDS: dict[str, tuple[Callable[[], bytes], bool]] = {
    # name: (bytes, whether the fast walk takes it)
    "ustar": (lambda: _tar(_samples(40)), True),
    "gnu": (lambda: _tar(_samples(40), tarfile.GNU_FORMAT), True),
    "pax, simple names (plain ustar headers)": (
        lambda: _tar(_samples(5), tarfile.PAX_FORMAT),
        True,
    ),
    "pax headers": (lambda: _tar(_samples(3, key=lambda i: f"é{i}"), tarfile.PAX_FORMAT), False),
    "members past the window": (
        lambda: _tar([(f"{i}.jpg", b"x" * (700_000 + i)) for i in range(4)] + _samples(3)),
        True,
    ),
    "ustar prefix (a long name)": (
        lambda: _tar(_samples(3, key=lambda i: "d" * 120 + f"/{i}")),
        True,
    ),
    "gnu long name": (
        lambda: _tar(_samples(3, key=lambda i: "d" * 120 + f"/{i}"), tarfile.GNU_FORMAT),
        False,
    ),
    "a name of exactly 100 bytes": (
        lambda: _tar([("n" * 96 + ".jpg", b"1"), ("k.txt", b"2")]),
        True,
    ),
    "upper case and dotted names": (
        lambda: _tar([("K.JPG", b"1"), ("K.Txt", b"2"), (".hidden.jpg", b"3"), ("a.b.c", b"4")]),
        True,
    ),
    "names not ASCII": (lambda: _tar(_samples(3, key=lambda i: f"é日本{i}")), True),
    "a name with a newline": (lambda: _tar([("a\nb.jpg", b"1"), ("x.jpg\n", b"2")]), True),
    "empty members": (lambda: _tar([("a.jpg", b""), ("a.txt", b"")]), True),
    "a directory and a link": (_with_dir_and_link, False),
    "numbers padded with spaces, a signed checksum": (
        lambda: _spaced_numbers() + b"\0" * 1024,
        True,
    ),
    "no end-of-archive blocks": (
        lambda: b"".join(tar_member(n, d) for n, d in _samples(2)),
        True,
    ),
    "last member cut": (lambda: b"".join(tar_member(n, d) for n, d in _samples(2))[:-700], False),
    "last padding cut": (lambda: b"".join(tar_member(n, d) for n, d in _samples(1))[:-3], False),
    "a header cut": (
        lambda: b"".join(tar_member(n, d) for n, d in _samples(1)) + b"\1" * 100,
        False,
    ),
    "a bad checksum in the middle": (lambda: _bad_checksum(_tar(_samples(2)), at=1024), False),
    "garbage after the end": (lambda: _tar(_samples(2)) + os.urandom(3000), True),
    "all zero": (lambda: b"\0" * 10240, False),
    "empty": (lambda: b"", False),
    "not a tar": (lambda: b"PK\3\4" + b"x" * 2000, False),
}


def _scan(data: bytes, *, fast: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    if not fast:
        monkeypatch.setattr(index_mod, "quick_walk", lambda *a, **k: None)
    try:
        return index_mod.scan(
            io.BytesIO(data), location="s.tar", stamp="1", size=len(data), json_exts=("json",)
        )
    except Exception as exc:
        return (type(exc), str(exc))
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("case", sorted(SHARDS))
def test_fast_header_walk_gives_what_tarfile_gives(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, taken = SHARDS[case]
    data = make()
    walked = headers.quick_walk(
        io.BytesIO(data), size=len(data), suffixes=(".json",), limit=1 << 20
    )
    assert (walked is not None) == taken, "the fast walk takes exactly the clean shards"
    assert _scan(data, fast=True, monkeypatch=monkeypatch) == _scan(
        data, fast=False, monkeypatch=monkeypatch
    )


def test_fast_header_walk_reads_windows_not_members(tmp_path: Path) -> None:
    """A shard of large members is read near its headers only (a small window after each
    large member), so the first open reads a small part of the data."""
    members = [(f"{i:04d}.jpg", b"\xff" * 3_000_000) for i in range(6)]
    data = _tar(members)
    reads: list[int] = []

    class Counting(io.BytesIO):
        def read(self, n: int | None = -1) -> bytes:
            out = super().read(n)
            reads.append(len(out))
            return out

    walked = headers.quick_walk(Counting(data), size=len(data), suffixes=(".json",), limit=1 << 20)
    assert walked is not None and walked.names == [m[0] for m in members]
    assert sum(reads) < len(data) / 10, reads


# -- grouping against the code it replaces --------------------------------------------------


def _reference(names: list[str], exts: tuple[tuple[str, ...], ...]) -> tuple[Any, ...]:
    """The grouping of the JSON-index code (``SampleTable.group`` and ``add_shard``)."""
    groups: dict[str, dict[str, tuple[str, int]]] = {}
    seen: set[str] = set()
    repeated: dict[str, str] = {}
    roles = zip("itj", exts, strict=True)
    ranks = {role: {e: r for r, e in enumerate(listed)} for role, listed in roles}
    best: dict[tuple[str, str], int] = {}
    for i, name in enumerate(names):
        split = split_name(name)
        if split is None:
            continue
        key, ext = split
        role = next((r for r, listed in ranks.items() if ext in listed), None)
        if role is None:
            continue
        if name in seen:
            repeated.setdefault(key, name)
            continue
        seen.add(name)
        members = groups.setdefault(key, {})
        rank = ranks[role][ext]
        if (key, role) not in best or rank < best[(key, role)]:
            best[(key, role)] = rank
            members[role] = (name, i)
    for key in repeated:
        groups.pop(key, None)
    rows = []
    for key, members in groups.items():
        row = [key]
        for role, listed in zip("itj", exts, strict=True):
            m = members.get(role)
            row += [m[1], listed.index(split_name(m[0])[1])] if m else [-1, -1]  # type: ignore[index]
        row.append("itj".index(next(iter(members))))
        rows.append(tuple(row))
    return tuple(rows), tuple(repeated.items())


def _grouped(names: list[str], exts: Any) -> tuple[Any, ...]:
    g = group(names, exts)
    ids = IdColumn(len(g.first_role), g.id_buf, g.id_off)
    rows = []
    for i in range(len(g.first_role)):
        row: list[Any] = [ids.id(i)]
        for role in range(3):
            row += [int(g.best[i, role]), int(g.number[i, role])]
        row.append(int(g.first_role[i]))
        rows.append(tuple(row))
    return tuple(rows), g.repeated


@pytest.mark.parametrize("seed", range(40))
def test_grouping_is_the_json_index_codes(seed: int) -> None:
    rng = random.Random(seed)
    exts = (("jpg", "jpeg", "png", "jpg"), ("txt", "caption"), ("json", "jpeg"))
    parts = ["a", "b", "dir/c", "d.e/f", "É", "x\ny", ".h", ""]
    suffixes = ["jpg", "JPG", "jpeg", "png", "txt", "caption", "json", "gif", "tar.gz", ""]
    names = []
    for _ in range(rng.randint(0, 40)):
        name = rng.choice(parts) + str(rng.randint(0, 5))
        if rng.random() < 0.9:
            name += "." + rng.choice(suffixes)
        names.append(name)
    if seed % 2:  # every name different, no newline: the usual shard's way
        names = [n for n in dict.fromkeys(names) if "\n" not in n]
    assert _grouped(names, exts) == _reference(names, exts)


# -- the member index file ------------------------------------------------------------------


def _damage_rows(data: bytearray, column: int, value: int) -> None:
    meta_len = struct.unpack_from("<8sIIQQ", data)[2]
    start = 32 + meta_len + (-(32 + meta_len) % 8)
    struct.pack_into("<q", data, start + 8 * column, value)


def _damage_header(data: bytearray, field: int, value: int) -> None:
    fmt = "<8sIIQQ"
    parts = list(struct.unpack_from(fmt, data))
    parts[field] = value
    struct.pack_into(fmt, data, 0, *parts)


def _damage_keys(data: bytearray) -> None:
    data[-1] = 0xFF  # the last key's last byte: not UTF-8 anymore


DAMAGES: dict[str, tuple[Callable[[bytearray], Any], str]] = {
    "cut short": (lambda d: d.__delitem__(slice(len(d) - 9, None)), "but the file has"),
    "not one": (lambda d: d.__setitem__(slice(0, 8), b"NOTMINE!"), "not a member index"),
    "a header claiming 2^60 samples": (lambda d: _damage_header(d, 3, 1 << 60), "samples"),
    "an image past the shard's end": (lambda d: _damage_rows(d, 0, 1 << 40), "not inside"),
    "an extension number outside the list": (lambda d: _damage_rows(d, 4, 99), "extension"),
    "a key that is not UTF-8": (_damage_keys, "not UTF-8"),
    "a first member of no role": (lambda d: _damage_rows(d, 8, 7), "first member"),
}


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_damaged_member_index_is_refused_naming_it_and_rebuilt(
    case: str, tmp_path: Path, small_pipeline: Pipeline, caplog: pytest.LogCaptureFixture
) -> None:
    shard = tmp_path / "s.tar"
    members = _samples(3)
    members[1] = ("000000.json", b"{}")  # the first sample's json, no width: -1 -1
    shard.write_bytes(_tar([m for m in members if m[0] != "000001.json"]))
    kw: dict[str, Any] = {"pipeline": small_pipeline, "index_dir": tmp_path / "idx"}
    src = WebDatasetSource(shard, **kw)
    (path,) = (tmp_path / "idx").glob("*" + tablefile.SUFFIX)
    data = bytearray(path.read_bytes())
    damage, reason = DAMAGES[case]
    damage(data)
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        again = WebDatasetSource(shard, **kw)
    said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0] and reason in said[0], said
    np.testing.assert_array_equal(again.key_rows(range(3)), src.key_rows(range(3)))
    np.testing.assert_array_equal(again.image_sizes(range(3)), src.image_sizes(range(3)))
    exts = (src.image_exts, src.text_exts, src.json_exts)
    stamp = src.shard_stamps[0]
    assert tablefile.read(str(path), location=str(shard), stamp=stamp, exts=exts) is not None


def test_table_file_round_trips_every_column(tmp_path: Path) -> None:
    data = _tar([*_samples(7), ("000003.jpg", b"again")])  # a repeated member
    index = index_mod.scan(
        io.BytesIO(data), location="s", stamp="1", size=len(data), json_exts=("json",)
    )
    table = ShardTable.group(index, EXTS)
    assert table.repeated == (("000003", "000003.jpg"),) and len(table) == 6
    path = str(tmp_path / ("t" + tablefile.SUFFIX))
    tablefile.write(path, table)
    back = tablefile.read(path, location="s", stamp="1", exts=EXTS)
    assert back is not None
    np.testing.assert_array_equal(back.rows, table.rows)
    np.testing.assert_array_equal(back.id_buf, table.id_buf)
    np.testing.assert_array_equal(back.id_off, table.id_off)
    assert (back.repeated, back.members, back.truncated) == (table.repeated, 22, False)
    # another version of the shard, or other extensions: not this file's table (quietly)
    assert tablefile.read(path, location="s", stamp="2", exts=EXTS) is None
    assert tablefile.read(path, location="s", stamp="1", exts=(("png",), (), ())) is None
    assert tablefile.location_of(path) == "s"


def test_gc_removes_json_member_indexes_of_the_earlier_version(tmp_path: Path) -> None:
    old = tmp_path / "0123.json"
    old.write_text(json.dumps({"format": "mmcache.wds-index", "version": 1, "location": "x"}))
    other = tmp_path / "notes.json"
    other.write_text("{}")
    assert sweep_indexes(str(tmp_path)) == [str(old)]
    assert other.exists()


# -- hostile .json members ------------------------------------------------------------------


@pytest.mark.parametrize(
    "meta",
    [
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the recursion limit
        b'{"width": 100000000000000000000000, "height": 1}',  # not an int64
        b'{"width": 1, "height": -100000000000000000000000}',
    ],
    ids=["too deep", "width too large", "height too small"],
)
def test_json_member_too_deep_or_too_large_leaves_the_size_unknown(
    meta: bytes, tmp_path: Path, small_pipeline: Pipeline
) -> None:
    shard = tmp_path / "s.tar"
    shard.write_bytes(_tar([("k.jpg", b"1"), ("k.json", meta), ("k.txt", b"a caption")]))
    src = WebDatasetSource(shard, pipeline=small_pipeline, index_dir=False)
    assert src.image_sizes([0]).tolist() == [[-1, -1]]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"width": 3, "height": 4}',
        b'{"width": 3, "height": 4}  \n\t',
        b'{"width": 3} x',
        b'{"width": 3',
        b"{\0\0\0",
        '{"width": 3, "height": 4}'.encode("utf-16"),
        b'\xef\xbb\xbf{"width": 3, "height": 4}',
        b'{"a": "\xff"}',
        b'{"a": "\\ud800"}',
        b"[1, 2]",
        b"",
        b"{",
        b" {}",
        b"{}\x1c",
    ],
)
def test_fast_json_loads_is_json_loads(raw: bytes) -> None:
    def outcome(fn: Callable[[bytes], Any]) -> Any:
        try:
            return ("ok", fn(raw))
        except ValueError:  # JSONDecodeError and UnicodeDecodeError, as _all_dims catches
            return ("error",)

    assert outcome(index_mod._loads) == outcome(json.loads)


# -- duplicate ids --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(30))
def test_duplicates_are_found_as_one_by_one(seed: int) -> None:
    rng = random.Random(seed)
    values = [
        "".join(rng.choice("ab\u00e9") for _ in range(rng.randint(0, 3)))
        for _ in range(rng.randint(0, 50))
    ]
    seen: dict[str, int] = {}
    want = []
    for i, v in enumerate(values):
        first = seen.setdefault(v, i)
        if first != i:
            want.append((first, i))
    assert IdColumn.of_strings(values).duplicates() == want
