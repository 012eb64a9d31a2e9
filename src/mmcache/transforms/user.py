"""User stages: a plain callable as a cached :class:`~mmcache.transforms.stage.Stage`.

``mmcache.stage(fn)`` wraps the function a training script already calls in its
``__getitem__`` so that the cache holds its output:

>>> import numpy as np
>>> def grey(im):
...     return np.asarray(im.convert("L").resize((32, 32)))[None]
>>> pipe = Pipeline(image=stage(grey))                                  # doctest: +SKIP

- an **image** stage receives the decoded image upright (EXIF orientation applied)
  and in RGB (transparent pixels composited on white:
  :func:`mmcache.transforms.pixels.upright_rgb`) and returns a uint8 array
  ``[C, H, W]`` or ``[H, W, C]`` (C is 1 or 3; ``[H, W, C]`` is transposed, a
  ``torch`` tensor is accepted); anything else is a SampleError naming the stage and
  the shape and dtype it returned: floats are never cached (4x the bytes of uint8;
  normalise after the cache with :func:`mmcache.normalize`);
- a **text** stage receives the record's text and returns a dict of integer arrays
  (lists and tensors are converted); the field name ``"image"`` is the image stage's.

The fingerprint, part of every cache key, is ``version`` when given, else
:func:`~mmcache.transforms.fingerprint.callable_fingerprint` of ``fn``: its code,
constants, defaults, closure values and the globals it reads. Change the body or a
captured constant and the old entries are never served again. What cannot be seen
into (a C function, a class, an object whose ``__call__`` is not Python code) is
refused unless ``version=`` is given; bump the version whenever its behaviour changes.

Workers: the stage is pickled into spawn-started workers, so ``fn`` must be picklable
there (a module-level function, a ``functools.partial`` of one, a callable object);
the default fork start method also takes lambdas and closures. Thread-safety is
``fn``'s own: the wrapper keeps no state beyond its fingerprint.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from PIL import Image

from mmcache import keys
from mmcache.errors import ConfigError, SampleError
from mmcache.transforms.fingerprint import callable_fingerprint
from mmcache.transforms.pixels import upright_rgb
from mmcache.transforms.stage import Stage, StageKind

__all__ = ["UserStage", "image_output", "stage", "text_output"]

_KINDS: tuple[StageKind, ...] = ("image", "text")


def _as_array(value: Any) -> Any:
    """``value`` as a numpy array when it is one, a torch tensor, or a list/tuple; else as is."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)):
        return np.asarray(value)
    return value


def image_output(value: Any, *, stage_name: str) -> npt.NDArray[np.uint8]:
    """An image stage's result as a C-contiguous uint8 ``[C, H, W]`` (C 1 or 3).

    Accepts ``[C, H, W]`` and ``[H, W, C]`` (transposed; ``[C, ...]`` wins when both
    read); raises SampleError naming ``stage_name`` and what was returned otherwise.
    """
    arr = _as_array(value)
    if not isinstance(arr, np.ndarray):
        raise SampleError(
            f"image stage {stage_name} returned a {type(value).__name__}, not an array: "
            "return a uint8 numpy array [C,H,W] or [H,W,C]",
            sample_id="<image>",
        )
    if arr.dtype != np.uint8 or arr.ndim != 3 or 0 in arr.shape:
        raise SampleError(
            f"image stage {stage_name} returned {arr.dtype} {list(arr.shape)}; it must return "
            "uint8 [C,H,W] or [H,W,C] with C 1 or 3 (floats are not cached: convert to uint8 "
            "and normalise after the cache with mmcache.normalize)",
            sample_id="<image>",
        )
    if arr.shape[0] in (1, 3):
        return np.ascontiguousarray(arr)
    if arr.shape[2] in (1, 3):
        return np.ascontiguousarray(arr.transpose(2, 0, 1))
    raise SampleError(
        f"image stage {stage_name} returned uint8 {list(arr.shape)}: neither [C,H,W] nor "
        "[H,W,C] with C 1 or 3",
        sample_id="<image>",
    )


