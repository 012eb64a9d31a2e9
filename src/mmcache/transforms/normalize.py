"""Normalisation on the training device: uint8 images -> float32 ``(x / 255 - mean) / std``.

The cache holds uint8 samples (4x smaller in every tier and on every copy than
float32); the float conversion runs once the batch is on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmcache.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["CLIP_MEAN", "CLIP_STD", "IMAGENET_MEAN", "IMAGENET_STD", "normalize"]

CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


def normalize(
    images: torch.Tensor,
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
) -> torch.Tensor:
    """uint8 ``[B,3,H,W]`` or ``[3,H,W]`` -> float32 ``(x / 255 - mean) / std`` on its device.

    Meant to run on the GPU after the uint8 batch has been copied there (4x less to
    copy than float32). Returns a new tensor; the input is not modified.

    >>> import torch
    >>> normalize(torch.full((3, 1, 1), 255, dtype=torch.uint8), mean=(0.5,) * 3, std=(0.5,) * 3)
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
    if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std):
        raise ConfigError(f"mean and std need 3 values each, std > 0; got {mean!r}, {std!r}")
    mean_t = torch.tensor(mean, dtype=torch.float32, device=images.device).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=images.device).view(3, 1, 1)
    return (images.to(torch.float32).div_(255.0) - mean_t).div_(std_t)
