"""After the cache, on the device: cached uint8 images -> the ``pixel_values`` an HF model takes.

The cache holds each processed image as uint8 ``[3, h, w]`` (4x smaller than float32).
HF vision-language models take float32 pixels under the name ``pixel_values``, in the
layout of their processor:

- LLaVA, CLIP, SigLIP: ``[N, 3, H, W]``, ``(x * rescale - mean) / std``
  (:func:`~mmcache.transforms.normalize.normalize` with the stage's mean/std);
- Qwen2-VL / Qwen2.5-VL: flattened patches ``[sum(t*h*w), C * tp * p * p]`` with
  ``image_grid_thw`` ``[N, 3]`` (:func:`qwen_patches`: the processor's ``patchify``, the
  image repeated ``temporal_patch_size`` times, merge-size blocks kept together);
- LLaVA-NeXT: ``[N, max_crops, 3, h, w]`` with ``image_sizes`` ``[N, 2]`` (the
  original sizes): each image's ``1 + k`` cached crops normalised, the images with
  fewer crops zero-padded after normalisation, as ``LlavaNextImageProcessor`` pads a
  batch (:func:`llava_next_pixels`);

:class:`PixelValues` is a loader hook (``DataLoader(..., hooks=[PixelValues(...)])``)
that does it to each batch and names the result ``pixel_values``;
:meth:`PixelValues.from_processor` reads the mean, std and layout from the processor.
Each function runs on the device of its input (copy the uint8 batch first: 4x fewer
bytes than float32) and equals the processor's own output within 1e-5 (float rounding;
tested against transformers).

Thread safety: pure functions; a :class:`PixelValues` is immutable and may run on the
loader's assembling threads at once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmcache.checks import check_int
from mmcache.errors import ConfigError
from mmcache.transforms.normalize import normalize, resolve_mean_std
from mmcache.transforms.video import qwen_video_patches

if TYPE_CHECKING:
    import torch

__all__ = ["MODEL_INPUTS", "PixelValues", "llava_next_pixels", "qwen_patches"]

#: The fields ``PixelValues(model_only=True)`` keeps: what an HF VLM's ``forward`` takes
#: (Qwen2-VL / Qwen2.5-VL / Qwen3-VL's video inputs and ``mm_token_type_ids`` included).
MODEL_INPUTS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "labels",
        "position_ids",
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
        "mm_token_type_ids",
    }
)

_Images = Any  # a uint8 [N, 3, H, W] tensor or a sequence of [3, h, w] tensors

_LAYOUTS = ("image", "qwen", "llava_next")
#: The fields LLaVA-NeXT's batches carry for the hook (replaced by ``image_sizes``).
_CROP_FIELDS = ("image_crops", "image_original_sizes")


def _each(images: _Images) -> list[torch.Tensor]:
    import torch

    if isinstance(images, torch.Tensor):
        if images.dim() == 3:
            return [images]
        if images.dim() != 4:
            raise ConfigError(f"images must be [N, 3, H, W] or [3, H, W], got {list(images.shape)}")
        return list(images.unbind(0))
    if isinstance(images, Sequence) and all(isinstance(t, torch.Tensor) for t in images):
        return list(images)
    raise ConfigError(
        f"images must be a uint8 tensor or a list of [3, h, w] tensors, got {type(images).__name__}"
    )


def qwen_patches(
    images: _Images,
    mean: Sequence[float] | str | object = "clip",
    std: Sequence[float] | None = None,
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-VL's ``(pixel_values, image_grid_thw)`` of cached uint8 images (``SmartResize``'s).

    ``pixel_values`` is float32 ``[sum(grid_h * grid_w), 3 * temporal_patch_size *
    patch_size**2]``: each image normalised, cut into ``patch_size`` squares ordered by
    ``merge_size`` blocks, each square repeated ``temporal_patch_size`` times (a still
    image is a clip of that many equal frames), as ``Qwen2VLImageProcessor`` does;
    ``image_grid_thw`` int64 ``[N, 3]`` = ``(1, h / patch_size, w / patch_size)``.
    On the images' device. ConfigError naming the image whose sides are not multiples of
    ``patch_size * merge_size`` (not a SmartResize output of that factor)."""
    import torch

    mean_t, std_t = resolve_mean_std(mean, std)
    factor = patch_size * merge_size
    rows: list[torch.Tensor] = []
    grids: list[tuple[int, int, int]] = []
    device = None
    for i, image in enumerate(_each(images)):
        c, h, w = image.shape
        if h % factor or w % factor:
            raise ConfigError(
                f"image {i} is {h}x{w}: Qwen2-VL's patches need both sides multiples of "
                f"patch_size * merge_size = {factor} (SmartResize(factor={factor}))"
            )
        x = normalize(image, mean_t, std_t)
        gh, gw = h // patch_size, w // patch_size
        m, p = merge_size, patch_size
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        x = x.unsqueeze(5).expand(*x.shape[:5], temporal_patch_size, p, p)
        rows.append(x.reshape(gh * gw, c * temporal_patch_size * p * p))
        grids.append((1, gh, gw))
        device = image.device
    if not rows:
        empty = torch.zeros((0, 3 * temporal_patch_size * patch_size**2), dtype=torch.float32)
        return empty, torch.zeros((0, 3), dtype=torch.int64)
    grid = torch.tensor(grids, dtype=torch.int64, device=device)
    return torch.cat(rows), grid


