"""Processing stages: the deterministic steps a cache holds the result of.

A stage (:mod:`mmcache.transforms.stage`) is one step with a fingerprint;
:class:`mmcache.Pipeline` runs an ordered list of them over a record. The
built-in stages are :class:`ImageSpec` (:mod:`~mmcache.transforms.image`: the
decode step and the crop/resize/colour stage), :class:`SmartResize`
(:mod:`~mmcache.transforms.smart_resize`: Qwen2-VL's dynamic resolution),
:class:`TextSpec` (:mod:`~mmcache.transforms.text`: tokenization) and :class:`ChatSpec`
(:mod:`~mmcache.transforms.chat`: chat templates and SFT labels); user callables become
stages through ``mmcache.stage`` (:class:`UserStage`, :mod:`~mmcache.transforms.user`)
and HF image processors through ``mmcache.hf_image_processor``
(:mod:`~mmcache.transforms.hf`); the normalisation of
:mod:`mmcache.transforms.normalize` runs after the cache, on the device, and
:mod:`~mmcache.transforms.model_inputs` gives an HF model its ``pixel_values``
(:class:`PixelValues`, a loader hook; :func:`qwen_patches`, Qwen2-VL's patches;
:func:`llava_next_pixels`, LLaVA-NeXT's padded crops). Neither
``stage`` nor ``normalize`` is re-exported here, where each would hide the module of
that name; ``mmcache.stage`` and ``mmcache.normalize`` are those functions.
"""

from mmcache.transforms.chat import IGNORE_INDEX, Chat, ChatEncoding, ChatSpec
from mmcache.transforms.fingerprint import callable_fingerprint
from mmcache.transforms.image import ALPHA_BACKGROUND, ImageSpec, Interpolation, decode_bytes
from mmcache.transforms.model_inputs import PixelValues, llava_next_pixels, qwen_patches
from mmcache.transforms.normalize import CLIP_MEAN, CLIP_STD, IMAGENET_MEAN, IMAGENET_STD
from mmcache.transforms.smart_resize import SmartResize
from mmcache.transforms.stage import Stage, StageKind
from mmcache.transforms.text import TextSpec, train_tokenizer
from mmcache.transforms.user import UserStage
from mmcache.transforms.video import VideoSpec, VideoTokens

__all__ = [
    "ALPHA_BACKGROUND",
    "CLIP_MEAN",
    "CLIP_STD",
    "IGNORE_INDEX",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Chat",
    "ChatEncoding",
    "ChatSpec",
    "ImageSpec",
    "Interpolation",
    "PixelValues",
    "SmartResize",
    "Stage",
    "StageKind",
    "TextSpec",
    "UserStage",
    "VideoSpec",
    "VideoTokens",
    "callable_fingerprint",
    "decode_bytes",
    "llava_next_pixels",
    "qwen_patches",
    "train_tokenizer",
]
