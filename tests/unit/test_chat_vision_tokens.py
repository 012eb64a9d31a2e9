"""Vision tokens written as text in a record, and lone surrogates (issue 37, H7 and H11).

A record whose user turn or reply writes ``<|video_pad|>``, ``<|image_pad|>`` or
``<|vision_start|>`` would be tokenized into the vision token itself: the sample holds
more of it than its grid says (291 ``<|video_pad|>`` where ``video_grid_thw`` wants
288), Qwen2.5-VL's forward fails steps later naming no sample, and a reply trains on
it. ChatSpec refuses such a sample (``SampleError`` naming it and the token; skipped
and listed under ``on_error="skip"``), and counts every vision token against the runs
before a sample is cached. In the LLaVA-style pipeline the token is the ``<image>``
placeholder itself, which the placeholder count refuses.

A lone surrogate in ChatSpec's strings is a ConfigError naming the field; in a
record's message or a TextSpec caption, a SampleError naming the sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chat_support import make_tokenizer, turns, write_image, write_llava
from tokenizers import AddedToken, Tokenizer, normalizers

from mmcache import ChatSpec, MultimodalDataset, Pipeline, SmartResize, TextSpec, VideoSpec
from mmcache.errors import ConfigError, ManifestError, SampleError
from mmcache.sources.base import OnError
from mmcache.transforms import VideoTokens
from mmcache.transforms.chat import Chat
from mmcache.transforms.text import train_tokenizer

pytest.importorskip("jinja2")

QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<video>"]
SR = SmartResize(min_pixels=28 * 28, max_pixels=56 * 56 * 4)
SURROGATE = chr(0xD800)


def qwen_tokenizer() -> Tokenizer:
    tok = make_tokenizer()
    tok.add_special_tokens(QWEN_SPECIALS)
    return tok


def qwen_spec(template: str = "chatml", **kw: Any) -> ChatSpec:
    """Qwen2.5-VL's layout: ``<|vision_start|><|image_pad|>*n<|vision_end|>`` per image,
    the same around ``<|video_pad|>`` runs per video."""
    tok = qwen_tokenizer()
    return ChatSpec(
        tok,
        template,
        4096,
        image_token_id=tok.token_to_id("<|image_pad|>"),
        image_tokens=SR.image_tokens,
        image_prefix="<|vision_start|>",
        image_suffix="<|vision_end|>",
        video=VideoTokens(),
        **kw,
    )


def qwen_pipeline() -> Pipeline:
    return Pipeline(
        image=SR,
        text=qwen_spec(),
        video=VideoSpec(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28),
    )


# -- ChatSpec on its own -----------------------------------------------------------------


@pytest.mark.parametrize("role", ["user", "assistant"])
@pytest.mark.parametrize("token", ["<|video_pad|>", "<|image_pad|>", "<|vision_start|>"])
def test_a_vision_token_written_in_a_message_is_refused(role: str, token: str) -> None:
    spec = qwen_spec()
    ask, reply = "<video>\nWhat happens?", "A square moves."
    if role == "user":
        ask += f" {token}{token}{token}"
    else:
        reply = f"A {token} square moves."
    chat = Chat((("user", ask), ("assistant", reply)), (), ((4, 56, 56),))
    with pytest.raises(SampleError) as info:
        spec.encode(chat, sample_id="s3")
    err = info.value
    assert err.sample_id == "s3"
    k = 0 if role == "user" else 1
    assert f"message {k} ({role}) writes the vision token {token!r} as text" in err.reason
    assert ("trained on" in err.reason) == (role == "assistant")
    # the same record without the token: the counts are the grid's
    clean = spec.encode(Chat((("user", "<video>\nWhat?"), ("assistant", "A.")), (), ((4, 56, 56),)))
    pad = spec.tokenizer.token_to_id("<|video_pad|>")
    assert int(np.count_nonzero(clean.input_ids == pad)) == VideoTokens().count(4, 56, 56)
    vision = [spec.tokenizer.token_to_id(t) for t in QWEN_SPECIALS[:4]]
    assert not np.isin(clean.labels, vision).any()


def test_vision_token_counts_are_checked_before_caching() -> None:
    """A template that writes a vision token itself, seen only in the tokenized ids: the
    count check refuses it, with the count and the grid's."""
    spec = qwen_spec(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'user' %}<|vision_start|>{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}",
        end_of_turn="<|im_end|>",
    )
    chat = Chat((("user", "<image>\nWhat?"), ("assistant", "A cat.")), ((56, 56),))
    with pytest.raises(SampleError) as info:
        spec.encode(chat, sample_id="tpl")
    assert info.value.sample_id == "tpl"
    assert info.value.reason.startswith(
        "2 '<|vision_start|>' tokens where the sample's images and videos account for 1"
    )


