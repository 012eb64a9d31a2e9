"""Normalisation on the training device: uint8 images -> float32 ``(x / 255 - mean) / std``.

The cache holds uint8 samples (4x smaller in every tier and on every copy than
float32); the float conversion runs once the batch is on the GPU.

The mean and std are given as 3 floats each, as a preset name (:data:`PRESETS`:
``"clip"`` for OpenAI CLIP / open_clip's OpenAI weights, ``"siglip"`` for SigLIP's
0.5/0.5, ``"imagenet"`` for torchvision's), or as a stage that knows them (an HF image
processor stage's ``mean``/``std``). The
default is CLIP's: a SigLIP or ImageNet model needs its preset named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from mmcache.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PRESETS",
    "SIGLIP_MEAN",
    "SIGLIP_STD",
    "HasMeanStd",
    "normalize",
    "resolve_mean_std",
]

CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
SIGLIP_MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
SIGLIP_STD: tuple[float, float, float] = (0.5, 0.5, 0.5)

#: The named (mean, std) pairs :func:`normalize` takes as ``mean="name"``.
PRESETS: Mapping[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "clip": (CLIP_MEAN, CLIP_STD),
    "siglip": (SIGLIP_MEAN, SIGLIP_STD),
    "imagenet": (IMAGENET_MEAN, IMAGENET_STD),
}


@runtime_checkable
class HasMeanStd(Protocol):
    """What :func:`normalize` takes in place of ``mean``/``std``: an object that knows
    them for ``(x / 255 - mean) / std`` (``hf_image_processor(...)``'s stage, a LLaVA-NeXT
    image stage, or a user's own)."""

    @property
    def mean(self) -> Sequence[float]: ...

    @property
    def std(self) -> Sequence[float]: ...


def _floats(what: str, value: object) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in value)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be 3 numbers, got {value!r}") from None
    if len(out) != 3:
        raise ConfigError(f"{what} must be 3 numbers (R, G, B), got {value!r}")
    return out


def resolve_mean_std(
    mean: Sequence[float] | str | object, std: Sequence[float] | None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` from 3 floats each, a preset name (``std`` then None) or an object
    with ``mean``/``std`` attributes for ``(x / 255 - mean) / std`` (a stage such as
    ``hf_image_processor(...)``, which folds the processor's rescale factor in; a raw HF
    processor's ``image_mean`` is not taken, as it assumes its own rescale); ConfigError
    for anything else, naming what was given."""
    m: object
    s: object
    if isinstance(mean, str):
        if mean not in PRESETS:
            raise ConfigError(
                f"normalize preset {mean!r} is not one of {sorted(PRESETS)}: give mean and std"
            )
        if std is not None:
            raise ConfigError(f"normalize preset {mean!r} sets std too: drop std=")
        m, s = PRESETS[mean]
    elif not isinstance(mean, Sequence):
        pair = (mean.mean, mean.std) if isinstance(mean, HasMeanStd) else (None, None)
        if pair[0] is None or pair[1] is None or std is not None:
            raise ConfigError(
                f"normalize takes 3 means, a preset {sorted(PRESETS)} or a stage with "
                f"mean/std, got {type(mean).__name__}"
            )
        m, s = pair
    else:
        m, s = mean, (CLIP_STD if std is None else std)
    mean_t, std_t = _floats("mean", m), _floats("std", s)
    if any(v <= 0 for v in std_t):
        raise ConfigError(f"std must be > 0, got {std_t!r}")
    return mean_t, std_t


def normalize(
    images: torch.Tensor,
    mean: Sequence[float] | str | object = CLIP_MEAN,
    std: Sequence[float] | None = None,
) -> torch.Tensor:
    """uint8 ``[B,3,H,W]`` or ``[3,H,W]`` -> float32 ``(x / 255 - mean) / std`` on its device.

    ``mean``: 3 floats (then ``std`` is 3 floats, CLIP's when omitted), a preset name
    of :data:`PRESETS` (``"clip"``, ``"siglip"``, ``"imagenet"``), or a stage with
    ``mean``/``std`` (``hf_image_processor(...)``). Meant to run on the GPU after the
    uint8 batch has been copied there (4x less to copy than float32). Returns a new
    tensor; the input is not modified. Thread-safe.

    >>> import torch
    >>> normalize(torch.full((3, 1, 1), 255, dtype=torch.uint8), "siglip")
    tensor([[[1.]],
    <BLANKLINE>
            [[1.]],
    <BLANKLINE>
            [[1.]]])
    """
    import torch

    if not isinstance(images, torch.Tensor):
        raise ConfigError(f"normalize expects a torch.Tensor, got {type(images).__name__}")
    if images.dtype != torch.uint8:
        raise ConfigError(f"normalize expects a uint8 tensor, got {images.dtype}")
    if images.dim() not in (3, 4) or images.shape[-3] != 3:
        raise ConfigError(f"normalize expects shape [B,3,H,W] or [3,H,W], got {list(images.shape)}")
    mean, std = resolve_mean_std(mean, std)
    mean_t = torch.tensor(mean, dtype=torch.float32, device=images.device).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=images.device).view(3, 1, 1)
    return (images.to(torch.float32).div_(255.0) - mean_t).div_(std_t)
