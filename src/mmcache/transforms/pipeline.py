"""``Pipeline``: a record -> its cacheable arrays through an ordered list of stages, and the
fingerprint that names that processing in every cache key.

A :class:`Pipeline` turns one record (an image path and a caption) into the arrays that
mmcache caches: ``image`` (uint8 ``[3, size, size]``, C-contiguous, from
:class:`~mmcache.transforms.image.ImageSpec`; ``[3, H, W]`` of varied shapes with
``crop=None``; ``[C, H, W]`` from a user stage) and ``input_ids`` / ``attention_mask``
(int32 ``[max_length]``, from :class:`~mmcache.transforms.text.TextSpec`). Float
conversion and normalisation are left to the training device (:func:`normalize`): a
uint8 sample is 4x smaller in every cache tier and on every copy than the float32
tensor of the ``ToTensor`` pattern.

With a :class:`~mmcache.transforms.chat.ChatSpec` as its text stage a pipeline makes
supervised fine-tuning samples instead (:meth:`Pipeline.process_chat`: a conversation and
all its images -> ``input_ids``, ``labels``, ``images``, ``image_sizes`` and, with
:class:`~mmcache.transforms.smart_resize.SmartResize`, ``image_grid_thw``).

The stages live beside it in :mod:`mmcache.transforms`. The pipeline sits in the
transforms layer, below the sources, so that a source types its pipeline and reads
its fields as attributes. A source also takes a user's own processing object: what it
needs of one is declared here (:class:`RecordProcessor`: ``process``;
:class:`StagedProcessor`: ``stages``; both with ``fingerprint``; :class:`LaysOutFields`
when the object says which fields vary or are cached channels-last); what only a
:class:`Pipeline` has (a chat stage, a video stage) a source reads from a Pipeline.

Thread and process safety: a :class:`Pipeline` is immutable after construction.
:meth:`Pipeline.process` may be called from several threads at once (each call has its
own image objects; the tokenizer is only read). A pipeline pickles to plain data (the
tokenizer as its JSON string), so spawn/forkserver DataLoader workers rebuild it cheaply.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.errors import ConfigError, SampleError
from mmcache.transforms.chat import Chat, ChatSpec
from mmcache.transforms.frame_lists import load_frame_list
from mmcache.transforms.hf_llava_next import Crops, LlavaNextImageStage
from mmcache.transforms.image import ImageSpec, load_image
from mmcache.transforms.smart_resize import SmartResize
from mmcache.transforms.stage import ImageTraits, Stage, StageKind
from mmcache.transforms.text import TextSpec
from mmcache.transforms.user import UserStage
from mmcache.transforms.video import VideoSpec
from mmcache.transforms.video_decode import VIDEO_FIELDS, Clip, load_clip, video_fields

__all__ = [
    "PIPELINE_FORMAT_VERSION",
    "LaysOutFields",
    "Pipeline",
    "Processor",
    "RecordProcessor",
    "StagedProcessor",
]

#: Bump when the meaning of a pipeline's output changes for the same parameters
#: (geometry convention, colour handling...): it is part of :meth:`Pipeline.fingerprint`.
PIPELINE_FORMAT_VERSION = 1


@runtime_checkable
class RecordProcessor(Protocol):
    """What a source of records (:class:`~mmcache.sources.files.FileSource`) needs of
    its pipeline: :class:`Pipeline` is one, and so is a user's own object with these."""

    def fingerprint(self) -> str:
        """A stable digest of the processing: part of every key."""
        ...

    def process(
        self, image_path: str | None, text: str | None, *, sample_id: str
    ) -> dict[str, npt.NDArray[Any]]:
        """One record -> its arrays. Raises :class:`SampleError`."""
        ...


@runtime_checkable
class StagedProcessor(Protocol):
    """What a source of bytes (WebDataset members, Parquet and HF rows, remote objects)
    needs of its pipeline: it runs the stages itself on the bytes it read
    (:func:`mmcache.sources.bytesproc.process_bytes`). :class:`Pipeline` is one."""

    @property
    def stages(self) -> Sequence[Stage]: ...

    def fingerprint(self) -> str: ...


@runtime_checkable
class LaysOutFields(Protocol):
    """A processor that says how its samples' fields are laid out (:class:`Pipeline`
    does); one that does not makes fixed shapes, channels first."""

    @property
    def varying_fields(self) -> frozenset[str]: ...

    @property
    def channels_last_fields(self) -> frozenset[str]: ...


