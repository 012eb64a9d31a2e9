"""SFT batches: variable-length samples padded to the batch's longest, or packed into one row.

A source of supervised fine-tuning samples caches, per sample, ``input_ids`` and
``labels`` (int32 ``[L]``, ``-100`` where not trained, no padding) and, with images,
``images`` (uint8: each image's C-contiguous ``[3, h, w]`` bytes one after the other)
with ``image_sizes`` (int32 ``[n, 2]``: h, w; ``n = 0`` for a text-only sample) and
optionally ``image_grid_thw`` (int32 ``[n, 3]``). These are the source's varying
fields, so an assembled batch holds them as lists of tensors, one per row
(:mod:`mmcache.loader.varying`). This module turns such a batch into what a model
takes:

:class:`PadHook` (``DataLoader`` default for such a source): ``input_ids`` int64
``[B, L]`` padded with the pad id, ``labels`` int64 ``[B, L]`` padded with ``-100``,
``attention_mask`` int64 ``[B, L]``, ``L`` the longest row rounded up to
``pad_to_multiple_of``.

:class:`PackHook` (``batching=SFTBatching(pack=PackSpec(...))``, one pack per batch): the rows
concatenated into ``input_ids``/``labels``/``position_ids`` int64 ``[1, T]``, with
``cu_seqlens`` int32 ``[k + 1]`` (sample boundaries, flash-attention's varlen form),
``position_ids`` restarting at 0 per sample and each sample's first label set to
``-100`` (the token before it belongs to another sample, so nothing predicts it).

Both: ``images`` uint8 ``[N, 3, H, W]`` when every image of the batch has one shape,
else a list of ``N`` ``[3, h, w]`` tensors (empty without images); ``image_sizes`` int64 ``[N, 2]``;
``image_counts`` int64 ``[B]`` (images per row, in order: rows' images are
consecutive, so a model maps image ``i`` to its sample); ``image_grid_thw`` int64
``[N, 3]`` when cached. Videos alike (a video SFT source caches ``videos``: each clip's
``[t, 3, h, w]`` bytes, and ``video_sizes`` int32 ``[n, 3]``): ``videos`` uint8
``[N, T, 3, H, W]`` when every clip has one shape, else a list of ``[t, 3, h, w]``;
``video_sizes`` int64 ``[N, 3]``; ``video_counts`` int64 ``[B]``; ``video_grid_thw``
int64 ``[N, 3]`` and ``second_per_grid_ts`` float32 ``[N]`` (Qwen2.5-VL's).
A row whose labels are all ``-100`` never reaches the model:
it is a :class:`~mmcache.errors.SampleError` naming it under ``on_error="raise"``,
dropped and recorded in the source's rejects under ``"skip"``.

Thread safety: the hooks are immutable; ``after_assemble`` runs on two threads at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmcache.errors import ConfigError, SampleError
from mmcache.hooks import BatchContext, LoaderHook
from mmcache.sources.base import SampleSource

__all__ = ["IGNORE_INDEX", "PackHook", "PadHook", "split_images", "split_videos"]

#: The label of a token that is not trained (torch's cross-entropy ``ignore_index``).
IGNORE_INDEX = -100
#: Fields the hooks replace; any other field of the batch passes through.
_TOKENS = ("input_ids", "labels")
_IMAGES = ("images", "image_sizes", "image_grid_thw")
_VIDEOS = ("videos", "video_sizes", "video_grid_thw", "second_per_grid_ts")


def _rows(batch: dict[str, Any], name: str) -> list[np.ndarray]:
    """Field ``name`` of each row as a 1-D/2-D numpy array (a list or a batch tensor)."""
    value = batch[name]
    if isinstance(value, torch.Tensor):
        return [value[r].numpy() for r in range(value.shape[0])]
    return [t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t) for t in value]


def split_images(flat: np.ndarray, sizes: np.ndarray, *, sample_id: str) -> list[np.ndarray]:
    """One sample's ``images`` (uint8, concatenated ``[3, h, w]`` bytes) as a list of
    ``[3, h, w]`` views, by its ``image_sizes``; SampleError when the bytes do not add up."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    counts = 3 * sizes[:, 0] * sizes[:, 1]
    if int(counts.sum()) != flat.size:
        raise SampleError(
            f"images holds {flat.size} bytes but image_sizes {sizes.tolist()} say "
            f"{int(counts.sum())} (3*h*w each)",
            sample_id=sample_id,
        )
    out = []
    start = 0
    for (h, w), c in zip(sizes.tolist(), counts.tolist(), strict=True):
        out.append(flat[start : start + c].reshape(3, h, w))
        start += c
    return out


