"""Property test of ChatSpec's labels: for any conversation, the input_ids are
transformers' own and each trained run decodes to exactly its assistant reply."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from chat_support import hf_tokenizer, make_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmcache import ChatSpec
from mmcache.transforms import IGNORE_INDEX, Chat
from mmcache.transforms.chat_templates import BUILTIN_TEMPLATES

pytest.importorskip("jinja2")

TOK = make_tokenizer()
HF: dict[str, Any] = {
    "chatml": hf_tokenizer(TOK, BUILTIN_TEMPLATES["chatml"].text, bos=None, eos="<|im_end|>"),
    "llama3": hf_tokenizer(
        TOK, BUILTIN_TEMPLATES["llama3"].text, bos="<|begin_of_text|>", eos="<|eot_id|>"
    ),
}
SPECS = {name: ChatSpec(hf, name, 100_000) for name, hf in HF.items()}

# Words of the corpus, other words, punctuation, accents, newlines and spaces: replies that
# repeat the question or the template's own words ("assistant", "user") included.
text = st.lists(
    st.sampled_from(
        ["cat", "A", "mat.", "assistant", "user", "im_end", "é", "ü", "?", "!", "\n", " ", "  "]
    )
    | st.text(alphabet="abcxyzDEF0123 .,", min_size=1, max_size=6),
    min_size=1,
    max_size=12,
).map("".join)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[tuple[str, str], ...]:
    turns = draw(st.integers(1, 3))
    out: list[tuple[str, str]] = []
    if draw(st.booleans()):
        out.append(("system", draw(text)))
    for _ in range(turns):
        question = draw(text)
        reply = draw(st.one_of(text, st.just(question), st.just(" \n "), st.just("")))
        out += [("user", question), ("assistant", reply)]
    return tuple(out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=conversations(), name=st.sampled_from(sorted(SPECS)))
def test_trained_tokens_are_exactly_the_replies(
    conversation: tuple[tuple[str, str], ...], name: str
) -> None:
    hf = HF[name]
    messages = [{"role": r, "content": c} for r, c in conversation]
    expected = hf.apply_chat_template(messages, tokenize=True)["input_ids"]
    enc = SPECS[name].encode(Chat(conversation))
    assert enc.input_ids.tolist() == list(expected)
    mask = np.concatenate([[False], enc.labels != IGNORE_INDEX, [False]])
    edges = np.flatnonzero(mask[1:] != mask[:-1]).tolist()
    runs = list(zip(edges[::2], edges[1::2], strict=True))
    replies = [c for r, c in conversation if r == "assistant"]
    assert len(runs) == len(replies)
    for (a, b), reply in zip(runs, replies, strict=True):
        decoded = hf.decode(enc.input_ids[a:b].tolist(), skip_special_tokens=True)
        # llama3's template trims each message (`| trim`): its reply is the stripped one
        assert decoded == (reply.strip() if name == "llama3" else reply)
