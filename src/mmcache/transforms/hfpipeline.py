"""A whole HF multimodal processor as an mmcache :class:`~mmcache.Pipeline`: :func:`hf_processor`.

A LLaVA or Qwen2-VL training script holds one ``transformers`` processor that knows
the image processor, the tokenizer, the chat template, the image token and how many
of them an image becomes. :func:`hf_processor` reads all of that from it:

- ``LlavaProcessor``: the image processor as the cached stage
  (:func:`~mmcache.hf_image_processor`), a :class:`~mmcache.ChatSpec` with the
  processor's tokenizer and chat template, its ``image_token``, and the count
  ``(h // patch_size) * (w // patch_size) + num_additional_image_tokens``, less one
  for ``vision_feature_select_strategy="default"`` (LlavaProcessor's own rule, on
  the processed image's size);
- ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor`` (Qwen3-VL,
  Qwen3.5): a :class:`~mmcache.SmartResize` with the image processor's ``min_pixels``,
  ``max_pixels`` and ``patch_size * merge_size`` (28; 32 for Qwen3-VL's patch 16) whose
  pixels are the processor's own resize
  (:class:`~mmcache.transforms.hf_qwen.QwenImageStage`: torchvision's and Pillow's
  bicubic differ by a level), and ``<|image_pad|>`` runs of its grid rule between
  ``<|vision_start|>`` and ``<|vision_end|>``; the records' placeholder stays
  ``<image>``. With a video processor, the pipeline's :class:`~mmcache.VideoSpec` and
  the chat's :class:`~mmcache.transforms.VideoTokens` come from it (``_qwen_video``:
  qwen-vl-utils' frame rules at its geometry, fps and bounds; Qwen3-VL's timestamped
  video tokens); the records' video placeholder is ``<video>``;
- ``LlavaNextProcessor``: its any-resolution image processing as the cached stage
  (:class:`~mmcache.transforms.hf_llava_next.LlavaNextImageStage`: each image's uint8
  ``[1 + k, 3, h, w]`` crops, made by the processor itself, and its original size),
  and a ChatSpec whose ``image_tokens`` is the processor's own count of an image of
  that original size (:class:`~mmcache.transforms.hf_llava_next.LlavaNextTokens`);
  batches through ``PixelValues.from_processor(processor)`` get its ``pixel_values``
  ``[N, max_crops, 3, h, w]`` and ``image_sizes``;
- ``LlavaOnevisionProcessor`` is refused (ConfigError): it processes an image one way
  when its sample has one image (any-resolution crops) and another when it has several
  (one padded square each, a fixed token count), which a cached stage of one image
  cannot know.

A template that reads a message's content only as a list of ``{"type": "image"}`` /
``{"type": "text"}`` parts (llava-1.5-hf's) is found by a probe render, and ChatSpec
then renders the records' contents as such parts (:mod:`mmcache.transforms.chat_parts`).

Pure function of the processor; the Pipeline it returns is as thread-safe as any.
"""

from __future__ import annotations

from typing import Any

from mmcache.errors import ConfigError
from mmcache.transforms.chat import ChatSpec
from mmcache.transforms.hf import hf_image_processor
from mmcache.transforms.hf_llava_next import LlavaNextImageStage, LlavaNextTokens
from mmcache.transforms.hf_qwen import QwenImageStage
from mmcache.transforms.pipeline import Pipeline
from mmcache.transforms.smart_resize import SmartResize
from mmcache.transforms.video import VideoSpec, VideoTokens

__all__ = ["hf_processor", "llava_image_tokens"]

#: The Qwen processors hf_processor reads (Qwen3.5 and Qwen3-VL-MoE use Qwen3VLProcessor).
_QWEN = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor")
#: Those whose video tokens carry each temporal step's time (``<1.5 seconds>``).
_TIMESTAMPED = frozenset({"Qwen3VLProcessor"})
#: Video processors whose ``size`` bounds each frame's pixels (Qwen3-VL's bounds a clip's).
_PER_FRAME_BOUNDS = frozenset({"Qwen2VLVideoProcessor"})


