"""The ``Stage`` protocol: one deterministic step of a sample's processing.

A pipeline is an ordered list of stages (:class:`mmcache.transforms.pipeline.Pipeline`).
Every stage has a *fingerprint*: a string that changes whenever the stage's
output for the same input could change (its configuration; for a user
function its code, constants, defaults, closure values and the globals it
reads, or an explicit ``version=``). The pipeline's fingerprint, built from
its stages' fingerprints in order, is part of every cache key, so changing a
stage never serves an entry made by the old one.

Stages are called from DataLoader worker processes: they must pickle (spawn)
and be safe to call from one thread per process.

Two kinds, by what they consume:

- an **image stage** maps a decoded ``PIL.Image`` (as stored in the file: its
  mode and frame, the EXIF orientation not yet applied) to a ``uint8`` array
  ``[C, H, W]``: :class:`mmcache.ImageSpec` (which applies the orientation
  itself, after cropping, and asks the decode step for a reduced-size JPEG
  decode through :meth:`~mmcache.ImageSpec.draft_size`);
- a **text stage** maps a string (or a record's text) to a dict of integer
  arrays: :class:`mmcache.TextSpec`.

A plain function becomes a stage through ``mmcache.stage(fn, version=None)``
(:mod:`mmcache.transforms.user`), which hands it the image upright and in RGB
and checks what it returns; an HF image processor through
``mmcache.hf_image_processor`` (:mod:`mmcache.transforms.hf`).

``kind`` is read-only and the input is positional-only, so that a frozen
dataclass with a ``ClassVar`` kind (``ImageSpec``) or a class with any
parameter name conforms.

An image stage may also declare what it does beyond the protocol (its output's shape
varies, it caches ``[H, W, C]``, it keeps the EXIF orientation as stored, its byte limit):
:class:`ImageTraits` lists those members with what a stage that declares none means, and
:meth:`ImageTraits.of` is the one place that reads them, so the pipeline and the sources
read a typed record instead of asking the stage.

A stage is checked by :class:`mmcache.testing.stage_contract.StageContract`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from mmcache.units import MiB

__all__ = ["DEFAULT_MAX_BYTES", "ImageTraits", "Stage", "StageKind"]

# A large photo is tens of MiB (a 100 MP 16-bit TIFF about 600 MiB is the rare
# exception, raise the limit for those); a file far larger is a video or an archive
# listed by mistake, and reading it whole would raise MemoryError, which no on_error
# policy catches.
#: The default of ``ImageSpec.max_bytes``: what a sample's image (or, without an image
#: stage, its other bytes) may weigh when its stage declares no limit of its own.
DEFAULT_MAX_BYTES = 256 * MiB

#: What a stage consumes: a decoded image, or the sample's text.
StageKind = Literal["image", "text"]


@runtime_checkable
class Stage(Protocol):
    """One deterministic processing step with a fingerprint (see the module docstring)."""

    @property
    def kind(self) -> StageKind:
        """``"image"`` or ``"text"``: which input of a record the stage consumes."""
        ...

    def fingerprint(self) -> str:
        """A stable string that changes whenever this stage's output could change."""
        ...

    def __call__(self, value: Any, /) -> Any:
        """Process one input (an image stage: ``PIL.Image`` -> ``uint8 [C,H,W]``;
        a text stage: ``str`` -> ``{name: int array}``)."""
        ...


@dataclass(frozen=True)
class ImageTraits:
    """What an image stage declares beyond :class:`Stage`, each with what a stage that
    does not declare it means (a user's own stage need declare none of them).

    Attributes:
        fixed_shape: every output has one shape (False: an aspect-preserving resize;
            the loader batches a list plus ``image_sizes``).
        channels_last: the stage caches ``[H, W, C]`` pixels (presented as ``[C, H, W]``
            views).
        exif_transpose: the stage turns images upright by their EXIF orientation (a
            stage that declares nothing receives the upright image).
        max_bytes: the most bytes one image may have before it is read (None: no limit).
    """

    fixed_shape: bool = True
    channels_last: bool = False
    exif_transpose: bool = True
    max_bytes: int | None = DEFAULT_MAX_BYTES

    @classmethod
    def of(cls, stage: object) -> ImageTraits:
        """The traits ``stage`` declares (the built-in stages declare theirs as
        attributes; a value of the wrong type counts as not declared, None for
        ``max_bytes`` as no limit).

        The one place that asks a stage what it has: :class:`Stage` is a protocol that
        users implement, and these members are optional in it."""
        found = {name: getattr(stage, name, _UNDECLARED) for name in _TRAIT_NAMES}
        limit = found["max_bytes"]
        return cls(
            fixed_shape=found["fixed_shape"] is not False,
            channels_last=found["channels_last"] is True,
            exif_transpose=found["exif_transpose"] is not False,
            max_bytes=limit if limit is None or isinstance(limit, int) else DEFAULT_MAX_BYTES,
        )


_TRAIT_NAMES = ("fixed_shape", "channels_last", "exif_transpose", "max_bytes")
#: What :meth:`ImageTraits.of` finds for a member the stage does not have.
_UNDECLARED = object()
