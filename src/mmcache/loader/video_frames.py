"""Frame sampling after the cache: :class:`VideoFrameSampler`, a loader hook that keeps a
seeded subset or a temporal window of each cached clip's frames, fresh every epoch.

The cache holds a clip at its :class:`~mmcache.transforms.video.VideoSpec`'s frames
(decoded once); LLaVA-Video-style training wants a different draw of them each epoch.
Drawing after the cache keeps the decode out of every epoch but the first, and the
draw is a pure function of ``(seed, epoch, sample index, video number)``
(:func:`~mmcache.augment.sample_generators`): cold, warm, any ``num_workers`` and a
resumed run give the same frames.

What changes with the frames, so that a batch stays consistent: each video's tokens
shrink to the kept frames: Qwen2.5-VL's run of ``<|video_pad|>`` tokens to ``t' / 2 *
h / 28 * w / 28``; LLaVA-Video's per-frame image runs (``VideoTokens(per_frame=True)``,
:meth:`VideoFrameSampler.for_chat`) lose the dropped frames' runs, their prefix and
suffix tokens with them. Labels move with their tokens (the dropped ones were -100:
never trained on). ``video_sizes`` and ``video_grid_thw`` get the new ``t'``, and
``second_per_grid_ts`` the new spacing (a window keeps the rate; a subset of ``t'`` of
``t`` frames spaces them ``t / t'`` times further on average).

Padded batches keep their width (the freed tail becomes padding, ``attention_mask``
follows). Packed batches (``batching=SFTBatching(pack=PackSpec(...))``) shrink: the packed row
holds the kept tokens only, and ``cu_seqlens``, ``position_ids`` (restarting per
sample) and ``max_seqlen`` count them. The pack plan itself was made from the cached
lengths, so a pack never outgrows ``max_tokens``; it is fuller than the kept tokens
need by the frames dropped.

Per-frame runs are told apart from a row's images by order only, so a sample with
both images and a per-frame video is a :class:`~mmcache.errors.SampleError` here.

Thread safety: immutable; ``after_assemble`` may run on two threads at once.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import numpy as np
import torch

from mmcache.augment import sample_generators
from mmcache.checks import check_int
from mmcache.errors import ConfigError, SampleError
from mmcache.hooks import BatchContext, LoaderHook
from mmcache.transforms.chat import ChatSpec

__all__ = ["VideoFrameSampler"]


class VideoFrameSampler(LoaderHook):
    """Keep ``frames`` frames of each clip per epoch (see the module docstring).

    Args:
        frames: frames kept per clip (a multiple of ``temporal_patch_size``); a clip
            with no more is kept whole.
        mode: ``"subset"``: a random sorted subset; ``"window"``: a random run of
            consecutive frames.
        video_token_id: the id of the video's pad token (``ChatSpec.video_token_id``).
        pad_token_id: what the freed tail of a padded row is padded with (the source's
            ``pad_token_id``).
        factor, temporal_patch_size: the vision tower's (28, 2).
        frame_token_id: LLaVA-Video's per-frame form: the image token each frame's run
            is made of (``None``: Qwen's one run per video); ``frame_wrap``: how many
            tokens go before and after each frame's run. :meth:`for_chat` sets both.

    Pass it in ``DataLoader(hooks=[...])``: it runs after the padding or packing hook.
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
        frame_token_id: int | None = None,
        frame_wrap: tuple[int, int] = (0, 0),
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
        self.frame_token_id = None if frame_token_id is None else int(frame_token_id)
        before, after = frame_wrap
        self.frame_wrap = (check_int("frame_wrap[0]", before, minimum=0),
                           check_int("frame_wrap[1]", after, minimum=0))  # fmt: skip

    @classmethod
    def for_chat(
        cls,
        chat: ChatSpec | None,
        frames: int,
        *,
        pad_token_id: int,
        mode: Literal["subset", "window"] = "subset",
    ) -> VideoFrameSampler:
        """The sampler of a :class:`~mmcache.transforms.chat.ChatSpec`'s video tokens
        (``ChatSpec(video=VideoTokens(...))``, either form)."""
        if not isinstance(chat, ChatSpec) or chat.video is None:
            raise ConfigError("VideoFrameSampler.for_chat needs a ChatSpec(video=VideoTokens())")
        video = chat.video
        if video.timestamps:
            # Each step's "<t seconds>" text is tokens of the cached sample: dropping a
            # step's frames would leave its timestamp, or need a tokenizer here.
            raise ConfigError(
                "VideoFrameSampler cannot sample Qwen3-VL's timestamped video tokens "
                "(VideoTokens(timestamps=True)): choose the frames before the cache "
                "(VideoSpec's fps / nframes)"
            )
        common = functools.partial(cls, frames, pad_token_id=pad_token_id, mode=mode,
                                   factor=video.factor,
                                   temporal_patch_size=video.temporal_patch_size)  # fmt: skip
        if not video.per_frame:
            return common(video_token_id=chat.video_token_id)
        return common(video_token_id=-1, frame_token_id=chat.image_token_id,
                      frame_wrap=chat.image_wrap_lengths)  # fmt: skip

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
        if len(batch["id"]) != len(ctx.indices):
            raise ConfigError("VideoFrameSampler needs every row of the batch (none refused)")
        packed = "cu_seqlens" in batch
        ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
        state = _Clips(
            list(batch["videos"]),
            batch["video_sizes"].clone(),
            batch["video_grid_thw"].clone(),
            batch["second_per_grid_ts"].clone(),
        )
        counts = batch["video_counts"].tolist()
        gens = sample_generators(ctx.seed, ctx.epoch, np.asarray(ctx.indices).tolist())
        if packed:
            cu = batch["cu_seqlens"].tolist()
            segments = [(0, cu[s], cu[s + 1]) for s in range(len(counts))]
        else:
            segments = [(r, 0, ids.shape[1]) for r in range(len(counts))]
        keep = torch.ones(ids.shape, dtype=torch.bool)
        images = batch.get("image_counts")
        for s, ((row, a, b), n) in enumerate(zip(segments, counts, strict=True)):
            if self.frame_token_id is not None and images is not None and int(images[s]):
                raise SampleError(
                    "a sample with images and a per-frame video: which image runs are "
                    "frames cannot be told",
                    sample_id=batch["id"][s],
                )
            sid = batch["id"][s]
            self._sample(ids[row, a:b], keep[row, a:b], n, state, g=gens[s], sample_id=sid)
        out = dict(batch)
        if packed:
            out.update(_repack(ids, labels, keep, segments))
        else:
            out.update(self._repad(batch, ids, labels, keep))
        shapes = {tuple(c.shape) for c in state.clips}
        out["videos"] = (
            torch.stack(state.clips) if len(shapes) == 1 and state.clips else state.clips
        )
        out.update(video_sizes=state.sizes, video_grid_thw=state.grids,
                   second_per_grid_ts=state.seconds)  # fmt: skip
        return out

    def _sample(
        self,
        ids: torch.Tensor,
        keep: torch.Tensor,
        n: int,
        state: _Clips,
        *,
        g: torch.Generator,
        sample_id: str,
    ) -> None:
        """Draw the kept frames of one sample's ``n`` videos (the next ones of ``state``),
        clearing ``keep`` (a view of the sample's tokens) over the dropped frames' tokens."""
        token = self.video_token_id if self.frame_token_id is None else self.frame_token_id
        runs = _runs(ids == token)
        v0 = state.next
        sizes = [tuple(int(x) for x in state.sizes[v]) for v in range(v0, v0 + n)]
        want = n if self.frame_token_id is None else sum(t for t, _, _ in sizes)
        if len(runs) != want:
            what = "videos" if self.frame_token_id is None else "frames of its videos"
            raise SampleError(f"{len(runs)} runs of the video token for {want} {what}",
                              sample_id=sample_id)  # fmt: skip
        at = 0
        for v, (t, h, w) in enumerate(sizes, start=v0):
            chosen = self.pick(t, g)
            new_t = len(chosen)
            if self.frame_token_id is None:
                a, b = runs[at]
                at += 1
                keep[a + (new_t // self.tps) * (h // self.factor) * (w // self.factor) : b] = False
            else:
                before, after = self.frame_wrap
                kept = set(chosen)
                for k, (a, b) in enumerate(runs[at : at + t]):
                    if k not in kept:
                        keep[max(0, a - before) : b + after] = False
                at += t
            state.take(v, chosen, t, tps=self.tps, subset=self.mode == "subset")
        state.next = v0 + n

    def _repad(
        self, batch: dict[str, Any], ids: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor
    ) -> dict[str, Any]:
        """The padded rows with their kept tokens first, the freed tail padding."""
        mask = batch["attention_mask"].clone() if "attention_mask" in batch else None
        for r in range(ids.shape[0]):
            kept = int(keep[r].sum())
            ids[r, :kept], labels[r, :kept] = ids[r][keep[r]], labels[r][keep[r]]
            ids[r, kept:], labels[r, kept:] = self.pad_token_id, -100
            if mask is not None:
                used = int(mask[r].sum()) - (ids.shape[1] - kept)
                mask[r] = 0
                mask[r, :used] = 1
        out: dict[str, Any] = {"input_ids": ids, "labels": labels}
        if mask is not None:
            out["attention_mask"] = mask
        return out


class _Clips:
    """The batch's clips and their per-video fields, as the draws change them."""

    def __init__(
        self, clips: list[torch.Tensor], sizes: torch.Tensor, grids: torch.Tensor,
        seconds: torch.Tensor,
    ) -> None:  # fmt: skip
        self.clips, self.sizes, self.grids, self.seconds = clips, sizes, grids, seconds
        self.next = 0  # the first video of the next sample

    def take(self, v: int, chosen: list[int], t: int, *, tps: int, subset: bool) -> None:
        """Video ``v`` keeps frames ``chosen`` of its ``t`` (``tps`` frames per grid step)."""
        self.clips[v] = self.clips[v][chosen]
        new_t = len(chosen)
        self.sizes[v, 0], self.grids[v, 0] = new_t, new_t // tps
        if subset:
            self.seconds[v] = self.seconds[v] * t / new_t


def _repack(
    ids: torch.Tensor,
    labels: torch.Tensor,
    keep: torch.Tensor,
    segments: list[tuple[int, int, int]],
) -> dict[str, Any]:
    """The packed row of the kept tokens, its ``cu_seqlens``, ``position_ids`` (from 0 in
    each sample) and ``max_seqlen``; each sample's first label stays -100."""
    lens = [int(keep[0, a:b].sum()) for _, a, b in segments]
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    new_ids, new_labels = ids[0][keep[0]].unsqueeze(0), labels[0][keep[0]].unsqueeze(0)
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens] or
                          [torch.zeros(0, dtype=torch.int64)]).unsqueeze(0)  # fmt: skip
    for a in cu[:-1].tolist():
        if a < new_labels.shape[1]:
            new_labels[0, a] = -100
    return {"input_ids": new_ids, "labels": new_labels, "position_ids": positions,
            "cu_seqlens": cu, "max_seqlen": max(lens, default=0)}  # fmt: skip


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``[a, b)`` of each run of True in a 1-D bool tensor."""
    zero = torch.zeros(1, dtype=torch.int8)
    m = torch.cat([zero, mask.to(torch.int8), zero])
    edges = torch.diff(m)
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends, strict=True))