def text_output(value: Any, *, stage_name: str) -> dict[str, npt.NDArray[Any]]:
    """A text stage's result as ``{name: integer array}``; SampleError naming
    ``stage_name`` for anything else (not a dict, empty, a float or string field,
    a field named ``"image"``)."""
    if not isinstance(value, dict) or not value:
        raise SampleError(
            f"text stage {stage_name} returned {type(value).__name__}"
            f"{' (empty)' if isinstance(value, dict) else ''}; it must return a non-empty "
            "dict of integer arrays such as {'input_ids': ..., 'attention_mask': ...}",
            sample_id="<text>",
        )
    out: dict[str, npt.NDArray[Any]] = {}
    for name, field in value.items():
        if not isinstance(name, str) or not name or name == "image":
            raise SampleError(
                f"text stage {stage_name} returned a field named {name!r}: names are "
                "non-empty strings, and 'image' is the image stage's",
                sample_id="<text>",
            )
        arr = _as_array(field)
        if not isinstance(arr, np.ndarray) or not np.issubdtype(arr.dtype, np.integer):
            what = f"{arr.dtype} array" if isinstance(arr, np.ndarray) else type(field).__name__
            raise SampleError(
                f"text stage {stage_name} returned field {name!r} as {what}; it must be an "
                "integer array (token ids, masks)",
                sample_id="<text>",
            )
        out[name] = np.ascontiguousarray(arr)
    return out


