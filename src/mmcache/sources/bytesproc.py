"""One sample's image *bytes* (or a local image file) and caption through a pipeline's
stages: what every source whose images are not loose manifest files produces with
(WebDataset members, remote objects, Parquet and HF rows).

:func:`process_bytes` runs the stages of a :class:`mmcache.Pipeline` exactly as
:meth:`mmcache.Pipeline.process` does for a file (image through
:func:`~mmcache.transforms.image.decode_bytes`, after the ``ImageSpec.max_bytes`` check
a file gets; text through the text stage; text fields first in the result), so that a
sample read from a shard or a row is bitwise the sample read from the loose file with
the same bytes. Its errors are :class:`~mmcache.errors.SampleError`s naming the sample
(key or id) and where its bytes live (``shard.tar:key.jpg``, ``file.parquet row 12``,
the URL), and saying what is missing in the source's own terms (a member, a null cell,
a record without an image). The pipeline is a :class:`~mmcache.Pipeline` or any
:class:`~mmcache.transforms.pipeline.StagedProcessor` (``stages`` and ``fingerprint``).

:class:`PipelineFields` is the small part of the source protocol every source forwards
to its pipeline (``fingerprint``, ``describe``, ``varying_fields``,
``channels_last_fields``), in one place.

Thread-safe (each call has its own image objects).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from mmcache.errors import SampleError
from mmcache.transforms.image import decode_bytes, load_image
from mmcache.transforms.pipeline import LaysOutFields, Pipeline, Processor, StagedProcessor
from mmcache.transforms.stage import DEFAULT_MAX_BYTES, ImageTraits

__all__ = [
    "PipelineFields",
    "StagedProcessor",
    "Unit",
    "byte_limit",
    "check_size",
    "process_bytes",
]

#: How a source names what holds a sample's image and text, for "is missing" errors.
Unit = Literal["member", "row", "record"]

_MISSING: dict[str, tuple[str, str]] = {
    "member": ("sample has no image member", "sample has no text member"),
    "row": ("the row's image is null", "the row's text is null"),
    "record": ("the record has no image", "the record has no text"),
}


def process_bytes(
    pipeline: StagedProcessor,
    image: bytes | None,
    text: str | None,
    *,
    sample_id: str,
    path: str | None,
    image_file: str | None = None,
    unit: Unit = "member",
) -> dict[str, np.ndarray]:
    """``pipeline``'s arrays of one sample given its image bytes (or ``image_file``, a
    local path read as the Pipeline reads one) and caption.

    ``path`` names where the bytes came from in errors (``shard.tar:key.jpg``,
    ``file.parquet row 12``); ``unit`` what held them (see :data:`Unit`). Raises
    :class:`SampleError` naming ``sample_id`` and ``path`` when the pipeline needs an
    image (or a caption) the sample lacks, the image is over ``ImageSpec.max_bytes``,
    or it cannot be decoded.
    """
    out: dict[str, np.ndarray] = {}
    decoded: Any = None
    no_image, no_text = _MISSING[unit]
    for stage in pipeline.stages:
        if stage.kind == "image":
            if image_file is not None:
                decoded = load_image(stage, image_file, sample_id=sample_id)
                continue
            if image is None:
                raise SampleError(
                    f"{no_image}, but the pipeline has an image stage "
                    "(use Pipeline(image=None, ...) for text-only data)",
                    sample_id=sample_id,
                    path=path,
                )
            check_size(len(image), byte_limit(pipeline), "image", sample_id=sample_id, path=path)
            decoded = decode_bytes(stage, image, sample_id=sample_id, path=path)
        else:
            if text is None:
                raise SampleError(
                    f"{no_text}, but the pipeline has a text stage "
                    "(use Pipeline(text=None, ...) for image-only data)",
                    sample_id=sample_id,
                    path=path,
                )
            try:
                out.update(stage(text))
            except SampleError as err:  # a user stage names no sample: this one
                raise SampleError(err.reason, sample_id=sample_id, path=path) from err
    if decoded is not None:
        out["image"] = decoded
    return out


def byte_limit(pipeline: StagedProcessor) -> int | None:
    """The most bytes one member, object or cell of a sample may have before it is read:
    the image stage's ``max_bytes`` (:class:`~mmcache.transforms.stage.ImageTraits`: the
    default of ``ImageSpec.max_bytes`` for a stage that declares none, as for a file;
    ``None``: no limit), or that default for a pipeline without an image stage (a
    caption of hundreds of MiB is a file listed by mistake, as an image that large is)."""
    for stage in pipeline.stages:
        if stage.kind == "image":
            return ImageTraits.of(stage).max_bytes
    return DEFAULT_MAX_BYTES


def check_size(
    size: int, limit: int | None, what: str, *, sample_id: str, path: str | None
) -> None:
    """Raise :class:`SampleError` naming the sample when ``size`` (taken from an index, a
    header or a stat: before any byte is read) is over ``limit`` (see :func:`byte_limit`).

    This is the one check every source makes before it reads a sample's bytes, so that a
    hostile size never becomes an allocation: the caller reads nothing when it raises."""
    if limit is not None and size > limit:
        raise SampleError(
            f"{what} is {size} bytes, over the limit of {limit} bytes (ImageSpec.max_bytes); "
            "refused before reading it",
            sample_id=sample_id,
            path=path,
        )


class PipelineFields:
    """What a source forwards to its ``pipeline`` (set by the source; ``_fingerprint``
    is its fingerprint, taken once)."""

    pipeline: Processor
    _fingerprint: str

    def fingerprint(self) -> str:
        """The pipeline's fingerprint (part of every key)."""
        return self._fingerprint

    def describe(self) -> str:
        """The pipeline's repr: what the cache records beside the fingerprint."""
        return repr(self.pipeline)

    @property
    def varying_fields(self) -> frozenset[str]:
        """The fields whose shapes vary between samples (the pipeline's
        ``varying_fields``; empty: every sample has the same shapes)."""
        layout = self.pipeline
        if isinstance(layout, LaysOutFields):
            return frozenset(layout.varying_fields)
        return frozenset()

    @property
    def channels_last_fields(self) -> frozenset[str]:
        """The fields cached as ``[H, W, C]`` and presented as ``[C, H, W]`` views (the
        pipeline's ``channels_last_fields``; see :mod:`mmcache.sources.items`)."""
        layout = self.pipeline
        if isinstance(layout, LaysOutFields):
            return frozenset(layout.channels_last_fields)
        return frozenset()

    @property
    def pad_token_id(self) -> int | None:
        """What SFT batches pad ``input_ids`` with: the chat stage's ``pad_id``
        (``ChatSpec(pad_id=)`` or its tokenizer's pad token); None without a chat stage."""
        chat = self.pipeline.chat if isinstance(self.pipeline, Pipeline) else None
        return None if chat is None else chat.pad_id  # an int once the ChatSpec is made
