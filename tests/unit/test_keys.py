"""Unit tests of mmcache.keys: stable, unambiguous content keys and source stamps."""

from __future__ import annotations

import doctest
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from mmcache import codec, keys
from mmcache.keys import (
    FORMAT_VERSION,
    digest,
    feature_key,
    key_from_hex,
    key_hex,
    sample_key,
    source_stamp,
)
from mmcache.stores.base import KEY_SIZE, check_key

ID = "coco/000000391895"
STAMP = "150528:1700000000123456789"
FP = "pipe:v1:size=224"
CAPTION = "A man riding a bike."


# ---------------------------------------------------------------- stability


def test_keys_are_pinned() -> None:
    # If one of these fails, the key scheme changed silently: every cache on
    # every machine would be cold. Change it on purpose only, with a bump of
    # FORMAT_VERSION, and then update the expected values.
    assert FORMAT_VERSION == 1
    assert key_hex(sample_key(ID, STAMP, FP, CAPTION)) == "74624a4dba6d875e59cfdb00559058a1"
    assert key_hex(sample_key(ID, "none", FP)) == "a6fca7a6dd8beb55834309af23205617"
    assert (
        key_hex(feature_key(bytes(range(16)), "clip-vit-b16:abc", "float16", "last_hidden_state"))
        == "d9e6e6490bf9ab12ea2644f03a7f264e"
    )
    assert digest("a", b"b", 3, None, -7).hex() == "1d4e6981115d87ed4332d5effde2390e"


def test_codec_version_is_covered_by_the_key_version() -> None:
    # Entries of an older codec are refused anyway (CorruptEntryError), but a
    # codec change must come with a key bump so old entries are never even looked up.
    assert (codec.VERSION, FORMAT_VERSION) == (1, 1), "bump keys.FORMAT_VERSION with codec.VERSION"


def test_keys_are_16_bytes_and_fit_the_store_contract() -> None:
    key = sample_key(ID, STAMP, FP, CAPTION)
    assert isinstance(key, bytes)
    assert len(key) == KEY_SIZE == 16
    assert check_key(key) == key
    assert check_key(feature_key(key, "enc", "float16", "pooled")) is not None


# ---------------------------------------------------------------- every input matters


