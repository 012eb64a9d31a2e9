"""A small synthetic source of SFT samples in the cached format, for tests and benchmarks.

:class:`SyntheticSFTSource` produces, per sample, what a chat-template text stage and
a VLM image stage cache (the format the loader's SFT batches are made from, see
:mod:`mmcache.loader.padding`):

- ``input_ids`` int32 ``[L]`` and ``labels`` int32 ``[L]`` (``-100``: not trained),
  no padding; each image's placeholder expanded to ``image_tokens(h, w)`` copies of
  ``image_token_id``;
- ``images`` uint8 ``[sum 3*h*w]``: each image's C-contiguous ``[3, h, w]`` bytes one
  after the other, and ``image_sizes`` int32 ``[n, 2]`` (``n = 0`` for a text-only
  sample: ``images`` ``[0]`` and ``image_sizes`` ``[0, 2]``).

It also answers what the loader's length grouping and packing ask of a source
(:mod:`mmcache.loader.lengths`): ``lengths()`` (tokens per sample, without producing
anything) and ``modalities()`` (whether each sample has an image). Everything is a pure
function of ``(seed, index)``: a sample is the same in every process. Stamps are
``FIXED`` (nothing to re-check). ``masked=`` names samples whose labels are all
``-100``: like a chat stage, the source refuses them (a ``SampleError``), so a loader
never yields them.

Thread/process safety: read-only after construction but for the reject log
(process-safe); pickles to a few small arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from mmcache import keys
from mmcache.errors import SampleError
from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.sources.rejects import Reject, RejectLog

__all__ = ["SyntheticSFTSource"]

_FIELDS = ("input_ids", "labels", "images", "image_sizes")


def _one_token(h: int, w: int) -> int:
    return 1


class SyntheticSFTSource:
    """``n`` synthetic SFT samples: token counts in ``[min_text, max_text]`` plus image
    runs; ``image_counts`` cycles through the image counts given (0: text-only) and
    each image takes one of ``shapes`` (``(h, w)``).

    Args:
        n: samples.
        seed: what every sample is a function of (with its index).
        vocab: token ids are drawn from ``[image_token_id + 1, vocab)``.
        image_token_id: the id an image placeholder expands to.
        image_tokens: tokens per image as a function of its ``(h, w)``.
        image_counts: images per sample, cycled over the indices.
        shapes: image shapes, cycled over the images.
        masked: indices whose labels would all be ``-100`` (refused by :meth:`produce`).
        pad_token_id: what the loader pads ``input_ids`` with (read by the loader).
        on_error: ``"raise"`` or ``"skip"``.
    """

    stamp_kind = StampKind.FIXED

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        vocab: int = 512,
        min_text: int = 4,
        max_text: int = 40,
        image_token_id: int = 3,
        image_tokens: Callable[[int, int], int] = _one_token,
        image_counts: Sequence[int] = (1, 0, 2),
        shapes: Sequence[tuple[int, int]] = ((16, 16), (16, 24)),
        masked: Sequence[int] = (),
        pad_token_id: int = 0,
        on_error: OnError = "raise",
    ) -> None:
        self.n = n
        self.seed = seed
        self.vocab = vocab
        self.image_token_id = image_token_id
        self.pad_token_id = pad_token_id
        self.on_error: OnError = on_error
        self.varying_fields = frozenset(_FIELDS)
        self.channels_last_fields: frozenset[str] = frozenset()
        rng = np.random.default_rng([seed, n])
        self._text = rng.integers(min_text, max_text + 1, size=n).astype(np.int64)
        counts = list(image_counts)
        self._counts = np.array([counts[i % len(counts)] for i in range(n)], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(self._counts)])
        self._first_image = starts[:-1]
        self._shapes = [tuple(s) for s in shapes]
        self._masked = frozenset(int(i) for i in masked)
        self._image_tokens = image_tokens
        img_tokens = np.zeros(n, dtype=np.int64)
        for i in range(n):
            img_tokens[i] = sum(image_tokens(*self._shape(i, k)) for k in range(self._counts[i]))
        self._lengths = self._text + img_tokens
        self._fingerprint = xxhash.xxh3_128_hexdigest(
            repr(
                (seed, n, vocab, min_text, max_text, image_token_id, counts, self._shapes)
            ).encode()
            + img_tokens.tobytes()
        )
        self._rejects = RejectLog()

    def _shape(self, index: int, k: int) -> tuple[int, int]:
        h, w = self._shapes[int(self._first_image[index] + k) % len(self._shapes)]
        return int(h), int(w)

    # -- the protocol ---------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n

    def sample_id(self, index: int) -> str:
        return f"sft-{index:06d}"

    def ids(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        return [self.sample_id(int(i)) for i in np.asarray(indices).reshape(-1)]

    def ids_digest(self) -> str:
        return xxhash.xxh3_128_hexdigest(f"sft:{self.n}".encode())

    def fingerprint(self) -> str:
        return self._fingerprint

    def describe(self) -> str:
        return f"SyntheticSFTSource(n={self.n}, seed={self.seed})"

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return np.stack([idx, np.full_like(idx, self.seed)], axis=1)

    def key(self, index: int) -> bytes:
        return keys.sample_key(self.sample_id(index), f"fixed:{self.seed}", self._fingerprint)

    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = np.empty((len(idx), 16), dtype=np.uint8)
        for j, i in enumerate(idx.tolist()):
            out[j] = np.frombuffer(self.key(i), dtype=np.uint8)
        return out

    def produce(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.n:
            raise IndexError(f"sample index {index} out of range for {self.n} samples")
        if index in self._masked:
            raise SampleError(
                "fully masked: no assistant token to train on", sample_id=self.sample_id(index)
            )
        rng = np.random.default_rng([self.seed, index, 1])
        text = int(self._text[index])
        ids = rng.integers(self.image_token_id + 1, self.vocab, size=text).astype(np.int32)
        # The first half is the prompt (not trained), the rest the answer.
        labels = ids.copy()
        labels[: text // 2] = -100
        count = int(self._counts[index])
        runs_ids: list[np.ndarray] = []
        images: list[np.ndarray] = []
        sizes = np.zeros((count, 2), dtype=np.int32)
        for k in range(count):
            h, w = self._shape(index, k)
            sizes[k] = (h, w)
            images.append(rng.integers(0, 256, size=(3, h, w), dtype=np.uint8).reshape(-1))
            run = np.full(self._image_tokens(h, w), self.image_token_id, dtype=np.int32)
            runs_ids.append(run)
        head = np.concatenate(runs_ids) if runs_ids else np.zeros(0, dtype=np.int32)
        return {
            "input_ids": np.concatenate([head, ids]).astype(np.int32),
            "labels": np.concatenate([np.full(len(head), -100, np.int32), labels]),
            "images": np.concatenate(images) if images else np.zeros(0, dtype=np.uint8),
            "image_sizes": sizes,
        }

    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]:
        item: dict[str, Any] = {"id": self.sample_id(index)}
        for name, array in sample.items():
            item[name] = torch.from_numpy(array if array.flags.writeable else array.copy())
        return item

    def record_reject(self, err: Exception) -> None:
        if not isinstance(err, SampleError):
            err = SampleError(f"{type(err).__name__}: {err}", sample_id="<unknown>")
        self._rejects.record(err)

    def rejects(self) -> list[Reject]:
        return self._rejects.read()

    # -- what length grouping and packing read ------------------------------------------
    def lengths(self) -> np.ndarray:
        """Tokens per sample (image runs included), exact, without producing anything;
        0 for a sample refused under ``on_error="skip"`` (``masked``)."""
        out: np.ndarray = self._lengths.copy()
        if self.on_error == "skip" and self._masked:
            out[sorted(self._masked)] = 0
        return out

    def modalities(self) -> np.ndarray:
        """Whether each sample has at least one image."""
        return np.asarray(self._counts > 0, dtype=bool)


if TYPE_CHECKING:

    def _conforms(source: SyntheticSFTSource) -> SampleSource:
        return source
