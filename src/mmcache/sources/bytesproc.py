"""One sample's image *bytes* and caption through a pipeline's stages: what a source whose
images are not files (a tar member, an object's byte range) produces with.

:func:`process_bytes` runs the stages of a :class:`mmcache.Pipeline` exactly as
:meth:`mmcache.Pipeline.process` does for a file (image through
:func:`~mmcache.transforms.image.decode_bytes`, text through the text stage, text fields
first in the result), so that a sample read from a shard is bitwise the sample read
from the loose file with the same bytes. The pipeline is duck-typed
(:class:`StagedProcessor`: ``stages`` and ``fingerprint``) because sources sit below
:mod:`mmcache.pipeline` in the layers.

Thread-safe (each call has its own image objects).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mmcache.errors import SampleError
from mmcache.transforms.image import decode_bytes
from mmcache.transforms.stage import Stage

__all__ = ["StagedProcessor", "process_bytes"]


@runtime_checkable
class StagedProcessor(Protocol):
    """What a bytes source needs of its pipeline (:class:`mmcache.Pipeline` is one)."""

    @property
    def stages(self) -> Sequence[Stage]: ...

    def fingerprint(self) -> str: ...


def process_bytes(
    pipeline: StagedProcessor,
    image: bytes | None,
    text: str | None,
    *,
    sample_id: str,
    path: str | None,
) -> dict[str, np.ndarray]:
    """``pipeline``'s arrays of one sample given its image bytes and caption.

    ``path`` names where the bytes came from in errors (``shard.tar:key.jpg``).
    Raises :class:`SampleError` naming ``sample_id`` and ``path`` when the pipeline
    needs an image (or a caption) the sample lacks, or the image cannot be decoded.
    """
    out: dict[str, np.ndarray] = {}
    decoded: Any = None
    for stage in pipeline.stages:
        if stage.kind == "image":
            if image is None:
                raise SampleError(
                    "sample has no image member, but the pipeline has an image stage "
                    "(use Pipeline(image=None, ...) for text-only data)",
                    sample_id=sample_id,
                    path=path,
                )
            decoded = decode_bytes(stage, image, sample_id=sample_id, path=path)
        else:
            if text is None:
                raise SampleError(
                    "sample has no text member, but the pipeline has a text stage "
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