#: What a source takes as its ``pipeline``.
Processor = RecordProcessor | StagedProcessor


def _checked(value: object, kind: StageKind) -> Stage | None:
    """``value`` as a :class:`Stage` of ``kind``: ``None``, a Stage of that kind, or a
    plain callable (wrapped by :func:`mmcache.stage`); ConfigError otherwise."""
    if value is None:
        return None
    if isinstance(value, UserStage):
        value = value.for_kind(kind)
    elif not isinstance(value, Stage) and callable(value):
        value = UserStage(value, kind=kind)
    if not isinstance(value, Stage) or value.kind != kind:
        builtin = "an ImageSpec" if kind == "image" else "a TextSpec"
        raise ConfigError(
            f"Pipeline.{kind} must be {builtin}, a Stage whose kind is {kind!r} or a callable "
            f"(wrapped by mmcache.stage), got {type(value).__name__}"
            + (f" of kind {value.kind!r}" if isinstance(value, Stage) else "")
        )
    return value


def _stage_payload(stage: Stage | None) -> dict[str, Any] | None:
    """What ``stage`` contributes to :meth:`Pipeline.fingerprint`.

    ImageSpec and TextSpec contribute their ``fingerprint_fields()``: the form every
    existing cache was keyed by, kept so that those entries stay valid. Any other stage
    contributes its class and its own :meth:`Stage.fingerprint`.
    """
    if stage is None:
        return None
    if isinstance(stage, (ImageSpec, TextSpec)):
        return stage.fingerprint_fields()
    cls = type(stage)
    return {"stage": f"{cls.__module__}.{cls.__qualname__}", "fingerprint": stage.fingerprint()}