def test_a_spelling_the_tokenizer_reads_as_the_image_token_is_counted() -> None:
    """LLaVA-style: ``<image>`` is the placeholder and its token. A tokenizer that matches
    it after lowercasing reads ``<IMAGE>`` as the image token: one more than the image's
    run, which only the count of ids can see."""
    tok = Tokenizer.from_str(make_tokenizer().to_str())
    tok.normalizer = normalizers.Lowercase()
    tok.add_tokens([AddedToken("<image>", normalized=True)])
    spec = ChatSpec(tok, "vicuna_v1", 4096, image_tokens=9)
    ok = spec.encode(Chat((("user", "<image>\nWhat?"), ("assistant", "A cat.")), ((8, 8),)))
    assert int(np.count_nonzero(ok.input_ids == spec.image_token_id)) == 9
    for chat in (
        Chat((("user", "<image>\nIs <IMAGE> a word?"), ("assistant", "A cat.")), ((8, 8),)),
        Chat((("user", "<image>\nWhat?"), ("assistant", "It says <IMAGE>.")), ((8, 8),)),
    ):
        with pytest.raises(SampleError, match=r"10 '<image>' tokens where .* account for 9"):
            spec.encode(chat, sample_id="x")


def test_llava_placeholder_written_twice_is_refused_by_its_count() -> None:
    spec = ChatSpec(make_tokenizer(), "vicuna_v1", 4096, image_tokens=9)
    for messages in (
        (("user", "<image>\nWhat is <image>?"), ("assistant", "A cat.")),
        (("user", "<image>\nWhat?"), ("assistant", "A <image> cat.")),
    ):
        with pytest.raises(SampleError, match="2 '<image>' placeholders for 1 images") as info:
            spec.encode(Chat(messages, ((8, 8),)), sample_id="l1")
        assert info.value.sample_id == "l1"


# -- through a dataset: raise and skip -------------------------------------------------------


def _qwen_records(root: Path) -> Path:
    from video_support import write_clip

    write_image(root / "a.jpg", (64, 48))
    write_clip(root / "v.mp4", frames=12, fps=6, size=(56, 56))
    ask = "<image>\nWhat is in the picture?"
    video = "<video>\nWhat happens?"
    return write_llava(
        root / "m.json",
        [
            {"id": "ok", "image": "a.jpg",
             "conversations": turns(("human", ask), ("gpt", "A cat."))},
            {"id": "user_pad", "image": "a.jpg",
             "conversations": turns(("human", ask + " <|image_pad|>"), ("gpt", "A cat."))},
            {"id": "reply_pad", "video": "v.mp4",
             "conversations": turns(("human", video), ("gpt", "It <|video_pad|> moves."))},
            {"id": "user_video_pad", "video": "v.mp4",
             "conversations": turns(("human", video + "<|video_pad|>" * 3), ("gpt", "It moves."))},
            {"id": "ok_video", "video": "v.mp4",
             "conversations": turns(("human", video), ("gpt", "It moves."))},
        ],
    )  # fmt: skip


_REFUSED = {
    "user_pad": "message 0 (user) writes the vision token '<|image_pad|>' as text",
    "reply_pad": "message 1 (assistant) writes the vision token '<|video_pad|>' as text",
    "user_video_pad": "message 0 (user) writes the vision token '<|video_pad|>' as text",
}


def _dataset(root: Path, on_error: OnError) -> MultimodalDataset:
    return MultimodalDataset(_qwen_records(root), pipeline=qwen_pipeline(), on_error=on_error)


def test_qwen_pipeline_raises_naming_the_sample_and_the_token(tmp_path: Path) -> None:
    pytest.importorskip("av")
    ds = _dataset(tmp_path, "raise")
    assert ds.produce(0)["input_ids"].size and ds.produce(4)["input_ids"].size
    for i, (sample_id, reason) in enumerate(_REFUSED.items(), start=1):
        with pytest.raises(SampleError) as info:
            ds.produce(i)
        assert info.value.sample_id == sample_id and info.value.reason.startswith(reason)
    with pytest.raises(SampleError) as first:
        ds.lengths()
    assert first.value.sample_id == "user_pad"


