"""Seeded colour augmentation of cached uint8 images, and the float normalisation that ends it.

- :class:`ColorJitter`: torchvision's ``ColorJitter`` (brightness, contrast,
  saturation, hue in a random order, each factor drawn uniformly), applied with
  probability ``p`` (open_clip's ``aug_cfg.color_jitter_prob``; torchvision's
  ``RandomApply([ColorJitter(...)], p)``).
- :class:`RandomGrayscale`: torchvision's ``RandomGrayscale(p)`` (open_clip's
  ``aug_cfg.gray_scale_prob``): the ITU-R 601 luma on all three channels.
- :class:`Normalize`: uint8 -> float32 ``(x / 255 - mean) / std`` (torchvision's
  ``ToTensor()`` + ``Normalize(mean, std)``), the last step of an augment, on the
  loader's ``device``.

The arithmetic is torchvision's tensor kernels (``transforms._functional_tensor``:
``_blend`` in float32 truncated back to uint8 after each adjustment, the same
grey weights, the same HSV round trip for the hue). It is written out here
because torchvision cannot be imported beside the CPU torch build mmcache
runs with (every torchvision release on the registry is built for CUDA);
``tests/reference`` checks it against torchvision's own functions, within one
level of 255. Randomness comes only from each image's generator
(:func:`mmcache.augment.sample_generators`), drawn in torchvision's order
(the ``p`` draw first, then ``randperm(4)`` and the four factors), never from
torch's or Python's global RNG.

Thread safety: the transforms hold only their configuration; concurrent calls
are safe (each draws from the generators it is given).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from mmcache.augment.core import Images, check_images
from mmcache.errors import ConfigError
from mmcache.transforms.normalize import normalize, resolve_mean_std

__all__ = ["ColorJitter", "Normalize", "RandomGrayscale", "rgb_to_grayscale"]

# ITU-R 601-2 luma, torchvision's (and Pillow's "L" conversion's) weights.
_LUMA = (0.2989, 0.587, 0.114)


def _check_p(who: str, p: object) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= p <= 1.0):
        raise ConfigError(f"{who} p must be a probability in [0, 1], got {p!r}")
    return float(p)


def _factor_range(
    name: str, value: float | Sequence[float], *, center: float, bound: tuple[float, float]
) -> tuple[float, float] | None:
    """torchvision's ``ColorJitter._check_input``: a number ``v`` means ``[center - v,
    center + v]`` clipped at the bound's low end; a pair is taken as is; ``None`` means
    that adjustment is off (a range that is just ``center``)."""
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        v = float(value)  # type: ignore[arg-type]
        if v < 0 or not math.isfinite(v):
            raise ConfigError(f"ColorJitter {name} must be a non-negative number, got {value!r}")
        lo, hi = center - v, center + v
        lo = max(lo, 0.0) if bound[0] == 0.0 else lo
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        lo, hi = float(value[0]), float(value[1])
    else:
        raise ConfigError(f"ColorJitter {name} must be a number or a pair, got {value!r}")
    if not (bound[0] <= lo <= hi <= bound[1]):
        raise ConfigError(f"ColorJitter {name} must lie in {list(bound)}, got {value!r}")
    return None if lo == hi == center else (lo, hi)


def _blend(img: torch.Tensor, other: torch.Tensor | float, ratio: float) -> torch.Tensor:
    return (ratio * img.float() + (1.0 - ratio) * other).clamp_(0, 255).to(torch.uint8)


def rgb_to_grayscale(img: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 3, H, W]`` -> uint8 ``[..., 1, H, W]`` luma (torchvision's weights,
    truncated to uint8 as its tensor kernel does)."""
    r, g, b = img.float().unbind(dim=-3)
    return (_LUMA[0] * r + _LUMA[1] * g + _LUMA[2] * b).to(torch.uint8).unsqueeze(-3)