class Pipeline:
    """Record -> arrays: ``{"image": uint8 [3,H,W]}`` and/or ``{"input_ids", "attention_mask"}``.

    Args:
        image: the image stage (an :class:`ImageSpec`, any
            :class:`~mmcache.transforms.stage.Stage` of kind ``"image"``, or a plain
            callable ``PIL.Image -> uint8 [C,H,W]``, wrapped by :func:`mmcache.stage`);
            ``None`` for a text-only pipeline.
        text: the text stage (a :class:`TextSpec`, a Stage of kind ``"text"``, or a
            callable ``str -> {name: int array}``); ``None`` for an image-only pipeline.

    At least one is required. :attr:`stages` lists them in the order they run (image,
    then text); a record has one image and one text, so there is at most one stage of
    each kind. Immutable, picklable, thread-safe (see the module docstring).

    >>> pipe = Pipeline(image=ImageSpec(size=64))
    >>> len(pipe.fingerprint())
    32
    """

    __slots__ = ("_fingerprint", "image", "stages", "text", "video")

    _fingerprint: str | None
    image: Stage | None
    text: Stage | None
    video: VideoSpec | None
    stages: tuple[Stage, ...]

    def __init__(
        self,
        image: Stage | Callable[[Any], Any] | None = None,
        text: Stage | Callable[[Any], Any] | None = None,
        video: VideoSpec | None = None,
    ) -> None:
        if image is None and text is None:
            raise ConfigError("Pipeline needs an image spec, a text spec or both")
        if video is not None and not isinstance(video, VideoSpec):
            raise ConfigError(f"Pipeline.video must be a VideoSpec, got {type(video).__name__}")
        if video is not None and not isinstance(text, ChatSpec):
            raise ConfigError("Pipeline.video needs a ChatSpec text stage (video SFT samples)")
        if isinstance(image, LlavaNextImageStage) and not isinstance(text, ChatSpec):
            raise ConfigError(
                "a LlavaNextImageStage makes 1 + k crops per image, counted in tokens from "
                "the original size: it needs a ChatSpec text stage (mmcache.hf_processor "
                "builds both)"
            )
        self._set(_checked(image, "image"), _checked(text, "text"), video)

    def _set(self, image: Stage | None, text: Stage | None, video: VideoSpec | None) -> None:
        object.__setattr__(self, "image", image)
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "video", video)
        object.__setattr__(self, "stages", tuple(s for s in (image, text) if s is not None))
        object.__setattr__(self, "_fingerprint", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Pipeline is immutable (cannot set {name!r})")

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.image, self.text, self.video)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self._set(state[0], state[1], state[2] if len(state) > 2 else None)

    def __repr__(self) -> str:
        video = "" if self.video is None else f", video={self.video!r}"
        return f"Pipeline(image={self.image!r}, text={self.text!r}{video})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pipeline):
            return NotImplemented
        return self.fingerprint() == other.fingerprint()

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    @property
    def chat(self) -> ChatSpec | None:
        """The text stage when it is a :class:`~mmcache.transforms.chat.ChatSpec` (a
        supervised fine-tuning pipeline: :meth:`process_chat`), else ``None``."""
        return self.text if isinstance(self.text, ChatSpec) else None

    @property
    def varying_fields(self) -> frozenset[str]:
        """``{"image"}`` when the image stage's output shape varies between samples (its
        ``fixed_shape`` is False: an aspect-preserving resize), else empty. The loader
        then gives batches a list of images and their ``image_sizes``. A chat pipeline
        varies in every field it makes (:meth:`process_chat`)."""
        if self.chat is not None:
            names = {"input_ids", "labels"}
            if self.image is not None:
                names |= {"images", "image_sizes"}
                if isinstance(self.image, SmartResize):
                    names.add("image_grid_thw")
                if isinstance(self.image, LlavaNextImageStage):
                    names |= {"image_crops", "image_original_sizes"}
            if self.video is not None:
                names |= set(VIDEO_FIELDS)
            return frozenset(names)
        if self.image is not None and not ImageTraits.of(self.image).fixed_shape:
            return frozenset({"image"})
        return frozenset()

    @property
    def channels_last_fields(self) -> frozenset[str]:
        """``{"image"}`` when the image stage caches ``[H, W, C]`` pixels
        (``ImageSpec(channels_last=True)``), else empty. The loader and ``ds[i]`` then
        present them as ``[C, H, W]`` views (torch's ``channels_last`` strides)."""
        if self.image is not None and ImageTraits.of(self.image).channels_last:
            return frozenset({"image"})
        return frozenset()

    def fingerprint(self) -> str:
        """Hex digest (xxh3-128) of everything that changes this pipeline's output.

        In: image size, resize, interpolation, crop and geometry convention, draft,
        alpha background, decoder (Pillow) major version, the tokenizer's content
        (canonical JSON, not its path), max_length, pad id (or another stage's own
        fingerprint), and :data:`PIPELINE_FORMAT_VERSION`. Out: file paths, worker
        counts, batch sizes, ``max_pixels`` and ``max_bytes`` (they decide which
        samples fail, not what others contain), and the tokenizers library version
        (its output for a given tokenizer.json is stable). Identical across processes,
        runs and machines with the same Pillow major version.
        """
        cached: str | None = self._fingerprint
        if cached is None:
            payload: dict[str, Any] = {
                "format": PIPELINE_FORMAT_VERSION,
                "image": _stage_payload(self.image),
                "text": _stage_payload(self.text),
            }
            if self.video is not None:  # absent otherwise: older keys stay valid
                payload["video"] = self.video.fingerprint()
            blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
            cached = xxhash.xxh3_128_hexdigest(blob)
            object.__setattr__(self, "_fingerprint", cached)
        return cached

    def load_image(self, path: str | os.PathLike[str], *, sample_id: str) -> npt.NDArray[np.uint8]:
        """Decode, resize and crop one image to uint8 ``[3, size, size]``. Raises SampleError."""
        if self.image is None:
            raise ConfigError("this pipeline has no ImageSpec")
        out: npt.NDArray[np.uint8] = load_image(self.image, path, sample_id=sample_id)
        return out

    def tokenize(self, text: str) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """``(input_ids, attention_mask)``, int32 ``[max_length]`` each."""
        if self.text is None:
            raise ConfigError("this pipeline has no TextSpec")
        out = self.text(text)
        return out["input_ids"], out["attention_mask"]

    def process_chat(
        self,
        image_paths: Sequence[str | os.PathLike[str]],
        messages: Sequence[tuple[str, str]] | None,
        *,
        sample_id: str,
        videos: Sequence[Mapping[str, Any]] = (),
    ) -> dict[str, npt.NDArray[Any]]:
        """One chat record (its images, its ``(role, content)`` messages, its video parts)
        -> the SFT sample.

        Fields: ``input_ids`` and ``labels`` (int32 ``[L]``, no padding) and, when the
        pipeline has an image stage, ``images`` (uint8, the concatenated C-contiguous
        ``[3, h, w]`` bytes of the images kept after truncation), ``image_sizes`` (int32
        ``[n, 2]``: h, w; ``n = 0`` for a text-only sample) and, with
        :class:`~mmcache.transforms.smart_resize.SmartResize`, ``image_grid_thw`` (int32
        ``[n, 3]``: ``(1, h / patch, w / patch)``). The image token runs are sized from
        the processed images' shapes. With a
        :class:`~mmcache.transforms.hf_llava_next.LlavaNextImageStage` (LLaVA-NeXT's
        1 + k crops per image) ``images`` holds each image's ``[1 + k, 3, h, w]`` crops,
        ``image_sizes`` is each crop's ``(h, w)`` (int32 ``[sum(1 + k), 2]``: what the
        loader splits the bytes by), ``image_crops`` (int32 ``[n]``) each image's
        ``1 + k`` and ``image_original_sizes`` (int32 ``[n, 2]``) its original upright
        size, which its token run is sized from. With a
        :class:`~mmcache.transforms.video.VideoSpec` and ``videos`` (``{"video": path,
        option: value}``), the fields of
        :func:`~mmcache.transforms.video_decode.video_fields` too. Raises SampleError.
        """
        chat = self.chat
        if chat is None:
            raise ConfigError("process_chat needs a pipeline whose text stage is a ChatSpec")
        if messages is None:
            raise SampleError(
                "record has no conversation (a caption record), but the pipeline has a ChatSpec",
                sample_id=sample_id,
            )
        found = sum(content.count(chat.image_token) for _, content in messages)
        if found != len(image_paths):
            raise SampleError(
                f"{found} {chat.image_token!r} placeholders for {len(image_paths)} images",
                sample_id=sample_id,
            )
        if image_paths and self.image is None:
            raise SampleError(
                "record has images, but the pipeline has no image stage", sample_id=sample_id
            )
        arrays, sizes, crops = self._chat_images(image_paths, sample_id)
        clips = self._videos(videos, sample_id)
        shapes = tuple(clip.shape for clip in clips)
        times = tuple(clip.times for clip in clips)
        enc = chat.encode(Chat(tuple(messages), sizes, shapes, times), sample_id=sample_id)
        out: dict[str, npt.NDArray[Any]] = {"input_ids": enc.input_ids, "labels": enc.labels}
        if self.video is not None:
            out.update(video_fields(self.video, clips[: enc.n_videos]))
        if self.image is None:
            return out
        n = enc.n_images
        kept = arrays[:n]
        if crops:  # each crop's size (the loader splits the bytes by them), then per image
            hw = [(a.shape[2], a.shape[3]) for a in kept for _ in range(a.shape[0])]
            out["image_sizes"] = np.array(hw, dtype=np.int32).reshape(len(hw), 2)
            out["image_crops"] = np.array([a.shape[0] for a in kept], dtype=np.int32)
            out["image_original_sizes"] = np.array(sizes[:n], dtype=np.int32).reshape(n, 2)
        else:
            out["image_sizes"] = np.array(sizes[:n], dtype=np.int32).reshape(n, 2)
        if isinstance(self.image, SmartResize):
            grids = [self.image.grid_thw(h, w) for h, w in sizes[:n]]
            out["image_grid_thw"] = np.array(grids, dtype=np.int32).reshape(n, 3)
        out["images"] = (
            np.concatenate([a.reshape(-1) for a in kept]) if kept else np.zeros(0, np.uint8)
        )
        return out

    def _chat_images(
        self, image_paths: Sequence[str | os.PathLike[str]], sample_id: str
    ) -> tuple[list[npt.NDArray[Any]], tuple[tuple[int, int], ...], bool]:
        """Each image through the image stage: the arrays to cache, the ``(h, w)`` the
        chat counts each image's tokens from, and whether the stage is a
        :class:`~mmcache.transforms.hf_llava_next.LlavaNextImageStage` (its
        :class:`~mmcache.transforms.hf_llava_next.Crops`: several crops per image,
        counted from the original size) rather than one making a ``[3, h, w]`` image
        (counted from its own size)."""
        arrays: list[npt.NDArray[Any]] = []
        sizes: list[tuple[int, int]] = []
        crops = isinstance(self.image, LlavaNextImageStage)
        for path in image_paths:
            result = load_image(cast(Stage, self.image), path, sample_id=sample_id)
            array = result.pixels if isinstance(result, Crops) else result
            want = "[1 + k, 3, h, w] Crops" if crops else "[3, h, w]"
            if (
                isinstance(result, Crops) != crops
                or not isinstance(array, np.ndarray)
                or array.dtype != np.uint8
                or array.ndim != (4 if crops else 3)
                or array.shape[-3] != 3
            ):
                is_array = isinstance(array, np.ndarray)
                got = f"{array.dtype} {tuple(array.shape)}" if is_array else type(result).__name__
                raise SampleError(
                    f"a chat pipeline's image stage must give uint8 {want}, got {got}",
                    sample_id=sample_id,
                    path=os.fspath(path),
                )
            arrays.append(array)
            if isinstance(result, Crops):
                sizes.append((int(result.original[0]), int(result.original[1])))
            else:
                sizes.append((int(array.shape[1]), int(array.shape[2])))
        return arrays, tuple(sizes), crops

    def _videos(self, videos: Sequence[Mapping[str, Any]], sample_id: str) -> list[Clip]:
        """Each video part decoded to its spec's frames (one decode per clip): ``video``
        a path, the clip's bytes or a list of frame images
        (:func:`~mmcache.transforms.frame_lists.load_frame_list`); optional ``name``
        (what errors call it) and ``max_bytes`` (a larger clip is refused before it is
        opened)."""
        if videos and self.video is None:
            raise SampleError(
                "record has videos, but the pipeline has no VideoSpec (Pipeline(video=...))",
                sample_id=sample_id,
            )
        clips = []
        for part in videos:
            if isinstance(part["video"], list):  # frame images (qwen-vl-utils' list form)
                clips.append(load_frame_list(cast(VideoSpec, self.video), part,
                                             sample_id=sample_id))  # fmt: skip
                continue
            # A part of a shard member or an object carries the clip's bytes, the name
            # errors give it and the size limit it was read under.
            name = part.get("name", part["video"])
            spec = cast(VideoSpec, self.video).for_sample(part, sample_id=sample_id, path=name)
            clips.append(load_clip(spec, part["video"], sample_id=sample_id, name=name,
                                   max_bytes=part.get("max_bytes")))  # fmt: skip
        return clips

    def process(
        self, image_path: str | os.PathLike[str] | None, text: str | None, *, sample_id: str
    ) -> dict[str, npt.NDArray[Any]]:
        """One record -> its arrays. Inputs the pipeline has no stage for are ignored.

        The stages run in order (:attr:`stages`). Raises SampleError when the pipeline
        needs an image (or a caption) and the record has none, or when the image
        cannot be decoded.
        """
        # Text fields first in the result: the codec stores fields in this order, so
        # the small ones sit next to the header and the loader reads header + tokens
        # as one range.
        out: dict[str, npt.NDArray[Any]] = {}
        image: npt.NDArray[Any] | None = None
        if self.chat is not None:
            raise ConfigError(
                "a pipeline with a ChatSpec makes samples from conversations: "
                "process_chat(image_paths, messages, sample_id=...)"
            )
        for stage in self.stages:
            if stage.kind == "image":
                if image_path is None:
                    raise SampleError(
                        "record has no image, but the pipeline has an ImageSpec (text-only"
                        " data: Pipeline(image=None, ...); chat records, with images or not:"
                        " a ChatSpec text stage, see docs/recipes/sft.md)",
                        sample_id=sample_id,
                    )
                image = load_image(stage, image_path, sample_id=sample_id)
            else:
                if text is None:
                    raise SampleError(
                        "record has no text, but the pipeline has a TextSpec "
                        "(use Pipeline(text=None, ...) for image-only data)",
                        sample_id=sample_id,
                        path=None if image_path is None else os.fspath(image_path),
                    )
                try:
                    out.update(stage(text))
                except SampleError as err:  # a user stage names no sample: this one
                    raise SampleError(err.reason, sample_id=sample_id) from err
        if image is not None:
            out["image"] = image
        return out
