"""The chat stage: a conversation -> int32 ``input_ids`` and ``labels`` for supervised
fine-tuning (:class:`ChatSpec`).

One sample's conversation (:class:`Chat`: its messages and the geometry of its processed
images) is rendered with the model's chat template (:mod:`mmcache.transforms.chat_templates`),
tokenized once with offsets, and labelled from those offsets: a token is trained on
when its characters overlap an assistant message's content or the end-of-turn marker
the template writes right after it; every other token is ``-100``. The character span
of assistant message ``k`` is found exactly, not by searching: the conversation is
rendered again with that reply replaced by a marker character, and the reply sits where
the two renders differ (so a reply that also occurs in the question, or in the template's
own text, is still placed right). A template that changes a reply (``| trim``) is matched
by the stripped reply; one that rewrites it otherwise is a ``SampleError`` naming the
message, never a silently masked sample (the "tokenization mismatch" of LLaVA #1166).

Each image placeholder (``image_token``) becomes the image token id repeated
``image_tokens`` times, an int or a function of the processed image's ``(h, w)``
(known from the cached image's shape, never by decoding again). Truncation at
``max_length`` never cuts inside an image's run: when it would, the sample ends after
the last whole assistant turn before that image instead. A sample left with no
trainable token raises ``SampleError("fully masked ...")``.

Only the media runs may hold a vision token (the image token's id, the video pad's,
and the added tokens around their runs, such as ``<|vision_start|>``): the model
counts them against the images' and videos' features. A message that writes one as
text is a ``SampleError`` naming it, and before a sample is cached each vision token
is counted against the runs, so a chat template that writes one is refused too.
Refused, not escaped: ``transformers`` processors refuse such a text by default
(their placeholder and token counts), and its opt-in escape
(``apply_chat_template(sanitize_control_tokens=True)``) does not combine with the
assistant mask that SFT labels come from.

Thread and process safety: a :class:`ChatSpec` is immutable; it pickles to the
tokenizer's JSON and its options. One sample is encoded at a time (never
``encode_batch``, which would start the tokenizers thread pool before the DataLoader
forks its workers).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
import xxhash
from tokenizers import Tokenizer

from mmcache.checks import check_int
from mmcache.errors import ConfigError, SampleError
from mmcache.transforms.chat_parts import parts_messages, reads_parts
from mmcache.transforms.chat_templates import BUILTIN_TEMPLATES, compile_template, render
from mmcache.transforms.chat_tokenizer import (
    SPECIAL_NAMES,
    pad_id_of,
    tokenizer_digest,
    tokenizer_parts,
    vision_tokens,
)
from mmcache.transforms.fingerprint import callable_fingerprint
from mmcache.transforms.stage import StageKind
from mmcache.transforms.text import check_text, surrogate_reason
from mmcache.transforms.video import VideoTokens

__all__ = ["IGNORE_INDEX", "Chat", "ChatEncoding", "ChatSpec", "FullyMaskedError"]

#: The label of a token that is not trained on (PyTorch's ``CrossEntropyLoss`` default).
IGNORE_INDEX = -100

#: Bump when the meaning of ChatSpec's output changes for the same options.
CHAT_FORMAT_VERSION = 1

#: What a reply is replaced by to find where it renders (a private-use character: no
#: template strips or escapes it).
_MARK = "\ue000"

#: End-of-turn markers tried, in order, after an assistant reply of a custom template.
_EOT_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>")

ImageTokens = int | Callable[[int, int], int]

#: The metadata of a ChatSpec field rebuilt after unpickling instead of pickled.
_DERIVED = {"derived": True}


class FullyMaskedError(SampleError):
    """A conversation with no token to train on (no assistant reply, or every reply cut by
    truncation): the kind that :func:`mmcache.sources.chat.chat_lengths` counts as
    ``fully_masked``, told by its type rather than its text."""

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_fully_masked, (self.reason, self.sample_id, self.path))


def _rebuild_fully_masked(reason: str, sample_id: str, path: str | None) -> FullyMaskedError:
    return FullyMaskedError(reason, sample_id=sample_id, path=path)


@dataclass(frozen=True)
class Chat:
    """One sample's conversation: ``messages`` as ``(role, content)`` pairs (roles
    ``"system"``, ``"user"``, ``"assistant"``...), with ``image_token`` placeholders in
    the contents, and ``image_sizes``: the ``(h, w)`` of each processed image, in the
    order of the placeholders (empty for a text-only sample)."""

    messages: tuple[tuple[str, str], ...]
    image_sizes: tuple[tuple[int, int], ...] = ()
    #: ``(t, h, w)`` of each processed video, in the order of the video placeholders.
    video_sizes: tuple[tuple[int, int, int], ...] = ()
    #: Each video's kept frames' times in seconds (what ``VideoTokens(timestamps=True)``
    #: writes; may be left empty otherwise).
    video_times: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True)
class ChatEncoding:
    """What :meth:`ChatSpec.encode` makes of a :class:`Chat`.

    ``input_ids``/``labels``: int32 ``[L]``; ``n_images``: how many images (the first
    ones) kept their token run after truncation; ``truncated``: whether tokens were
    dropped; ``full_length``: the length before truncation."""

    input_ids: npt.NDArray[np.int32]
    labels: npt.NDArray[np.int32]
    n_images: int
    truncated: bool
    full_length: int
    image_runs: tuple[tuple[int, int], ...] = field(default=())
    #: How many videos (the first ones) kept their tokens after truncation.
    n_videos: int = 0

    @property
    def trainable(self) -> int:
        """The number of tokens whose label is not ``-100``."""
        return int(np.count_nonzero(self.labels != IGNORE_INDEX))


@dataclass(frozen=True, eq=False, repr=False)
class ChatSpec:
    """How a conversation becomes int32 ``input_ids`` and ``labels``: a text
    :class:`~mmcache.transforms.stage.Stage` for supervised fine-tuning.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``, a ``tokenizer.json`` path or a
            ``transformers`` fast tokenizer (its ``bos_token``/``eos_token``... and
            ``chat_template`` are used when not given here).
        template: a Jinja chat template in the Hugging Face format, or a built-in name:
            ``"chatml"``, ``"llama3"``, ``"vicuna_v1"``; ``None``: the transformers
            tokenizer's own ``chat_template``.
        max_length: the most tokens a sample keeps (image tokens included); longer
            ones are truncated (see the module docstring).
        image_token: the placeholder that marks where an image goes in a message.
        image_token_id: the id its run is made of; default: the tokenizer's id of
            ``image_token`` (ConfigError if the tokenizer has none). Any int32: ``-200``
            with ``image_tokens=1`` is LLaVA's own ``IMAGE_TOKEN_INDEX`` convention.
        image_tokens: tokens per image: an int (576 for LLaVA-1.5 at 336 px, 1 for
            models that expand in the model) or a function ``(h, w) -> int`` of the
            processed image's size (``SmartResize(...).image_tokens`` for Qwen2-VL).
            A function enters the fingerprint by its code (see
            :func:`~mmcache.transforms.fingerprint.callable_fingerprint`).
        end_of_turn: the marker after an assistant reply that is trained on with it;
            default: the built-in template's, else the first of ``<|im_end|>``,
            ``<|eot_id|>``, ``<|end|>``, ``<end_of_turn>``, ``</s>`` (or the eos token)
            found right after each reply; ``""``: none.
        bos_token, eos_token: the special tokens the template reads; default: the
            transformers tokenizer's, else the built-in template's, else ``""``.
        image_prefix, image_suffix: text whose tokens go around each image's run (never
            trained on), e.g. Qwen2-VL's ``"<|vision_start|>"`` and ``"<|vision_end|>"``
            with ``image_token_id`` = the id of ``<|image_pad|>``.
        pad_id: what batches pad ``input_ids`` with (:attr:`pad_id`; the cache holds no
            padding, so it is not in the fingerprint); default
            :func:`~mmcache.transforms.chat_tokenizer.pad_id_of`.
        video: how each ``<video>`` placeholder expands
            (:class:`~mmcache.transforms.video.VideoTokens`: Qwen2.5-VL's video tokens, or
            LLaVA-Video's per-frame image runs); ``None``: a placeholder stays text.
        content_parts: render each message's content as a list of ``{"type": "image"}``
            / ``{"type": "text"}`` parts (:mod:`~mmcache.transforms.chat_parts`), for a
            template that reads only that form (llava-1.5-hf's); ``None``: when the
            template renders no string content (probed once); ``False``: strings.

    The fingerprint covers the tokenizer's content (canonical JSON), the template text,
    ``max_length`` and every option. Immutable, picklable, thread-safe; ConfigError on
    invalid values.
    """

    kind: ClassVar[StageKind] = "text"

    # The fields, written once. Given ones are resolved in place by __post_init__ (the
    # tokenizer becomes a tokenizers.Tokenizer, the template its text, a None default
    # its value); a pickle carries every field but the ``derived`` ones, which _derive
    # rebuilds from the others (the tokenizer from its tokenizer.json text). Add an
    # option as one field here (and, if it changes the output, in fingerprint_fields).
    tokenizer: Any = field(metadata=_DERIVED)
    template: str | None = None
    max_length: int = 2048
    _: KW_ONLY
    image_token: str = "<image>"  # noqa: S105 (a placeholder, not a password)
    image_token_id: int | None = None
    image_tokens: ImageTokens = 1
    end_of_turn: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    image_prefix: str = ""
    image_suffix: str = ""
    pad_id: int | None = None
    video: VideoTokens | None = None
    content_parts: bool | None = None
    template_name: str | None = field(init=False, default=None)
    special_tokens: dict[str, str] = field(init=False, default_factory=dict)
    _json: str = field(init=False, default="")
    video_token_id: int = field(init=False, default=-1, metadata=_DERIVED)
    _digest: str = field(init=False, default="", metadata=_DERIVED)
    _wrap: tuple[npt.NDArray[np.int32], ...] = field(init=False, metadata=_DERIVED)
    _video_wrap: tuple[npt.NDArray[np.int32], ...] = field(init=False, metadata=_DERIVED)
    #: The vision tokens (id -> text) that only a media run may hold (:meth:`_derive`).
    _vision: dict[int, str] = field(init=False, metadata=_DERIVED)
    #: Their texts that a record's message may not write (the placeholders aside).
    _literals: tuple[str, ...] = field(init=False, metadata=_DERIVED)

    def __post_init__(self) -> None:
        tokenizer_json, specials, own_template = tokenizer_parts(self.tokenizer)
        template, end_of_turn, name = self.template, self.end_of_turn, None
        if template is None:
            if own_template is None:
                raise ConfigError(
                    "ChatSpec.template is required (a Jinja chat template or one of "
                    f"{sorted(BUILTIN_TEMPLATES)}) unless the transformers tokenizer has one"
                )
            template = own_template
        if not isinstance(template, str) or not template:
            raise ConfigError(f"ChatSpec.template must be a non-empty str, got {template!r}")
        builtin = BUILTIN_TEMPLATES.get(template)
        if builtin is not None:
            name, template = template, builtin.text
            specials.setdefault("bos_token", builtin.bos_token)
            specials.setdefault("eos_token", builtin.eos_token)
            if end_of_turn is None:
                end_of_turn = builtin.end_of_turn
        if self.bos_token is not None:
            specials["bos_token"] = self.bos_token
        if self.eos_token is not None:
            specials["eos_token"] = self.eos_token
        self._check_texts(template, specials)
        pad_id = self.pad_id
        if pad_id is None:
            pad_id = pad_id_of(Tokenizer.from_str(tokenizer_json), specials)
        # Only the tokens the template can read (by naming them) change its output.
        specials = {k: v for k, v in specials.items() if k in template}
        for key in SPECIAL_NAMES[:2]:
            specials.setdefault(key, "")
        resolved = {
            "_json": tokenizer_json,
            "template": template,
            "template_name": name,
            "end_of_turn": end_of_turn,
            "special_tokens": specials,
            "bos_token": specials.get("bos_token"),
            "eos_token": specials.get("eos_token"),
            "pad_id": pad_id,
        }
        for key, value in resolved.items():
            object.__setattr__(self, key, value)
        self._derive()

    def _derive(self) -> None:
        """Check the resolved fields and build the derived ones (the tokenizer object,
        its digest, the image wrap's tokens, the video pad id): after __post_init__ and
        after unpickling."""
        setattr_ = object.__setattr__
        setattr_(self, "max_length", check_int("ChatSpec.max_length", self.max_length, minimum=1))
        setattr_(self, "pad_id", check_int("ChatSpec.pad_id", self.pad_id, minimum=0))
        for label in ("image_prefix", "image_suffix"):
            value = getattr(self, label)
            if not isinstance(value, str):
                raise ConfigError(f"ChatSpec.{label} must be a str, got {value!r}")
        image_token, end_of_turn = self.image_token, self.end_of_turn
        if not isinstance(image_token, str) or not image_token:
            raise ConfigError(f"ChatSpec.image_token must be a non-empty str, got {image_token!r}")
        if end_of_turn is not None and not isinstance(end_of_turn, str):
            raise ConfigError(f"ChatSpec.end_of_turn must be a str or None, got {end_of_turn!r}")
        if not callable(self.image_tokens):
            check_int("ChatSpec.image_tokens", self.image_tokens, minimum=1)
        tok = Tokenizer.from_str(self._json)
        tok.no_padding()
        tok.no_truncation()
        if self.image_token_id is None:
            found = tok.token_to_id(image_token)
            if found is None:
                raise ConfigError(
                    f"the tokenizer has no token {image_token!r}: add it as a special token "
                    "(tokenizer.add_special_tokens) or pass ChatSpec(image_token_id=...)"
                )
            image_id = int(found)
        else:
            # Any int32: LLaVA's own code marks an image with -200 (IMAGE_TOKEN_INDEX).
            image_id = check_int(
                "ChatSpec.image_token_id", self.image_token_id, minimum=-(2**31), maximum=2**31 - 1
            )
        setattr_(self, "image_token_id", image_id)
        video = self.video
        if video is not None and not isinstance(video, VideoTokens):
            raise ConfigError(f"ChatSpec.video must be a VideoTokens, got {video!r}")
        video_id = -1
        if video is not None and not video.per_frame:
            found_id = tok.token_to_id(video.pad_token)
            if found_id is None:
                raise ConfigError(f"the tokenizer has no token {video.pad_token!r} (VideoTokens)")
            video_id = int(found_id)
        compile_template(self.template)  # ConfigError now for a template that does not parse
        template, specials, content_parts = (
            self.template or "",
            self.special_tokens,
            self.content_parts,
        )
        if content_parts is None:  # a probe render decides once (a pickle carries the answer)
            content_parts = reads_parts(lambda m: render(template, m, specials), image_token)
        elif not isinstance(content_parts, bool):
            raise ConfigError(
                f"ChatSpec.content_parts must be a bool or None, got {content_parts!r}"
            )
        setattr_(self, "content_parts", content_parts)
        setattr_(self, "special_tokens", dict(self.special_tokens))
        setattr_(self, "_digest", tokenizer_digest(self._json))
        setattr_(self, "tokenizer", tok)
        setattr_(self, "video_token_id", video_id)
        wrap = _encode_wrap(tok, self.image_prefix, self.image_suffix)
        video_wrap: tuple[npt.NDArray[np.int32], ...] = ()
        if video is not None and not video.per_frame:
            video_wrap = _encode_wrap(tok, video.prefix, video.suffix)
        setattr_(self, "_wrap", wrap)
        setattr_(self, "_video_wrap", video_wrap)
        self._derive_vision(tok, image_id, [*wrap, *video_wrap])
        self.fingerprint()  # refuses an image_tokens function that cannot be hashed

    def _check_texts(self, template: str, specials: dict[str, str]) -> None:
        """ConfigError naming the field for a configuration string holding a lone
        surrogate: it would reach the tokenizer with every sample, which refuses it
        with a bare TypeError (the template and the special tokens it writes), or could
        never match a record's text (a placeholder, a marker)."""
        texts: dict[str, object] = {
            "ChatSpec.template": template,
            "ChatSpec.image_token": self.image_token,
            "ChatSpec.end_of_turn": self.end_of_turn,
            "ChatSpec.image_prefix": self.image_prefix,
            "ChatSpec.image_suffix": self.image_suffix,
        }
        for key, token in specials.items():
            field_name = f"ChatSpec.{key}" if key in SPECIAL_NAMES[:2] else f"the tokenizer's {key}"
            texts[field_name] = token
        if isinstance(self.video, VideoTokens):
            for attr in ("placeholder", "pad_token", "prefix", "suffix"):
                texts[f"VideoTokens.{attr}"] = getattr(self.video, attr)
        for label, value in texts.items():
            if isinstance(value, str):  # (a wrong type is refused with its own message)
                check_text(label, value)

    def _derive_vision(
        self, tok: Tokenizer, image_id: int, wraps: Sequence[npt.NDArray[np.int32]]
    ) -> None:
        """The vision tokens: the image token's id, the video pad's, and the added tokens
        around their runs (:func:`~mmcache.transforms.chat_tokenizer.vision_tokens`).
        Qwen2-VL's and LLaVA's forward count them in ``input_ids`` against the images'
        and videos' features, so one written by the text makes a batch fail far from
        its sample; :meth:`encode` refuses it."""
        image_name = tok.id_to_token(image_id) if image_id >= 0 else None
        runs = {image_id: image_name or self.image_token}
        placeholders = {self.image_token}
        if self.video is not None:
            placeholders.add(self.video.placeholder)
            if self.video_token_id >= 0:
                runs[self.video_token_id] = self.video.pad_token
        vision = vision_tokens(tok, runs, itertools.chain.from_iterable(wraps))
        literals = tuple(sorted({t for t in vision.values() if t and t not in placeholders}))
        object.__setattr__(self, "_vision", vision)
        object.__setattr__(self, "_literals", literals)

    def __getstate__(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("derived")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._derive()

    def __repr__(self) -> str:
        text = self.template or ""  # (resolved: never None after __post_init__)
        tpl = self.template_name or f"<jinja {xxhash.xxh3_64_hexdigest(text.encode())[:8]}>"
        return (
            f"ChatSpec(tokenizer=<{self._digest[:12]}>, template={tpl}, "
            f"max_length={self.max_length}, image_token={self.image_token!r}, "
            f"image_tokens={self._image_tokens_token()})"
        )

    # -- fingerprint ----------------------------------------------------------------
    def _image_tokens_token(self) -> str | int:
        n = self.image_tokens
        if callable(n):
            return "fn:" + callable_fingerprint(n)
        return int(n)

    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything about this spec that changes its output."""
        return {
            "version": CHAT_FORMAT_VERSION,
            "tokenizer": self._digest,
            "template": self.template,
            "max_length": self.max_length,
            "image_token": self.image_token,
            "image_token_id": self.image_token_id,
            "image_tokens": self._image_tokens_token(),
            "end_of_turn": self.end_of_turn,
            "special_tokens": self.special_tokens,
            "image_prefix": self.image_prefix,
            "image_suffix": self.image_suffix,
            "labels": "offsets",
        }

    def fingerprint(self) -> str:
        """xxh3-128 hex digest of :meth:`fingerprint_fields` (and of the video tokens'
        fields when set: a spec without them keeps the fingerprint it always had)."""
        fields = self.fingerprint_fields()
        if self.video is not None:
            fields = {**fields, "video": self.video.fingerprint_fields()}
        if self.content_parts:  # absent otherwise: a string-content spec keeps its key
            fields = {**fields, "content": "parts"}
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_hexdigest(blob.encode())

    @property
    def image_wrap_lengths(self) -> tuple[int, int]:
        """How many tokens go before and after each image's run (``image_prefix`` and
        ``image_suffix`` tokenized): what a frame sampler drops with a frame's run."""
        return len(self._wrap[0]), len(self._wrap[1])

    # -- encoding -------------------------------------------------------------------
    def tokens_for_image(self, h: int, w: int) -> int:
        """How many tokens an image processed to ``h x w`` becomes (>= 1)."""
        n = self.image_tokens
        count = n(h, w) if callable(n) else n
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise SampleError(
                f"image_tokens({h}, {w}) gave {count!r}, not an int >= 1", sample_id="<chat>"
            )
        return int(count)

    def __call__(self, chat: Chat, /) -> dict[str, npt.NDArray[np.int32]]:
        """``{"input_ids", "labels"}`` of :meth:`encode`. Raises SampleError."""
        enc = self.encode(chat)
        return {"input_ids": enc.input_ids, "labels": enc.labels}

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        """The template's text for ``messages`` (no generation prompt). SampleError when
        the template raises (``raise_exception``, a role it does not know...)."""
        return self._render([{"role": r, "content": c} for r, c in messages])

    def _render(self, messages: list[dict[str, str]]) -> str:
        import jinja2

        if self.content_parts:
            messages = parts_messages(messages, self.image_token)
        try:
            return render(self.template or "", messages, self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise SampleError(
                f"the chat template refused the conversation: {exc}", sample_id="<chat>"
            ) from exc
        except Exception as exc:
            # A template is user code run in jinja's sandbox: 1/0, a range over the
            # sandbox's limit, an {% import %} without a loader each raise their own
            # type. Each is this sample's failure, named, never a raw exception.
            raise SampleError(
                f"the chat template failed on the conversation: {type(exc).__name__}: {exc}",
                sample_id="<chat>",
            ) from exc

    def encode(self, chat: Chat, *, sample_id: str = "<chat>") -> ChatEncoding:
        """Render, tokenize, label and truncate one conversation (see the module
        docstring). Raises SampleError (naming ``sample_id``) for a placeholder count
        that differs from ``len(chat.image_sizes)``, a message holding a lone surrogate
        or writing a vision token (see :meth:`_check_messages`), a template that
        rewrites a reply, and a fully masked result."""
        self._check_messages(chat, sample_id)
        messages = [{"role": r, "content": c} for r, c in chat.messages]
        placeholders = sum(c.count(self.image_token) for _, c in chat.messages)
        if placeholders != len(chat.image_sizes):
            raise SampleError(
                f"{placeholders} {self.image_token!r} placeholders for "
                f"{len(chat.image_sizes)} images",
                sample_id=sample_id,
            )
        self._check_videos(chat, sample_id)
        try:
            text = self._render(messages)
            spans = self._assistant_spans(messages, text)
        except SampleError as err:
            raise SampleError(err.reason, sample_id=sample_id) from err
        ids, starts, ends, runs, blocks = self._tokenize(text, chat, sample_id)
        trainable = np.zeros(len(ids), dtype=bool)
        real = ends > starts
        for a, b in spans:
            trainable |= real & (starts < b) & (ends > a)
        labels = np.where(trainable, ids, IGNORE_INDEX).astype(np.int32)
        full = len(ids)
        cut = full
        if full > self.max_length:
            cut = self.max_length
            pre, post = (int(t.size) for t in self._wrap)  # a run with its wrap is one
            inside = [(a - pre, b + post) for a, b in runs if a - pre < cut < b + post]
            inside += [(a, b) for a, b in blocks if a < cut < b]  # a video's whole block
            if inside:
                # Never split an image run: end after the last whole assistant turn
                # (its end-of-turn marker included) that precedes the image.
                run_start = min(a for a, _ in inside)
                ends_before = [int(e) for e in _span_token_ends(spans, ends) if e <= run_start]
                cut = max(ends_before, default=0)
        kept_runs = tuple((a, b) for a, b in runs if b + int(self._wrap[1].size) <= cut)
        enc = ChatEncoding(
            input_ids=np.ascontiguousarray(ids[:cut]),
            labels=np.ascontiguousarray(labels[:cut]),
            n_images=len(kept_runs),
            truncated=cut < full,
            full_length=full,
            image_runs=kept_runs,
            n_videos=sum(1 for _, b in blocks if b <= cut),
        )
        if enc.trainable == 0:
            why = (
                "fully masked after truncation"
                if enc.truncated
                else "fully masked: no assistant token to train on"
            )
            raise FullyMaskedError(why, sample_id=sample_id)
        return enc

    def _assistant_spans(self, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
        """Character spans ``[a, b)`` of each assistant reply in ``text`` (its end-of-turn
        marker included), found by rendering with that reply replaced by a marker."""
        spans: list[tuple[int, int]] = []
        mark = _free_mark(text, messages)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            content = message["content"]
            marked = [*messages[:k], {**message, "content": mark}, *messages[k + 1 :]]
            start, rendered = _placed(text, self._render(marked), mark)
            if start < 0 or rendered not in (content, content.strip()):
                raise SampleError(
                    f"the chat template rewrites assistant message {k} (its reply is not in "
                    "the rendered text): labels cannot be placed",
                    sample_id="<chat>",
                )
            end = start + len(rendered)
            end += len(self._end_of_turn_at(text, end))
            spans.append((start, end))
        return spans

    def _end_of_turn_at(self, text: str, pos: int) -> str:
        if self.end_of_turn is not None:
            return self.end_of_turn if text.startswith(self.end_of_turn, pos) else ""
        eos = self.special_tokens.get("eos_token", "")
        for marker in (*_EOT_CANDIDATES, eos):
            if marker and text.startswith(marker, pos):
                return marker
        return ""

    def _check_messages(self, chat: Chat, sample_id: str) -> None:
        """SampleError naming the message for one that holds a lone surrogate (no
        tokenizer reads it) or writes a vision token, such as ``<|video_pad|>`` or
        ``<|vision_start|>``, as text.

        Such a token would be tokenized as the vision token itself: the sample would hold
        more of it than its images and videos account for, and the model's forward
        fails on its batch, steps later and naming no sample (Qwen2-VL: "video features
        and video tokens do not match"); in a reply it would also be trained on.
        Refused, as the model's processor refuses it, rather than escaped (the module
        docstring says why). The placeholders are counted instead (a surplus one is
        refused by that count)."""
        for k, (role, content) in enumerate(chat.messages):
            reason = surrogate_reason(f"message {k} ({role})", content)
            if reason is not None:
                raise SampleError(reason, sample_id=sample_id)
            for token in self._literals:
                if token in content:
                    trained = "; a reply would also be trained on it" if role == "assistant" else ""
                    raise SampleError(
                        f"message {k} ({role}) writes the vision token {token!r} as text: the "
                        f"sample would hold more {token!r} tokens than its images and videos "
                        f"account for, and the model's forward fails on its batch{trained}. "
                        "Remove it from the record's text",
                        sample_id=sample_id,
                    )

    def _check_videos(self, chat: Chat, sample_id: str) -> None:
        """SampleError when the video placeholders and ``chat.video_sizes`` disagree."""
        if self.video is None:
            if chat.video_sizes:
                raise SampleError(
                    "the sample has videos, but the ChatSpec has no video= (VideoTokens)",
                    sample_id=sample_id,
                )
            return
        found = sum(c.count(self.video.placeholder) for _, c in chat.messages)
        if found != len(chat.video_sizes):
            raise SampleError(
                f"{found} {self.video.placeholder!r} placeholders for "
                f"{len(chat.video_sizes)} videos",
                sample_id=sample_id,
            )

    def _tokenize(
        self, text: str, chat: Chat, sample_id: str
    ) -> tuple[
        npt.NDArray[np.int32],
        npt.NDArray[np.int64],
        npt.NDArray[np.int64],
        list[tuple[int, int]],
        list[tuple[int, int]],
    ]:
        """Token ids with their character offsets (a media run's are empty), the token
        ranges of the image runs, and each video's whole block of tokens (its wrap
        included). The text is split at the placeholders and each piece tokenized
        alone, as an added placeholder token splits it in the tokenizer."""
        marks = [self.image_token] + ([self.video.placeholder] if self.video else [])
        split = re.compile("(" + "|".join(re.escape(m) for m in sorted(marks, key=len)[::-1]) + ")")
        parts = split.split(text)
        pieces, found = parts[0::2], parts[1::2]
        n_images = found.count(self.image_token)
        if n_images != len(chat.image_sizes) or len(found) - n_images != len(chat.video_sizes):
            raise SampleError(
                f"the rendered conversation has {n_images} {self.image_token!r} placeholders "
                f"for {len(chat.image_sizes)} images and {len(found) - n_images} video ones "
                f"for {len(chat.video_sizes)} videos (the template adds or drops some)",
                sample_id=sample_id,
            )
        ids: list[npt.NDArray[np.int32]] = []
        texts: list[npt.NDArray[np.int32]] = []  # the text pieces' ids (no media run)
        spans: list[npt.NDArray[np.int64]] = []  # [n, 2] character offsets per part
        runs: list[tuple[int, int]] = []
        blocks: list[tuple[int, int]] = []
        count = base = 0

        def emit(part: npt.NDArray[np.int32]) -> None:
            nonlocal count
            if part.size:
                ids.append(part)
                spans.append(np.full((part.size, 2), base, dtype=np.int64))  # never trained
                count += part.size

        def position() -> int:
            return count

        def image_run(h: int, w: int) -> None:
            try:
                n = self.tokens_for_image(int(h), int(w))
            except SampleError as err:
                raise SampleError(err.reason, sample_id=sample_id) from err
            emit(self._wrap[0])
            runs.append((count, count + n))
            emit(np.full(n, self.image_token_id, dtype=np.int32))
            emit(self._wrap[1])

        images, videos = iter(chat.image_sizes), iter(chat.video_sizes)
        times = iter(chat.video_times)
        for i, piece in enumerate(pieces):
            if piece:
                enc = self.tokenizer.encode(piece, add_special_tokens=False)
                if enc.ids:
                    texts.append(np.asarray(enc.ids, dtype=np.int32))
                    ids.append(texts[-1])
                    flat = itertools.chain.from_iterable(enc.offsets)
                    pairs = np.fromiter(flat, dtype=np.int64, count=2 * len(enc.ids))
                    spans.append(pairs.reshape(-1, 2) + base)
                    count += len(enc.ids)
            base += len(piece)
            if i == len(found):
                break
            if found[i] == self.image_token:
                image_run(*next(images))
            else:
                clip_times = next(times, None)
                self._video_block(next(videos), emit, image_run, blocks, position, times=clip_times)
            base += len(found[i])
        if not ids:
            empty = np.zeros(0, dtype=np.int64)
            return np.zeros(0, dtype=np.int32), empty, empty, runs, blocks
        offsets = np.concatenate(spans)
        every = np.concatenate(ids)
        self._check_vision_counts(every, texts, sample_id)
        return every, offsets[:, 0], offsets[:, 1], runs, blocks

    def _check_vision_counts(
        self, ids: npt.NDArray[np.int32], texts: list[npt.NDArray[np.int32]], sample_id: str
    ) -> None:
        """SampleError unless each vision token occurs in ``ids`` exactly as many times
        as the images' and videos' runs put it there (their grids' counts): the text
        pieces' ids (``texts``) hold none. The last check before a sample is cached; it
        also sees what :meth:`_check_messages` cannot: a chat template that writes a
        vision token, or a spelling the tokenizer reads as one (an added token matched
        after normalisation)."""
        text = np.concatenate(texts) if texts else ids[:0]
        for token, name in self._vision.items():  # a few ids: one compare each
            extra = int(np.count_nonzero(text == token))
            if extra:
                total = int(np.count_nonzero(ids == token))
                raise SampleError(
                    f"{total} {name!r} tokens where the sample's images and videos account "
                    f"for {total - extra}: the chat template, or text the tokenizer reads as "
                    f"{name!r}, writes the other {extra}, and the model's forward would fail "
                    "on its batch",
                    sample_id=sample_id,
                )

    def _video_block(
        self,
        size: tuple[int, int, int],
        emit: Callable[[npt.NDArray[np.int32]], None],
        image_run: Callable[[int, int], None],
        blocks: list[tuple[int, int]],
        position: Callable[[], int],
        *,
        times: tuple[float, ...] | None,
    ) -> None:
        """Emit one video's tokens (see :class:`~mmcache.transforms.video.VideoTokens`)
        and record its block. SampleError when timestamped tokens have no frame times
        for each frame."""
        video = self.video
        assert video is not None
        t, h, w = (int(v) for v in size)
        start = position()
        if video.per_frame:
            for _ in range(t):
                image_run(h, w)
        elif video.timestamps:
            if times is None or len(times) != t:
                raise SampleError(
                    f"VideoTokens(timestamps=True) needs each of the video's {t} frames' "
                    f"times, got {0 if times is None else len(times)}",
                    sample_id="<chat>",
                )
            per_step = video.count(video.temporal_patch_size, h, w)
            pads = np.full(per_step, self.video_token_id, dtype=np.int32)
            emit(self._video_wrap[0])
            for seconds in video.step_times(times):
                stamp = self.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
                emit(np.asarray(stamp.ids, dtype=np.int32))
                emit(self._video_wrap[0])
                emit(pads)
                emit(self._video_wrap[1])
            emit(self._video_wrap[1])
        else:
            emit(self._video_wrap[0])
            emit(np.full(video.count(t, h, w), self.video_token_id, dtype=np.int32))
            emit(self._video_wrap[1])
        blocks.append((start, position()))


def _encode_wrap(tok: Tokenizer, *texts: str) -> tuple[npt.NDArray[np.int32], ...]:
    """The token ids of each of ``texts`` (a run's prefix and suffix; none for ``""``)."""
    return tuple(
        np.asarray(tok.encode(t, add_special_tokens=False).ids if t else [], np.int32)
        for t in texts
    )


def _free_mark(text: str, messages: list[dict[str, str]]) -> str:
    """A marker found neither in the rendered ``text`` nor in any message: the first
    private-use character absent from both (U+E000 first), or, for a conversation using
    them all, a run of them. A user turn holding U+E000 (icon-font text scraped from the
    web) is then labelled like any other, never refused as a rewritten reply."""
    seen = set(text).union(*(m["content"] for m in messages))
    for code in range(0xE000, 0xF900):  # the Basic Multilingual Plane's private-use area
        if chr(code) not in seen:
            return chr(code)
    mark = _MARK * 2
    while mark in text or any(mark in m["content"] for m in messages):
        mark += _MARK
    return mark


def _placed(text: str, marked: str, mark: str = _MARK) -> tuple[int, str]:
    """Where the reply sits in ``text``, given ``marked``: the same render with that reply
    replaced by ``mark`` (absent from the conversation). Both share everything but the
    reply, so it starts where they first differ and ends where their common end begins:
    ``(start, reply as rendered)``, or ``(-1, "")`` when ``marked`` is not ``text`` with
    one mark in place of one substring (a template that uses the reply twice, or branches
    on it)."""
    if marked.count(mark) != 1:
        return -1, ""
    h = marked.index(mark)
    tail = marked[h + len(mark) :]
    if not text.startswith(marked[:h]) or not text.endswith(tail) or len(text) < h + len(tail):
        return -1, ""
    return h, text[h : len(text) - len(tail)]


def _span_token_ends(spans: list[tuple[int, int]], ends: npt.NDArray[np.int64]) -> list[int]:
    """For each character span, the index just past its last token (tokens ending at or
    before the span's end)."""
    return [int(np.searchsorted(ends, b, side="right")) for _, b in spans]


if TYPE_CHECKING:  # mypy checks that ChatSpec conforms to the protocol
    from mmcache.transforms.stage import Stage

    def _conforms(spec: ChatSpec) -> Stage:
        return spec