def _rgb2hsv(img: torch.Tensor) -> torch.Tensor:
    r, g, b = img.unbind(dim=-3)
    maxc = torch.max(img, dim=-3).values
    minc = torch.min(img, dim=-3).values
    eqc = maxc == minc
    cr = maxc - minc
    ones = torch.ones_like(maxc)
    s = cr / torch.where(eqc, ones, maxc)
    cr_divisor = torch.where(eqc, ones, cr)
    rc, gc, bc = (maxc - r) / cr_divisor, (maxc - g) / cr_divisor, (maxc - b) / cr_divisor
    hr = (maxc == r) * (bc - gc)
    hg = ((maxc == g) & (maxc != r)) * (2.0 + rc - bc)
    hb = ((maxc != g) & (maxc != r)) * (4.0 + gc - rc)
    h = torch.fmod((hr + hg + hb) / 6.0 + 1.0, 1.0)
    return torch.stack((h, s, maxc), dim=-3)


def _hsv2rgb(img: torch.Tensor) -> torch.Tensor:
    h, s, v = img.unbind(dim=-3)
    i = torch.floor(h * 6.0)
    f = h * 6.0 - i
    i = i.to(torch.int32) % 6
    p = torch.clamp(v * (1.0 - s), 0.0, 1.0)
    q = torch.clamp(v * (1.0 - s * f), 0.0, 1.0)
    t = torch.clamp(v * (1.0 - s * (1.0 - f)), 0.0, 1.0)
    mask = i.unsqueeze(-3) == torch.arange(6, device=i.device).view(-1, 1, 1)
    a1 = torch.stack((v, q, p, p, t, v), dim=-3)
    a2 = torch.stack((t, v, v, q, p, p), dim=-3)
    a3 = torch.stack((p, p, t, v, v, q), dim=-3)
    a4 = torch.stack((a1, a2, a3), dim=-4)
    return torch.einsum("...ijk, ...xijk -> ...xjk", mask.to(img.dtype), a4)


def _adjust(img: torch.Tensor, fn: int, factor: float) -> torch.Tensor:
    if fn == 0:  # brightness: blend with black
        return _blend(img, 0.0, factor)
    if fn == 1:  # contrast: blend with the mean grey
        mean = rgb_to_grayscale(img).float().mean(dim=(-3, -2, -1), keepdim=True)
        return _blend(img, mean, factor)
    if fn == 2:  # saturation: blend with the grey image
        return _blend(img, rgb_to_grayscale(img).float(), factor)
    # hue: rotate in HSV (float 0..1, back to uint8 as convert_image_dtype does)
    hsv = _rgb2hsv(img.float() / 255.0)
    h, s, v = hsv.unbind(dim=-3)
    rgb = _hsv2rgb(torch.stack(((h + factor) % 1.0, s, v), dim=-3))
    return rgb.mul(255.0 + 1.0 - 1e-3).to(torch.uint8)


def _per_image(images: Images, fn: object) -> Images:
    """Applies ``fn(image, i) -> image`` to each image of a batch tensor or list."""
    if isinstance(images, torch.Tensor):
        out = images.clone()
        for i in range(images.shape[0]):
            out[i] = fn(images[i], i)  # type: ignore[operator]
        return out
    return [fn(im, i) for i, im in enumerate(images)]  # type: ignore[operator]


