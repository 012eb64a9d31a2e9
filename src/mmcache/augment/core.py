"""Seeded random augmentation of cached uint8 images, run on each batch after the cache.

Random crops and flips cannot be cached (they differ every epoch), so the cache
holds the deterministic prefix (decode, resize) as uint8 and these run on the
assembled batch, in the training process, on the CPU or on a GPU
(``mmcache.DataLoader(..., augment=Augment(fn, device=...))``).

Randomness comes only from ``(seed, epoch, sample index)``: every sample has its
own ``torch.Generator`` (:func:`sample_generators`), never the global RNG, so
the same seed gives bitwise the same augmented batches with the cache off,
cold, warm or partly warm, with any ``num_workers`` and after a resume
mid-epoch (on one kind of device: a CPU and a GPU resample differently).

The built-ins take ``(images, generators)``: a uint8 batch ``[B,3,H,W]`` or a
list of ``B`` uint8 images ``[3,H_i,W_i]`` (variable-shape cached images), and
one generator per image, drawn from in order (a :class:`Compose` passes the
same generators on, so each transform draws after the previous one).

- :class:`RandomResizedCrop`: torchvision's parameter sampling and geometry
  (``RandomResizedCrop.get_params``: ten tries at a random area and log-uniform
  aspect ratio, then a centre crop clipped to the image), then an antialiased
  bilinear or bicubic resize to ``size x size``; always returns a uint8 tensor
  ``[B,3,size,size]``. The crop box always lies inside the image (a crop
  larger than a small image is clipped, as torchvision's is).
- :class:`RandomHorizontalFlip`: ``torch.rand(1) < p`` per image, as torchvision.
- :class:`Compose`: the transforms in order.

The colour transforms (``ColorJitter``, ``RandomGrayscale``), ``Normalize`` and
:func:`~mmcache.augment.torchvision.from_torchvision` (a torchvision ``Compose``
split into a cached stage and these) live beside this module in the package.

>>> import torch
>>> images = torch.randint(0, 256, (4, 3, 64, 80), dtype=torch.uint8)
>>> aug = Compose([RandomResizedCrop(32, scale=(0.9, 1.0)), RandomHorizontalFlip()])
>>> out = aug(images, sample_generators(seed=0, epoch=3, indices=[7, 8, 9, 10]))
>>> tuple(out.shape), out.dtype
((4, 3, 32, 32), torch.uint8)
>>> torch.equal(out, aug(images, sample_generators(0, 3, [7, 8, 9, 10])))
True

Any other callable can be an ``augment`` of the loader: it gets ``(images,
generator)`` with one ``torch.Generator`` per batch (:func:`batch_generator`,
from ``(seed, epoch, batch index)``), see :mod:`mmcache.loader.augmenting`.

Thread safety: the transforms hold only their configuration; calls on two
threads at once are safe (each call draws from the generators it is given).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from mmcache.errors import ConfigError

__all__ = [
    "Augment",
    "Compose",
    "Images",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resample",
    "augment_into",
    "batch_generator",
    "check_images",
    "reseed_generators",
    "sample_generators",
    "sample_seed",
]

#: The resampling filters of :class:`RandomResizedCrop` (torch's antialiased ones).
Resample = Literal["bilinear", "bicubic"]

#: A batch of images: one uint8 tensor ``[B,3,H,W]``, or ``B`` tensors ``[3,H_i,W_i]``.
Images: TypeAlias = "torch.Tensor | list[torch.Tensor]"

_MASK64 = (1 << 64) - 1
#: Domain tags so that a sample's and a batch's seed never coincide.
_SAMPLE_TAG, _BATCH_TAG = 0x5A17, 0xBA7C


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that scatters nearby inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _fold(*parts: int) -> int:
    h = 0
    for p in parts:
        h = _mix(h ^ (int(p) & _MASK64))
    return h


def _seed_of(*parts: int) -> int:
    return _fold(*parts) >> 1  # torch.Generator.manual_seed takes up to 2**63 - 1 without wrapping


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s generator in ``epoch``: a pure function of the three."""
    return _seed_of(_SAMPLE_TAG, seed, epoch, index)


