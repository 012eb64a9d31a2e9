"""ChatSpec: chat templates rendered as transformers renders them, labels from token
offsets, image-token runs, truncation and fully masked samples, fingerprints."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chat_support import hf_tokenizer, make_tokenizer
from tokenizers import Tokenizer

from mmcache import ChatSpec, Pipeline
from mmcache.errors import ConfigError, SampleError
from mmcache.testing.stage_contract import StageContract
from mmcache.transforms import IGNORE_INDEX, Chat
from mmcache.transforms.chat_templates import BUILTIN_TEMPLATES

pytest.importorskip("jinja2")

MESSAGES = (
    ("system", "You are a helpful assistant."),
    ("user", "<image>\nWhat is in the picture?"),
    ("assistant", "A cat sits on a mat."),
    ("user", "And the colour? é"),
    ("assistant", "It is grey with white paws."),
)

# A Qwen2-style template: whitespace control, indentation, a default system message,
# raise_exception and the {% generation %} tag (trim_blocks/lstrip_blocks matter here).
QWEN_STYLE = """{%- if messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}
    {{- '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] }}<|im_end|>
    {%- endgeneration %}
    {{- '\\n' }}
    {%- else %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return make_tokenizer()


def dicts(messages: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in messages]


def assistant_runs(labels: np.ndarray) -> list[tuple[int, int]]:
    """Maximal index ranges of trainable labels."""
    mask = np.concatenate([[False], labels != IGNORE_INDEX, [False]])
    edges = np.flatnonzero(mask[1:] != mask[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


# -- equality with transformers' apply_chat_template ------------------------------------------


@pytest.mark.parametrize(
    ("name", "template", "bos", "eos"),
    [
        ("chatml", BUILTIN_TEMPLATES["chatml"].text, None, "<|im_end|>"),
        ("llama3", BUILTIN_TEMPLATES["llama3"].text, "<|begin_of_text|>", "<|eot_id|>"),
        ("qwen-style", QWEN_STYLE, None, "<|im_end|>"),
    ],
)
def test_input_ids_equal_transformers_and_trained_tokens_decode_to_the_replies(
    tok: Tokenizer, name: str, template: str, bos: str | None, eos: str
) -> None:
    hf = hf_tokenizer(tok, template, bos=bos, eos=eos)
    expected = hf.apply_chat_template(dicts(MESSAGES), tokenize=True)["input_ids"]
    spec = ChatSpec(hf, None if name == "qwen-style" else name, max_length=4096)
    enc = spec.encode(Chat(MESSAGES, ((336, 336),)))
    assert enc.input_ids.dtype == np.int32 and enc.labels.dtype == np.int32
    assert enc.input_ids.tolist() == list(expected)
    assert spec.render(MESSAGES) == hf.apply_chat_template(dicts(MESSAGES), tokenize=False)
    # each trainable run is one assistant reply plus the template's end-of-turn token
    replies = [c for r, c in MESSAGES if r == "assistant"]
    runs = assistant_runs(enc.labels)
    assert len(runs) == len(replies)
    for (a, b), reply in zip(runs, replies, strict=True):
        ids = enc.input_ids[a:b].tolist()
        assert enc.labels[a:b].tolist() == ids
        assert hf.decode(ids, skip_special_tokens=True) == reply
        assert hf.decode(ids[-1:]) == eos  # the end-of-turn token is trained on
    assert enc.trainable == sum(b - a for a, b in runs)


def test_image_placeholder_equals_transformers_with_the_expanded_placeholder(
    tok: Tokenizer,
) -> None:
    # HF's LLaVA processor repeats "<image>" image_tokens times in the text: same ids.
    hf = hf_tokenizer(tok, BUILTIN_TEMPLATES["chatml"].text, bos=None, eos="<|im_end|>")
    spec = ChatSpec(hf, "chatml", 4096, image_tokens=7)
    enc = spec.encode(Chat(MESSAGES, ((336, 336),)))
    expanded = [(r, c.replace("<image>", "<image>" * 7)) for r, c in MESSAGES]
    expected = hf.apply_chat_template(dicts(expanded), tokenize=True)["input_ids"]
    assert enc.input_ids.tolist() == list(expected)
    image_id = tok.token_to_id("<image>")
    positions = np.flatnonzero(enc.input_ids == image_id)
    assert positions.size == 7 and np.all(np.diff(positions) == 1)
    assert np.all(enc.labels[positions] == IGNORE_INDEX)
    assert enc.image_runs == ((int(positions[0]), int(positions[-1]) + 1),)


def test_vicuna_v1_is_llava_conversation_format(tok: Tokenizer) -> None:
    spec = ChatSpec(tok, "vicuna_v1", 4096)
    msgs = (
        ("user", "<image>\nWhat?"),
        ("assistant", "A cat."),
        ("user", "Why?"),
        ("assistant", "B."),
    )
    text = spec.render(msgs)
    system = (
        "A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions."
    )
    # LLaVA's conv_vicuna_v1.get_prompt(): system + " " + "USER: q ASSISTANT: a</s>" ...
    assert (
        text
        == f"<s>{system} USER: <image>\nWhat? ASSISTANT: A cat.</s>USER: Why? ASSISTANT: B.</s>"
    )
    enc = spec.encode(Chat(msgs, ((24, 24),)))
    runs = assistant_runs(enc.labels)
    decoded = [tok.decode(enc.input_ids[a:b].tolist(), skip_special_tokens=False) for a, b in runs]
    assert [d.strip() for d in decoded] == ["A cat.</s>", "B.</s>"]


def test_a_reply_that_also_occurs_earlier_is_placed_at_its_own_turn(tok: Tokenizer) -> None:
    # Searching the text for the reply would find it in the question (or in "assistant").
    spec = ChatSpec(tok, "chatml", 4096)
    msgs = (("user", "Say assistant then a cat."), ("assistant", "a cat"))
    enc = spec.encode(Chat(msgs))
    ((a, b),) = assistant_runs(enc.labels)
    assert tok.decode(enc.input_ids[a:b].tolist(), skip_special_tokens=False) == "a cat<|im_end|>"
    assert a > len(enc.input_ids) // 2


def test_a_template_that_rewrites_a_reply_is_an_error_not_a_masked_sample(tok: Tokenizer) -> None:
    upper = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] | upper }}<|im_end|>\n{% endfor %}"
    )
    spec = ChatSpec(tok, upper, 4096)
    with pytest.raises(SampleError, match="rewrites assistant message 1") as info:
        spec.encode(Chat((("user", "hi"), ("assistant", "a cat"))), sample_id="s7")
    assert info.value.sample_id == "s7"


def test_raise_exception_in_the_template_is_a_sample_error(tok: Tokenizer) -> None:
    spec = ChatSpec(tok, QWEN_STYLE, 4096)
    with pytest.raises(SampleError, match="unknown role tool"):
        spec.encode(Chat((("tool", "x"), ("assistant", "y"))), sample_id="s1")


# -- image tokens ------------------------------------------------------------------------------


def test_image_tokens_function_of_the_processed_geometry(tok: Tokenizer) -> None:
    spec = ChatSpec(tok, "chatml", 4096, image_tokens=lambda h, w: (h // 28) * (w // 28))
    msgs = (("user", "<image> and <image>"), ("assistant", "two"))
    enc = spec.encode(Chat(msgs, ((56, 84), (28, 28))))
    image_id = tok.token_to_id("<image>")
    assert [b - a for a, b in enc.image_runs] == [6, 1]
    assert int(np.count_nonzero(enc.input_ids == image_id)) == 7


def test_placeholder_count_must_match_the_images(tok: Tokenizer) -> None:
    spec = ChatSpec(tok, "chatml", 4096)
    with pytest.raises(SampleError, match="2 '<image>' placeholders for 1 images"):
        spec.encode(Chat((("user", "<image><image>"), ("assistant", "x")), ((8, 8),)))


def test_image_token_must_be_known(tok: Tokenizer) -> None:
    with pytest.raises(ConfigError, match="no token '<img>'"):
        ChatSpec(tok, "chatml", 64, image_token="<img>")
    spec = ChatSpec(tok, "chatml", 64, image_token="<img>", image_token_id=5)
    enc = spec.encode(Chat((("user", "<img>"), ("assistant", "ok")), ((1, 1),)))
    assert 5 in enc.input_ids.tolist()


# -- truncation and fully masked samples ------------------------------------------------------


def test_truncation_never_splits_an_image_run(tok: Tokenizer) -> None:
    spec_long = ChatSpec(tok, "chatml", 4096, image_tokens=50)
    msgs = (
        ("user", "What is in the picture?"),
        ("assistant", "A cat sits on a mat."),
        ("user", "<image>\nAnd this one?"),
        ("assistant", "Two dogs."),
    )
    full = spec_long.encode(Chat(msgs, ((8, 8),)))
    ((run_a, run_b),) = full.image_runs
    first_reply_end = assistant_runs(full.labels)[0][1]
    cut = (run_a + run_b) // 2  # max_length falls inside the image's 50 tokens
    enc = ChatSpec(tok, "chatml", cut, image_tokens=50).encode(Chat(msgs, ((8, 8),)))
    assert enc.truncated and enc.full_length == len(full.input_ids)
    assert enc.n_images == 0 and enc.image_runs == ()
    image_id = tok.token_to_id("<image>")
    assert image_id not in enc.input_ids.tolist()
    # the tail turn is dropped: the sample ends with the first reply's end-of-turn
    assert len(enc.input_ids) == first_reply_end
    assert enc.input_ids.tolist() == full.input_ids[:first_reply_end].tolist()
    assert enc.labels.tolist() == full.labels[:first_reply_end].tolist()
    # a cut after the run keeps the image
    after = ChatSpec(tok, "chatml", run_b + 1, image_tokens=50).encode(Chat(msgs, ((8, 8),)))
    assert after.n_images == 1 and len(after.input_ids) == run_b + 1


def test_fully_masked_after_truncation_raises(tok: Tokenizer) -> None:
    spec = ChatSpec(tok, "chatml", 12, image_tokens=50)
    msgs = (("user", "<image>\nDescribe the image in detail."), ("assistant", "Two dogs."))
    with pytest.raises(SampleError, match="fully masked after truncation") as info:
        spec.encode(Chat(msgs, ((8, 8),)), sample_id="long")
    assert info.value.sample_id == "long"
    with pytest.raises(SampleError, match="fully masked"):
        ChatSpec(tok, "chatml", 64).encode(Chat((("user", "only a question"),)))


# -- fingerprint ----------------------------------------------------------------------------


def test_fingerprint_covers_tokenizer_template_and_every_option(tok: Tokenizer) -> None:
    base = ChatSpec(tok, "chatml", 256)
    other_tok = make_tokenizer(vocab_size=350)
    variants = [
        ChatSpec(other_tok, "chatml", 256),
        ChatSpec(tok, "llama3", 256),
        ChatSpec(tok, BUILTIN_TEMPLATES["chatml"].text + " ", 256),
        ChatSpec(tok, "chatml", 257),
        ChatSpec(tok, "chatml", 256, image_tokens=2),
        ChatSpec(tok, "chatml", 256, image_tokens=lambda h, w: h * w),
        ChatSpec(tok, "chatml", 256, image_token_id=4),
        ChatSpec(tok, "chatml", 256, end_of_turn=""),
        ChatSpec(tok, "vicuna_v1", 256),
        ChatSpec(tok, "vicuna_v1", 256, bos_token=""),
        ChatSpec(tok, "vicuna_v1", 256, eos_token="<|im_end|>"),
    ]
    prints = {base.fingerprint(), *(v.fingerprint() for v in variants)}
    assert len(prints) == len(variants) + 1
    # the keys of a pipeline change with it
    pipes = {Pipeline(text=s).fingerprint() for s in [base, *variants]}
    assert len(pipes) == len(variants) + 1
    # a special token the template never reads does not change its output, nor the key
    assert ChatSpec(tok, "chatml", 256, bos_token="<s>").fingerprint() == base.fingerprint()


def test_same_tokenizer_from_a_file_or_transformers_has_the_same_fingerprint(
    tok: Tokenizer, tmp_path: Path
) -> None:
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = hf_tokenizer(tok, "x", bos="<|begin_of_text|>", eos="<|eot_id|>")
    a = ChatSpec(tok, "llama3", 128)
    assert ChatSpec(str(path), "llama3", 128).fingerprint() == a.fingerprint()
    assert ChatSpec(hf, "llama3", 128).fingerprint() == a.fingerprint()
    assert pickle.loads(pickle.dumps(a)).fingerprint() == a.fingerprint()


def test_bad_config_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ConfigError, match="template is required"):
        ChatSpec(tok, None, 16)
    with pytest.raises(ConfigError, match="does not parse"):
        ChatSpec(tok, "{% for %}", 16)
    with pytest.raises(ConfigError, match="max_length"):
        ChatSpec(tok, "chatml", 0)
    with pytest.raises(ConfigError, match="image_tokens"):
        ChatSpec(tok, "chatml", 16, image_tokens=0)
    with pytest.raises(ConfigError, match="tokenizer"):
        ChatSpec(object(), "chatml", 16)


# -- the stage contract ---------------------------------------------------------------------


def _qwen_tokens(h: int, w: int) -> int:
    return (h // 28) * (w // 28)


class TestChatSpecContract(StageContract):
    __test__ = True

    def make_stage(self) -> Any:
        return ChatSpec(make_tokenizer(), "chatml", 512, image_tokens=_qwen_tokens)

    def variants(self) -> Sequence[Any]:
        tok = make_tokenizer()
        return [
            ChatSpec(tok, "llama3", 512, image_tokens=_qwen_tokens),
            ChatSpec(tok, "chatml", 60, image_tokens=_qwen_tokens),  # truncated
            ChatSpec(tok, "chatml", 512, image_tokens=3),
        ]

    def same_config(self) -> Sequence[Any]:
        tok = make_tokenizer()
        hf = hf_tokenizer(tok, "unused", bos=None, eos="<|im_end|>")
        return [ChatSpec(hf, "chatml", 512, image_tokens=_qwen_tokens)]

    def make_input(self) -> Any:
        return Chat(MESSAGES, ((56, 84),))

    def check_output(self, stage: Any, output: Any) -> None:
        super().check_output(stage, output)
        assert set(output) == {"input_ids", "labels"}
        assert output["input_ids"].dtype == np.int32 and output["labels"].dtype == np.int32
        assert (output["labels"] != IGNORE_INDEX).any()


def test_llava_image_token_index_convention(tok: Tokenizer) -> None:
    # LLaVA's own code: the placeholder becomes one -200, expanded in the model
    spec = ChatSpec(tok, "vicuna_v1", 256, image_token_id=-200, image_tokens=1)
    enc = spec.encode(Chat((("user", "<image>\nWhat?"), ("assistant", "A cat.")), ((336, 336),)))
    assert enc.input_ids.tolist().count(-200) == 1
    assert enc.labels[enc.input_ids == -200].tolist() == [IGNORE_INDEX]


def test_image_prefix_and_suffix_wrap_each_run_like_qwen2_vl(tok: Tokenizer) -> None:
    # Qwen2-VL's processor: "<|vision_start|><|image_pad|>*n<|vision_end|>" for each image
    hf = hf_tokenizer(tok, BUILTIN_TEMPLATES["chatml"].text, bos=None, eos="<|im_end|>")
    pad = tok.token_to_id("<image>")
    spec = ChatSpec(hf, "chatml", 4096, image_tokens=3, image_prefix="<s>", image_suffix="</s>")
    msgs = (("user", "<image>What?"), ("assistant", "A cat."))
    enc = spec.encode(Chat(msgs, ((28, 28),)))
    wrapped = [(r, c.replace("<image>", "<s>" + "<image>" * 3 + "</s>")) for r, c in msgs]
    expected = hf.apply_chat_template(dicts(wrapped), tokenize=True)["input_ids"]
    assert enc.input_ids.tolist() == list(expected)
    ((a, b),) = enc.image_runs
    assert enc.input_ids[a:b].tolist() == [pad] * 3
    assert hf.decode(enc.input_ids[a - 1 : b + 1].tolist()) == "<s><image><image><image></s>"
    # a cut between the run and its suffix drops the whole wrapped run (and its turn)
    two = (("user", "Hi"), ("assistant", "Hello."), *msgs)
    kw: dict[str, Any] = {"image_tokens": 3, "image_prefix": "<s>", "image_suffix": "</s>"}
    full = ChatSpec(tok, "chatml", 4096, **kw).encode(Chat(two, ((28, 28),)))
    ((a, b),) = full.image_runs
    cut = ChatSpec(tok, "chatml", b, **kw).encode(Chat(two, ((28, 28),)))
    assert cut.n_images == 0 and cut.truncated
    assert len(cut.input_ids) == assistant_runs(full.labels)[0][1] < a - 1
    assert tok.token_to_id("<s>") not in cut.input_ids.tolist()
    assert (
        ChatSpec(tok, "chatml", 64, image_prefix="<s>").fingerprint()
        != ChatSpec(tok, "chatml", 64).fingerprint()
    )


def test_pad_id_for_batches_is_not_in_the_fingerprint(tok: Tokenizer) -> None:
    hf = hf_tokenizer(tok, "x", bos=None, eos="<|im_end|>")  # pad_token="<pad>"
    assert ChatSpec(hf, "chatml", 64).pad_id == tok.token_to_id("<pad>")
    assert ChatSpec(tok, "chatml", 64).pad_id == tok.token_to_id("<pad>")  # by name
    spec = ChatSpec(tok, "chatml", 64, pad_id=7)
    assert spec.pad_id == 7 and pickle.loads(pickle.dumps(spec)).pad_id == 7
    assert spec.fingerprint() == ChatSpec(tok, "chatml", 64).fingerprint()
