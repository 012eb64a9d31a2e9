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


CHAT_PIPELINE = """
import mmcache as mc


def sft():
    text = mc.ChatSpec({tokenizer!r}, "vicuna_v1", max_length=512, image_token_id=-200)
    return mc.Pipeline(image=mc.ImageSpec(size=32), text=text)
"""


@pytest.fixture
def chat_file(data: Path) -> Path:
    """The SFT recipe's LLaVA file (docs/recipes/sft.md) whose first record is text-only."""
    records = []
    for i, line in enumerate((data / "manifest.jsonl").read_text().splitlines()[:6]):
        r = json.loads(line)
        chat = [
            {"from": "human", "value": "<image>\nWhat is in the picture?"},
            {"from": "gpt", "value": r["caption"]},
        ]
        if i == 0:
            chat[0]["value"] = "Say something."
            records.append({"id": f"t{i}", "conversations": chat})
        else:
            records.append({"id": r["id"], "image": r["image_path"], "conversations": chat})
    path = data / "llava.json"
    path.write_text(json.dumps(records))
    return path


def test_a_chat_file_whose_first_record_is_text_only_gets_the_sft_advice(
    chat_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 12 of issue 37: inspect looked at record 0 only and advised
    Pipeline(image=None) for a chat file with images. It looks further, counts the
    records, and says what the SFT recipe says: a ChatSpec, with an image stage."""
    code, out, err = _inspect(capsys, str(chat_file), "--size", "32")
    assert code == 0, err
    assert "records: 5 with images, 1 text-only, conversations" in out
    assert "refused: 1 samples before it" in out and "index 0, id 't0'" in out
    assert "first sample: index 1, id '000001'" in out and "[3, 32, 32]" in out
    (advice,) = [line for line in out.splitlines() if line.startswith("advice: ")]
    assert "ChatSpec" in advice and "image=mc.ImageSpec(" in advice, advice
    assert "image=None" not in advice and "docs/recipes/sft.md" in advice

    code, out, _ = _inspect(capsys, str(chat_file), "--size", "32", "--json")
    report = json.loads(out)
    assert report["records"] == {
        "records": 6,
        "with_images": 5,
        "text_only": 1,
        "chat": True,
        "video": False,
    }
    assert report["refused"]["count"] == 1 and report["first"]["index"] == 1
    assert len(report["advice"]) == 1


def test_a_chat_file_with_a_chat_pipeline_needs_no_advice(
    chat_file: Path, tokenizer_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = tmp_path / "train_sft.py"
    module.write_text(CHAT_PIPELINE.format(tokenizer=str(tokenizer_json)))
    code, out, err = _inspect(capsys, str(chat_file), "--pipeline", f"{module}:sft", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["advice"] == [] and report["refused"]["count"] == 0
    assert report["first"]["id"] == "t0"  # the text-only record is a text-only sample
    assert "image" not in report["first"]["fields"] and "labels" in report["first"]["fields"]


def test_a_file_none_of_whose_first_samples_can_be_made_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = tmp_path / "gone.jsonl"
    manifest.write_text(
        "".join(
            json.dumps({"id": f"s{i}", "image_path": f"gone{i}.jpg", "caption": "c"}) + "\n"
            for i in range(3)
        )
    )
    code, out, err = _inspect(capsys, str(manifest), "--size", "32")
    assert code == 2 and out == ""
    assert "none of the first 3 samples can be made" in err and "'s0'" in err
    assert len(err.strip().splitlines()) == 1
