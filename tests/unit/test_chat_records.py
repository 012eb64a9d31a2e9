"""Chat records: LLaVA conversations and the messages form, several images, text-only
records, the structured conversation beside the flattened text, placeholder checks."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from chat_support import make_tokenizer, turns, write_image, write_llava

from mmcache import ChatSpec, ImageSpec, Pipeline, TextSpec, keys, read_manifest
from mmcache.errors import ManifestError
from mmcache.sources import FileSource, identity
from mmcache.sources.readers import llava_text

pytest.importorskip("jinja2")


def chat_pipeline() -> Pipeline:
    tok = make_tokenizer()
    return Pipeline(image=ImageSpec(size=32), text=ChatSpec(tok, "chatml", 512, image_tokens=4))


def test_llava_multi_image_and_text_only_records(tmp_path: Path) -> None:
    conv = turns(("human", "<image>\nFirst <image> second?"), ("gpt", "Both cats."))
    path = write_llava(
        tmp_path / "m.json",
        [
            {"id": "multi", "image": ["img/a.jpg", "img/b.jpg"], "conversations": conv},
            {"id": "one", "image": "img/a.jpg", "conversations": conv[:1] + conv[1:]},
            {"id": "text", "conversations": turns(("human", "Hi"), ("gpt", "Hello."))},
            {"id": "sys", "conversations": turns(("system", "Be brief."), ("human", "x"))},
        ],
    )
    records = read_manifest(path)
    assert records.has_chats
    assert records.image_count(0) == 2 and records.image_count(1) == 1
    assert records.image_count(2) == 0 and records.image_paths(2) == []
    assert records.image_paths(0) == [str(tmp_path / "img/a.jpg"), str(tmp_path / "img/b.jpg")]
    assert records.image_path(0) == str(tmp_path / "img/a.jpg")  # the first one
    # roles normalised for chat templates, placeholders kept
    assert records.chat(0) == [
        ("user", "<image>\nFirst <image> second?"),
        ("assistant", "Both cats."),
    ]
    assert records.chat(3) == [("system", "Be brief."), ("user", "x")]
    # the flattened text of the plain pipelines is what it always was
    assert records.text(0) == llava_text(conv) == "human: First  second?\ngpt: Both cats."
    assert records.placeholder_counts("<image>").tolist() == [2, 2, 0, 0]
    assert records.image_counts().tolist() == [2, 1, 0, 0]
    assert records.placeholder_counts('"a"').tolist() == [0, 0, 0, 0]
    # pickles with its conversations; select keeps them
    again = pickle.loads(pickle.dumps(records))
    assert again.chat(0) == records.chat(0) and again.image_paths(0) == records.image_paths(0)
    sub = records.select([2, 0], [])
    assert [sub.id(0), sub.id(1)] == ["text", "multi"] and sub.chat(1) == records.chat(0)
    assert sub.image_count(1) == 2 and sub.line(1) == 1


def test_messages_form_in_json_and_jsonl(tmp_path: Path) -> None:
    record = {
        "id": "m1",
        "messages": [
            {"role": "user", "content": "<image>Describe."},
            {"role": "assistant", "content": "A dog."},
        ],
        "images": ["a.jpg"],
    }
    parts = {
        "id": "m2",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        ],
        "images": ["b.jpg"],
    }
    as_json = read_manifest(write_llava(tmp_path / "m.json", [record, parts]))
    jsonl = tmp_path / "m.jsonl"
    caption = {"id": "c", "image_path": "c.jpg", "caption": "a caption"}
    jsonl.write_text("\n".join(json.dumps(r) for r in (record, parts, caption)) + "\n")
    as_jsonl = read_manifest(jsonl)
    for records in (as_json, as_jsonl):
        assert records.chat(0) == [("user", "<image>Describe."), ("assistant", "A dog.")]
        assert records.chat(1) == [("user", "<image>What?"), ("assistant", "A cat.")]
        assert records.image_count(0) == 1 and records.image_paths(1) == [str(tmp_path / "b.jpg")]
        assert records.text(0) == "user: Describe.\nassistant: A dog."
    assert as_jsonl.chat(2) is None and as_jsonl.text(2) == "a caption"
    assert [as_jsonl.line(i) for i in range(3)] == [1, 2, 3]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"id": "x", "messages": []}, "'messages' is empty"),
        ({"id": "x", "messages": [{"content": "a"}]}, "messages[0]: missing key 'role'"),
        (
            {"id": "x", "messages": [{"role": "user", "content": 3}]},
            "messages[0]: 'content' must be a string or a list",
        ),
        ({"id": "x", "images": [1], "messages": [{"role": "user", "content": "a"}]}, "'images[0]'"),
    ],
)
def test_bad_messages_records(tmp_path: Path, record: dict[str, object], reason: str) -> None:
    path = tmp_path / "m.jsonl"
    good = {"id": "g", "messages": [{"role": "user", "content": "hi"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ManifestError, match=reason.replace("[", r"\[")) as info:
        read_manifest(path)
    assert info.value.line == 2 and info.value.sample_id == "x"
    records = read_manifest(path, on_error="skip")
    assert len(records) == 1 and records.rejects[0].line == 2


def test_plain_pipeline_keys_are_unchanged_for_llava_records(tmp_path: Path) -> None:
    write_image(tmp_path / "img/a.jpg", (40, 30))
    conv = turns(("human", "<image>\nWhat?"), ("gpt", "A cat."))
    path = write_llava(
        tmp_path / "m.json", [{"id": "a", "image": "img/a.jpg", "conversations": conv}]
    )
    pipe = Pipeline(image=ImageSpec(size=16), text=TextSpec(make_tokenizer(), max_length=8))
    source = FileSource(path, pipeline=pipe)
    stamp = identity.file_identity(str(tmp_path / "img/a.jpg"))  # the identity of its bytes
    assert source.key(0) == keys.sample_key(
        "a", stamp, pipe.fingerprint(), "human: What?\ngpt: A cat."
    )
    assert source.key_rows([0])[0].tobytes() == source.key(0)
    assert set(source.produce(0)) == {"image", "input_ids", "attention_mask"}


def test_placeholder_mismatch_is_a_manifest_error_naming_file_line_and_id(tmp_path: Path) -> None:
    conv = turns(("human", "<image>\nWhat?"), ("gpt", "A cat."))
    records = [
        {"id": "ok", "image": "a.jpg", "conversations": conv},
        {
            "id": "two-for-one",
            "image": "a.jpg",
            "conversations": turns(("human", "<image><image>"), ("gpt", "x")),
        },
        {
            "id": "none-for-one",
            "image": ["a.jpg", "b.jpg"],
            "conversations": turns(("human", "<image>"), ("gpt", "y")),
        },
    ]
    path = write_llava(tmp_path / "m.json", records)
    with pytest.raises(ManifestError, match="2 '<image>' placeholders for 1 images") as info:
        FileSource(path, pipeline=chat_pipeline())
    assert info.value.path == str(path) and info.value.line == 2
    assert info.value.sample_id == "two-for-one"
    source = FileSource(path, pipeline=chat_pipeline(), on_error="skip")
    assert len(source) == 1 and source.sample_id(0) == "ok"
    rejected = {r.sample_id: r.reason for r in source.rejects()}
    assert rejected == {
        "two-for-one": "2 '<image>' placeholders for 1 images",
        "none-for-one": "1 '<image>' placeholders for 2 images",
    }
    # the plain pipelines read the same manifest as before (no placeholder rule there)
    plain = Pipeline(text=TextSpec(make_tokenizer(), max_length=8))
    assert len(FileSource(path, pipeline=plain)) == 3


def test_image_root_is_llavas_image_folder(tmp_path: Path) -> None:
    conv = turns(("human", "<image>\nWhat?"), ("gpt", "A cat."))
    path = write_llava(
        tmp_path / "m.json", [{"id": "a", "image": "coco/x.jpg", "conversations": conv}]
    )
    records = read_manifest(path, image_root=tmp_path / "data")
    assert records.image_paths(0) == [str(tmp_path / "data/coco/x.jpg")]
    assert read_manifest(path).image_path(0) == str(tmp_path / "coco/x.jpg")