def llava_next_pixels(
    images: _Images,
    crops: Sequence[int] | torch.Tensor,
    mean: Sequence[float] | str | object = "clip",
    std: Sequence[float] | None = None,
) -> torch.Tensor:
    """LLaVA-NeXT's ``pixel_values`` of cached crops: float32 ``[N, max_crops, 3, h, w]``.

    ``images`` are the batch's crops in order (a uint8 ``[sum(crops), 3, h, w]`` tensor
    or a list of ``[3, h, w]``: what the loader gives for a
    :class:`~mmcache.transforms.hf_llava_next.LlavaNextImageStage` pipeline),
    ``crops`` each image's ``1 + k``. Each crop is normalised; image ``i`` fills
    ``[i, :crops[i]]`` and the rest of its row is 0.0 (after normalisation), as
    ``LlavaNextImageProcessor`` pads a batch to its most crops. On the images'
    device. ConfigError when the counts and the crops disagree."""
    import torch

    mean_t, std_t = resolve_mean_std(mean, std)
    counts = [int(c) for c in (crops.tolist() if isinstance(crops, torch.Tensor) else crops)]
    each = _each(images) if not isinstance(images, torch.Tensor) or images.dim() != 4 else None
    stacked = images if each is None else (torch.stack(each) if each else None)
    total = 0 if stacked is None else int(stacked.shape[0])
    if sum(counts) != total or any(c < 1 for c in counts):
        raise ConfigError(
            f"{total} crops for images of {counts} crops each: LLaVA-NeXT's batches give "
            "every image's 1 + k crops in order (image_crops)"
        )
    if stacked is None:
        device = images.device if isinstance(images, torch.Tensor) else None
        return torch.zeros((0, 0, 3, 0, 0), dtype=torch.float32, device=device)
    x = normalize(stacked, mean_t, std_t)
    out = x.new_zeros((len(counts), max(counts), *x.shape[1:]))
    start = 0
    for i, c in enumerate(counts):
        out[i, :c] = x[start : start + c]
        start += c
    return out


def _per_row(value: Any, width: int) -> list[torch.Tensor]:
    """A batch field held per row (a list of tensors, or one ``[B, ...]`` tensor) as
    one int64 ``[n, width]`` tensor per row."""
    import torch

    rows = value.unbind(0) if isinstance(value, torch.Tensor) else value
    return [torch.as_tensor(v, dtype=torch.int64).reshape(-1, width) for v in rows]