_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2, _M3 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31, _S1 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(1)


def _sample_seeds(seed: int, epoch: int, indices: Sequence[int] | np.ndarray) -> list[int]:
    """:func:`sample_seed` of each index, the last mixing step done for the whole batch in
    numpy (uint64 arithmetic wraps as ``& _MASK64`` does): ~0.3 us an index instead of
    ~5 us, the same ints."""
    try:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    except (OverflowError, TypeError, ValueError):  # ints beyond int64: the plain form
        return [sample_seed(seed, epoch, int(i)) for i in indices]
    h = _fold(_SAMPLE_TAG, seed, epoch)
    with np.errstate(over="ignore"):
        x = idx.view(np.uint64) ^ np.uint64(h)
        x = x + _M1
        x = (x ^ (x >> _S30)) * _M2
        x = (x ^ (x >> _S27)) * _M3
        x = (x ^ (x >> _S31)) >> _S1
    return x.tolist()  # type: ignore[no-any-return]


def sample_generators(
    seed: int, epoch: int, indices: Sequence[int] | np.ndarray
) -> list[torch.Generator]:
    """One CPU ``torch.Generator`` per dataset index, seeded by :func:`sample_seed`."""
    out = []
    for s in _sample_seeds(seed, epoch, indices):
        g = torch.Generator()
        g.manual_seed(s)
        out.append(g)
    return out


def reseed_generators(
    generators: list[torch.Generator], seed: int, epoch: int, indices: Sequence[int] | np.ndarray
) -> list[torch.Generator]:
    """The generators :func:`sample_generators` gives, made by seeding those in
    ``generators`` again (grown as needed; ``manual_seed`` resets a CPU generator's whole
    state, so each is as a new one): for a caller that makes a batch's generators again and
    again and keeps none (a crop process). Returns the first ``len(indices)`` of the list.

    Not thread-safe: one list per thread."""
    seeds = _sample_seeds(seed, epoch, indices)
    while len(generators) < len(seeds):
        generators.append(torch.Generator())
    for g, s in zip(generators, seeds, strict=False):
        g.manual_seed(s)
    return generators[: len(seeds)]


def batch_generator(seed: int, epoch: int, batch: int) -> torch.Generator:
    """The CPU ``torch.Generator`` a user ``augment`` callable gets for batch ``batch``
    of ``epoch`` (same seed, epoch and batch: same generator state)."""
    g = torch.Generator()
    g.manual_seed(_seed_of(_BATCH_TAG, seed, epoch, batch))
    return g


@runtime_checkable
class Augment(Protocol):
    """A seeded batch transform: ``(images, generators) -> images``, one generator per image."""

    def __call__(self, images: Images, generators: Sequence[torch.Generator], /) -> Images: ...


def check_images(images: Images, generators: Sequence[torch.Generator], who: str) -> int:
    if isinstance(images, torch.Tensor):
        if images.dim() != 4 or images.dtype != torch.uint8:
            raise ConfigError(
                f"{who} takes uint8 images [B,C,H,W] (or a list of [C,H,W]), got "
                f"{images.dtype} of shape {tuple(images.shape)}"
            )
        n = images.shape[0]
    else:
        for im in images:
            if not isinstance(im, torch.Tensor) or im.dim() != 3 or im.dtype != torch.uint8:
                got = f"{im.dtype} {tuple(im.shape)}" if isinstance(im, torch.Tensor) else im
                raise ConfigError(f"{who} takes a list of uint8 images [C,H,W], got {got!r}")
        n = len(images)
    if len(generators) != n:
        raise ConfigError(f"{who} got {n} images but {len(generators)} generators (one each)")
    return n


def _pair(name: str, value: Sequence[float]) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a pair (low, high), got {value!r}") from None
    if not (0 < lo <= hi) or not math.isfinite(hi):
        raise ConfigError(f"{name} must be a pair 0 < low <= high, got {value!r}")
    return lo, hi


