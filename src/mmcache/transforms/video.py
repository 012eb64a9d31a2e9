"""Video frames for video-language models: :class:`VideoSpec`, the rules that choose which
frames of a clip are kept and at what size, exactly as Qwen's ``qwen-vl-utils`` chooses
them, and the resize that makes them.

Why a port and not a call: ``qwen_vl_utils.vision_process`` imports torchvision at module
level, and mmcache must run on an install without it. The rules below are the ones of
``qwen-vl-utils`` 0.0.14 (``smart_nframes``, ``calculate_video_frame_range``,
``smart_resize``, ``fetch_video``'s pixel bounds and ``sample_fps``), kept line for line
in what they compute; ``tests/helpers/qwen_vl_reference.py`` holds the reference functions
copied from that file and the tests compare the two on many clips' geometries.

- **Which frames** (:meth:`VideoSpec.frame_indices`): from the clip's frame count ``n``
  and average frame rate ``fps``, the range ``[start, end]`` (``video_start`` /
  ``video_end`` in seconds: ``ceil(start * fps)``, ``floor(end * fps)``), then
  ``nframes``: a multiple of :data:`FRAME_FACTOR` (2), either given or ``range / fps *
  VideoSpec.fps`` clamped to ``[min_frames, max_frames]`` and to the range, then
  ``torch.linspace(start, end, nframes).round()`` (torch's float32 linspace, as Qwen's).
- **What size** (:meth:`VideoSpec.frame_size`): Qwen's ``smart_resize`` with factor 28
  (patch 14 x merge 2), ``min_pixels`` (default 128 tokens' worth), and ``max_pixels`` =
  ``min(768 tokens' worth, total_pixels / nframes * 2)`` (at least ``1.05 * min_pixels``),
  lowered to a given ``max_pixels``.
- **The resize** (:func:`resize_frames`): torchvision's tensor resize as Qwen calls it
  (bicubic, antialias, on float32, clamped to [0, 255], rounded to uint8), done with
  ``torch.nn.functional.interpolate`` itself. Qwen then makes float32 of the same uint8
  values; mmcache keeps the uint8 (4x smaller in every tier).
- **Tokens** (:meth:`VideoSpec.grid_thw`): Qwen2.5-VL's ``video_grid_thw`` = ``(t / 2,
  h / 14, w / 14)``, ``t / 2 * h / 28 * w / 28`` ``<|video_pad|>`` tokens, and
  ``second_per_grid_t = 2 / sample_fps``.

A record's video part may override the spec per video (``fps`` or ``nframes``,
``min_pixels``, ``max_pixels``, ``video_start``, ``video_end``: :meth:`VideoSpec.for_part`),
as Qwen's message parts do.

Pure and immutable; thread-safe.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.checks import check_int
from mmcache.errors import ConfigError, SampleError
from mmcache.transforms.normalize import CLIP_MEAN, CLIP_STD

if TYPE_CHECKING:
    import torch

__all__ = [
    "FRAME_FACTOR",
    "FRAME_LIST_KEYS",
    "MAX_SOURCE_PIXELS",
    "PART_KEYS",
    "VideoSpec",
    "VideoTokens",
    "qwen_video_patches",
    "resize_frames",
]

#: Kept frame counts are multiples of it (Qwen2-VL's temporal patch: 2 frames per grid step).
FRAME_FACTOR = 2
#: The per-video options a record's video part may carry (Qwen's message-part keys).
PART_KEYS = ("fps", "nframes", "min_frames", "max_frames", "min_pixels", "max_pixels",
             "total_pixels", "video_start", "video_end")  # fmt: skip
#: What a video part given as a list of frame images may carry besides PART_KEYS:
#: qwen-vl-utils' ``sample_fps`` (the list's frame rate, default 2.0) and ``raw_fps``
#: (the rate its timestamps are counted at, default ``sample_fps``).
FRAME_LIST_KEYS = ("sample_fps", "raw_fps")
# qwen-vl-utils' constants (vision_process.py).
_MAX_RATIO = 200
_VIDEO_MIN_TOKENS = 128
_VIDEO_MAX_TOKENS = 768
_MODEL_SEQ_LEN = 128000
#: The default of :attr:`VideoSpec.max_source_pixels`: the largest frame any level of
#: H.264, H.265 and AV1 allows (8192 x 4352; their levels 6.x share this bound), so every
#: conforming stream passes and only a header that claims more is refused.
MAX_SOURCE_PIXELS = 8192 * 4352
#: Bump when the meaning of a VideoSpec's output changes for the same options.
VIDEO_FORMAT_VERSION = 1


def _round_by(number: float, factor: int) -> int:
    return round(number / factor) * factor


def _ceil_by(number: float, factor: int) -> int:
    return math.ceil(number / factor) * factor


def _floor_by(number: float, factor: int) -> int:
    return math.floor(number / factor) * factor


def qwen_smart_resize(
    height: int, width: int, *, factor: int, min_pixels: float, max_pixels: float
) -> tuple[int, int]:
    """``qwen-vl-utils``' ``smart_resize`` (not transformers': this one starts from
    ``max(factor, round(side / factor) * factor)``). ValueError for an aspect ratio over
    200, as it raises."""
    if max(height, width) / min(height, width) > _MAX_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {_MAX_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = max(factor, _round_by(height, factor))
    w_bar = max(factor, _round_by(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = _floor_by(height / beta, factor)
        w_bar = _floor_by(width / beta, factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = _ceil_by(height * beta, factor)
        w_bar = _ceil_by(width * beta, factor)
    return h_bar, w_bar


@dataclass(frozen=True)
class VideoSpec:
    """Which frames of a clip are cached, and at what size (Qwen2-VL / Qwen2.5-VL rules).

    Args:
        fps: frames kept per second of video (Qwen's default 2.0); unused when
            ``nframes`` is given.
        nframes: keep this many frames (rounded to a multiple of 2), evenly spread.
        min_frames, max_frames: bounds on the count chosen from ``fps``.
        min_pixels, max_pixels, total_pixels: bounds on a frame's ``h * w`` (``None``:
            Qwen's defaults, 128 and 768 tokens of 28 x 28, and a 128k-token sequence);
            ``max_pixels`` only ever lowers Qwen's own bound, as in ``fetch_video``.
        start, end: the part of the clip used, in seconds (``video_start``/``video_end``).
        patch_size, merge_size, temporal_patch_size: the vision tower's (14, 2, 2).
        max_source_pixels: refuse clips whose frames, as the stream declares them, have
            more pixels than this, before a frame is decoded (a SampleError that
            ``on_error="skip"`` skips and counts). Frames are decoded and resized one at
            a time, so a clip costs its output plus about 30 bytes per source pixel of
            one frame (the decoder's frames, RGB, the resize's float32 copies); this
            bounds the second term (about 1 GiB at the default). Default :data:`MAX_SOURCE_PIXELS`
            (8192 x 4352, the largest frame H.264, H.265 and AV1 allow); ``None``: no
            limit. Like ``ImageSpec.max_pixels`` it decides which samples fail, never
            what a sample contains, so it is not in the fingerprint.
        decoder: ``"auto"``: torchcodec where it loads, else PyAV;
            ``"torchcodec"`` or ``"pyav"``: that one (see
            :mod:`~mmcache.transforms.video_decode`). The frames are the same (within
            a level), so it is not in the fingerprint.

    A record's video part may override the first nine per video (:meth:`for_part`).
    Combinations that refuse every clip (``max_pixels`` below ``min_pixels``, ``nframes``
    or ``max_frames`` that round to no frame, ``max_pixels`` under one 28 x 28 patch) are
    a ConfigError here, not a refusal of each clip after its decode. The fingerprint
    covers every field but ``max_source_pixels`` and ``decoder``. Immutable, picklable,
    thread-safe.

    >>> spec = VideoSpec()
    >>> spec.frame_indices(total_frames=60, video_fps=30.0)
    [0, 20, 39, 59]
    >>> spec.frame_indices(total_frames=300, video_fps=30.0)[:3]
    [0, 16, 31]
    >>> spec.frame_size(360, 640, nframes=20)
    (364, 644)
    """

    kind: ClassVar[str] = "video"

    fps: float = 2.0
    nframes: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    start: float | None = None
    end: float | None = None
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    max_source_pixels: int | None = MAX_SOURCE_PIXELS
    decoder: Literal["auto", "torchcodec", "pyav"] = "auto"

    def __post_init__(self) -> None:
        if self.decoder not in ("auto", "torchcodec", "pyav"):
            raise ConfigError(
                f"VideoSpec.decoder must be 'auto', 'torchcodec' or 'pyav', got {self.decoder!r}"
            )
        for name in ("min_frames", "patch_size", "merge_size", "temporal_patch_size"):
            check_int(f"VideoSpec.{name}", getattr(self, name), minimum=1)
        # Kept counts are rounded to a multiple of FRAME_FACTOR: 1 frame rounds to none,
        # and Qwen's rule then refuses every clip.
        check_int("VideoSpec.max_frames", self.max_frames, minimum=FRAME_FACTOR)
        if self.nframes is not None:
            check_int("VideoSpec.nframes", self.nframes, minimum=FRAME_FACTOR)
        for name in ("min_pixels", "max_pixels", "total_pixels", "max_source_pixels"):
            value = getattr(self, name)
            if value is not None:
                check_int(f"VideoSpec.{name}", value, minimum=1)
        numbers = (("fps", self.fps), ("start", self.start), ("end", self.end))
        for name, value in numbers:
            if value is None and name != "fps":
                continue
            # NaN passes every comparison below and fails each clip's frame count; an
            # infinite start is past every clip's end.
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ConfigError(f"VideoSpec.{name} must be a finite number >= 0, got {value!r}")
        if self.fps <= 0:
            raise ConfigError(f"VideoSpec.fps must be > 0, got {self.fps!r}")
        if self.start is not None and self.end is not None and self.end <= self.start:
            raise ConfigError(f"VideoSpec.end ({self.end}) must be after start ({self.start})")
        self._check_pixels()

    def _check_pixels(self) -> None:
        """ConfigError for pixel bounds no frame can meet, found once here rather than by
        refusing each clip after its decode."""
        f2 = self.factor * self.factor
        if self.max_pixels is not None:
            low = self.min_pixels if self.min_pixels is not None else _VIDEO_MIN_TOKENS * f2
            if self.max_pixels < low:
                which = (
                    f"min_pixels ({low})"
                    if self.min_pixels is not None
                    else f"the default min_pixels ({low}: {_VIDEO_MIN_TOKENS} tokens of "
                    f"{self.factor} x {self.factor})"
                )
                raise ConfigError(
                    f"VideoSpec.max_pixels ({self.max_pixels}) is below {which}: "
                    f"every frame would be refused (qwen-vl-utils asserts max_pixels >= "
                    f"min_pixels); pass min_pixels <= {self.max_pixels} or max_pixels >= {low}"
                )
        # The fewest frames kept (FRAME_FACTOR) allow the largest frame. smart_resize
        # floors both sides to multiples of the factor, so a bound under one factor x
        # factor patch gives every frame a side of 0.
        _, high = self.pixel_bounds(FRAME_FACTOR)
        if high < f2:
            raise ConfigError(
                f"VideoSpec allows frames of at most {high:g} pixels (max_pixels="
                f"{self.max_pixels}, total_pixels={self.total_pixels}, min_pixels="
                f"{self.min_pixels}), less than one {self.factor} x {self.factor} patch "
                f"({f2} pixels): every frame would have a side of 0; pass max_pixels (and "
                f"total_pixels or min_pixels) >= {f2}"
            )

    # -- per video ---------------------------------------------------------------

    def for_part(self, part: Mapping[str, Any]) -> VideoSpec:
        """This spec with a record's video part's options (:data:`PART_KEYS`) applied: a
        part's ``nframes`` replaces the spec's ``fps`` rule and its ``fps`` the spec's
        ``nframes``. ConfigError for a part with both, or a bad value."""
        given = {k: part[k] for k in PART_KEYS if part.get(k) is not None}
        if not given:
            return self
        if "fps" in given and "nframes" in given:
            raise ConfigError("a video part takes 'fps' or 'nframes', not both")
        if "fps" in given:
            given["nframes"] = None
        if "video_start" in given:
            given["start"] = given.pop("video_start")
        if "video_end" in given:
            given["end"] = given.pop("video_end")
        return replace(self, **given)

    def for_sample(self, part: Mapping[str, Any], *, sample_id: str, path: str) -> VideoSpec:
        """:meth:`for_part` for one record's part, its ConfigError (a record's options
        that contradict each other or this spec, e.g. a ``max_pixels`` below the
        ``min_pixels``) a SampleError naming ``sample_id`` and the clip's ``path``: one
        record's bad options refuse that record, not the run."""
        try:
            return self.for_part(part)
        except ConfigError as exc:
            raise SampleError(str(exc), sample_id=sample_id, path=path) from exc

    @property
    def factor(self) -> int:
        """Both frame sides are multiples of it: ``patch_size * merge_size`` (28)."""
        return self.patch_size * self.merge_size

    # -- which frames ----------------------------------------------------------------

    def frame_range(self, total_frames: int, video_fps: float) -> tuple[int, int, int]:
        """``(first, last, count)`` of the frames in ``[start, end]`` seconds
        (``calculate_video_frame_range``). ValueError for an empty range."""
        if video_fps <= 0:
            raise ValueError("video_fps must be a positive number")
        if total_frames <= 0:
            raise ValueError("total_frames must be a positive integer")
        if self.start is None and self.end is None:
            return 0, total_frames - 1, total_frames
        duration = total_frames / video_fps
        first = 0
        if self.start is not None:
            first = math.ceil(max(0.0, min(self.start, duration)) * video_fps)
        last = total_frames - 1
        if self.end is not None:
            last = min(math.floor(max(0.0, min(self.end, duration)) * video_fps), total_frames - 1)
        if first >= last:
            raise ValueError(
                f"invalid time range: start frame {first} is not before end frame {last} "
                f"(video of {duration:.2f}s, {total_frames} frames at {video_fps} fps)"
            )
        return first, last, last - first + 1

    def frame_count(self, total_frames: int, video_fps: float) -> int:
        """How many frames are kept of a range of ``total_frames`` (``smart_nframes``).
        ValueError when it is not within ``[2, total_frames]``."""
        if self.nframes is not None:
            n = _round_by(self.nframes, FRAME_FACTOR)
        else:
            low = _ceil_by(self.min_frames, FRAME_FACTOR)
            high = _floor_by(self.max_frames, FRAME_FACTOR)
            wanted = total_frames / video_fps * self.fps
            n = _floor_by(min(max(wanted, low), high, total_frames), FRAME_FACTOR)
        if not FRAME_FACTOR <= n <= total_frames:
            raise ValueError(f"nframes should be in [{FRAME_FACTOR}, {total_frames}], but got {n}")
        return n

    def frame_indices(self, total_frames: int, video_fps: float) -> list[int]:
        """The indices of the kept frames, in order (``torch.linspace(first, last,
        nframes).round()``, as Qwen's torchcodec and decord readers compute them)."""
        import torch

        first, last, count = self.frame_range(total_frames, video_fps)
        n = self.frame_count(count, video_fps)
        out: list[int] = torch.linspace(first, last, n).round().long().tolist()
        return out

    def sample_fps(self, total_frames: int, video_fps: float) -> float:
        """The kept frames' rate: ``nframes / range * video_fps`` (Qwen's ``sample_fps``)."""
        _, _, count = self.frame_range(total_frames, video_fps)
        return self.frame_count(count, video_fps) / max(count, 1e-6) * video_fps

    # -- what size -----------------------------------------------------------------------

    def pixel_bounds(self, nframes: int) -> tuple[float, float]:
        """``(min_pixels, max_pixels)`` of a frame of a clip of ``nframes`` kept frames."""
        f2 = self.factor * self.factor
        low: float = self.min_pixels if self.min_pixels is not None else _VIDEO_MIN_TOKENS * f2
        total = self.total_pixels if self.total_pixels is not None else _MODEL_SEQ_LEN * f2 * 0.9
        high = max(min(_VIDEO_MAX_TOKENS * f2, total / nframes * FRAME_FACTOR), int(low * 1.05))
        if self.max_pixels is not None:
            high = min(self.max_pixels, high)
        return low, high

    def frame_size(self, height: int, width: int, *, nframes: int) -> tuple[int, int]:
        """The ``(h, w)`` the kept frames are resized to. ValueError for an aspect over
        200, a ``max_pixels`` below ``min_pixels`` or a side of 0 (bounds under one patch
        for this many frames: a small ``total_pixels`` and ``min_pixels``)."""
        low, high = self.pixel_bounds(nframes)
        if high < low:  # qwen-vl-utils asserts it
            raise ValueError(f"max_pixels {high} is below min_pixels {low}")
        h, w = qwen_smart_resize(height, width, factor=self.factor, min_pixels=low,
                                 max_pixels=high)  # fmt: skip
        if h <= 0 or w <= 0:
            raise ValueError(
                f"{width}x{height} frames become {w}x{h} under max_pixels {high:g} for "
                f"{nframes} frames: raise total_pixels or min_pixels"
            )
        return h, w

    # -- tokens ------------------------------------------------------------------------

    def grid_thw(self, t: int, h: int, w: int) -> tuple[int, int, int]:
        """Qwen2-VL's ``video_grid_thw`` of ``t`` frames of ``h x w``."""
        p = self.patch_size
        return (t // self.temporal_patch_size, h // p, w // p)

    def video_tokens(self, t: int, h: int, w: int) -> int:
        """How many ``<|video_pad|>`` tokens a clip of ``t`` frames of ``h x w`` becomes."""
        gt, gh, gw = self.grid_thw(t, h, w)
        return gt * gh * gw // (self.merge_size * self.merge_size)

    def second_per_grid_t(self, sample_fps: float) -> float:
        """Seconds per temporal grid step (Qwen2.5-VL's ``second_per_grid_ts``)."""
        return self.temporal_patch_size / sample_fps

    # -- fingerprint ---------------------------------------------------------------------

    def fingerprint(self) -> str:
        """xxh3-128 hex digest of every field but ``max_source_pixels`` and ``decoder``,
        and :data:`VIDEO_FORMAT_VERSION`."""
        fields = asdict(self)
        del fields["max_source_pixels"]  # which clips fail, never what one holds
        del fields["decoder"]  # the same frames (within a level) from either
        payload = {"version": VIDEO_FORMAT_VERSION, "resize": "bicubic-aa-f32", **fields}
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_hexdigest(blob.encode())


def resize_frames(frames: npt.NDArray[np.uint8], size: tuple[int, int]) -> npt.NDArray[np.uint8]:
    """uint8 ``[T, 3, H, W]`` -> uint8 ``[T, 3, h, w]``, C-contiguous: torchvision's tensor
    resize as Qwen calls it (bicubic, antialias, on float32, clamped, rounded)."""
    import torch

    height, width = frames.shape[2:]
    if (height, width) == tuple(size):
        return np.ascontiguousarray(frames)
    x = torch.from_numpy(np.ascontiguousarray(frames)).to(torch.float32)
    y = torch.nn.functional.interpolate(
        x, size=list(size), mode="bicubic", align_corners=False, antialias=True
    )
    out: npt.NDArray[np.uint8] = y.clamp_(0, 255).round_().to(torch.uint8).numpy()
    return np.ascontiguousarray(out)


@dataclass(frozen=True)
class VideoTokens:
    """How a :class:`~mmcache.transforms.chat.ChatSpec` expands each ``<video>``
    placeholder (``ChatSpec(video=VideoTokens(...))``).

    Qwen2.5-VL (the default): ``prefix``, then ``pad_token``'s id repeated ``t /
    temporal_patch_size * h / factor * w / factor`` times, then ``suffix``
    (``<|vision_start|><|video_pad|>...<|vision_end|>``, what its processor makes of
    ``<|vision_start|><|video_pad|><|vision_end|>``). ``timestamps=True`` (Qwen3-VL,
    Qwen3.5): inside ``prefix`` ... ``suffix``, each temporal step (``temporal_patch_size``
    frames) is the text ``<{seconds:.1f} seconds>`` (the mean of its frames' times,
    frame index / the clip's average frame rate, as ``Qwen3VLProcessor`` computes them),
    then ``prefix``, its ``h / factor * w / factor`` pad tokens, ``suffix``.
    ``per_frame=True`` (LLaVA-Video): each of the ``t`` frames becomes an image run of
    the chat spec's own image token, count, prefix and suffix, frame after frame. Runs
    are never trained on and never cut by truncation. Immutable, picklable.
    """

    placeholder: str = "<video>"
    pad_token: str = "<|video_pad|>"  # noqa: S105 (a token name, not a password)
    prefix: str = "<|vision_start|>"
    suffix: str = "<|vision_end|>"
    per_frame: bool = False
    factor: int = 28
    temporal_patch_size: int = 2
    timestamps: bool = False

    def __post_init__(self) -> None:
        for name in ("placeholder", "pad_token", "prefix", "suffix"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"VideoTokens.{name} must be a str")
        if not self.placeholder:
            raise ConfigError("VideoTokens.placeholder must be a non-empty str")
        check_int("VideoTokens.factor", self.factor, minimum=1)
        check_int("VideoTokens.temporal_patch_size", self.temporal_patch_size, minimum=1)
        if not isinstance(self.timestamps, bool) or (self.timestamps and self.per_frame):
            raise ConfigError(
                "VideoTokens.timestamps must be a bool, and not with per_frame=True "
                "(Qwen3-VL's timestamped steps are one video's runs)"
            )

    def step_times(self, times: Sequence[float]) -> list[float]:
        """Each temporal step's time in seconds: the mean of its first and last frame's
        ``times`` (the last frame repeated to fill the last step), as
        ``Qwen3VLProcessor._calculate_timestamps`` does."""
        tps = self.temporal_patch_size
        padded = list(times) + [times[-1]] * (-len(times) % tps) if times else []
        return [(padded[i] + padded[i + tps - 1]) / 2 for i in range(0, len(padded), tps)]

    def count(self, t: int, h: int, w: int) -> int:
        """The pad tokens of a clip of ``t`` frames of ``h x w`` (Qwen's rule)."""
        f = self.factor
        return (t // self.temporal_patch_size) * (h // f) * (w // f)

    def fingerprint_fields(self) -> dict[str, Any]:
        """Every field (what a chat spec's fingerprint holds of it); ``timestamps`` only
        when set (the specs made before it keep their keys)."""
        fields = asdict(self)
        if not self.timestamps:
            del fields["timestamps"]
        return fields


def qwen_video_patches(
    frames: torch.Tensor,
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    mean: tuple[float, float, float] = CLIP_MEAN,
    std: tuple[float, float, float] = CLIP_STD,
) -> torch.Tensor:
    """One cached clip (uint8 ``[t, 3, h, w]``, on any device) as Qwen2-VL's
    ``pixel_values_videos`` rows: float32 ``[t/2 * h/14 * w/14, 3 * 2 * 14 * 14]``,
    rescaled by 1/255 and normalised (CLIP's mean and std), patches in the merge order
    of ``Qwen2VLImageProcessor._preprocess``. Done on the device, after the cache: the
    cache keeps the 4x smaller uint8 frames."""
    import torch

    t, c, h, w = frames.shape
    x = frames.to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, c, 1, 1)
    sd = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, c, 1, 1)
    x = (x - m) / sd
    if t % temporal_patch_size:
        x = torch.cat([x, x[-1:].expand(temporal_patch_size - t % temporal_patch_size, -1, -1, -1)])
    gt, gh, gw = x.shape[0] // temporal_patch_size, h // patch_size, w // patch_size
    x = x.reshape(gt, temporal_patch_size, c, gh // merge_size, merge_size, patch_size,
                  gw // merge_size, merge_size, patch_size)  # fmt: skip
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * temporal_patch_size * patch_size * patch_size)