@dataclass(frozen=True)
class _Video:
    """How a :class:`PixelValues` hook makes Qwen's ``pixel_values_videos``: the video
    processor's mean and std and its patch geometry."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    patch_size: int
    merge_size: int
    temporal_patch_size: int


class PixelValues:
    """A loader hook naming a batch's pixels ``pixel_values`` as an HF model takes them.

    Args:
        mean, std: as :func:`~mmcache.transforms.normalize.normalize` takes them (3
            floats each, a preset name, or a stage with ``mean``/``std``).
        layout: ``"image"`` (``[N, 3, H, W]``, or a list when shapes vary), ``"qwen"``
            (:func:`qwen_patches`, with ``image_grid_thw``; and the videos, below) or
            ``"llava_next"`` (:func:`llava_next_pixels`, with ``image_sizes`` the
            original sizes and ``image_counts`` images per row; kept by ``model_only``).
        patch_size, merge_size, temporal_patch_size: Qwen's patch geometry (images and
            videos alike; Qwen3-VL's patch is 16).
        video_mean, video_std: the video processor's, for ``pixel_values_videos``
            (``None``: the images' ``mean``/``std``).
        image_token_id, video_token_id: Qwen's ``<|image_pad|>`` and ``<|video_pad|>``
            ids: when given, the batch gets ``mm_token_type_ids`` (0 text, 1 image, 2
            video, the shape of ``input_ids``), which transformers 5's Qwen models
            compute their 3-D (M-RoPE) positions from; without it they fall back to 1-D
            positions, silently.
        model_inputs: the fields ``model_only`` keeps (``None``: :data:`MODEL_INPUTS`);
            :meth:`from_processor` takes the processor's own ``model_input_names``.
        device: where to normalise (``"cuda"``: the uint8 batch is copied there
            first); ``None``: where the batch is.
        model_only: keep only the model's inputs (the batch is then
            ``model(**batch)``'s keyword arguments, as a ``transformers.Trainer``
            passes them); False: every other field passes through.

    The batch's uint8 ``images`` (SFT batches) or ``image`` (caption batches) is
    replaced by ``pixel_values``. In the ``"qwen"`` layout a batch's ``videos`` (a
    :class:`~mmcache.VideoSpec` pipeline's clips) become ``pixel_values_videos``
    (:func:`~mmcache.transforms.video.qwen_video_patches` of each clip, in order) beside
    the cached ``video_grid_thw`` and ``second_per_grid_ts``, in image-only, video-only
    and mixed batches; a batch with no image (or no video) gets no image (or video)
    fields, as the processor gives none (an empty ``pixel_values`` fails in the
    model's vision tower). In another layout a ``model_only`` hook refuses a batch
    with clips (ConfigError) rather than drop them: the model would train the video's
    tokens as text. Put it after a :class:`~mmcache.loader.video_frames.VideoFrameSampler` in
    ``hooks``. Immutable.
    """

    def __init__(
        self,
        mean: Sequence[float] | str | object = "clip",
        std: Sequence[float] | None = None,
        *,
        layout: str = "image",
        patch_size: int = 14,
        merge_size: int = 2,
        temporal_patch_size: int = 2,
        video_mean: Sequence[float] | str | object | None = None,
        video_std: Sequence[float] | None = None,
        image_token_id: int | None = None,
        video_token_id: int | None = None,
        model_inputs: Collection[str] | None = None,
        device: Any = None,
        model_only: bool = False,
    ) -> None:
        if layout not in _LAYOUTS:
            raise ConfigError(f"PixelValues.layout must be one of {_LAYOUTS}, got {layout!r}")
        self.mean, self.std = resolve_mean_std(mean, std)
        self.layout = layout
        for name, value in (("patch_size", patch_size), ("merge_size", merge_size),
                            ("temporal_patch_size", temporal_patch_size)):  # fmt: skip
            check_int(f"PixelValues.{name}", value, minimum=1)
        self.patch = (patch_size, merge_size, temporal_patch_size)
        vmean, vstd = (
            (self.mean, self.std) if video_mean is None else resolve_mean_std(video_mean, video_std)
        )
        self.video = _Video(
            (vmean[0], vmean[1], vmean[2]),
            (vstd[0], vstd[1], vstd[2]),
            patch_size,
            merge_size,
            temporal_patch_size,
        )
        self.token_ids = {
            k: None if v is None else check_int(f"PixelValues.{k}", v, minimum=0)
            for k, v in (("image", image_token_id), ("video", video_token_id))
        }
        self.model_inputs = MODEL_INPUTS if model_inputs is None else frozenset(model_inputs)
        self.device = device
        self.model_only = bool(model_only)

    @classmethod
    def from_processor(
        cls, processor: Any, *, device: Any = None, model_only: bool = False
    ) -> PixelValues:
        """The hook for an HF processor (or its image processor): its rescale, mean and
        std, and the layout of its class (Qwen2-VL's patches, LLaVA-NeXT's crops, else
        plain images). A whole processor also gives its video processor's mean, std and
        patch geometry (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), its ``model_input_names``
        (what ``model_only`` keeps: ``second_per_grid_ts`` for Qwen2.5-VL only) and,
        where it makes ``mm_token_type_ids`` (``return_mm_token_type_ids``), its image
        and video token ids. ConfigError for LLaVA-OneVision's (not cached: see
        :func:`mmcache.hf_processor`)."""
        from mmcache.transforms.hf import processor_mean_std

        images = getattr(processor, "image_processor", None) or processor
        name = type(images).__name__
        if name.startswith("LlavaOnevision"):
            raise ConfigError(f"PixelValues has no layout for {name} (hf_processor refuses it)")
        mean, std = processor_mean_std(images)
        inputs = _processor_inputs(processor)
        if hasattr(images, "image_grid_pinpoints"):
            return cls(
                mean,
                std,
                layout="llava_next",
                model_inputs=inputs,
                device=device,
                model_only=model_only,
            )
        if hasattr(images, "merge_size") and hasattr(images, "temporal_patch_size"):
            videos = getattr(processor, "video_processor", None)
            vmean, vstd = processor_mean_std(videos) if videos is not None else (None, None)
            typed = bool(getattr(processor, "return_mm_token_type_ids", False))
            return cls(
                mean,
                std,
                layout="qwen",
                patch_size=int(images.patch_size),
                merge_size=int(images.merge_size),
                temporal_patch_size=int(images.temporal_patch_size),
                video_mean=vmean,
                video_std=vstd,
                image_token_id=_token_id(processor, "image") if typed else None,
                video_token_id=_token_id(processor, "video") if typed else None,
                model_inputs=inputs,
                device=device,
                model_only=model_only,
            )
        return cls(mean, std, model_inputs=inputs, device=device, model_only=model_only)

    def after_assemble(self, batch: dict[str, Any], ctx: object) -> dict[str, Any]:
        """``batch`` with its uint8 images replaced by ``pixel_values`` (see the class)."""

        if self.layout == "qwen":
            self._qwen_videos(batch)
            self._token_types(batch)
        elif self.model_only and _clip_count(batch):
            raise ConfigError(
                f"PixelValues(layout={self.layout!r}, model_only=True) got a batch with "
                f"{_clip_count(batch)} video clips, which it has no model input for: the "
                "model would train the videos' tokens as text. Use layout='qwen' (Qwen2-VL, "
                "Qwen2.5-VL, Qwen3-VL) or model_only=False and make the video inputs in "
                "your own hook"
            )
        name = "images" if "images" in batch else "image"
        if name not in batch:
            return self._kept(batch)
        images = self._to_device(batch.pop(name))
        if self.layout == "llava_next":
            self._llava_next(batch, images)
        elif self.layout == "qwen":
            p, m, t = self.patch
            pixels, grid = qwen_patches(
                images, self.mean, self.std, patch_size=p, merge_size=m, temporal_patch_size=t
            )
            if grid.shape[0]:
                batch["pixel_values"] = pixels
                batch["image_grid_thw"] = grid
            else:  # no image in the batch: no image inputs, as the processor gives none
                batch.pop("image_grid_thw", None)
        elif isinstance(images, list):
            batch["pixel_values"] = [normalize(t, self.mean, self.std) for t in images]
        else:
            batch["pixel_values"] = normalize(images, self.mean, self.std)
        return self._kept(batch)

    def _to_device(self, images: Any) -> Any:
        import torch

        if self.device is None:
            return images
        if isinstance(images, torch.Tensor):
            return images.to(self.device, non_blocking=True)
        return [t.to(self.device, non_blocking=True) for t in _each(images)]

    def _qwen_videos(self, batch: dict[str, Any]) -> None:
        """The batch's ``videos`` -> ``pixel_values_videos`` (Qwen's patch rows, one
        clip after another), with ``video_grid_thw`` and ``second_per_grid_ts`` kept;
        a batch with no clip loses its (empty) video fields. ConfigError when the
        cached grid disagrees with the clips' sizes under this geometry."""
        import torch

        if "videos" not in batch:
            return
        clips = _clips(batch.pop("videos"))
        batch.pop("video_sizes", None)
        if not clips:
            batch.pop("video_grid_thw", None)
            batch.pop("second_per_grid_ts", None)
            return
        v = self.video
        rows = [
            qwen_video_patches(
                self._to_device(c),
                patch_size=v.patch_size,
                merge_size=v.merge_size,
                temporal_patch_size=v.temporal_patch_size,
                mean=v.mean,
                std=v.std,
            )
            for c in clips
        ]
        grid = batch.get("video_grid_thw")
        counted = sum(r.shape[0] for r in rows)
        if grid is None or int(torch.as_tensor(grid).prod(dim=-1).sum()) != counted:
            raise ConfigError(
                f"PixelValues made {counted} video patch rows of {len(clips)} clips with "
                f"patch_size {v.patch_size}, but the batch's video_grid_thw "
                f"{None if grid is None else torch.as_tensor(grid).tolist()} counts "
                "otherwise: the hook's patch geometry must be the VideoSpec's "
                "(PixelValues.from_processor(processor) reads it)"
            )
        batch["pixel_values_videos"] = torch.cat(rows)

    def _token_types(self, batch: dict[str, Any]) -> None:
        """``mm_token_type_ids`` from ``input_ids`` (see the class), when the ids are known."""
        import torch

        image, video = self.token_ids["image"], self.token_ids["video"]
        ids = batch.get("input_ids")
        if (image is None and video is None) or not isinstance(ids, torch.Tensor):
            return
        types = torch.zeros_like(ids)
        if image is not None:
            types[ids == image] = 1
        if video is not None:
            types[ids == video] = 2
        batch["mm_token_type_ids"] = types

    def _llava_next(self, batch: dict[str, Any], images: Any) -> None:
        """LLaVA-NeXT's crops -> ``pixel_values``, and its per-image fields: ``image_sizes``
        the original sizes (the model's name), ``image_counts`` images per row."""
        import torch

        missing = [f for f in _CROP_FIELDS if f not in batch]
        if missing:
            raise ConfigError(
                f"PixelValues(layout='llava_next') needs the batch's {missing}: a pipeline "
                "of mmcache.hf_processor(LlavaNextProcessor) caches them"
            )
        crops = _per_row(batch.pop("image_crops"), 1)
        originals = _per_row(batch.pop("image_original_sizes"), 2)
        counts = torch.cat(crops).reshape(-1) if crops else torch.zeros(0, dtype=torch.int64)
        batch["pixel_values"] = llava_next_pixels(images, counts, self.mean, self.std)
        batch["image_sizes"] = (
            torch.cat(originals) if originals else torch.zeros((0, 2), dtype=torch.int64)
        )
        batch["image_counts"] = torch.tensor([len(c) for c in crops], dtype=torch.int64)

    def _kept(self, batch: dict[str, Any]) -> dict[str, Any]:
        if not self.model_only:
            return batch
        keep = self.model_inputs | ({"image_sizes"} if self.layout == "llava_next" else set())
        return {k: v for k, v in batch.items() if k in keep}

    def __repr__(self) -> str:
        return f"PixelValues(layout={self.layout!r}, mean={self.mean}, std={self.std})"