def split_videos(flat: np.ndarray, sizes: np.ndarray, *, sample_id: str) -> list[np.ndarray]:
    """One sample's ``videos`` (uint8, concatenated ``[t, 3, h, w]`` bytes) as a list of
    ``[t, 3, h, w]`` views, by its ``video_sizes``; SampleError when the bytes do not add up."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 3)
    counts = 3 * sizes.prod(axis=1)
    if int(counts.sum()) != flat.size:
        raise SampleError(
            f"videos holds {flat.size} bytes but video_sizes {sizes.tolist()} say "
            f"{int(counts.sum())} (3*t*h*w each)",
            sample_id=sample_id,
        )
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    return [
        flat[a:b].reshape(t, 3, h, w)
        for (t, h, w), a, b in zip(sizes.tolist(), bounds[:-1], bounds[1:], strict=True)
    ]


class _SFTHook(LoaderHook):
    """What padding and packing share: the checks of the rows, and the image fields."""

    def __init__(self, source: SampleSource) -> None:
        self._source = source

    def _kept(self, batch: dict[str, Any]) -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
        """The rows to keep (fully masked ones refused), their input ids and labels."""
        ids = _rows(batch, "input_ids")
        labels = _rows(batch, "labels")
        keep = []
        for r, (x, y) in enumerate(zip(ids, labels, strict=True)):
            sid = batch["id"][r]
            if x.ndim != 1 or y.shape != x.shape:
                raise SampleError(
                    f"input_ids {x.shape} and labels {y.shape} must be 1-D of one length",
                    sample_id=sid,
                )
            if not (y != IGNORE_INDEX).any():
                err = SampleError(
                    "fully masked: every label is -100, nothing to train on", sample_id=sid
                )
                if self._source.on_error == "raise":
                    raise err
                self._source.record_reject(err)
                continue
            keep.append(r)
        return keep, [ids[r] for r in keep], [labels[r] for r in keep]

    def _images(self, batch: dict[str, Any], keep: list[int], out: dict[str, Any]) -> None:
        if "images" not in batch:
            return
        flats = _rows(batch, "images")
        sizes = _rows(batch, "image_sizes")
        images: list[np.ndarray] = []
        counts = np.zeros(len(keep), dtype=np.int64)
        for j, r in enumerate(keep):
            got = split_images(flats[r], sizes[r], sample_id=batch["id"][r])
            counts[j] = len(got)
            images.extend(got)
        shapes = {im.shape for im in images}
        if len(shapes) == 1:
            out["images"] = torch.from_numpy(np.stack(images))
        else:
            out["images"] = [torch.from_numpy(im) for im in images]  # views of the rows
        all_sizes = [np.asarray(sizes[r], dtype=np.int64).reshape(-1, 2) for r in keep]
        empty = np.zeros((0, 2), dtype=np.int64)
        out["image_sizes"] = torch.from_numpy(np.concatenate([empty, *all_sizes]))
        out["image_counts"] = torch.from_numpy(counts)
        if "image_grid_thw" in batch:
            grids = _rows(batch, "image_grid_thw")
            parts = [np.asarray(grids[r], dtype=np.int64).reshape(-1, 3) for r in keep]
            out["image_grid_thw"] = torch.from_numpy(
                np.concatenate(parts or [np.zeros((0, 3), dtype=np.int64)])
            )

    def _videos(self, batch: dict[str, Any], keep: list[int], out: dict[str, Any]) -> None:
        if "videos" not in batch:
            return
        flats = _rows(batch, "videos")
        sizes = [np.asarray(s, dtype=np.int64).reshape(-1, 3) for s in _rows(batch, "video_sizes")]
        clips: list[np.ndarray] = []
        counts = np.zeros(len(keep), dtype=np.int64)
        for j, r in enumerate(keep):
            got = split_videos(flats[r], sizes[r], sample_id=batch["id"][r])
            counts[j] = len(got)
            clips.extend(got)
        if len({c.shape for c in clips}) == 1:
            out["videos"] = torch.from_numpy(np.stack(clips))
        else:
            out["videos"] = [torch.from_numpy(c) for c in clips]
        out["video_sizes"] = torch.from_numpy(
            np.concatenate([np.zeros((0, 3), np.int64), *(sizes[r] for r in keep)])
        )
        out["video_counts"] = torch.from_numpy(counts)
        grids = _rows(batch, "video_grid_thw")
        out["video_grid_thw"] = torch.from_numpy(
            np.concatenate(
                [
                    np.zeros((0, 3), np.int64),
                    *(grids[r].astype(np.int64).reshape(-1, 3) for r in keep),
                ]
            )
        )
        seconds = _rows(batch, "second_per_grid_ts")
        out["second_per_grid_ts"] = torch.from_numpy(
            np.concatenate([np.zeros(0, np.float32), *(seconds[r].reshape(-1) for r in keep)])
        )

    def _rest(self, batch: dict[str, Any], keep: list[int], out: dict[str, Any]) -> None:
        """Every other field of the batch, for the kept rows."""
        for name, value in batch.items():
            if name in out or name in _TOKENS or name in _IMAGES or name in _VIDEOS:
                continue
            if len(keep) == len(batch["id"]):
                out[name] = value
            elif isinstance(value, torch.Tensor):
                out[name] = value[keep]
            else:
                out[name] = [value[r] for r in keep]


class PadHook(_SFTHook):
    """Pads each batch to its longest row (see the module docstring).

    Args:
        source: whose ``on_error`` and rejects a fully masked row goes to.
        pad_token_id: what ``input_ids`` is padded with.
        pad_to_multiple_of: the padded length is a multiple of it (1: exactly the longest).
    """

    def __init__(self, source: SampleSource, *, pad_token_id: int, pad_to_multiple_of: int) -> None:
        super().__init__(source)
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> dict[str, Any]:
        keep, ids, labels = self._kept(batch)
        n = len(keep)
        longest = max((len(x) for x in ids), default=0)
        m = self.pad_to_multiple_of
        width = -(-longest // m) * m
        input_ids = np.full((n, width), self.pad_token_id, dtype=np.int64)
        padded = np.full((n, width), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        for j, (x, y) in enumerate(zip(ids, labels, strict=True)):
            input_ids[j, : len(x)] = x
            padded[j, : len(y)] = y
            mask[j, : len(x)] = 1
        out: dict[str, Any] = {
            "id": [batch["id"][r] for r in keep],
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(padded),
            "attention_mask": torch.from_numpy(mask),
        }
        self._images(batch, keep, out)
        self._videos(batch, keep, out)
        self._rest(batch, keep, out)
        return out


class PackHook(_SFTHook):
    """Concatenates each batch's rows into one packed row (see the module docstring).

    Args:
        source: whose ``on_error`` and rejects a fully masked row goes to.
        lengths: the source's token counts the plan was made from; a row of another
            length is an error naming it (the plan would not hold).
    """

    def __init__(
        self,
        source: SampleSource,
        *,
        lengths: np.ndarray,
    ) -> None:
        super().__init__(source)
        self._lengths = np.asarray(lengths, dtype=np.int64)

    def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> dict[str, Any]:
        rows = _rows(batch, "input_ids")
        for r, i in enumerate(np.asarray(ctx.indices).tolist()):
            got = len(rows[r])
            want = int(self._lengths[i])
            if got != want:
                raise ConfigError(
                    f"sample {batch['id'][r]!r} has {got} tokens but the source's lengths() "
                    f"said {want}: the packing plan was made from lengths() and would not hold"
                )
        keep, ids, labels = self._kept(batch)
        seqlens = np.array([len(x) for x in ids], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
        total = int(cu[-1])
        input_ids = np.empty((1, total), dtype=np.int64)
        packed = np.empty((1, total), dtype=np.int64)
        positions = np.empty((1, total), dtype=np.int64)
        for j, (x, y) in enumerate(zip(ids, labels, strict=True)):
            a, b = int(cu[j]), int(cu[j + 1])
            input_ids[0, a:b] = x
            packed[0, a:b] = y
            packed[0, a] = IGNORE_INDEX  # predicted from another sample's last token
            positions[0, a:b] = np.arange(b - a)
        out: dict[str, Any] = {
            "id": [batch["id"][r] for r in keep],
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(packed),
            "position_ids": torch.from_numpy(positions),
            "cu_seqlens": torch.from_numpy(cu),
            "max_seqlen": int(seqlens.max()) if len(seqlens) else 0,
        }
        self._images(batch, keep, out)
        self._videos(batch, keep, out)
        self._rest(batch, keep, out)
        return out


def check_pad_config(pad_token_id: object, pad_to_multiple_of: object) -> None:
    """ConfigError unless both are ints in range (pad id >= 0, multiple >= 1)."""
    for name, value, low in (
        ("pad_token_id", pad_token_id, 0),
        ("pad_to_multiple_of", pad_to_multiple_of, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
