"""The text stage: a caption -> int32 ``input_ids`` and ``attention_mask`` (:class:`TextSpec`).

Captions are tokenized by a Hugging Face ``tokenizers`` tokenizer, truncated and padded
to a fixed length. A caption far longer than that is tokenized only through a bounded
prefix that provably gives the same tokens (:meth:`TextSpec._encode_long`), so its cost
depends on ``max_length``, not on its length. :func:`train_tokenizer` makes a small
offline tokenizer for demos, tests and benchmarks.

Thread and process safety: a :class:`TextSpec` is immutable; it pickles to the
tokenizer's JSON string, so spawn/forkserver DataLoader workers rebuild it cheaply.
Captions are encoded one at a time, never with ``encode_batch``: that keeps the
tokenizers library from starting its Rayon thread pool, which would make it warn and
fall back to one thread in every forked worker.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
import xxhash
from tokenizers import Encoding, Tokenizer

from mmcache.checks import check_int
from mmcache.errors import ConfigError, SampleError
from mmcache.transforms.stage import StageKind

__all__ = ["TextSpec", "check_text", "surrogate_at", "train_tokenizer"]

_PAD_TOKENS = ("[PAD]", "<pad>")
_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
_BASE_ALPHABET = string.ascii_lowercase + string.digits + string.punctuation

# Long captions are tokenized through a bounded prefix (TextSpec._encode_long): the
# first prefix holds max_length * _PREFIX_CHARS_PER_TOKEN characters (1,024 for 16
# tokens, far more than any normal caption, so those never take that path), then
# it grows _PREFIX_GROWTH-fold until it is safe to cut there (see _prefix_is_final).
_PREFIX_CHARS_PER_TOKEN = 64
_PREFIX_GROWTH = 4
# Tokens, and whole pre-tokenized words, that must follow the kept tokens in the
# prefix's encoding before its cut can no longer change them.
_PREFIX_MARGIN_TOKENS = 8
_PREFIX_MARGIN_WORDS = 2

#: What to tell a user whose text holds a surrogate code point (U+D800..U+DFFF): a Python
#: str may hold one, UTF-8 cannot, and tokenizers refuses the whole string with a bare
#: TypeError.
_SURROGATE_FIX = (
    "UTF-8 cannot encode it, so no tokenizer can read the text; it is usually a JSON "
    "'\\ud800'-style escape without its pair, or bytes decoded with "
    "errors='surrogateescape': fix the text where it was made"
)


def surrogate_at(text: str) -> int:
    """The index of the first surrogate code point (U+D800..U+DFFF) in ``text``, or -1.

    >>> surrogate_at("ok"), surrogate_at("a" + chr(0xD800))
    (-1, 1)
    """
    # Only a surrogate makes UTF-8 encoding fail, and encoding runs at several GB/s
    # where a regular expression over the surrogate range reads ~100 MB/s: this is paid
    # once per message of every sample.
    if text.isascii():
        return -1
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return -1


def surrogate_reason(what: str, text: str) -> str | None:
    """The message for ``text`` (described by ``what``) when it holds a surrogate code
    point; ``None`` when it holds none."""
    at = surrogate_at(text)
    if at < 0:
        return None
    code = ord(text[at])
    return f"{what} holds a lone surrogate (U+{code:04X} at character {at}): {_SURROGATE_FIX}"


def check_text(name: str, value: str) -> str:
    """``value``, a configuration string, when it holds no surrogate code point;
    ConfigError naming ``name`` otherwise (it would fail at every sample's tokenization)."""
    reason = surrogate_reason(name, value)
    if reason is not None:
        raise ConfigError(reason)
    return value


def _canonical_tokenizer_json(tokenizer_json: str) -> str:
    """The tokenizer's JSON with sorted keys and without the padding/truncation
    settings (TextSpec overrides those; they are fingerprinted separately)."""
    doc = json.loads(tokenizer_json)
    doc.pop("padding", None)
    doc.pop("truncation", None)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class TextSpec:
    """How a caption becomes int32 ``input_ids`` and ``attention_mask`` of ``max_length``:
    the text :class:`~mmcache.transforms.stage.Stage`.

    Args:
        tokenizer: a ``tokenizer.json`` path or a :class:`tokenizers.Tokenizer`. The
            object is copied: your tokenizer's padding and truncation settings are
            left untouched.
        max_length: every caption is truncated (special tokens included) and padded
            (on the right) to this length. Only as much of a long caption as that
            needs is tokenized (:meth:`encode`).
        pad_id: the padding id; by default the tokenizer's ``[PAD]`` or ``<pad>``
            token, else 0.

    A TextSpec is immutable; it pickles as the tokenizer's JSON string. Thread-safe.
    Raises ConfigError on invalid values or an unreadable tokenizer file.
    """

    __slots__ = (
        "_canonical",
        "_content_length",
        "_json",
        "_tokenizer",
        "_untruncated",
        "max_length",
        "pad_id",
    )

    kind: ClassVar[StageKind] = "text"

    _json: str
    _canonical: str | None
    _tokenizer: Tokenizer
    _untruncated: Tokenizer | None
    _content_length: int
    max_length: int
    pad_id: int

    def __init__(
        self,
        tokenizer: str | os.PathLike[str] | Tokenizer,
        max_length: int = 32,
        pad_id: int | None = None,
    ) -> None:
        if isinstance(tokenizer, Tokenizer):
            tokenizer_json = tokenizer.to_str()
        elif isinstance(tokenizer, (str, os.PathLike)):
            try:
                tokenizer_json = Tokenizer.from_file(os.fspath(tokenizer)).to_str()
            except Exception as exc:  # the Rust side raises plain Exception subclasses
                raise ConfigError(
                    f"cannot load a tokenizer from {os.fspath(tokenizer)!r}: {exc} "
                    "(expected a tokenizers 'tokenizer.json' file)"
                ) from exc
        else:
            raise ConfigError(
                "TextSpec.tokenizer must be a tokenizer.json path or a tokenizers.Tokenizer, "
                f"got {type(tokenizer).__name__}"
            )
        self._setup(tokenizer_json, max_length, pad_id)

    def _setup(self, tokenizer_json: str, max_length: int, pad_id: int | None) -> None:
        max_length = check_int("TextSpec.max_length", max_length, minimum=1)
        tok = Tokenizer.from_str(tokenizer_json)
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        if pad_id is None:
            found = (tok.token_to_id(t) for t in _PAD_TOKENS)
            pad_id = next((i for i in found if i is not None), 0)
        else:
            pad_id = check_int("TextSpec.pad_id", pad_id, minimum=0)
            if pad_id >= vocab_size:
                raise ConfigError(
                    f"TextSpec.pad_id ({pad_id}) is outside the vocabulary (size {vocab_size})"
                )
        pad_token = tok.id_to_token(pad_id) or _PAD_TOKENS[0]
        tok.enable_truncation(max_length)
        tok.enable_padding(direction="right", pad_id=pad_id, pad_token=pad_token, length=max_length)
        try:
            probe = tok.encode("")
        except Exception as exc:
            raise ConfigError(
                f"TextSpec.max_length={max_length} does not work with this tokenizer: {exc}"
            ) from exc
        if len(probe.ids) != max_length:
            raise ConfigError(
                f"TextSpec.max_length={max_length} is shorter than the special tokens this "
                f"tokenizer adds ({len(probe.ids)})"
            )
        object.__setattr__(self, "_json", tokenizer_json)
        object.__setattr__(self, "_canonical", None)
        object.__setattr__(self, "_tokenizer", tok)
        object.__setattr__(self, "_untruncated", None)
        # How many text tokens truncation keeps: max_length minus the special tokens
        # the post-processor adds to a single sequence (tokenizers truncates that way).
        object.__setattr__(
            self, "_content_length", max_length - tok.num_special_tokens_to_add(is_pair=False)
        )
        object.__setattr__(self, "max_length", max_length)
        object.__setattr__(self, "pad_id", pad_id)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"TextSpec is immutable (cannot set {name!r})")

    @property
    def tokenizer(self) -> Tokenizer:
        """The configured copy (padding and truncation set). Do not modify it."""
        tok: Tokenizer = self._tokenizer
        return tok

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def tokenizer_digest(self) -> str:
        """xxh3-128 of the tokenizer's canonical JSON: same vocabulary and rules,
        same digest, wherever the file came from."""
        canonical: str | None = self._canonical
        if canonical is None:
            canonical = xxhash.xxh3_128_hexdigest(_canonical_tokenizer_json(self._json).encode())
            object.__setattr__(self, "_canonical", canonical)
        return canonical

    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything about this spec that changes its output."""
        return {
            "tokenizer": self.tokenizer_digest(),
            "max_length": self.max_length,
            "pad_id": self.pad_id,
            "padding": "right",
        }

    def fingerprint(self) -> str:
        """xxh3-128 hex digest of :meth:`fingerprint_fields` (the :class:`Stage` fingerprint)."""
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_hexdigest(blob.encode())

    def __call__(self, text: str, /) -> dict[str, npt.NDArray[np.int32]]:
        """``{"input_ids": ..., "attention_mask": ...}`` of :meth:`encode`. Thread-safe."""
        ids, mask = self.encode(text)
        return {"input_ids": ids, "attention_mask": mask}

    def encode(self, text: str) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """``(input_ids, attention_mask)``, both int32 ``[max_length]``. Thread-safe.

        The result is always the tokenizer's own (the whole text tokenized, then
        truncated, wrapped in the special tokens and padded), but a text longer than
        ``64 * max_length`` characters is tokenized only as far as needed: its cost
        depends on ``max_length``, not on its length, unless the text starts with a
        huge run without a word boundary (see :meth:`_encode_long`). SampleError when
        the part it tokenizes holds a lone surrogate (:func:`surrogate_at`).
        """
        # One string at a time on purpose: encode_batch would start the Rayon pool
        # (see the module docstring about forked workers).
        try:
            if len(text) <= self.max_length * _PREFIX_CHARS_PER_TOKEN:
                enc = self._tokenizer.encode(text)
            else:
                enc = self._encode_long(text)
        except TypeError as exc:
            # tokenizers' only word for a str it cannot read (a surrogate in the part it
            # tokenizes) is "TextInputSequence must be str": look for the cause only
            # then, so a good caption pays nothing for the check.
            reason = surrogate_reason("the text", text) if isinstance(text, str) else None
            if reason is None:
                raise
            raise SampleError(reason, sample_id="<text>") from exc
        return np.array(enc.ids, dtype=np.int32), np.array(enc.attention_mask, dtype=np.int32)

    def _encode_long(self, text: str) -> Encoding:
        """The encoding of ``text``, computed from the shortest safe prefix.

        Tokenizing everything and truncating afterwards costs seconds and hundreds
        of MB per MB of text (normalisation, alignment and offset tracking run over
        all of it), so one huge caption stalls a worker or gets it killed. A prefix
        of ``n`` characters gives the same first tokens as the whole text as long as
        the cut cannot reach them. Normalisers (NFKC, lowercase, a
        SentencePiece charsmap) and pre-tokenizers (Metaspace, ByteLevel's regex,
        BERT's whitespace/punctuation split) look only a few characters around any
        position, and the model (BPE, WordPiece, Unigram) tokenizes each
        pre-tokenized word on its own. So a cut changes at most the word it falls in
        and, through a boundary character or a lookahead (ByteLevel's ``\\s+(?!\\S)``
        gives trailing spaces to the next word), the one before. A prefix is
        therefore accepted only when the kept tokens lie in words that end at least
        two word boundaries before the cut, and at least 8 more tokens follow them
        (:func:`_prefix_is_final`); then truncating its encoding keeps exactly
        the tokens the whole text would keep, and the post-processor (``[CLS] ...
        [SEP]``) and padding run on the same tokens, so the ids and mask are
        identical. Otherwise the prefix grows 4x, up to the whole text.

        Limit: with no word boundary (a tokenizer without a pre-tokenizer, or a
        caption that starts with megabytes of text without spaces, such as a base64
        blob) no prefix is provably safe, and the prefix grows to the end of that
        run: such a caption costs what it did before (plus at most a third for the
        prefixes tried), never a wrong token.
        """
        untruncated = self._untruncated
        if untruncated is None:
            # A second copy without truncation or padding, built on the first long
            # caption only (a big vocabulary costs tens of MB). Two threads racing
            # here both build one; either serves.
            untruncated = Tokenizer.from_str(self._json)
            untruncated.no_truncation()
            untruncated.no_padding()
            object.__setattr__(self, "_untruncated", untruncated)
        n = self.max_length * _PREFIX_CHARS_PER_TOKEN
        while n < len(text):
            enc = untruncated.encode(text[:n], add_special_tokens=False)
            if _prefix_is_final(enc.word_ids, self._content_length):
                # Truncation, special tokens and padding, exactly as encode() does them
                # after tokenizing.
                return self._tokenizer.post_process(enc)
            n *= _PREFIX_GROWTH
        return self._tokenizer.encode(text)

    def __getstate__(self) -> tuple[str, int, int]:
        return (self._json, self.max_length, self.pad_id)

    def __setstate__(self, state: tuple[str, int, int]) -> None:
        tokenizer_json, max_length, pad_id = state
        self._setup(tokenizer_json, max_length, pad_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TextSpec):
            return NotImplemented
        return self.fingerprint_fields() == other.fingerprint_fields()

    def __hash__(self) -> int:
        return hash((self.tokenizer_digest(), self.max_length, self.pad_id))

    def __repr__(self) -> str:
        return (
            f"TextSpec(tokenizer=<vocab {self.vocab_size}, {self.tokenizer_digest()[:12]}>, "
            f"max_length={self.max_length}, pad_id={self.pad_id})"
        )


def _prefix_is_final(word_ids: Sequence[int | None], keep: int) -> bool:
    """Whether the first ``keep`` tokens of a prefix's encoding are the whole text's.

    ``word_ids`` are the prefix encoding's (no special tokens): the index of the
    pre-tokenized word each token comes from. See :meth:`TextSpec._encode_long`.
    """
    if len(word_ids) < keep + _PREFIX_MARGIN_TOKENS:
        return False
    if keep == 0:  # nothing is kept: truncation drops every token, whatever they are
        return True
    kept, last = word_ids[keep - 1], word_ids[-1]
    if kept is None or last is None:  # no word information: cannot tell, grow
        return False
    return kept + _PREFIX_MARGIN_WORDS <= last


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 4096, *, min_frequency: int = 1
) -> Tokenizer:
    """Train a small BPE tokenizer on ``texts``, offline (nothing is downloaded).

    NFKC + lowercase normalisation; SentencePiece-style word boundaries (``▁`` marks
    a word start, so decoding restores spaces); the lowercase ASCII letters, digits
    and punctuation are always in the vocabulary (no ``[UNK]`` for them); specials
    ``[PAD]`` (id 0), ``[UNK]`` (1), ``[CLS]`` (2), ``[SEP]`` (3); every encoding is
    wrapped as ``[CLS] ... [SEP]``. The vocabulary stops growing when every word of
    ``texts`` is a single token, so it can end up smaller than ``vocab_size``.

    Deterministic: the same texts give the same tokenizer JSON in any process. (BPE
    without a continuing-subword prefix on purpose: the WordPiece trainer numbers its
    ``##x`` tokens in hash-map order, which changes from run to run.) Enough for
    demos, tests and benchmarks; real training uses its model's own tokenizer.

    >>> tok = train_tokenizer(["a dog on a bench", "a cat on a mat"], vocab_size=100)
    >>> tok.encode("A dog!").tokens
    ['[CLS]', '▁a', '▁dog', '!', '[SEP]']
    """
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    check_int("vocab_size", vocab_size, minimum=8)
    check_int("min_frequency", min_frequency, minimum=0)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))  # noqa: S106
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(_SPECIALS),
        initial_alphabet=list(_BASE_ALPHABET),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    return tok


if TYPE_CHECKING:  # mypy checks that TextSpec conforms to the protocol
    from mmcache.transforms.stage import Stage

    def _conforms(spec: TextSpec) -> Stage:
        return spec
