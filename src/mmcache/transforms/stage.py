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

A stage is checked by :class:`mmcache.testing.stage_contract.StageContract`.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

__all__ = ["Stage", "StageKind"]

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
