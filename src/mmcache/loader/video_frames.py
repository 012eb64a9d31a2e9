"""Frame sampling after the cache: :class:`VideoFrameSampler`, a loader hook that keeps a
seeded subset or a temporal window of each cached clip's frames, fresh every epoch.

The cache holds a clip at its :class:`~mmcache.transforms.video.VideoSpec`'s frames
(decoded once); LLaVA-Video-style training wants a different draw of them each epoch.
Drawing after the cache keeps the decode out of every epoch but the first, and the
draw is a pure function of ``(seed, epoch, sample index, video number)``
(:func:`~mmcache.augment.sample_generators`): cold, warm, any ``num_workers`` and a
resumed run give the same frames.

What changes with the frames, so that a Qwen2.5-VL batch stays consistent: each
video's run of ``<|video_pad|>`` tokens shrinks to ``t' / 2 * h / 28 * w / 28`` (the
dropped tokens were never trained on; rows keep their padded width, the freed tail
becomes padding), ``video_sizes`` and ``video_grid_thw`` get the new ``t'``, and
``second_per_grid_ts`` the new spacing (a window keeps the rate; a subset of ``t'`` of
``t`` frames spaces them ``t / t'`` times further on average). Padded batches only: a
packed batch's ``cu_seqlens`` were planned from the cached lengths, so a
:class:`VideoFrameSampler` refuses one.

Thread safety: immutable; ``after_assemble`` may run on two threads at once.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch

from mmcache.augment import sample_generators
from mmcache.checks import check_int
from mmcache.errors import ConfigError, SampleError
from mmcache.hooks import BatchContext, LoaderHook

__all__ = ["VideoFrameSampler"]


class VideoFrameSampler(LoaderHook):
    """Keep ``frames`` frames of each clip per epoch (see the module docstring).

    Args:
        frames: frames kept per clip (a multiple of ``temporal_patch_size``); a clip
            with no more is kept whole.
        mode: ``"subset"``: a random sorted subset; ``"window"``: a random run of
            consecutive frames.
        video_token_id: the id of the video's pad token (``ChatSpec.video_token_id``).
        pad_token_id: what the freed tail of a row is padded with (the source's
            ``pad_token_id``).
        factor, temporal_patch_size: the vision tower's (28, 2).

    Pass it in ``DataLoader(hooks=[...])``: it runs after the padding hook.
    """

    def __init__(
        self,
        frames: int,
        *,
        video_token_id: int,
        pad_token_id: int,
        mode: Literal["subset", "window"] = "subset",
        factor: int = 28,
        temporal_patch_size: int = 2,
    ) -> None:
        self.frames = check_int("VideoFrameSampler.frames", frames, minimum=1)
        self.tps = check_int("temporal_patch_size", temporal_patch_size, minimum=1)
        self.factor = check_int("factor", factor, minimum=1)
        if self.frames % self.tps:
            raise ConfigError(f"frames={frames} must be a multiple of {self.tps}")
        if mode not in ("subset", "window"):
            raise ConfigError(f"mode must be 'subset' or 'window', got {mode!r}")
        self.mode = mode
        self.video_token_id = int(video_token_id)
        self.pad_token_id = int(pad_token_id)

    def pick(self, t: int, g: torch.Generator) -> list[int]:
        """The kept frame numbers of a clip of ``t`` frames, drawn from ``g``."""
        if t <= self.frames:
            return list(range(t))
        if self.mode == "window":
            start = int(torch.randint(0, t - self.frames + 1, (1,), generator=g))
            return list(range(start, start + self.frames))
        chosen: list[int] = torch.randperm(t, generator=g)[: self.frames].sort().values.tolist()
        return chosen

    def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> dict[str, Any]:
        if "videos" not in batch:
            return batch
        if "cu_seqlens" in batch:
            raise ConfigError("VideoFrameSampler works on padded batches, not packed ones")
        if len(batch["id"]) != len(ctx.indices):
            raise ConfigError("VideoFrameSampler needs every row of the batch (none refused)")
        clips = list(batch["videos"])
        sizes = batch["video_sizes"].clone()
        grids = batch["video_grid_thw"].clone()
        seconds = batch["second_per_grid_ts"].clone()
        counts = batch["video_counts"].tolist()
        gens = sample_generators(ctx.seed, ctx.epoch, np.asarray(ctx.indices).tolist())
        ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
        mask = batch["attention_mask"].clone() if "attention_mask" in batch else None
        v = 0
        for r, n in enumerate(counts):
            keep = torch.ones(ids.shape[1], dtype=torch.bool)
            runs = _runs(ids[r] == self.video_token_id)
            if len(runs) != n:
                raise SampleError(
                    f"{len(runs)} runs of the video token for {n} videos", sample_id=batch["id"][r]
                )
            for a, b in runs:
                t, h, w = (int(x) for x in sizes[v])
                chosen = self.pick(t, gens[r])
                clips[v] = clips[v][chosen]
                new_t = len(chosen)
                keep[a + (new_t // self.tps) * (h // self.factor) * (w // self.factor) : b] = False
                sizes[v, 0], grids[v, 0] = new_t, new_t // self.tps
                if self.mode == "subset":
                    seconds[v] = seconds[v] * t / new_t
                v += 1
            kept = int(keep.sum())
            ids[r, :kept], labels[r, :kept] = ids[r][keep], labels[r][keep]
            ids[r, kept:], labels[r, kept:] = self.pad_token_id, -100
            if mask is not None:
                used = int(mask[r].sum()) - (ids.shape[1] - kept)
                mask[r] = 0
                mask[r, :used] = 1
        shapes = {tuple(c.shape) for c in clips}
        out = dict(batch)
        out["videos"] = torch.stack(clips) if len(shapes) == 1 and clips else clips
        if mask is not None:
            out["attention_mask"] = mask
        out.update(input_ids=ids, labels=labels, video_sizes=sizes, video_grid_thw=grids,
                   second_per_grid_ts=seconds)  # fmt: skip
        return out


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``[a, b)`` of each run of True in a 1-D bool tensor."""
    zero = torch.zeros(1, dtype=torch.int8)
    m = torch.cat([zero, mask.to(torch.int8), zero])
    edges = torch.diff(m)
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends, strict=True))
