"""HF image processors as cached stages: the processor's resize and crop cached as uint8.

LLaVA, Qwen-VL and InternVL call a ``transformers`` image processor in
``__getitem__``; every epoch it decodes, resizes, crops, rescales and normalises
again, and caching its ``pixel_values`` would hold float32 (4x the bytes of uint8).
:func:`hf_image_processor` caches what the processor produces *before* rescale and
normalise, as uint8: the resize and crop are the processor's own (it is called with
``do_rescale=False, do_normalize=False``), so the pixels are the processor's. After
the cache, on the device,

>>> images = mmcache.normalize(batch["image"], stage.mean, stage.std)   # doctest: +SKIP

gives the processor's ``pixel_values`` (within 1e-5: float rounding).
``stage.mean`` / ``stage.std`` fold its ``rescale_factor``, ``image_mean`` and
``image_std`` into :func:`mmcache.normalize`'s ``(x / 255 - mean) / std``.

Migration from the ``__getitem__`` pattern::

    # before: pixel_values = processor(Image.open(p).convert("RGB"))["pixel_values"][0]
    stage = mmcache.hf_image_processor(processor)
    pipe = mmcache.Pipeline(image=stage, text=...)
    ...
    pixel_values = mmcache.normalize(batch["image"].cuda(), stage.mean, stage.std)

The stage receives the image upright (as transformers' ``load_image`` opens a file;
``exif_transpose=False``: as stored) and in RGB (transparent pixels composited on
white, as the processors' own ``convert_rgb`` does). Supported: processors whose
output is one ``[3, H, W]`` image per input (CLIP, SigLIP, BLIP, ViT, ConvNeXt...);
one that returns patches or a list of crops is refused when the stage is built.

Fingerprint: the processor's class, its JSON configuration (``to_dict()``, keys
sorted) and the major version of ``transformers`` (its resize code can change
between majors). ``transformers`` is an optional extra (``pip install mmcache[hf]``),
imported only to load a processor from a local path.

Thread and process safety: the stage holds the processor and calls it; it pickles
with it into spawn-started workers. Processors keep no state between calls.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
import xxhash
from PIL import Image

from mmcache.errors import ConfigError, SampleError
from mmcache.transforms.pixels import upright_rgb
from mmcache.transforms.stage import Stage, StageKind
from mmcache.transforms.user import image_output

__all__ = [
    "HFImageStage",
    "hf_image_processor",
    "processor_identity",
    "processor_mean_std",
]

#: Bump when what this stage caches for the same processor changes.
HF_STAGE_VERSION = 1

# Keys of a processor's configuration that name where it came from, not what it does.
_PROVENANCE_KEYS = frozenset({"processor_class", "auto_map", "_processor_class"})


def _transformers() -> Any:
    """``transformers``, imported now, or ConfigError naming the extra."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            f"mmcache.hf_image_processor needs the transformers package ({exc}): "
            "pip install 'mmcache[hf]'"
        ) from exc
    return transformers


def _transformers_major() -> int:
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(
            "mmcache.hf_image_processor needs the transformers package: pip install 'mmcache[hf]'"
        ) from exc
    return int(version.split(".")[0])


def _three(value: Any, name: str) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ConfigError(f"the processor's {name} has {len(values)} values; 3 (RGB) are needed")
    return (values[0], values[1], values[2])


