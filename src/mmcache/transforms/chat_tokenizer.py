"""The tokenizer side of :class:`~mmcache.transforms.chat.ChatSpec`: what it accepts as a
tokenizer, the digest of it that enters the fingerprint, the pad id batches use, and
the vision tokens only an image's or a video's run may hold.

Pure functions; thread-safe.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import xxhash
from tokenizers import Tokenizer

from mmcache.errors import ConfigError
from mmcache.transforms.text import _canonical_tokenizer_json

__all__ = ["SPECIAL_NAMES", "pad_id_of", "tokenizer_digest", "tokenizer_parts", "vision_tokens"]

#: The special tokens a chat template may read, as transformers passes them.
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

#: Pad tokens looked up when the tokenizer names none (then the eos token, then 0).
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|endoftext|>", "<|finetune_right_pad_id|>")


def tokenizer_parts(tokenizer: Any) -> tuple[str, dict[str, str], str | None]:
    """(tokenizer JSON, its special tokens by name, its chat template) of any accepted
    tokenizer; ConfigError otherwise."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.to_str(), {}, None
    if isinstance(tokenizer, (str, os.PathLike)):
        try:
            return Tokenizer.from_file(os.fspath(tokenizer)).to_str(), {}, None
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ConfigError(
                f"cannot load a tokenizer from {os.fspath(tokenizer)!r}: {exc} "
                "(expected a tokenizers 'tokenizer.json' file)"
            ) from exc
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):  # a transformers fast tokenizer
        specials = {}
        for name in SPECIAL_NAMES:
            value = getattr(tokenizer, name, None)
            if isinstance(value, str):
                specials[name] = value
        template = getattr(tokenizer, "chat_template", None)
        return backend.to_str(), specials, template if isinstance(template, str) else None
    raise ConfigError(
        "ChatSpec.tokenizer must be a tokenizers.Tokenizer, a tokenizer.json path or a "
        f"transformers fast tokenizer, got {type(tokenizer).__name__}"
    )


def tokenizer_digest(tokenizer_json: str) -> str:
    """xxh3-128 of what of the tokenizer ChatSpec uses: its canonical JSON without the
    post-processor (texts are encoded with ``add_special_tokens=False``, so it never
    runs; transformers adds an empty one to a tokenizer it wraps)."""
    doc = json.loads(_canonical_tokenizer_json(tokenizer_json))
    doc.pop("post_processor", None)
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return xxhash.xxh3_128_hexdigest(blob.encode())


def pad_id_of(tok: Tokenizer, specials: dict[str, str]) -> int:
    """The id batches pad ``input_ids`` with: the tokenizer's ``pad_token`` (a
    transformers tokenizer's), else the first of ``<pad>``, ``[PAD]``,
    ``<|endoftext|>``, ``<|finetune_right_pad_id|>`` it has, else its eos token, else 0."""
    names = [specials.get("pad_token"), *_PAD_CANDIDATES, specials.get("eos_token")]
    for name in names:
        found = tok.token_to_id(name) if name else None
        if found is not None:
            return int(found)
    return 0


def vision_tokens(tok: Tokenizer, runs: dict[int, str], wraps: Iterable[int]) -> dict[int, str]:
    """The ids a model counts as vision tokens, each with its text: ``runs`` (the id an
    image's or a video's run is made of, with its name) and, among ``wraps`` (the ids
    written around the runs, such as ``<|vision_start|>``), those that are added tokens
    of ``tok``. A wrap written as plain text (``image_prefix="Image: "``) tokenizes to
    ordinary words that any text may hold, so its ids are not counted; an added token
    is one the model's own code looks for."""
    out = dict(runs)
    added = tok.get_added_tokens_decoder()
    for i in wraps:
        token = added.get(int(i))
        if token is not None:
            out[int(i)] = token.content
    return out