def llava_image_tokens(processor: Any, height: int, width: int) -> int:
    """LlavaProcessor's image-token count for an image processed to ``height x width``."""
    patch = getattr(processor, "patch_size", None)
    if not isinstance(patch, int) or patch < 1:
        raise ConfigError(
            f"{type(processor).__name__} has no patch_size: build it with "
            "patch_size=, vision_feature_select_strategy= (as the model config says)"
        )
    n = (height // patch) * (width // patch) + int(processor.num_additional_image_tokens or 0)
    if processor.vision_feature_select_strategy == "default":
        n -= 1
    return n


def _parts(processor: Any) -> tuple[Any, Any, str]:
    tokenizer = getattr(processor, "tokenizer", None)
    images = getattr(processor, "image_processor", None)
    if tokenizer is None or images is None:
        raise ConfigError(
            f"hf_processor takes a multimodal processor with a tokenizer and an image "
            f"processor (LlavaProcessor, Qwen2VLProcessor), got {type(processor).__name__}"
        )
    template = getattr(processor, "chat_template", None) or getattr(
        tokenizer, "chat_template", None
    )
    if not template:
        raise ConfigError(
            f"{type(processor).__name__} has no chat_template (nor has its tokenizer): "
            "pass template="
        )
    return tokenizer, images, template


def _qwen(
    processor: Any,
    tokenizer: Any,
    images: Any,
    template: str,
    max_length: int,
    *,
    exif_transpose: bool,
) -> Pipeline:
    """Qwen2-VL's smart resize and grid rule (see the module docstring)."""
    factor = int(images.patch_size) * int(images.merge_size)
    size = getattr(images, "size", None) or {}

    def bound(attr: str, key: str) -> int:
        value = getattr(images, attr, None)
        if value is None:
            value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        if value is None:
            raise ConfigError(f"{type(images).__name__} has no {attr} (nor size[{key!r}])")
        return int(value)

    stage = QwenImageStage(
        min_pixels=bound("min_pixels", "shortest_edge"),
        max_pixels=bound("max_pixels", "longest_edge"),
        factor=factor,
        exif_transpose=exif_transpose,
        processor=images,
    )
    video, tokens = _qwen_video(processor)
    spec = ChatSpec(
        tokenizer,
        template,
        max_length,
        image_token_id=int(processor.image_token_id),
        # the plain rule's method: the same count, fingerprinted without the processor
        image_tokens=SmartResize(stage.min_pixels, stage.max_pixels, factor).image_tokens,
        image_prefix=_vision_token(processor, "start"),
        image_suffix=_vision_token(processor, "end"),
        video=tokens,
    )
    return Pipeline(image=stage, text=spec, video=video)


def _vision_token(processor: Any, which: str) -> str:
    """The processor's ``vision_start_token`` / ``vision_end_token`` (Qwen3-VL names
    them; Qwen2-VL's are these fixed strings)."""
    value = getattr(processor, f"vision_{which}_token", None)
    return value if isinstance(value, str) and value else f"<|vision_{which}|>"


def _qwen_video(processor: Any) -> tuple[VideoSpec | None, VideoTokens | None]:
    """The :class:`~mmcache.VideoSpec` and :class:`~mmcache.transforms.VideoTokens` of a
    Qwen processor's video processor (``None, None`` without one).

    The frames are chosen and sized by qwen-vl-utils' rules (what Qwen's own recipes
    feed the processor, which then samples and resizes no more), at the video
    processor's geometry (``patch_size`` 14 for Qwen2/2.5-VL, 16 for Qwen3-VL: frame
    sides multiples of 28 or 32), ``temporal_patch_size``, ``fps`` (qwen-vl-utils' 2.0
    when it has none), ``min_frames`` and ``max_frames``. Qwen2-VL's video processor
    bounds each frame's pixels (``size``: ``shortest_edge`` / ``longest_edge``): they
    become ``min_pixels`` / ``max_pixels`` (as a record's part passes them to
    qwen-vl-utils; its 768-token cap per frame stays). Qwen3-VL's bounds a whole clip's
    ``t * h * w`` instead, which qwen-vl-utils has no rule for: its per-frame defaults
    stay (128 to 768 tokens a frame, a 128k-token clip). Qwen3-VL's tokens are
    timestamped (``VideoTokens(timestamps=True)``)."""
    videos = getattr(processor, "video_processor", None)
    if videos is None:
        return None, None
    patch = int(videos.patch_size)
    merge = int(videos.merge_size)
    temporal = int(videos.temporal_patch_size)
    fps = getattr(videos, "fps", None)
    bounds: dict[str, int | None] = {"min_pixels": None, "max_pixels": None}
    if type(videos).__name__ in _PER_FRAME_BOUNDS:
        size = getattr(videos, "size", None) or {}
        for key, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
            value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
            if value is not None:
                bounds[name] = int(value)
    spec = VideoSpec(
        fps=float(fps) if isinstance(fps, (int, float)) and fps > 0 else 2.0,
        min_frames=int(getattr(videos, "min_frames", 4) or 4),
        max_frames=int(getattr(videos, "max_frames", 768) or 768),
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=temporal,
        min_pixels=bounds["min_pixels"],
        max_pixels=bounds["max_pixels"],
    )
    tokens = VideoTokens(
        pad_token=processor.video_token,
        prefix=_vision_token(processor, "start"),
        suffix=_vision_token(processor, "end"),
        factor=patch * merge,
        temporal_patch_size=temporal,
        timestamps=type(processor).__name__ in _TIMESTAMPED,
    )
    return spec, tokens


def _llava_next(
    processor: Any,
    tokenizer: Any,
    images: Any,
    template: str,
    max_length: int,
    *,
    exif_transpose: bool,
) -> Pipeline:
    """LLaVA-NeXT's crops and its token count from the original size (the module docstring)."""
    stage = LlavaNextImageStage(images, exif_transpose=exif_transpose)
    spec = ChatSpec(
        tokenizer,
        template,
        max_length,
        image_token=processor.image_token,
        image_tokens=LlavaNextTokens.of(processor, stage.crop_size),
    )
    return Pipeline(image=stage, text=spec)


def hf_processor(
    processor: Any,
    max_length: int = 2048,
    *,
    template: str | None = None,
    exif_transpose: bool = True,
) -> Pipeline:
    """The :class:`~mmcache.Pipeline` equivalent to ``processor`` (see the module docstring).

    Args:
        processor: a ``LlavaProcessor``, ``LlavaNextProcessor``, ``Qwen2VLProcessor``,
            ``Qwen2_5_VLProcessor`` or ``Qwen3VLProcessor`` (Qwen3-VL, Qwen3.5).
        max_length: the most tokens a sample keeps, image tokens included.
        template: a chat template to use instead of the processor's.
        exif_transpose: give the processor each image upright by its EXIF orientation
            (True: as transformers' ``load_image``, which ``apply_chat_template`` and
            the pipelines open files with, gives it) or as stored (False: as
            qwen-vl-utils' ``fetch_image`` and a plain ``Image.open`` give it).

    Raises:
        ConfigError: another processor class (LLaVA-OneVision's included), a missing
            part.
    """
    name = type(processor).__name__
    if name.startswith("LlavaOnevision"):
        raise ConfigError(
            f"hf_processor cannot cache {name}: it processes an image one way when its "
            "sample has one image (1 + k any-resolution crops, a token count from the "
            "original size) and another when the sample has several (one square padded "
            "with the mean colour each, a fixed count), which a cached stage of one image "
            "cannot know; use LlavaNextProcessor's any-resolution path or LlavaProcessor"
        )
    tokenizer, images, own = _parts(processor)
    template = template or own
    if name in _QWEN:
        return _qwen(processor, tokenizer, images, template, max_length,
                     exif_transpose=exif_transpose)  # fmt: skip
    if name == "LlavaNextProcessor":
        return _llava_next(processor, tokenizer, images, template, max_length,
                           exif_transpose=exif_transpose)  # fmt: skip
    if name != "LlavaProcessor":
        raise ConfigError(
            f"hf_processor knows LlavaProcessor, LlavaNextProcessor, {', '.join(_QWEN)}, "
            f"got {name}: build the Pipeline from hf_image_processor and ChatSpec"
        )
    stage = hf_image_processor(images, exif_transpose=exif_transpose)
    fixed = stage.output_size(1, 1) == stage.output_size(999, 333)
    hw = stage.output_size(1, 1)
    if not fixed or hw is None:
        raise ConfigError(
            f"{type(images).__name__} does not crop to one size: LLaVA's image-token "
            "count then depends on each image; set do_center_crop with crop_size"
        )
    count = llava_image_tokens(processor, *hw)
    spec = ChatSpec(
        tokenizer, template, max_length, image_token=processor.image_token, image_tokens=count
    )
    return Pipeline(image=stage, text=spec)