def test_each_component_changes_the_sample_key() -> None:
    base = sample_key(ID, STAMP, FP, CAPTION)
    variants = [
        sample_key(ID + "x", STAMP, FP, CAPTION),
        sample_key(ID, "150528:1700000000123456790", FP, CAPTION),
        sample_key(ID, STAMP, "pipe:v1:size=256", CAPTION),
        sample_key(ID, STAMP, FP, "A man riding a bike!"),
        sample_key(ID, STAMP, FP, None),
        sample_key(ID, STAMP, FP, ""),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_each_component_changes_the_feature_key() -> None:
    sk = sample_key(ID, STAMP, FP, CAPTION)
    base = feature_key(sk, "enc@1", "float16", "pooled")
    variants = [
        feature_key(sample_key(ID, STAMP, FP, "other"), "enc@1", "float16", "pooled"),
        feature_key(sk, "enc@2", "float16", "pooled"),
        feature_key(sk, "enc@1", "bfloat16", "pooled"),
        feature_key(sk, "enc@1", "float16", "last_hidden_state"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_sample_and_feature_keys_live_in_separate_domains() -> None:
    # Same material, different kind of key: never equal.
    assert digest("mmcache.sample", 1, "x") != digest("mmcache.feature", 1, "x")
    assert sample_key("a", "b", "c", "d") != feature_key(bytes(16), "b", "c", "d")


def test_encoding_is_unambiguous() -> None:
    assert digest("ab", "c") != digest("a", "bc")
    assert digest("abc") != digest("ab", "c")
    assert digest("abc") != digest(b"abc")
    assert digest("1") != digest(1)
    assert digest(None) != digest("")
    assert digest() != digest("")
    assert digest("a", None) != digest("a")
    assert digest(-1) != digest(1)
    assert digest(2**70) != digest(2**70 + 1)
    assert sample_key("ab", "c", FP) != sample_key("a", "bc", FP)
    assert sample_key(ID, STAMP, "fp", "x") != sample_key(ID, STAMP, "fpx", "")
    # Deterministic within and across calls.
    assert digest("a", 1, b"\x00", None) == digest("a", 1, b"\x00", None)


def test_digest_refuses_bool_and_other_types() -> None:
    with pytest.raises(TypeError, match="bool"):
        digest(True)
    with pytest.raises(TypeError, match="float"):
        digest(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        digest(["a"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "sample_id",
    [
        "../../etc/passwd",
        "/abs/path/img.jpg",
        "C:\\data\\x.jpg",
        "nul\x00byte",
        "",
        "图像/🙂",
        "\ud800",
    ],
)
def test_any_id_is_just_hashed(sample_id: str) -> None:
    key = sample_key(sample_id, "none", FP, "caption\x00with nul")
    assert isinstance(key, bytes)
    assert len(key) == 16
    assert key != sample_key(sample_id + "/", "none", FP, "caption\x00with nul")


# ---------------------------------------------------------------- hex


def test_hex_round_trip_and_validation() -> None:
    key = sample_key(ID, STAMP, FP, CAPTION)
    text = key_hex(key)
    assert len(text) == 32
    assert text == text.lower()
    assert key_from_hex(text) == key
    assert key_from_hex(text.upper()) == key
    bad = [
        text[:-1],
        text + "0",
        "0x" + text[2:],
        " " + text[1:],
        text[:-1] + "g",
        text[:16] + " " + text[17:],
        text[:-1] + "\n",
        "",
        "٠" * 32,
    ]
    for s in bad:
        with pytest.raises(ValueError, match="32 hex digits"):
            key_from_hex(s)
    with pytest.raises(ValueError):
        key_from_hex(key)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        key_hex(b"short")
    with pytest.raises(ValueError):
        feature_key(b"short", "enc", "float16", "pooled")


# ---------------------------------------------------------------- source stamps


def test_stamp_of_none_and_missing_files(tmp_path: Path) -> None:
    assert source_stamp(None) == "none"
    assert source_stamp(tmp_path / "absent.jpg") == "missing"
    assert source_stamp(tmp_path / "absent.jpg", content=True) == "missing"
    assert source_stamp(str(tmp_path / "dir" / "absent.jpg")) == "missing"
    assert source_stamp("bad\x00path") == "missing"
    # A key still computes for a missing file.
    assert len(sample_key(ID, source_stamp(tmp_path / "absent.jpg"), FP)) == 16


def test_stamp_is_size_mtime_ctime_and_inode(tmp_path: Path) -> None:
    path = tmp_path / "img.jpg"
    path.write_bytes(b"0123456789")
    os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_123_456_789))
    st = os.stat(path)
    assert keys.STAT_FIELDS == ("st_size", "st_mtime_ns", "st_ctime_ns", "st_ino")
    assert source_stamp(path) == f"10:1700000000123456789:{st.st_ctime_ns}:{st.st_ino}"
    assert source_stamp(str(path)) == source_stamp(path)
    assert keys.fields_stamp(list(keys.stat_fields(st))) == source_stamp(path)


def test_batched_stamps_equal_single_ones_for_inode_numbers_over_2_63() -> None:
    # Inode numbers are unsigned 64-bit (NFS, overlayfs xino, btrfs can use the top
    # bit); an int64 array row holds them wrapped, and both paths give one stamp.
    st = os.stat_result((0o100644, 2**64 - 5, 1, 1, 0, 0, 7, 1, 2, 3, 1.0, 2.0, 3.0, 10, 20, 30))
    row = np.array([keys.stat_fields(st)], dtype=np.int64)[0]
    assert keys.fields_stamp(row.tolist()) == keys.stat_stamp(st) == "7:20:30:-5"


def test_different_files_of_equal_size_and_mtime_have_different_stamps(tmp_path: Path) -> None:
    # Fixed-size formats (BMP, .npy) extracted with `tar x` (mtimes restored).
    a, b = tmp_path / "a.bmp", tmp_path / "b.bmp"
    a.write_bytes(b"a" * 64)
    b.write_bytes(b"b" * 64)
    for p in (a, b):
        os.utime(p, ns=(1_000_000_000, 1_000_000_000))
    assert source_stamp(a) != source_stamp(b)
    assert sample_key(ID, source_stamp(a), FP, CAPTION) != sample_key(
        ID, source_stamp(b), FP, CAPTION
    )


def test_touching_or_rewriting_a_file_changes_its_stamp(tmp_path: Path) -> None:
    path = tmp_path / "img.jpg"
    path.write_bytes(b"aaaa")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    first = source_stamp(path)
    assert source_stamp(path) == first  # stable while nothing changes

    os.utime(path, ns=(1_000_000_000, 1_000_000_001))  # touch: new mtime only
    touched = source_stamp(path)
    assert touched != first

    path.write_bytes(b"bbbb")  # same size, other bytes, same mtime restored (touch -d)
    os.utime(path, ns=(1_000_000_000, 1_000_000_001))
    rewritten = source_stamp(path)
    assert rewritten != touched  # the ctime cannot be restored
    replaced = tmp_path / "new.jpg"  # the same, written elsewhere and renamed over it
    replaced.write_bytes(b"cccc")
    os.utime(replaced, ns=(1_000_000_000, 1_000_000_001))
    os.replace(replaced, path)
    assert source_stamp(path) not in (touched, rewritten)
    path.write_bytes(b"bbbbb")  # other size
    os.utime(path, ns=(1_000_000_000, 1_000_000_001))
    assert source_stamp(path) != touched


def test_content_stamp_changes_only_when_bytes_change(tmp_path: Path) -> None:
    path = tmp_path / "img.jpg"
    path.write_bytes(b"x" * (3 << 20))  # several read chunks
    first = source_stamp(path, content=True)
    assert first.startswith("xxh3:")
    assert len(first) == len("xxh3:") + 32

    os.utime(path, ns=(5, 5))  # touch: same bytes
    assert source_stamp(path, content=True) == first

    data = bytearray(path.read_bytes())
    data[-1] = ord("y")  # same size, one byte differs, in the last chunk
    path.write_bytes(bytes(data))
    os.utime(path, ns=(5, 5))
    assert source_stamp(path, content=True) != first

    copy = tmp_path / "copy.jpg"  # same bytes elsewhere: same stamp
    copy.write_bytes(bytes(data))
    assert source_stamp(copy, content=True) == source_stamp(path, content=True)


def test_stamp_follows_symlinks(tmp_path: Path) -> None:
    target = tmp_path / "real.jpg"
    target.write_bytes(b"abc")
    link = tmp_path / "link.jpg"
    try:
        link.symlink_to(target)
    except OSError:
        pytest.skip("symlinks not available")
    assert source_stamp(link) == source_stamp(target)
    assert source_stamp(link, content=True) == source_stamp(target, content=True)
    target.unlink()
    assert source_stamp(link) == "missing"  # dangling link


def test_stamp_reports_other_errors_without_raising(tmp_path: Path) -> None:
    assert source_stamp(tmp_path, content=True) == "error:EISDIR"
    if sys.platform != "win32" and os.geteuid() != 0:
        secret = tmp_path / "secret.jpg"
        secret.write_bytes(b"abc")
        secret.chmod(0)
        try:
            assert source_stamp(secret, content=True) == "error:EACCES"
            assert source_stamp(secret) != "missing"  # stat still works
        finally:
            secret.chmod(0o600)


def test_docstring_examples_run() -> None:
    result = doctest.testmod(keys)
    assert result.attempted > 0
    assert result.failed == 0
