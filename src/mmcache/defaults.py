"""The documented default preprocessing of the CLI (``mmcache warm``/``bench`` without flags).

224 px images (shorter side resized to 256, centre crop), 32 tokens from a
small BPE tokenizer trained offline on :mod:`mmcache.synth`'s built-in caption
vocabulary (seed 0, 4,096 entries). Nothing is downloaded, and the tokenizer
is the same on every machine, so its fingerprint (and every cache key made
with it) is too. Real training uses its own tokenizer via ``--tokenizer``.
"""

from __future__ import annotations

import functools
import os

from tokenizers import Tokenizer

from mmcache.synth import synth_captions
from mmcache.transforms import ImageSpec, TextSpec, train_tokenizer
from mmcache.transforms.pipeline import Pipeline

__all__ = ["DEFAULT_MAX_LENGTH", "DEFAULT_SIZE", "default_pipeline", "default_tokenizer"]

DEFAULT_SIZE = 224
DEFAULT_MAX_LENGTH = 32
_TOKENIZER_CAPTIONS = 5000
_TOKENIZER_VOCAB = 4096


@functools.lru_cache(maxsize=1)
def _default_tokenizer_json() -> str:
    tok = train_tokenizer(synth_captions(_TOKENIZER_CAPTIONS, seed=0), vocab_size=_TOKENIZER_VOCAB)
    return str(tok.to_str())


def default_tokenizer() -> Tokenizer:
    """The offline default tokenizer (a fresh object each call)."""
    return Tokenizer.from_str(_default_tokenizer_json())


def default_pipeline(
    *,
    size: int = DEFAULT_SIZE,
    max_length: int = DEFAULT_MAX_LENGTH,
    tokenizer: str | os.PathLike[str] | None = None,
) -> Pipeline:
    """``Pipeline(ImageSpec(size), TextSpec(tokenizer or default_tokenizer(), max_length))``."""
    tok: str | os.PathLike[str] | Tokenizer = (
        tokenizer if tokenizer is not None else default_tokenizer()
    )
    return Pipeline(image=ImageSpec(size=size), text=TextSpec(tok, max_length=max_length))
