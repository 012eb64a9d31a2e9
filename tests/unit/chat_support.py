"""Shared pieces of the chat (SFT) tests: a small byte-level BPE tokenizer trained offline
with the special tokens of the built-in templates, LLaVA manifests and images."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = [
    "<pad>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<image>",
]

CORPUS = [
    "What is in the picture? A cat sits on a mat.",
    "Describe the image in detail. Two dogs play in the park near a red car.",
    "And the colour? It is grey with white paws.",
    "You are a helpful assistant. Answer briefly and politely.",
    "How many animals are there? There are three animals: two dogs and a cat.",
] * 4


def make_tokenizer(vocab_size: int = 400) -> Tokenizer:
    """A GPT-2/Llama-3 style tokenizer (byte-level BPE, case kept) with ``SPECIALS``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def hf_tokenizer(tok: Tokenizer, template: str, *, bos: str | None, eos: str) -> Any:
    """``tok`` as a transformers fast tokenizer with ``template`` as its chat_template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token="<pad>"
    )
    hf.chat_template = template
    return hf


def write_image(path: Path, size: tuple[int, int], shade: int = 0) -> None:
    """A ``size`` (width, height) JPEG at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (shade, 100, 200 - shade)).save(path, quality=90)


def write_llava(path: Path, records: list[dict[str, Any]]) -> Path:
    """A LLaVA JSON array manifest."""
    path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    return path


def turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    """LLaVA ``conversations`` from ``(from, value)`` pairs."""
    return [{"from": f, "value": v} for f, v in pairs]