class RandomResizedCrop:
    """A random crop of random area and aspect ratio, resized to ``size x size``.

    Args:
        size: the output's side (square output).
        scale: the range of the crop's area, as a fraction of the image's.
        ratio: the range of the crop's aspect ratio (width / height), sampled
            log-uniformly.
        antialias: antialiased resampling (as torchvision's default); False: plain.
        interpolation: ``"bilinear"`` (torchvision's default) or ``"bicubic"``
            (open_clip's ``image_transform``, torchvision's ``InterpolationMode.BICUBIC``);
            bicubic overshoots are clamped to 0..255, as torchvision's are.

    The parameters are torchvision's ``RandomResizedCrop.get_params`` drawn from
    each image's generator (the same draws, in the same order), so a generator
    seeded like torch's global RNG gives torchvision's crop boxes.
    """

    def __init__(
        self,
        size: int,
        *,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
        antialias: bool = True,
        interpolation: Resample = "bilinear",
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"RandomResizedCrop size must be an int >= 1, got {size!r}")
        self.size = size
        self.scale = _pair("RandomResizedCrop scale", scale)
        if self.scale[1] > 1.0:
            raise ConfigError(f"RandomResizedCrop scale must lie in (0, 1], got {scale!r}")
        self.ratio = _pair("RandomResizedCrop ratio", ratio)
        self.antialias = bool(antialias)
        if interpolation not in ("bilinear", "bicubic"):
            raise ConfigError(
                f"RandomResizedCrop interpolation must be 'bilinear' or 'bicubic', "
                f"got {interpolation!r}"
            )
        self.interpolation: Resample = interpolation
        self._log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))

    def __repr__(self) -> str:
        return (
            f"RandomResizedCrop({self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"antialias={self.antialias}, interpolation={self.interpolation!r})"
        )

    def params(self, height: int, width: int, g: torch.Generator) -> tuple[int, int, int, int]:
        """``(top, left, h, w)`` of one crop of a ``height x width`` image (torchvision's
        ``get_params``, drawing from ``g``)."""
        return self._params(height, width, g, _Draws())

    def _params(
        self, height: int, width: int, g: torch.Generator, draws: _Draws
    ) -> tuple[int, int, int, int]:
        # torchvision's get_params draws, per try, a uniform area fraction, then a uniform
        # log aspect ratio; on the first try that fits, a top and a left. Each draw of a
        # tensor element takes the generator's next numbers, element after element, so
        # the ten tries' values are drawn at once, twice from the same state (once per
        # range: the values are the same floats the one-by-one draws give), and the
        # generator is then put where the one-by-one draws leave it: four tensor calls
        # instead of ~11 (one per draw, ~3 us each; measured, busy). The results are
        # pinned against the one-by-one draws (tests/unit/test_augment_fast.py).
        area = height * width
        lo, hi = self._log_ratio
        state = g.get_state()
        fractions = draws.tries.uniform_(*self.scale, generator=g).tolist()
        g.set_state(state)
        logs = draws.tries.uniform_(lo, hi, generator=g).tolist()
        for k in range(10):
            target_area = area * fractions[2 * k]
            aspect = math.exp(logs[2 * k + 1])
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                g.set_state(state)
                draws.tries[: 2 * k + 2].uniform_(generator=g)  # the k+1 tries' draws
                whole = draws.whole
                top = int(whole.random_(0, height - h + 1, generator=g).item())
                left = int(whole.random_(0, width - w + 1, generator=g).item())
                return top, left, h, w
        # Ten tries failed (the generator is past their 20 draws, as one by one): a centre
        # crop, clipped to the image.
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w = width
            h = round(w / min(self.ratio))
        elif in_ratio > max(self.ratio):
            h = height
            w = round(h * max(self.ratio))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def _boxes(
        self, seq: Sequence[torch.Tensor], generators: Sequence[torch.Generator]
    ) -> list[tuple[int, int, int, int]]:
        draws = _Draws()
        return [
            self._params(int(im.shape[1]), int(im.shape[2]), g, draws)
            for im, g in zip(seq, generators, strict=True)
        ]

    def __call__(self, images: Images, generators: Sequence[torch.Generator], /) -> torch.Tensor:
        n = check_images(images, generators, "RandomResizedCrop")
        seq = list(images) if isinstance(images, torch.Tensor) else images
        channels = seq[0].shape[0] if n else 3
        device = seq[0].device if n else torch.device("cpu")
        s = self.size
        boxes = self._boxes(seq, generators)
        if device.type != "cpu":
            # CUDA resamples floats only: each crop resized, the batch rounded back once.
            fout = torch.empty((n, channels, s, s), dtype=torch.float32, device=device)
            for i, (im, (top, left, h, w)) in enumerate(zip(seq, boxes, strict=True)):
                crop = im[:, top : top + h, left : left + w].unsqueeze(0).float()
                fout[i] = self._resize(crop)[0]
            return fout.round_().clamp_(0, 255).to(torch.uint8)
        return self._write(seq, boxes, None, [False] * n)

    def crop_into(
        self,
        images: Images,
        generators: Sequence[torch.Generator],
        out: torch.Tensor | None,
        flips: Sequence[RandomHorizontalFlip] = (),
    ) -> torch.Tensor:
        """The crops of CPU ``images``, then the ``flips`` after them, written into ``out``
        (a CPU uint8 ``[B,C,size,size]``; None: a new batch, channels-last from interleaved
        images) and returned: bitwise ``Compose([self, *flips])(images, generators)``.
        The draws are the same, in the same order (every crop's, then each flip's)."""
        check_images(images, generators, "RandomResizedCrop")
        seq = list(images) if isinstance(images, torch.Tensor) else images
        boxes = self._boxes(seq, generators)
        flipped = [False] * len(seq)
        for f in flips:
            flipped = [a != b for a, b in zip(flipped, f.draws(generators), strict=True)]
        return self._write(seq, boxes, out, flipped)

    def _write(
        self,
        seq: Sequence[torch.Tensor],
        boxes: Sequence[tuple[int, int, int, int]],
        out: torch.Tensor | None,
        flips: Sequence[bool],
    ) -> torch.Tensor:
        """Each CPU crop resized straight into its row of ``out`` (flipped left-right where
        ``flips`` says), without a resized copy of it in between; ``out`` None: a new
        batch, channels-last from interleaved images (interleaved in, interleaved out)."""
        if out is None:
            channels, s = (seq[0].shape[0] if seq else 3), self.size
            fmt = torch.channels_last if _interleaved(seq, channels) else torch.contiguous_format
            out = torch.empty((len(seq), channels, s, s), dtype=torch.uint8, memory_format=fmt)
        # The CPU resamples uint8 natively (fastest) from a channels-last crop. From
        # interleaved pixels (ImageSpec(channels_last=True)) that crop is a copy of
        # rows; from [3,H,W] planes an interleaving copy, about as long as the resize
        # itself (torch's is 1.3-2.7x faster than numpy's transpose, measured on
        # 3x240x240 crops with 1 and 2 intra-op threads). Bitwise the same result. The
        # kernel takes the crop as a strided view too (bitwise the same) but is slower
        # so (~500 against ~330 us for a 243 px crop of a 256 px image, busy).
        # The kernel writes each row of ``out`` in that row's own layout (channels-last or
        # planar), the values bitwise F.interpolate's.
        resize = self._resize_into
        scratch: torch.Tensor | None = None
        for i, (im, (top, left, h, w)) in enumerate(zip(seq, boxes, strict=True)):
            crop = im[:, top : top + h, left : left + w].unsqueeze(0)
            crop = crop.contiguous(memory_format=torch.channels_last)
            if flips[i]:
                if scratch is None:
                    scratch = torch.empty(
                        (1, *out.shape[1:]), dtype=torch.uint8, memory_format=torch.channels_last
                    )
                resize(crop, scratch)
                out[i].copy_(scratch[0].flip(-1))
            else:
                resize(crop, out[i : i + 1])
        return out

    def _resize(self, crop: torch.Tensor) -> torch.Tensor:
        s = self.size
        return F.interpolate(
            crop,
            size=(s, s),
            mode=self.interpolation,
            align_corners=False,
            antialias=self.antialias,
        )

    def _resize_into(self, crop: torch.Tensor, out: torch.Tensor) -> None:
        # What F.interpolate(crop, size=(s, s), mode, align_corners=False, antialias)
        # calls, with its out= form: the result lands in ``out`` (a row of the batch),
        # bitwise F.interpolate's (pinned for all four modes in tests/unit/test_augment_fast.py).
        s = self.size
        _RESIZE[self.interpolation, self.antialias](crop, (s, s), False, None, None, out=out)


