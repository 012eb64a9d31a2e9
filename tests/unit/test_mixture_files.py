"""The recipes' mixture files read as they are: InternVL's meta JSON and LLaVA-OneVision's
data YAML (every sampling strategy), on files written here; paths that do not exist and
bad values are ManifestErrors naming the file and the entry."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import mmcache as mc
from mmcache.errors import ManifestError
from mmcache.loader import DataLoader
from mmcache.synth import make_dataset

pytest.importorskip("yaml")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``images/`` of 20 synthetic JPEGs and three LLaVA-style annotation files."""
    root = tmp_path_factory.mktemp("recipe-data")
    manifest = make_dataset(root, 20, seed=3)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]

    def chat(question: str, answer: str) -> list[dict[str, str]]:
        return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]

    caps = [
        {
            "id": f"cap{i}",
            "image": r["image_path"],
            "conversations": chat("<image>\nDescribe it.", r["caption"]),
        }
        for i, r in enumerate(rows[:12])
    ]
    multi = [
        {
            "id": f"pair{i}",
            "image": [rows[i]["image_path"], rows[i + 1]["image_path"]],
            "conversations": chat("<image>\n<image>\nWhat differs?", "The colours."),
        }
        for i in range(12, 18)
    ]
    text = [{"id": f"txt{i}", "conversations": chat(f"Count to {i}.", "One.")} for i in range(8)]
    (root / "caps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in caps))
    (root / "multi.json").write_text(json.dumps(multi))
    (root / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in text))
    (root / "clips").mkdir()
    video = [{"id": "v0", "video": "a.mp4", "conversations": chat("<video>\nWhat?", "Waves.")}]
    (root / "video.json").write_text(json.dumps(video))
    return root


@pytest.fixture
def pipe(tokenizer_json: Path) -> mc.Pipeline:
    text = mc.ChatSpec(tokenizer_json, "vicuna_v1", max_length=256, image_token_id=3)
    return mc.Pipeline(image=mc.ImageSpec(size=32), text=text)


def _write(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(obj))
    return path


def _ids(part: mc.MixturePart) -> list[str]:
    source = part.source
    return list(source.ids(range(len(source))))


def _internvl(data: Path) -> dict[str, Any]:
    return {
        "captions": {
            "root": str(data),
            "annotation": "caps.jsonl",
            "repeat_time": 2,
            "length": 12,
            "data_augment": False,
            "max_dynamic_patch": 6,
        },
        "pairs": {"root": str(data), "annotation": "multi.json", "repeat_time": 0.5},
        "chat": {"root": "clips", "annotation": str(data / "text.jsonl")},
    }


def test_internvl_meta_gives_one_part_per_entry_with_its_repeat(
    data: Path, pipe: mc.Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = _write(tmp_path / "meta.json", _internvl(data))
    monkeypatch.chdir(data)  # relative paths resolve where the script runs, as InternVL's
    mix = mc.Mixture.from_internvl(meta, pipeline=pipe)
    assert mix.part_names == ("captions", "pairs", "chat")
    # repeat_time 2: repeat=2; 0.5: a fixed subset of int(6 * 0.5) = 3 records, once
    assert mix.counts == {"captions": 24, "pairs": 3, "chat": 8}
    pairs = _ids(mix.parts[1])
    assert len(pairs) == 3 and set(pairs) <= {f"pair{i}" for i in range(12, 18)}
    again = mc.Mixture.from_internvl(meta, pipeline=pipe)
    assert _ids(again.parts[1]) == pairs  # the same subset every run
    other = mc.Mixture.from_internvl(meta, pipeline=pipe, subset_seed=1)
    assert len(_ids(other.parts[1])) == 3
    # images relative to root; the whole epoch loads, every row named by its part
    loader = DataLoader(mix, cache=None, batch_size=8, seed=0)
    rows = [(p, i) for b in loader for p, i in zip(b["part"], b["id"], strict=True)]
    assert len(rows) == len(mix) == 35
    assert {i for p, i in rows if p == "pairs"} == set(pairs)
    assert mix.parts[0].source.records.image_path(0) == str(data / "images" / "000000.jpg")


def test_internvl_paths_resolve_against_base_dir(
    data: Path, pipe: mc.Pipeline, tmp_path: Path
) -> None:
    meta = _write(tmp_path / "meta.json", _internvl(data))
    mix = mc.Mixture.from_internvl(meta, pipeline=pipe, base_dir=data)
    assert len(mix) == 35


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"annotation": "gone.jsonl"}, "entry 'pairs': annotation file '.*gone.jsonl' does not"),
        ({"root": "nowhere"}, "entry 'pairs': root folder '.*nowhere' does not exist"),
        ({"repeat_time": "2"}, "entry 'pairs': repeat_time must be a number > 0, got '2'"),
        ({"repeat_time": 0}, "entry 'pairs': repeat_time must be a number > 0"),
        ({"annotation": None}, "entry 'pairs' needs 'annotation'"),
    ],
)
def test_internvl_errors_name_the_file_and_the_entry(
    data: Path, pipe: mc.Pipeline, tmp_path: Path, change: dict[str, Any], words: str
) -> None:
    meta = _internvl(data)
    meta["pairs"].update(change)
    path = _write(tmp_path / "meta.json", meta)
    with pytest.raises(ManifestError, match=words) as err:
        mc.Mixture.from_internvl(path, pipeline=pipe, base_dir=data)
    assert err.value.path == str(path)


