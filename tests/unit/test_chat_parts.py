"""ChatSpec with chat templates that read a message's content only as a list of parts
(llava-1.5-hf's form): the string contents of records become image/text parts, the
labels are the replies' tokens exactly, and a template that renders strings keeps them."""

from __future__ import annotations

import pickle

import pytest
from chat_support import make_tokenizer

import mmcache as mc
from mmcache.transforms.chat import Chat
from mmcache.transforms.chat_parts import as_parts

pytest.importorskip("jinja2")

PARTS_ONLY = (
    "{% for m in messages %}{{ m['role'] + ': ' }}"
    "{% for c in m['content'] | selectattr('type', 'equalto', 'image') %}<image>\n{% endfor %}"
    "{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] }}"
    "{% endfor %}</s>{% endfor %}"
)
BOTH = (
    "{% for m in messages %}{{ m['role'] + ': ' }}{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}</s>{% endfor %}"
)


def test_as_parts_splits_at_placeholders_and_drops_the_whitespace_next_to_them() -> None:
    assert as_parts("<image>\nWhat is it?", "<image>") == [
        {"type": "image"},
        {"type": "text", "text": "What is it?"},
    ]
    assert as_parts("Compare <image> and <image>", "<image>") == [
        {"type": "text", "text": "Compare"},
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
    ]
    assert as_parts(" a reply kept as is ", "<image>") == [
        {"type": "text", "text": " a reply kept as is "}
    ]


def test_a_parts_only_template_is_probed_and_labels_are_the_replies() -> None:
    tok = make_tokenizer()
    spec = mc.ChatSpec(tok, PARTS_ONLY, 256, image_tokens=3)
    assert spec.content_parts is True
    assert pickle.loads(pickle.dumps(spec)).content_parts is True  # workers render alike
    chat = Chat((("user", "<image>\nWhat is in the picture?"), ("assistant", "A cat.")), ((8, 8),))
    enc = spec.encode(chat)
    text = tok.decode(enc.input_ids.tolist(), skip_special_tokens=False)
    assert text.startswith("user: " + "<image>" * 3 + "\nWhat is in the picture?</s>")
    trained = [int(t) for t in enc.labels if t != -100]
    assert tok.decode(trained, skip_special_tokens=False) == " A cat.</s>"  # " A": one token
    # forced to strings, the same template renders no reply: refused, never mislabelled
    with pytest.raises(mc.SampleError):
        mc.ChatSpec(tok, PARTS_ONLY, 256, image_tokens=3, content_parts=False).encode(chat)


def test_templates_that_render_strings_keep_them() -> None:
    tok = make_tokenizer()
    for template in ("chatml", "vicuna_v1", BOTH):
        spec = mc.ChatSpec(tok, template, 256)
        assert spec.content_parts is False
    both = mc.ChatSpec(tok, BOTH, 256, content_parts=True)
    assert both.fingerprint() != mc.ChatSpec(tok, BOTH, 256).fingerprint()
    with pytest.raises(mc.ConfigError, match="content_parts"):
        mc.ChatSpec(tok, BOTH, 256, content_parts="yes")  # type: ignore[arg-type]