class ColorJitter:
    """torchvision's ``ColorJitter``, applied to each image with probability ``p``.

    Args:
        brightness, contrast, saturation: a number ``v`` draws the factor from
            ``[max(0, 1 - v), 1 + v]``, a pair ``(lo, hi)`` from that range; 0 is off.
        hue: a number ``v`` in [0, 0.5] draws the shift from ``[-v, v]``; a pair
            within [-0.5, 0.5] is taken as is.
        p: the probability of jittering an image (1.0: always, torchvision's
            ``ColorJitter``; open_clip's ``color_jitter_prob``, e.g. 0.8).
    """

    def __init__(
        self,
        brightness: float | Sequence[float] = 0.0,
        contrast: float | Sequence[float] = 0.0,
        saturation: float | Sequence[float] = 0.0,
        hue: float | Sequence[float] = 0.0,
        *,
        p: float = 1.0,
    ) -> None:
        inf = float("inf")
        self.brightness = _factor_range("brightness", brightness, center=1.0, bound=(0.0, inf))
        self.contrast = _factor_range("contrast", contrast, center=1.0, bound=(0.0, inf))
        self.saturation = _factor_range("saturation", saturation, center=1.0, bound=(0.0, inf))
        self.hue = _factor_range("hue", hue, center=0.0, bound=(-0.5, 0.5))
        self.p = _check_p("ColorJitter", p)

    def __repr__(self) -> str:
        return (
            f"ColorJitter(brightness={self.brightness}, contrast={self.contrast}, "
            f"saturation={self.saturation}, hue={self.hue}, p={self.p})"
        )

    def params(self, g: torch.Generator) -> tuple[list[int], list[float | None]] | None:
        """One image's draws: ``None`` (not jittered, probability ``1 - p``) or the order
        of the four adjustments and their factors (``None`` for those that are off),
        drawn as torchvision's ``ColorJitter.get_params`` draws them."""
        if self.p < 1.0 and not bool(torch.rand(1, generator=g).item() < self.p):
            return None
        order = [int(i) for i in torch.randperm(4, generator=g)]
        factors: list[float | None] = []
        for rng in (self.brightness, self.contrast, self.saturation, self.hue):
            factors.append(
                None if rng is None else float(torch.empty(1).uniform_(*rng, generator=g))
            )
        return order, factors

    def apply(
        self, image: torch.Tensor, draw: tuple[list[int], list[float | None]]
    ) -> torch.Tensor:
        """One uint8 ``[3, H, W]`` image jittered by the draws of :meth:`params`."""
        order, factors = draw
        for fn in order:
            factor = factors[fn]
            if factor is not None:
                image = _adjust(image, fn, factor)
        return image

    def __call__(self, images: Images, generators: Sequence[torch.Generator], /) -> Images:
        check_images(images, generators, "ColorJitter")
        draws = [self.params(g) for g in generators]

        def one(im: torch.Tensor, i: int) -> torch.Tensor:
            d = draws[i]
            return im if d is None else self.apply(im, d)

        return _per_image(images, one)


class RandomGrayscale:
    """torchvision's ``RandomGrayscale(p)``: with probability ``p`` an image becomes its
    luma on all three channels (``torch.rand(1) < p`` drawn from its generator)."""

    def __init__(self, p: float = 0.1) -> None:
        self.p = _check_p("RandomGrayscale", p)

    def __repr__(self) -> str:
        return f"RandomGrayscale(p={self.p})"

    def __call__(self, images: Images, generators: Sequence[torch.Generator], /) -> Images:
        check_images(images, generators, "RandomGrayscale")
        grey = [bool(torch.rand(1, generator=g).item() < self.p) for g in generators]

        def one(im: torch.Tensor, i: int) -> torch.Tensor:
            return rgb_to_grayscale(im).expand_as(im) if grey[i] else im

        return _per_image(images, one)


class Normalize:
    """uint8 images -> float32 ``(x / 255 - mean) / std``: torchvision's ``ToTensor()`` +
    ``Normalize(mean, std)``, run by the loader on its ``device``.

    ``mean`` is 3 floats, a preset name (``"clip"``, ``"siglip"``, ``"imagenet"``) or a
    stage with ``mean``/``std`` attributes (an HF image processor stage); see
    :func:`mmcache.normalize`. It must be the last transform of a :class:`Compose`
    (the others take uint8). Draws nothing.
    """

    def __init__(
        self,
        mean: Sequence[float] | str | object = "clip",
        std: Sequence[float] | None = None,
    ) -> None:
        self.mean, self.std = resolve_mean_std(mean, std)

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std})"

    def __call__(self, images: Images, generators: Sequence[torch.Generator], /) -> Images:
        check_images(images, generators, "Normalize")
        if isinstance(images, torch.Tensor):
            return normalize(images, self.mean, self.std)
        return [normalize(im, self.mean, self.std) for im in images]