#: F.interpolate's kernels by (interpolation, antialias), called in their out= form
#: ``(input, output_size, align_corners, scales_h, scales_w, *, out)``.
_RESIZE: dict[tuple[str, bool], Callable[..., Any]] = {
    ("bilinear", True): torch._C._nn._upsample_bilinear2d_aa,
    ("bicubic", True): torch._C._nn._upsample_bicubic2d_aa,
    ("bilinear", False): torch._C._nn.upsample_bilinear2d,
    ("bicubic", False): torch._C._nn.upsample_bicubic2d,
}


class _Draws:
    """The tensors :meth:`RandomResizedCrop._params` draws into, made once a batch: the
    ten tries' 20 values (the default float dtype, as torchvision's
    ``torch.empty(1).uniform_``) and an int64 for the top and the left. Not shared
    between threads."""

    def __init__(self) -> None:
        self.tries = torch.empty(20)
        self.whole = torch.empty(1, dtype=torch.int64)


def _interleaved(seq: Sequence[torch.Tensor], channels: int) -> bool:
    return len(seq) > 0 and channels > 1 and all(im.stride(0) == 1 for im in seq)


class RandomHorizontalFlip:
    """Flips each image left-right with probability ``p`` (``torch.rand(1) < p`` drawn
    from its generator, as torchvision does from the global RNG)."""

    def __init__(self, p: float = 0.5) -> None:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= p <= 1.0):
            raise ConfigError(f"RandomHorizontalFlip p must be a probability in [0, 1], got {p!r}")
        self.p = float(p)

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"

    def __call__(self, images: Images, generators: Sequence[torch.Generator], /) -> Images:
        return self.apply(images, generators, in_place=False)

    def apply(
        self, images: Images, generators: Sequence[torch.Generator], *, in_place: bool
    ) -> Images:
        """The flips of :meth:`__call__`; ``in_place=True`` flips a CPU batch tensor's rows
        in place (what :class:`Compose` does with the fresh output of a crop: a new
        9.6 MB batch would cost its page faults again on every batch)."""
        n = check_images(images, generators, "RandomHorizontalFlip")
        flip = self.draws(generators)
        if isinstance(images, torch.Tensor):
            if images.device.type != "cpu":
                rows = torch.tensor([i for i in range(n) if flip[i]], device=images.device)
                out = images.clone()
                out[rows] = images[rows].flip(-1)
                return out
            # Row by row with torch's flip kernel: ~8 us for a 3x224x224 uint8 image, where
            # a reversed-stride numpy copy takes ~50 us (measured, one intra-op thread).
            dst = images if in_place else images.clone()
            for i, f in enumerate(flip):
                if f:
                    dst[i].copy_(images[i].flip(-1))
            return dst
        return [im.flip(-1) if f else im for im, f in zip(images, flip, strict=True)]

    def draws(self, generators: Sequence[torch.Generator]) -> list[bool]:
        """Whether each image is flipped: ``torch.rand(1, generator=g) < p`` per generator,
        in order (drawn into one reused tensor: the same value, ~1 us less a draw)."""
        real, p = torch.empty(1), self.p  # torch.rand's dtype and kernel: uniform_(0, 1)
        return [bool(real.uniform_(0, 1, generator=g).item() < p) for g in generators]