def test_internvl_files_that_are_not_meta_files(pipe: mc.Pipeline, tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="file not found"):
        mc.Mixture.from_internvl(tmp_path / "none.json", pipeline=pipe)
    with pytest.raises(ManifestError, match="a JSON object of datasets"):
        mc.Mixture.from_internvl(_write(tmp_path / "m.json", [1]), pipeline=pipe)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ManifestError, match="malformed JSON"):
        mc.Mixture.from_internvl(tmp_path / "bad.json", pipeline=pipe)


def _yaml(path: Path, entries: list[dict[str, Any]]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({"datasets": entries}))
    return path


def test_onevision_yaml_every_sampling_strategy(
    data: Path, pipe: mc.Pipeline, tmp_path: Path
) -> None:
    path = _yaml(
        tmp_path / "ov.yaml",
        [
            {"json_path": "caps.jsonl", "sampling_strategy": "all"},
            {"json_path": "caps.jsonl", "sampling_strategy": "first:5"},
            {"json_path": "multi.json", "sampling_strategy": "end:50%"},
            {"json_path": "caps.jsonl", "sampling_strategy": "random:25%"},
            {"json_path": "text.jsonl", "sampling_strategy": "random:3"},
            {"json_path": "text.jsonl", "sampling_strategy": "first:100"},
            {"json_path": "multi.json"},
        ],
    )
    mix = mc.Mixture.from_llava_onevision(path, image_folder=data, pipeline=pipe, base_dir=data)
    assert mix.part_names == ("caps", "caps-2", "multi", "caps-3", "text", "text-2", "multi-2")
    ids = [_ids(p) for p in mix.parts]
    caps = [f"cap{i}" for i in range(12)]
    assert ids[0] == caps and ids[1] == caps[:5]
    assert ids[2] == [f"pair{i}" for i in range(15, 18)]  # ceil(50 * 6 / 100) = 3, the end
    assert len(ids[3]) == math.ceil(25 * 12 / 100) and set(ids[3]) <= set(caps)
    assert len(ids[4]) == 3 and ids[5] == [f"txt{i}" for i in range(8)]  # N > len: all
    assert len(ids[6]) == 6
    assert len(mix) == 12 + 5 + 3 + 3 + 3 + 8 + 6
    again = mc.Mixture.from_llava_onevision(path, image_folder=data, pipeline=pipe, base_dir=data)
    assert [_ids(p) for p in again.parts] == ids  # random:N is a fixed subset
    loader = DataLoader(mix, cache=None, batch_size=16, seed=0)
    assert sum(len(b["id"]) for b in loader) == len(mix)


def test_onevision_videos_resolve_against_the_video_folder(
    data: Path, pipe: mc.Pipeline, tmp_path: Path
) -> None:
    path = _yaml(tmp_path / "ov.yaml", [{"json_path": str(data / "video.json")}])
    mix = mc.Mixture.from_llava_onevision(
        path, image_folder=data, video_folder=data / "clips", pipeline=pipe
    )
    records = mix.parts[0].source.records
    assert records.videos(0)[0]["video"] == str(data / "clips" / "a.mp4")
    same = mc.Mixture.from_llava_onevision(path, image_folder=data, pipeline=pipe)
    assert same.parts[0].source.records.videos(0)[0]["video"] == str(data / "a.mp4")


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"json_path": "gone.json"}, r"entry datasets\[1\] \(gone.json\): json_path file"),
        ({"json_path": "caps.jsonl", "sampling_strategy": "sample:3"}, "sampling_strategy must"),
        ({"json_path": "caps.jsonl", "sampling_strategy": "first"}, "sampling_strategy must"),
        ({"json_path": "caps.jsonl", "sampling_strategy": "end:0"}, "keeps no sample of 12"),
        ({"json_path": "caps.jsonl", "sampling_strategy": "random:2.5%"}, "sampling_strategy"),
        ({"path": "caps.jsonl"}, r"entry datasets\[1\] needs 'json_path'"),
    ],
)
def test_onevision_errors_name_the_file_and_the_entry(
    data: Path, pipe: mc.Pipeline, tmp_path: Path, entry: dict[str, Any], words: str
) -> None:
    path = _yaml(tmp_path / "ov.yaml", [{"json_path": "text.jsonl"}, entry])
    with pytest.raises(ManifestError, match=words) as err:
        mc.Mixture.from_llava_onevision(path, image_folder=data, pipeline=pipe, base_dir=data)
    assert err.value.path == str(path)


def test_onevision_files_that_are_not_data_files(
    data: Path, pipe: mc.Pipeline, tmp_path: Path
) -> None:
    with pytest.raises(ManifestError, match=r"image_folder folder .* does not exist"):
        mc.Mixture.from_llava_onevision(
            _yaml(tmp_path / "a.yaml", [{"json_path": "caps.jsonl"}]),
            image_folder=tmp_path / "none",
            pipeline=pipe,
        )
    (tmp_path / "b.yaml").write_text("items: [1, 2]\n")
    with pytest.raises(ManifestError, match="a 'datasets' list"):
        mc.Mixture.from_llava_onevision(tmp_path / "b.yaml", image_folder=data, pipeline=pipe)
    (tmp_path / "c.yaml").write_text("datasets: [\n")
    with pytest.raises(ManifestError, match="malformed YAML"):
        mc.Mixture.from_llava_onevision(tmp_path / "c.yaml", image_folder=data, pipeline=pipe)
