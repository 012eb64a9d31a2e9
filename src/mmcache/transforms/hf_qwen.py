"""Qwen2-VL's image processor as the cached stage: :class:`QwenImageStage`.

:class:`~mmcache.transforms.smart_resize.SmartResize` resizes with Pillow. The
processor ``transformers`` builds by default when torchvision is installed resizes
with torchvision's bicubic kernel instead, which differs from Pillow's by up to one
level: the normalised pixels then differ from the processor's ``pixel_values`` by
~0.015. :class:`QwenImageStage` is a SmartResize (same size rule, grid and token
count, so lengths, grouping and packing work unchanged) whose pixels are the
processor's own: it calls the processor with ``do_rescale=False, do_normalize=False``
and puts the uint8 patches it returns back into the ``[3, h, w]`` image they were cut
from (the inverse of its ``patchify``; the temporal copies are equal, the first is
kept). After the cache, :func:`mmcache.transforms.qwen_patches` cuts them again.

Fingerprint: SmartResize's fields and the processor's class, configuration and
transformers' major version. Immutable; pickles with the processor into spawn-started
workers; processors keep no state between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from PIL import Image

from mmcache.errors import SampleError
from mmcache.transforms.hf import processor_identity
from mmcache.transforms.pixels import upright_rgb
from mmcache.transforms.smart_resize import SmartResize

__all__ = ["QwenImageStage", "unpatchify"]


def unpatchify(
    patches: npt.NDArray[Any], grid_h: int, grid_w: int, *, patch: int, merge: int, temporal: int
) -> npt.NDArray[Any]:
    """Qwen2-VL's flattened patches ``[grid_h * grid_w, C * temporal * patch**2]`` of one
    image -> the ``[C, grid_h * patch, grid_w * patch]`` image (first temporal copy)."""
    m, p = merge, patch
    c = patches.shape[1] // (temporal * p * p)
    x = patches.reshape(grid_h // m, grid_w // m, m, m, c, temporal, p, p)[:, :, :, :, :, 0]
    x = x.transpose(4, 0, 2, 5, 1, 3, 6)  # (C, gh/m, m, p, gw/m, m, p)
    return np.ascontiguousarray(x.reshape(c, grid_h * p, grid_w * p))


@dataclass(frozen=True)
class QwenImageStage(SmartResize):
    """A SmartResize whose pixels come from ``processor`` (a ``Qwen2VLImageProcessor``
    of either backend); see the module docstring. Build it with
    :func:`mmcache.hf_processor`."""

    processor: Any = field(default=None, compare=False, repr=False)

    @property
    def patch(self) -> int:
        """The processor's vision patch side."""
        return int(self.processor.patch_size)

    def fingerprint_fields(self) -> dict[str, Any]:
        """SmartResize's fields and the processor's identity."""
        return {**super().fingerprint_fields(), "processor": processor_identity(self.processor)}

    def __call__(self, im: Image.Image, /) -> npt.NDArray[np.uint8]:
        """A decoded image -> the processor's resized uint8 ``[3, h, w]``. SampleError
        for an aspect ratio over 200 or output the processor did not make as the size
        rule says."""
        src = upright_rgb(im, transpose=self.exif_transpose)
        try:
            h, w = self.output_size(src.height, src.width)
        except ValueError as exc:
            raise SampleError(str(exc), sample_id="<image>") from exc
        p = self.processor
        out = p(src, do_rescale=False, do_normalize=False, return_tensors="np")
        grid = [int(v) for v in np.asarray(out["image_grid_thw"]).reshape(-1)]
        values = np.asarray(out["pixel_values"])
        if grid != [1, h // self.patch, w // self.patch] or not (
            values.dtype == np.uint8 or np.array_equal(values, np.round(values))
        ):
            raise SampleError(
                f"{type(p).__name__} made grid {grid} of {values.dtype} patches for a "
                f"{src.height}x{src.width} image; the size rule says {h}x{w} of uint8",
                sample_id="<image>",
            )
        image = unpatchify(
            values,
            grid[1],
            grid[2],
            patch=self.patch,
            merge=int(p.merge_size),
            temporal=int(p.temporal_patch_size),
        )
        return np.ascontiguousarray(image.astype(np.uint8))


if TYPE_CHECKING:  # mypy checks that QwenImageStage conforms to the protocol
    from mmcache.transforms.stage import Stage

    def _conforms(spec: QwenImageStage) -> Stage:
        return spec