def _opaque(fn: Any) -> bool:
    """Whether ``fn``'s behaviour is invisible to :func:`callable_fingerprint` (it would
    be hashed by name only): a C function, a class, a callable object without Python
    ``__call__`` code, also inside ``functools.partial``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, (types.FunctionType, types.MethodType)):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(fn, torch.nn.Module):
        return False  # hashed with its weights
    if isinstance(fn, (type, types.BuiltinFunctionType, types.BuiltinMethodType)):
        return True
    call = next((vars(k)["__call__"] for k in type(fn).__mro__ if "__call__" in vars(k)), None)
    return not isinstance(call, types.FunctionType) or not hasattr(fn, "__dict__")


def _describe(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or '?'}.{name}"


class UserStage:
    """A callable as a :class:`Stage` (see the module docstring); build it with :func:`stage`.

    Attributes: ``fn``, ``version`` (``None``: fingerprinted by content), ``kind``,
    ``fixed_shape`` (False: an image stage whose output shape varies between samples).
    Immutable; picklable when ``fn`` is.
    """

    __slots__ = ("_explicit", "_fingerprint", "_fixed", "_kind", "fn", "version")

    fn: Callable[[Any], Any]
    version: str | None
    _kind: StageKind
    _explicit: bool
    _fingerprint: str
    _fixed: bool

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        version: str | int | None = None,
        kind: StageKind | None = None,
        fixed_shape: bool = True,
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"mmcache.stage needs a callable, got {type(fn).__name__}")
        if isinstance(fn, UserStage):
            raise ConfigError(f"{fn!r} is already a stage: pass it as it is")
        if kind is not None and kind not in _KINDS:
            raise ConfigError(f"mmcache.stage kind must be 'image', 'text' or None, got {kind!r}")
        if not isinstance(fixed_shape, bool):
            raise ConfigError(f"mmcache.stage fixed_shape must be a bool, got {fixed_shape!r}")
        if version is not None and (
            isinstance(version, bool) or not isinstance(version, (str, int)) or version == ""
        ):
            raise ConfigError(
                f"mmcache.stage version must be a non-empty string or an int, got {version!r}"
            )
        pinned = None if version is None else str(version)
        if pinned is None:
            if _opaque(fn):
                raise ConfigError(
                    f"cannot fingerprint {_describe(fn)}: it is not Python code mmcache can "
                    "read (a C function, a class or an object without a Python __call__), so "
                    "a change in it would serve stale entries. Pass "
                    f"mmcache.stage({getattr(fn, '__name__', 'fn')}, version='1') and bump "
                    "the version whenever its behaviour changes"
                )
            content = callable_fingerprint(fn)  # ConfigError (saying: pass a version) if not
            fingerprint = keys.digest("mmcache.stage", "code", content).hex()
        else:
            fingerprint = keys.digest("mmcache.stage", "version", pinned).hex()
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "version", pinned)
        object.__setattr__(self, "_kind", kind or "image")
        object.__setattr__(self, "_explicit", kind is not None)
        object.__setattr__(self, "_fingerprint", fingerprint)
        object.__setattr__(self, "_fixed", fixed_shape)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a stage is immutable (cannot set {name!r})")

    def __getstate__(self) -> tuple[Any, str | None, StageKind, bool, str, bool]:
        return (self.fn, self.version, self._kind, self._explicit, self._fingerprint, self._fixed)

    def __setstate__(self, state: tuple[Any, str | None, StageKind, bool, str, bool]) -> None:
        # The fingerprint travels as computed: a spawned worker need not re-hash (and a
        # function re-imported there is the same code anyway).
        for name, value in zip(
            ("fn", "version", "_kind", "_explicit", "_fingerprint", "_fixed"), state, strict=True
        ):
            object.__setattr__(self, name, value)

    @property
    def kind(self) -> StageKind:
        """``"image"`` or ``"text"`` (``kind=None`` at construction: the Pipeline slot's)."""
        return self._kind

    @property
    def fixed_shape(self) -> bool:
        """Whether every output has one shape (``fixed_shape=False`` at construction: an
        image stage of varied shapes, whose batches come as a list plus ``image_sizes``).
        Not part of the fingerprint: it says how batches are built, not what is cached."""
        return self._fixed

    def for_kind(self, kind: StageKind) -> UserStage:
        """This stage as a ``kind`` stage: what :class:`mmcache.Pipeline` does with a stage
        built with ``kind=None``; one whose kind was given explicitly is returned as is
        (the Pipeline then refuses a mismatch)."""
        if self._explicit or kind == self._kind:
            return self
        clone = object.__new__(UserStage)
        clone.__setstate__((self.fn, self.version, kind, False, self._fingerprint, self._fixed))
        return clone

    def fingerprint(self) -> str:
        """``version``'s digest when pinned, else a digest of the callable's content."""
        return self._fingerprint

    def __repr__(self) -> str:
        pinned = "" if self.version is None else f", version={self.version!r}"
        varied = "" if self._fixed else ", fixed_shape=False"
        return f"stage({_describe(self.fn)}, kind={self._kind!r}{pinned}{varied})"

    def __call__(self, value: Any, /) -> Any:
        """Run ``fn`` on one input and check its output (see the module docstring)."""
        name = _describe(self.fn)
        if self._kind == "image":
            if not isinstance(value, Image.Image):
                raise ConfigError(f"image stage {name} needs a PIL.Image, got {type(value)}")
            return image_output(self.fn(upright_rgb(value)), stage_name=name)
        return text_output(self.fn(value), stage_name=name)


def stage(
    fn: Callable[[Any], Any],
    version: str | int | None = None,
    kind: StageKind | None = None,
    *,
    fixed_shape: bool = True,
) -> UserStage:
    """Wrap ``fn`` as a cached pipeline stage (see the module docstring).

    Args:
        fn: image stage: upright RGB ``PIL.Image`` -> uint8 ``[C,H,W]`` or ``[H,W,C]``;
            text stage: ``str`` -> ``{name: integer array}``.
        version: pin the fingerprint (bump it when ``fn`` changes); ``None``:
            fingerprint ``fn``'s code, constants, defaults, closure and globals.
        kind: ``"image"`` or ``"text"``; ``None``: set by the ``Pipeline`` argument it
            is passed as (``"image"`` when used alone).
        fixed_shape: ``False`` for an image stage whose output shape varies between
            samples (an aspect-preserving resize of your own): its batches then hold a
            list of images plus ``image_sizes``, as ``ImageSpec(crop=None)``'s do.

    Raises ConfigError for a callable that cannot be fingerprinted without ``version``.

    >>> stage(lambda im: im, version="v1").fingerprint() == stage(len, version="v1").fingerprint()
    True
    """
    return UserStage(fn, version=version, kind=kind, fixed_shape=fixed_shape)


if TYPE_CHECKING:  # mypy checks that UserStage conforms to the protocol

    def _conforms(s: UserStage) -> Stage:
        return s
