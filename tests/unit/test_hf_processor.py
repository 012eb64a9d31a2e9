"""mmcache.hf_processor: a whole LlavaProcessor as the Pipeline (issue 26), checked
against the processor itself: input_ids and labels equal
``processor.apply_chat_template(..., return_assistant_tokens_mask=True)``, and the
normalised cached pixels equal its ``pixel_values`` within 1e-5. Everything is built
offline (a trained tiny tokenizer, processors from their constructors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from chat_support import hf_tokenizer, make_tokenizer, turns, write_image, write_llava
from PIL import Image

import mmcache as mc

pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

# Vicuna-style, rendering a message's content given as a string (ChatSpec's form) or as
# the list of parts LlavaProcessor passes; {% generation %} marks the trained reply.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}{% else %}"
    "{% set text = namespace(v='') %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}{% set text.v = text.v + '<image>' %}"
    "{% else %}{% set text.v = text.v + p['text'] %}{% endif %}{% endfor %}"
    "{% set text = text.v %}{% endif %}"
    "{% if m['role'] == 'user' %}USER: {{ text }} "
    "{% else %}ASSISTANT: {% generation %}{{ text }}{{ eos_token }}{% endgeneration %}"
    "{% endif %}{% endfor %}"
)


def llava_processor() -> Any:
    tok = hf_tokenizer(make_tokenizer(), TEMPLATE, bos="<s>", eos="</s>")
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    images = cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=TEMPLATE,
    )


CONVERSATIONS = [
    [("human", "<image>\nWhat is in the picture?"), ("gpt", "A cat sits on a mat.")],
    [
        ("human", "<image>\nDescribe the image."),
        ("gpt", "Two dogs play in the park."),
        ("human", "And the colour?"),
        ("gpt", "It is grey."),
    ],
]


def as_messages(conv: list[tuple[str, str]], image: Image.Image) -> list[dict[str, Any]]:
    out = []
    for who, text in conv:
        parts: list[dict[str, Any]] = []
        if "<image>" in text:
            parts.append({"type": "image", "image": image})
            text = text.replace("<image>", "")
        parts.append({"type": "text", "text": text})
        out.append({"role": "user" if who == "human" else "assistant", "content": parts})
    return out


def test_llava_processor_pipeline_equals_apply_chat_template(tmp_path: Path) -> None:
    processor = llava_processor()
    pipe = mc.hf_processor(processor, max_length=512)
    assert pipe.text.image_tokens == 16  # (32 // 8) ** 2 + 1 CLS - 1 ("default")
    sizes = [(64, 48), (40, 90)]
    records = []
    for i, (conv, size) in enumerate(zip(CONVERSATIONS, sizes, strict=True)):
        write_image(tmp_path / f"{i}.jpg", size, shade=40 * i)
        records.append({"id": f"s{i}", "image": f"{i}.jpg", "conversations": turns(*conv)})
    ds = mc.MultimodalDataset(write_llava(tmp_path / "m.json", records), pipeline=pipe)
    assert ds.lengths().tolist() == [len(ds.produce(i)["input_ids"]) for i in range(len(ds))]
    for i, conv in enumerate(CONVERSATIONS):
        with Image.open(tmp_path / f"{i}.jpg") as im:
            image = im.convert("RGB")
        ref = processor.apply_chat_template(
            [as_messages(conv, image)],
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            return_tensors="np",
        )
        ids = ref["input_ids"][0]
        labels = np.where(ref["assistant_masks"][0] == 1, ids, -100)
        sample = ds.produce(i)
        assert sample["input_ids"].tolist() == ids.tolist()
        assert sample["labels"].tolist() == labels.tolist()
        cached = torch.from_numpy(np.asarray(sample["images"]).reshape(1, 3, 32, 32))
        pixels = mc.normalize(cached, pipe.image)
        assert torch.allclose(pixels, torch.from_numpy(ref["pixel_values"]), atol=1e-5)


def test_unknown_processors_are_refused() -> None:
    with pytest.raises(mc.ConfigError, match="LlavaProcessor"):
        mc.hf_processor(object())


# llava-hf/llava-1.5-7b-hf's own chat template: it reads content only as a list of parts
# (a string content renders as nothing) and writes each image part as "<image>\n".
LLAVA_15_HF = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}{# Render all text next #}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def test_a_template_of_content_parts_only(tmp_path: Path) -> None:
    processor = llava_processor()
    processor.chat_template = LLAVA_15_HF
    pipe = mc.hf_processor(processor, max_length=512)
    assert pipe.text.content_parts is True  # probed: strings render as nothing
    records = []
    for i, conv in enumerate(CONVERSATIONS):
        write_image(tmp_path / f"{i}.jpg", (48, 40), shade=50 * i)
        records.append({"id": f"s{i}", "image": f"{i}.jpg", "conversations": turns(*conv)})
    ds = mc.MultimodalDataset(write_llava(tmp_path / "m.json", records), pipeline=pipe)
    tok = processor.tokenizer
    for i, conv in enumerate(CONVERSATIONS):
        with Image.open(tmp_path / f"{i}.jpg") as im:
            image = im.convert("RGB")
        messages = as_messages(conv, image)
        for m in messages:  # what a processor user writes: no newline left by <image>
            for p in m["content"]:
                if p["type"] == "text":
                    p["text"] = p["text"].strip()
        ref = processor.apply_chat_template(
            [messages],
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            return_tensors="np",
        )
        ids = ref["input_ids"][0]
        sample = ds.produce(i)
        assert sample["input_ids"].tolist() == ids.tolist()
        # Trained: exactly the tokens of the replies (the first one carries the space
        # before it, as a byte-level BPE token does).
        replies = [text for who, text in conv if who == "gpt"]
        trained = sample["labels"] != -100
        runs = np.split(sample["labels"], np.flatnonzero(np.diff(trained.astype(int))) + 1)
        assert [tok.decode(r.tolist()) for r in runs if (r != -100).all()] == [
            " " + r for r in replies
        ]
        # HF's mask: the same, plus the token holding the space the template writes
        # after each reply inside {% generation %} (" USER", or a lone " " at the end).
        hf = ref["assistant_masks"][0] == 1
        assert not (trained & ~hf).any()
        extra = [tok.decode([int(ids[j])]) for j in np.flatnonzero(hf & ~trained)]
        assert all(t.startswith(" ") and t.strip() in ("", "USER") for t in extra), extra