def test_qwen_pipeline_skips_and_counts(tmp_path: Path) -> None:
    pytest.importorskip("av")
    from mmcache import DataLoader

    ds = _dataset(tmp_path, "skip")
    assert [ds[i] is None for i in range(5)] == [False, True, True, True, False]
    lengths = ds.lengths()
    assert [bool(n) for n in lengths] == [True, False, False, False, True]
    reasons = {r.sample_id: r.reason for r in ds.rejects()}
    assert set(reasons) == set(_REFUSED)
    assert all(reasons[k].startswith(v) for k, v in _REFUSED.items())
    loader = DataLoader(ds, cache=None, batch_size=1, shuffle=False)
    try:
        served = [sid for batch in loader for sid in batch["id"]]
    finally:
        loader.close()
    assert served == ["ok", "ok_video"]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_llava_pipeline_refuses_a_written_image_placeholder(
    tmp_path: Path, on_error: OnError
) -> None:
    from mmcache import ImageSpec

    write_image(tmp_path / "a.jpg", (64, 48))
    ask = "<image>\nWhat is in the picture?"
    path = write_llava(
        tmp_path / "m.json",
        [
            {"id": "ok", "image": "a.jpg",
             "conversations": turns(("human", ask), ("gpt", "A cat."))},
            {"id": "user", "image": "a.jpg",
             "conversations": turns(("human", ask + " Is <image> a tag?"), ("gpt", "Yes."))},
            {"id": "reply", "image": "a.jpg",
             "conversations": turns(("human", ask), ("gpt", "It is <image>."))},
        ],
    )  # fmt: skip
    pipe = Pipeline(
        image=ImageSpec(size=32), text=ChatSpec(make_tokenizer(), "vicuna_v1", 512, image_tokens=9)
    )
    if on_error == "raise":
        with pytest.raises(ManifestError, match="2 '<image>' placeholders for 1 images") as info:
            MultimodalDataset(path, pipeline=pipe)
        assert info.value.sample_id == "user"
        return
    ds = MultimodalDataset(path, pipeline=pipe, on_error="skip")
    assert len(ds) == 1 and ds.produce(0)["input_ids"].size
    reasons = {r.sample_id: r.reason for r in ds.rejects()}
    assert reasons == dict.fromkeys(("user", "reply"), "2 '<image>' placeholders for 1 images")
    assert ds.text_report().mismatched_placeholders == 2


# -- lone surrogates (H11) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"template": "{% for m in messages %}{{ m['content'] }}" + SURROGATE + "{% endfor %}"},
         "ChatSpec.template"),
        ({"template": "llama3", "bos_token": "<s>" + SURROGATE}, "ChatSpec.bos_token"),
        ({"eos_token": SURROGATE}, "ChatSpec.eos_token"),
        ({"image_prefix": SURROGATE}, "ChatSpec.image_prefix"),
        ({"image_suffix": "x" + SURROGATE}, "ChatSpec.image_suffix"),
        ({"image_token": SURROGATE, "image_token_id": 5}, "ChatSpec.image_token"),
        ({"end_of_turn": SURROGATE}, "ChatSpec.end_of_turn"),
        ({"video": VideoTokens(pad_token=SURROGATE)}, "VideoTokens.pad_token"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_in_chatspec_is_a_config_error(kw: dict[str, Any], field: str) -> None:
    kw = {"template": "chatml", **kw}
    with pytest.raises(ConfigError) as info:
        ChatSpec(qwen_tokenizer(), kw.pop("template"), 256, **kw)
    assert str(info.value).startswith(f"{field} holds a lone surrogate (U+D800 at character")


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        ((("system", "Be brief." + SURROGATE), ("user", "Hi"), ("assistant", "Yo")),
         "message 0 (system) holds a lone surrogate (U+D800 at character 9)"),
        ((("user", "Hi"), ("assistant", SURROGATE + "Yo")),
         "message 1 (assistant) holds a lone surrogate (U+D800 at character 0)"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_in_a_message_is_the_samples_error(
    messages: tuple[tuple[str, str], ...], where: str
) -> None:
    with pytest.raises(SampleError) as info:
        ChatSpec(make_tokenizer(), "chatml", 256).encode(Chat(messages), sample_id="m9")
    assert info.value.sample_id == "m9" and info.value.reason.startswith(where)


def test_a_lone_surrogate_in_a_caption_is_the_samples_error() -> None:
    spec = TextSpec(train_tokenizer(["a dog on a bench"], vocab_size=100), max_length=8)
    with pytest.raises(SampleError, match=r"the text holds a lone surrogate \(U\+DCFF at char"):
        spec("a dog" + chr(0xDCFF))
    # a long caption is read through a prefix: a surrogate in it is found the same way
    with pytest.raises(SampleError, match="at character 3"):
        spec("a d" + SURROGATE + " dog" * 500)
    with pytest.raises(SampleError) as info:
        Pipeline(text=spec).process(None, "x" + SURROGATE, sample_id="c4")
    assert info.value.sample_id == "c4"
    assert spec("a dog on a bench")["input_ids"].size == 8