def _clips(videos: Any) -> list[torch.Tensor]:
    """A batch's ``videos`` (uint8 ``[N, t, 3, h, w]`` or a list of ``[t, 3, h, w]``)
    as a list of clips."""
    import torch

    if isinstance(videos, torch.Tensor):
        if videos.dim() != 5:
            raise ConfigError(f"videos must be [N, t, 3, h, w], got {list(videos.shape)}")
        return list(videos.unbind(0))
    return list(videos)


def _clip_count(batch: dict[str, Any]) -> int:
    videos = batch.get("videos")
    return 0 if videos is None else len(videos)


def _token_id(processor: Any, kind: str) -> int | None:
    """The processor's ``image_token_id`` / ``video_token_id`` (``None`` when it has none)."""
    value = getattr(processor, f"{kind}_token_id", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _processor_inputs(processor: Any) -> frozenset[str] | None:
    """What a whole processor says its model takes (``model_input_names``) with the
    training fields (``labels``, ``position_ids``); ``None`` for an image processor
    alone (:data:`MODEL_INPUTS` then)."""
    if getattr(processor, "image_processor", None) is None:
        return None
    names = getattr(processor, "model_input_names", None)
    if not isinstance(names, (list, tuple)) or "input_ids" not in names:
        return None
    return frozenset(names) | {"labels", "position_ids"}
