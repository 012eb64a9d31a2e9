"""`mmcache inspect PATH`: the format, the sample count and the first sample's fields,
shapes, dtypes and key, and nothing written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import mmcache as mc
from mmcache.cli import main
from mmcache.sources.wds.write import write_shards


def _tree(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``roots`` with its size and mtime (what a write would change)."""
    out = {}
    for root in roots:
        for folder, _dirs, files in os.walk(root):
            for name in files:
                st = os.stat(os.path.join(folder, name))
                out[os.path.join(folder, name)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def data(tmp_path: Path, tiny_data: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the tiny dataset (a manifest and its images) and shards of it, with the
    user cache folder (where shard indexes go by default) inside ``tmp_path``."""
    folder = tmp_path / "data"
    shutil.copytree(tiny_data.parent, folder)
    write_shards(folder / "manifest.jsonl", folder / "shards", per_shard=16)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return folder


def _inspect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_manifest_prints_format_count_and_the_first_samples_fields_and_key(
    data: Path, tokenizer_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tree(tmp_path)
    manifest = str(data / "manifest.jsonl")
    code, out, _ = _inspect(capsys, manifest, "--size", "32", "--tokenizer", str(tokenizer_json))
    assert code == 0
    assert f"path:    {manifest}" in out
    assert "format:  jsonl" in out and "samples: 48" in out
    assert "first sample: index 0, id '000000'" in out
    assert "image" in out and "uint8" in out and "[3, 32, 32]" in out
    assert "input_ids" in out and "int32" in out and "[32]" in out
    pipe = mc.Pipeline(image=mc.ImageSpec(size=32), text=mc.TextSpec(tokenizer_json))
    assert _tree(tmp_path) == before  # nothing written (checked before this test's own key)
    key = mc.MultimodalDataset(manifest, pipeline=pipe).key(0).hex()
    assert f"key:   {key}" in out  # the key the cache would hold for this pipeline


def test_shards_are_inspected_without_writing_their_index(
    data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tree(tmp_path)
    code, out, _ = _inspect(capsys, str(data / "shards" / "*.tar"), "--size", "32", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["format"] == "wds" and report["samples"] == 48
    assert report["first"]["id"] == "000000"
    assert report["first"]["fields"]["image"] == {"dtype": "uint8", "shape": [3, 32, 32]}
    assert len(report["first"]["key"]) == 32
    assert _tree(tmp_path) == before  # no shard index under XDG_CACHE_HOME, nothing else
    assert not (tmp_path / "xdg").exists()


def test_a_given_format_is_said_to_be_given(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _inspect(capsys, str(data / "manifest.jsonl"), "--format", "jsonl")
    assert code == 0 and "format:  jsonl (given)" in out


def test_an_empty_source_is_described_as_empty() -> None:
    from mmcache.cliinspect import describe

    text = describe({"path": "p", "format": "wds", "samples": 0, "first": None})
    assert text.endswith("first sample: none (the source is empty)")


@pytest.mark.parametrize(
    ("text", "where"),
    [("", ""), ('{"id": "a", "image_path": "x.jpg", "caption": "c"}\n{"id": \n', ":2")],
    ids=["empty", "bad-line"],
)
def test_an_unreadable_manifest_is_an_error_naming_the_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, where: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    code, out, err = _inspect(capsys, str(bad), "--size", "32")
    assert code == 2 and out == ""
    assert f"mmcache inspect: error: {bad}{where}" in err
