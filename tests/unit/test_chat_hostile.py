"""Hostile inputs of the chat (SFT) path (issue 23 items 9 and 14): ``lengths()`` and
``text_report()`` on a FIFO and a decompression-bomb header; chat templates that fail
in any way; a user turn holding the label finder's marker; the fully-masked kind."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from chat_support import make_tokenizer, turns, write_image, write_llava

from mmcache import ChatSpec, MultimodalDataset, Pipeline, SmartResize
from mmcache.errors import ConfigError, SampleError
from mmcache.sources.base import OnError
from mmcache.testing.hostile import bomb_png
from mmcache.transforms.chat import Chat, FullyMaskedError

pytest.importorskip("jinja2")
pytestmark = pytest.mark.timeout(120)  # a FIFO must never block lengths(): fail instead


# -- lengths() on a FIFO and a bomb (item 9) ------------------------------------------------


def _chat_dataset(tmp_path: Path, image: str, on_error: OnError) -> Any:
    write_image(tmp_path / "ok.jpg", (64, 48))
    q = turns(("human", "<image>\nWhat is it?"), ("gpt", "A cat."))
    manifest = write_llava(
        tmp_path / "m.json",
        [
            {"id": "ok", "image": "ok.jpg", "conversations": q},
            {"id": "hostile", "image": image, "conversations": q},
        ],
    )
    sr = SmartResize(min_pixels=28 * 28, max_pixels=56 * 56 * 4)
    spec = ChatSpec(make_tokenizer(), "chatml", 256, image_tokens=sr.image_tokens)
    return MultimodalDataset(manifest, pipeline=Pipeline(image=sr, text=spec), on_error=on_error)


def _write_hostile(target: Path, kind: str) -> None:
    """``target`` as a FIFO (a read would block) or a PNG bomb (a huge header)."""
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.write_bytes(bomb_png())


@pytest.mark.parametrize("kind", ["fifo", "bomb"])
def test_lengths_never_block_and_a_bomb_is_the_samples_error(tmp_path: Path, kind: str) -> None:
    _write_hostile(tmp_path / "hostile.png", kind)
    with pytest.raises(SampleError) as info:
        _chat_dataset(tmp_path, "hostile.png", "raise").lengths()
    assert info.value.sample_id == "hostile"
    skip = _chat_dataset(tmp_path, "hostile.png", "skip")
    lengths = skip.lengths()
    assert lengths[0] > 0 and lengths[1] == 0
    assert skip.text_report().unreadable == 1


def _loader_kw(mode: str) -> dict[str, Any]:
    from mmcache import PackSpec
    from mmcache.loader import SFTBatching

    if mode == "group_by_length":
        return {"batch_size": 2, "batching": SFTBatching(group_by_length=True)}
    return {"batch_size": 1, "batching": SFTBatching(pack=PackSpec(max_tokens=512))}


@pytest.mark.parametrize("mode", ["group_by_length", "pack"])
@pytest.mark.parametrize("kind", ["fifo", "bomb"])
def test_grouping_and_packing_never_block_and_a_bomb_is_the_samples_error(
    tmp_path: Path, kind: str, mode: str
) -> None:
    """G10 for ``group_by_length`` and ``pack`` separately: they plan from ``lengths()``,
    so a FIFO in the manifest never blocks them (this test's timeout fails instead) and a
    bomb header is that sample's error: ``SampleError`` naming it under "raise", left out
    of every batch under "skip" (the epoch serves the other sample)."""
    from mmcache import DataLoader

    _write_hostile(tmp_path / "hostile.png", kind)
    with pytest.raises(SampleError) as info:
        DataLoader(_chat_dataset(tmp_path, "hostile.png", "raise"), cache=None, **_loader_kw(mode))
    assert info.value.sample_id == "hostile"
    skip = _chat_dataset(tmp_path, "hostile.png", "skip")
    loader = DataLoader(skip, cache=None, shuffle=False, **_loader_kw(mode))
    served = [sid for batch in loader for sid in batch["id"]]
    assert served == ["ok"]


# -- chat templates (item 14) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        "{{ 1 / 0 }}",
        "{% for i in range(10**6) %}{% endfor %}",
        "{% import 'os' as os %}",
    ],
)
def test_every_chat_template_failure_is_a_sample_error(body: str) -> None:

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}" + body
    spec = ChatSpec(make_tokenizer(), template, 64)
    with pytest.raises(SampleError) as info:
        spec.encode(Chat((("user", "hi"), ("assistant", "yo")), ()), sample_id="s7")
    assert info.value.sample_id == "s7" and "chat template" in info.value.reason
    with pytest.raises(ConfigError):
        ChatSpec(make_tokenizer(), "{% for %}", 64)


def test_user_turn_holding_the_marker_is_labelled() -> None:

    spec = ChatSpec(make_tokenizer(), "chatml", 128)
    plain = spec.encode(Chat((("user", "icon  here"), ("assistant", "A cat.")), ()))
    marked = spec.encode(Chat((("user", "icon \ue000 here"), ("assistant", "A cat.")), ()))
    trained = plain.labels[plain.labels != -100].tolist()
    assert marked.labels[marked.labels != -100].tolist() == trained and trained


def test_fully_masked_has_a_kind() -> None:

    spec = ChatSpec(make_tokenizer(), "chatml", 128)
    with pytest.raises(FullyMaskedError) as info:
        spec.encode(Chat((("user", "only a question"),), ()), sample_id="q")
    again = pickle.loads(pickle.dumps(info.value))  # a worker's error keeps its kind
    assert isinstance(again, FullyMaskedError) and again.sample_id == "q"