def _load(path: str | os.PathLike[str]) -> Any:
    """An image processor from a local folder or ``preprocessor_config.json``, offline."""
    transformers = _transformers()
    location = os.fspath(path)
    if not os.path.exists(location):
        raise ConfigError(
            f"no image processor at {location!r}: give a folder with a preprocessor_config.json, "
            "the file itself, or a processor object"
        )
    try:
        return transformers.AutoImageProcessor.from_pretrained(location, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load an image processor from {location!r}: {exc}") from exc


class HFImageStage:
    """An HF image processor as a cached image :class:`Stage` (see the module docstring).

    Attributes:
        processor: the image processor.
        mean, std: pass them to :func:`mmcache.normalize` to get the processor's
            ``pixel_values`` from the cached uint8 images.

    Build it with :func:`hf_image_processor`. Immutable after construction.
    """

    kind: ClassVar[StageKind] = "image"

    def __init__(self, processor: Any, *, exif_transpose: bool = True) -> None:
        if not isinstance(exif_transpose, bool):
            raise ConfigError(f"exif_transpose must be a bool, got {exif_transpose!r}")
        if not callable(processor) or not callable(getattr(processor, "to_dict", None)):
            raise ConfigError(
                f"hf_image_processor needs a transformers image processor (such as "
                f"CLIPImageProcessor), got {type(processor).__name__}"
            )
        self.processor = processor
        self.exif_transpose = exif_transpose
        # As stored is named only when chosen: the stages made before keep their keys.
        name = "hf_image_processor" if exif_transpose else "hf_image_processor/as-stored"
        self._fingerprint = processor_fingerprint(name, HF_STAGE_VERSION, processor)
        self.mean, self.std = processor_mean_std(processor)
        # Refuse now, not in a worker at the first sample, a processor whose output is
        # not one uint8-valued image (patches, crops, a float resample).
        probe = probe_pixels()
        try:
            out = self._run(Image.fromarray(probe))
        except SampleError as exc:
            reason = exc.reason
            raise ConfigError(f"hf_image_processor cannot cache this processor: {reason}") from None
        # The size rule read from the configuration is trusted only if it predicts what
        # the processor made of the probe (and of a tall one); else lengths() refuses.
        self._sized = self._rule(30, 40) == tuple(out.shape[1:])
        if self._sized:
            tall = self._run(Image.fromarray(probe.transpose(1, 0, 2).copy()))
            self._sized = self._rule(40, 30) == tuple(tall.shape[1:])

    def output_size(self, height: int, width: int) -> tuple[int, int] | None:
        """The ``(h, w)`` the processor makes of an upright ``height x width`` image, from
        its configuration (``do_center_crop`` + ``crop_size``, ``size`` as
        ``height``/``width`` or ``shortest_edge``), without decoding: what
        ``lengths()``, ``text_report()``, ``group_by_length`` and ``pack`` size images
        by. ``None`` for a rule not read here (checked on two probes when the stage is
        built)."""
        return self._rule(height, width) if self._sized else None

    def _rule(self, height: int, width: int) -> tuple[int, int] | None:
        p = self.processor
        if getattr(p, "do_center_crop", False):
            crop = _hw(getattr(p, "crop_size", None))
            if crop is not None:
                return crop  # a crop larger than the resized image pads to crop_size
        if not getattr(p, "do_resize", True):
            return (height, width)
        size = getattr(p, "size", None)
        fixed = _hw(size)
        if fixed is not None:
            return fixed
        short = _field(size, "shortest_edge")
        if short is None or _field(size, "longest_edge") is not None:
            return None
        # transformers' get_resize_output_image_size(default_to_square=False)
        if height <= width:
            return (short, int(short * width / height))
        return (int(short * height / width), short)

    def fingerprint(self) -> str:
        """Digest of the processor's class, configuration and transformers' major version."""
        return self._fingerprint

    def __repr__(self) -> str:
        return f"hf_image_processor({type(self.processor).__name__})"

    def _run(self, rgb: Image.Image) -> npt.NDArray[np.uint8]:
        name = type(self.processor).__name__
        out = self.processor(rgb, do_rescale=False, do_normalize=False, return_tensors="np")
        values = out["pixel_values"]
        arr = values if isinstance(values, np.ndarray) else np.asarray(values)
        if arr.ndim == 4 and arr.shape[0] == 1:
            arr = arr[0]
        if arr.dtype != np.uint8 and arr.size and np.issubdtype(arr.dtype, np.number):
            # Some versions return the resampled uint8 pixels as floats: convert only
            # when that changes no value (never round a real float output).
            as_u8 = arr.astype(np.uint8)
            if np.array_equal(as_u8, arr):
                arr = as_u8
            else:
                raise SampleError(
                    f"{name} returned {arr.dtype} pixels that are not whole numbers 0..255 "
                    "before rescale and normalise; only uint8 pixels are cached",
                    sample_id="<image>",
                )
        return image_output(arr, stage_name=name)

    def __call__(self, im: Image.Image, /) -> npt.NDArray[np.uint8]:
        """A decoded image (stored frame) -> the processor's resized and cropped uint8
        ``[3, H, W]``, before rescale and normalise."""
        return self._run(upright_rgb(im, transpose=self.exif_transpose))


def processor_identity(processor: Any) -> dict[str, Any]:
    """What names an image processor's output in a fingerprint: its class, its JSON
    configuration (``to_dict()``, provenance keys dropped) and transformers' major
    version (its resize code can change between majors)."""
    config = {
        k: v
        for k, v in processor.to_dict().items()
        if k not in _PROVENANCE_KEYS and not k.startswith("_")
    }
    return {
        "class": type(processor).__qualname__,
        "transformers_major": _transformers_major(),
        "config": config,
    }


def processor_fingerprint(stage: str, version: int, processor: Any) -> str:
    """xxh3-128 hex digest of a processor stage's name and version and the
    :func:`processor_identity` of its ``processor``."""
    blob = json.dumps(
        {"stage": stage, "version": version} | processor_identity(processor),
        sort_keys=True,
        separators=(",", ":"),
        default=repr,
    )
    return xxhash.xxh3_128_hexdigest(blob.encode())


def probe_pixels() -> npt.NDArray[np.uint8]:
    """The 30x40 RGB gradient a processor stage is run on when it is built (its output
    checked there, not in a worker at the first sample)."""
    return np.linspace(0, 255, 40 * 30 * 3).reshape(30, 40, 3).astype(np.uint8)


def processor_mean_std(
    processor: Any,
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """``(mean, std)`` of an HF image processor for :func:`mmcache.normalize`'s
    ``(x / 255 - mean) / std``: equal to its ``(x * rescale_factor - image_mean) /
    image_std`` (``do_rescale`` and ``do_normalize`` honoured)."""
    p = processor
    do_rescale = getattr(p, "do_rescale", True)
    rescale = float(getattr(p, "rescale_factor", 1 / 255)) if do_rescale else 1.0
    if getattr(p, "do_normalize", False):
        mean, std = _three(p.image_mean, "image_mean"), _three(p.image_std, "image_std")
    else:
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    k = 255.0 * rescale
    return (
        (mean[0] / k, mean[1] / k, mean[2] / k),
        (std[0] / k, std[1] / k, std[2] / k),
    )


def _field(size: Any, key: str) -> int | None:
    """``size[key]`` of a processor's size (a dict or transformers' ``SizeDict``)."""
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if isinstance(value, (int, np.integer)) and value > 0 else None


def _hw(size: Any) -> tuple[int, int] | None:
    h, w = _field(size, "height"), _field(size, "width")
    return (h, w) if h is not None and w is not None else None


def hf_image_processor(processor: Any, *, exif_transpose: bool = True) -> HFImageStage:
    """A ``transformers`` image processor as a cached image stage (see the module docstring).

    Args:
        processor: an image processor (``CLIPImageProcessor``, ``SiglipImageProcessor``,
            ...), a multimodal processor with an ``image_processor`` (``CLIPProcessor``,
            a LLaVA processor), or the path of a local folder or
            ``preprocessor_config.json`` (loaded offline with ``AutoImageProcessor``).
        exif_transpose: give the processor each image upright (True: as transformers'
            ``load_image`` opens a file) or as stored (False).

    Raises ConfigError for what is not an image processor, one whose output cannot
    be cached as one uint8 image, or a path when ``transformers`` is not installed
    (``pip install mmcache[hf]``).
    """
    if isinstance(processor, (str, os.PathLike)):
        processor = _load(processor)
    inner = getattr(processor, "image_processor", None)
    if inner is not None:
        processor = inner
    return HFImageStage(processor, exif_transpose=exif_transpose)


if TYPE_CHECKING:  # mypy checks that HFImageStage conforms to the protocol

    def _conforms(s: HFImageStage) -> Stage:
        return s