class Compose:
    """The transforms in order, each drawing from the same per-image generators."""

    def __init__(self, transforms: Sequence[Augment]) -> None:
        if isinstance(transforms, (str, bytes)) or not isinstance(transforms, Sequence):
            raise ConfigError(
                f"Compose takes a list of transforms, got {type(transforms).__name__}"
            )
        for t in transforms:
            if not callable(t):
                raise ConfigError(f"Compose: {t!r} is not callable (a transform)")
        self.transforms = tuple(transforms)

    def __repr__(self) -> str:
        return f"Compose([{', '.join(map(repr, self.transforms))}])"

    def __call__(self, images: Images, generators: Sequence[torch.Generator], /) -> Images:
        fresh = False  # whether ``images`` is a tensor made here, so free to change in place
        transforms = self.transforms
        crop, flips = self._crop_stage()
        if crop is not None and _on_cpu(images):
            # The crop and the flips right after it in one pass: each flipped crop is
            # resized into a scratch row and written flipped into its batch row, instead
            # of a flip and a copy of the batch row afterwards. The draws are the ones the
            # transforms make one after another (the crops', then each flip's, over all
            # images), so the result is bitwise the same.
            images = crop.crop_into(images, generators, None, flips)
            transforms, fresh = transforms[1 + len(flips) :], True
        for t in transforms:
            if isinstance(t, RandomHorizontalFlip):
                images = t.apply(images, generators, in_place=fresh)
            else:
                images = t(images, generators)
                fresh = isinstance(t, RandomResizedCrop)
        return images

    def _crop_stage(self) -> tuple[RandomResizedCrop | None, tuple[RandomHorizontalFlip, ...]]:
        """The leading crop and the flips right after it (None, () without a leading crop)."""
        if not self.transforms or not isinstance(self.transforms[0], RandomResizedCrop):
            return None, ()
        flips: list[RandomHorizontalFlip] = []
        for t in self.transforms[1:]:
            if not isinstance(t, RandomHorizontalFlip):
                break
            flips.append(t)
        return self.transforms[0], tuple(flips)


