"""Fingerprints are cache keys: the same options give the same fingerprint as before any
refactoring of the classes that compute them (values computed on the main branch before the
option classes were rewritten; a change here invalidates every user's cache)."""

from __future__ import annotations

import pickle

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import mmcache as mc

pytest.importorskip("jinja2")

WORDS = ["<unk>", "<image>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "a", "cat", "user"]


def _tokenizer() -> Tokenizer:
    """A word-level tokenizer built from a fixed vocabulary (no training: fully fixed)."""
    words = [*WORDS, "assistant", "system", "\n", " "]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<image>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"])
    return tok


def test_chat_spec_and_pipeline_fingerprints_are_those_of_before() -> None:
    tok = _tokenizer()
    chatml = mc.ChatSpec(tok, "chatml", 64)
    vicuna = mc.ChatSpec(
        tok, "vicuna_v1", 128, image_token_id=-200, image_tokens=4, bos_token="<s>",
        eos_token="</s>", image_prefix="<s>", pad_id=3,
    )  # fmt: skip
    pipe = mc.Pipeline(image=mc.ImageSpec(size=32), text=chatml)
    assert chatml.fingerprint() == "60df0f1a1774ef1b70670774347d205b"
    assert vicuna.fingerprint() == "733619fadfffc54d002b61af86be9c80"
    assert pipe.fingerprint() == "bc85908b4a5d11f5bec28ffad464c239"
    for spec in (chatml, vicuna):  # a worker's copy keys the same
        twin = pickle.loads(pickle.dumps(spec))
        assert twin.fingerprint() == spec.fingerprint() and repr(twin) == repr(spec)
        assert twin.pad_id == spec.pad_id and twin.image_token_id == spec.image_token_id