def _on_cpu(images: Images) -> bool:
    """Whether ``images`` is a non-empty batch (or list) whose first image is a CPU tensor
    (anything else takes the transforms one by one, which say what is wrong with it)."""
    if not isinstance(images, (torch.Tensor, list)) or len(images) == 0:
        return False
    first = images[0]
    return isinstance(first, torch.Tensor) and first.device.type == "cpu"


def augment_into(
    augment: object, images: Images, generators: Sequence[torch.Generator], out: torch.Tensor
) -> bool:
    """Run ``augment`` on CPU ``images`` with its result written into ``out`` (a CPU uint8
    ``[B,C,size,size]`` tensor, any strides: a slice of a shared batch) when it is a
    :class:`RandomResizedCrop`, or a :class:`Compose` of one and then flips only: True,
    bitwise what ``augment(images, generators)`` returns, without a batch in between.
    False (``out`` untouched, nothing drawn): any other augment or input; the caller
    copies ``augment(images, generators)`` itself."""
    crop: RandomResizedCrop | None
    flips: tuple[RandomHorizontalFlip, ...]
    if isinstance(augment, RandomResizedCrop):
        crop, flips = augment, ()
    elif isinstance(augment, Compose):
        crop, flips = augment._crop_stage()
        if crop is None or 1 + len(flips) != len(augment.transforms):
            return False
    else:
        return False
    s = crop.size
    if (
        not _on_cpu(images)
        or out.device.type != "cpu"
        or out.dtype != torch.uint8
        or tuple(out.shape) != (len(images), images[0].shape[0], s, s)
    ):
        return False
    crop.crop_into(images, generators, out, flips)
    return True


def output_size(augment: object) -> int | None:
    """The fixed side an augment's output has (a :class:`RandomResizedCrop` in it), else None."""
    if isinstance(augment, RandomResizedCrop):
        return augment.size
    if isinstance(augment, Compose):
        size = None
        for t in augment.transforms:
            size = output_size(t) or size
        return size
    return None
