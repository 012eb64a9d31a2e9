"""Fingerprints of code: a stable hash that changes whenever a callable's or module's output can.

A cache key must change when the step that made the entry changes, or stale
entries are served. This module hashes the step itself, by content:

- :func:`callable_fingerprint`: a function, lambda, ``functools.partial``,
  bound method or callable object (what a user :class:`~mmcache.transforms.stage.Stage`
  is made of);
- :func:`encoder_fingerprint`: a ``torch.nn.Module`` with its structure,
  plain attributes and exact weights (what :class:`mmcache.FeatureCache` keys
  features by), and :func:`preprocess_fingerprint` for the callable that runs
  before it;
- :class:`WeightWatch`: notices, cheaply, that a module's weights changed after
  its fingerprint was taken.

It lives with the stages, not with the feature cache, because a user stage of
an image or text pipeline needs the same hashing; it does not import torch at
import time (a text-only pipeline never loads it): torch values are recognised
only once torch is imported, since none can exist before.

What is hashed, by content: a function's bytecode, constants, referenced
names, defaults, the values its closure captured and the globals it reads
(numbers, strings, containers, tensors and arrays by value; user functions
recursively by code, up to a small depth). Functions, classes and modules of
the standard library and of installed packages are hashed by their full name,
so a torch or numpy upgrade keeps fingerprints. User code is named by its bare
``__qualname__`` (not its module), so a definition in a training script
(``__main__``) and the same one imported by ``mmcache warm`` agree. An object
whose content cannot be hashed (a tokenizer, an open file) is refused with a
ConfigError: pin a name and version for such a step instead. Bytecode differs
between Python versions, so a Python upgrade changes fingerprints (safe: the
entries are recomputed once).

Weights. On the CPU a module's tensors are hashed in place with xxh3-128; CUDA
tensors are copied to the host in 64 MiB pinned chunks and hashed exactly. A
cheaper device-side checksum (a strided sum plus a few sampled elements) was
rejected: it can miss a change of a single weight, and a missed change serves
stale features silently. Not seen: code inside ``forward`` (pin a version),
the device, autocast or TF32 settings around the call.

Deterministic across processes and runs (nothing ``id()``-dependent enters a
hash). Thread-safe: no shared state but a cached list of library directories.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache import keys
from mmcache.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FINGERPRINT_VERSION",
    "WeightWatch",
    "callable_fingerprint",
    "encoder_fingerprint",
    "preprocess_fingerprint",
]

logger = logging.getLogger(__name__)

#: Version of the module fingerprint scheme; bump it when what is hashed changes.
FINGERPRINT_VERSION = 1
_HASH_CHUNK = 64 << 20
_SMALL_TENSOR = 1 << 20
# Functions reached through globals and closures are hashed by code up to this
# depth, by name beyond it (bounded work, no runaway through library code).
_MAX_CODE_DEPTH = 3


def _loaded_torch() -> Any:
    """The torch module if something imported it, else None (then no value is a torch object)."""
    return sys.modules.get("torch")


class _Unhashable(Exception):
    """Raised inside fingerprinting for a value that cannot be hashed by content."""


def _bytes_view(a: npt.NDArray[Any]) -> memoryview:
    """The raw bytes of an array, C order, as a flat memoryview (no copy when contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def _hex(token: str) -> str:
    return xxhash.xxh3_128_hexdigest(token.encode("utf-8", "surrogatepass"))


class _Hasher:
    """xxh3-128 over self-delimiting parts (the encoding of :func:`mmcache.keys.digest`)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def part(self, *parts: str | bytes | int | None) -> None:
        self._h.update(keys.digest(*parts))

    def raw(self, data: npt.NDArray[Any]) -> None:
        self._h.update(_bytes_view(data))

    def hexdigest(self) -> str:
        return str(self._h.hexdigest())


def _qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return f"{module}.{name if name is not None else type(obj).__qualname__}"


# -- modules and tensors ----------------------------------------------------------------------


def _feed_tensor(h: _Hasher, t: torch.Tensor, staging: list[torch.Tensor]) -> None:
    """Hash the exact bytes of ``t``; device tensors go through a reused pinned buffer."""
    import torch

    t = t.detach()
    if t.device.type == "meta":
        raise ConfigError(
            "the encoder has tensors on the meta device (not loaded yet): load its weights "
            "first, or pin the fingerprint with name=/version="
        )
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return
    u8 = flat.view(torch.uint8)
    if u8.device.type == "cpu":
        h.raw(u8.numpy())
        return
    if u8.numel() <= _SMALL_TENSOR:  # a bias or a captured constant: one small copy
        h.raw(u8.cpu().numpy())
        return
    for start in range(0, u8.numel(), _HASH_CHUNK):
        piece = u8[start : start + _HASH_CHUNK]
        if u8.device.type == "cuda":
            if not staging:
                staging.append(torch.empty(_HASH_CHUNK, dtype=torch.uint8, pin_memory=True))
            host = staging[0][: piece.numel()]
            host.copy_(piece)  # synchronous: the bytes are there when hashed
        else:
            host = piece.to("cpu")
        h.raw(host.numpy())


def _module_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def encoder_fingerprint(encoder: torch.nn.Module, *, preprocess: Any = None) -> str:
    """Hex xxh3-128 of everything about ``encoder`` (and ``preprocess``) that changes its output.

    Hashed: the module's class name; for every submodule its name, class name
    and plain public attributes (numbers, strings, tuples, dtypes, tensors by
    value; callables as :func:`preprocess_fingerprint` hashes them: library
    functions such as ``torch.tanh`` or ``F.gelu`` by name, ``functools.partial``
    with its arguments, lambdas and user functions by code, constants and
    closure; other objects are skipped); every parameter and
    buffer's name, dtype, shape and exact bytes; :func:`preprocess_fingerprint`
    of ``preprocess``. Not hashed: the device, ``training`` (FeatureCache runs
    in eval mode), code inside ``forward``, the Python module a class is
    defined in (a class in a script's ``__main__`` and the same class imported
    by ``mmcache warm`` agree). Deterministic across processes and runs.
    Raises ConfigError for weights on the meta device or an unhashable
    ``preprocess``. A callable attribute whose content cannot be hashed (a
    lambda capturing a tokenizer) is hashed by name, with a logged warning:
    pin ``name=``/``version=`` for such an encoder.
    """
    torch = _loaded_torch()
    if torch is None or not isinstance(encoder, torch.nn.Module):
        raise ConfigError(
            f"encoder_fingerprint needs a torch.nn.Module, got {type(encoder).__name__}"
        )
    return _module_fingerprint(encoder, preprocess, set())


def _module_fingerprint(encoder: torch.nn.Module, preprocess: Any, outer: set[int]) -> str:
    """:func:`encoder_fingerprint`; ``outer`` holds the ids of the modules being hashed
    around this one, which a callable attribute may capture (``lambda x: self.f(x)``):
    those are named, not hashed again (their content is hashed where they are)."""
    h = _Hasher()
    # Classes by __qualname__ without their module: the class of a training script
    # (module "__main__") and the same class imported by `mmcache warm` must agree.
    h.part("mmcache.encoder", FINGERPRINT_VERSION, type(encoder).__qualname__)
    modules = list(encoder.named_modules())
    inside = outer | {id(mod) for _, mod in modules}
    for name, mod in modules:
        h.part("module", name, type(mod).__qualname__, _attrs_token(mod, inside))
    staging: list[torch.Tensor] = []
    for name, t in _module_tensors(encoder):
        h.part("tensor", name, str(t.dtype), repr(tuple(t.shape)), t.numel() * t.element_size())
        _feed_tensor(h, t, staging)
    h.part("preprocess", preprocess_fingerprint(preprocess))
    return h.hexdigest()


def _attrs_token(mod: torch.nn.Module, inside: set[int]) -> str:
    torch = _loaded_torch()
    parts = []
    for name in sorted(vars(mod)):
        if name.startswith("_") or name == "training":
            continue
        value = vars(mod)[name]
        if callable(value) and not isinstance(value, torch.nn.Module):
            parts.append(f"{name}=callable:{_attr_callable_token(mod, name, value, inside)}")
            continue
        try:
            parts.append(f"{name}={_value_token(value, 1, set(inside))}")
        except _Unhashable:
            continue  # configuration objects and the like: the weights carry the meaning
    return ";".join(parts)


def _attr_callable_token(mod: torch.nn.Module, name: str, value: Any, inside: set[int]) -> str:
    """A callable attribute (``self.act``) as ``preprocess`` is hashed, by content.

    Library functions and classes (``torch.tanh``, ``F.relu``, ``nn.LayerNorm``)
    stay by name, in the token used before content hashing, so a torch upgrade
    and this change leave those fingerprints as they were. By name only, a
    ``partial(F.gelu, approximate="tanh")`` or ``lambda x: x * 3`` attribute
    shared the features of its ``"none"`` / ``x * 2`` sibling.
    """
    by_name = isinstance(
        value, (type, types.FunctionType, types.BuiltinFunctionType, types.BuiltinMethodType)
    ) or not hasattr(value, "__dict__")
    if by_name and _is_library(value):
        return _name(value)
    try:
        return _callable_token(value, 1, set(inside))
    except _Unhashable as exc:
        logger.warning(
            "%s.%s is fingerprinted by name only (%s): features of encoders that differ "
            "there would be shared; pin FeatureCache(..., name=, version=) for this encoder",
            type(mod).__qualname__,
            name,
            exc,
        )
        return _name(value)


def _tensor_token(t: torch.Tensor) -> str:
    h = _Hasher()
    _feed_tensor(h, t, [])
    return f"tensor({t.dtype},{tuple(t.shape)},{h.hexdigest()})"


def _module_token(m: torch.nn.Module, seen: set[int]) -> str:
    if id(m) in seen:  # the encoder being hashed (or a part of it), captured by a closure
        return f"nn-inside:{type(m).__qualname__}"
    return f"nn:{_module_fingerprint(m, None, seen)}"


# -- callables and values ---------------------------------------------------------------------


def callable_fingerprint(fn: Callable[..., Any]) -> str:
    """Hex xxh3-128 of a callable, by content: what a user stage's fingerprint is built from.

    The rules of :func:`preprocess_fingerprint` (see the module docstring): a
    function by its code, defaults, closure and the globals it reads; a
    ``functools.partial`` with its arguments; an ``nn.Module`` with its weights;
    a callable object by its class, ``__call__`` and attributes; library code by
    name. The same definition gives the same value in every process and run.

    >>> callable_fingerprint(lambda x: x * 2) == callable_fingerprint(lambda x: x * 2)
    True
    >>> callable_fingerprint(lambda x: x * 2) == callable_fingerprint(lambda x: x * 3)
    False

    Raises ConfigError for a non-callable, or when ``fn`` captures an object
    whose content cannot be hashed (a tokenizer, an open file...): give the
    stage an explicit ``version`` then, and bump it when the code changes.
    """
    if not callable(fn):
        raise ConfigError(f"callable_fingerprint needs a callable, got {type(fn).__name__}")
    try:
        return _hex(_callable_token(fn, 0, set()))
    except _Unhashable as exc:
        raise ConfigError(
            f"cannot fingerprint {fn!r}: {exc}. Its output would not be tracked, so stale "
            "entries could be served: give the stage an explicit version and bump it whenever "
            "its code or data change"
        ) from None


def preprocess_fingerprint(preprocess: Any) -> str:
    """Hex xxh3-128 of a preprocessing callable, by content where possible (best effort).

    - ``None``: a fixed value.
    - a plain function or lambda: its qualified name (not its module: see
      :func:`encoder_fingerprint`), bytecode (``co_code``), constants,
      referenced names, defaults, the values its closure captured and the
      globals it reads (numbers, strings, tuples, tensors and arrays by value;
      user functions recursively by code; modules, classes and functions of
      the standard library and installed packages by full name, so a torch
      upgrade does not invalidate features).
    - ``functools.partial``: the function and its bound arguments.
    - an ``nn.Module``: :func:`encoder_fingerprint` (weights included).
    - a bound method or a callable object: its class, ``__call__`` code and
      plain attributes.

    Raises ConfigError when a captured value is an arbitrary object whose
    content cannot be hashed (a tokenizer, an open file...): pass
    ``name=``/``version=`` to FeatureCache to pin the fingerprint yourself.
    Bytecode differs between Python versions, so a Python upgrade recomputes
    features (safe, merely slower once). Equal to :func:`callable_fingerprint`
    for a callable.
    """
    if preprocess is None:
        return "none"
    try:
        token = _callable_token(preprocess, 0, set())
    except _Unhashable as exc:
        raise ConfigError(
            f"cannot fingerprint preprocess={preprocess!r}: {exc}. Its output would not be "
            "tracked, so stale features could be served: pin the fingerprint with "
            "FeatureCache(..., name='my-encoder', version='1') and bump the version whenever "
            "the preprocessing or the weights change"
        ) from None
    return _hex(token)


def _value_token(v: Any, depth: int, seen: set[int]) -> str:
    """A stable string for ``v``'s content; raises _Unhashable for arbitrary objects."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, (tuple, list, set, frozenset)):
        items = [_value_token(x, depth, seen) for x in v]
        if isinstance(v, (set, frozenset)):
            items.sort()
        return f"{type(v).__name__}[{','.join(items)}]"
    if isinstance(v, dict):
        pairs = sorted(
            f"{_value_token(k, depth, seen)}:{_value_token(x, depth, seen)}" for k, x in v.items()
        )
        return f"dict{{{','.join(pairs)}}}"
    torch = _loaded_torch()
    if torch is not None and isinstance(v, (torch.dtype, torch.device, torch.Size)):
        return f"{type(v).__name__}:{v}"
    if isinstance(v, np.dtype):
        return f"{type(v).__name__}:{v}"
    if torch is not None and isinstance(v, torch.Tensor):
        return _tensor_token(v)
    if isinstance(v, np.ndarray):
        if v.dtype.hasobject:
            raise _Unhashable("a numpy array of Python objects")
        digest = xxhash.xxh3_128_hexdigest(_bytes_view(v))
        return f"ndarray({v.dtype.str},{v.shape},{digest})"
    if isinstance(v, types.ModuleType):
        return f"pymodule:{v.__name__}"
    if isinstance(v, types.CodeType):
        return _code_token(v, depth, seen)
    if callable(v):
        return _callable_token(v, depth, seen)
    if isinstance(v, enum.Enum):
        return f"enum:{_name(type(v))}.{v.name}"
    raise _Unhashable(f"it captures a {type(v).__qualname__} object")


def _code_token(code: types.CodeType, depth: int, seen: set[int]) -> str:
    consts = [
        _code_token(c, depth, seen)
        if isinstance(c, types.CodeType)
        else _value_token(c, depth, seen)
        for c in code.co_consts
    ]
    blob = "|".join([code.co_code.hex(), ",".join(consts), ",".join(code.co_names)])
    return f"code:{_hex(blob)}"


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(_global_names(c))
    return sorted(set(names))


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """Where the standard library and installed packages live (site-packages...)."""
    import site
    import sysconfig

    dirs = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # pragma: no cover - virtualenvs with an old site module
        pass
    return tuple(sorted(os.path.realpath(d) + os.sep for d in dirs if d))


def _is_library(obj: Any) -> bool:
    """Whether ``obj`` comes from the standard library, an installed package or C code.

    Such functions and classes are hashed by their full name, not their code, so
    upgrading torch or numpy does not invalidate every feature. User code (a
    script, a project checkout, an editable install) is hashed by content.
    """
    module_name = getattr(obj, "__module__", None)
    if not module_name or module_name == "__main__":
        return False
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return module is not None  # built-in modules (C code) are library code
    return bool(os.path.realpath(str(path)).startswith(_library_dirs()))


def _name(obj: Any) -> str:
    """A function's or class's name for fingerprints: ``module.qualname`` for library
    code, the bare ``__qualname__`` for user code, so that a definition in a training
    script (``__main__``) and the same one imported by ``mmcache warm`` agree."""
    if _is_library(obj):
        return _qualname(obj)
    return str(getattr(obj, "__qualname__", None) or type(obj).__qualname__)


def _callable_token(fn: Any, depth: int, seen: set[int]) -> str:
    torch = _loaded_torch()
    if torch is not None and isinstance(fn, torch.nn.Module):
        return _module_token(fn, seen)
    if isinstance(fn, functools.partial):
        return (
            f"partial({_callable_token(fn.func, depth, seen)};"
            f"{_value_token(fn.args, depth, seen)};{_value_token(fn.keywords, depth, seen)})"
        )
    if isinstance(fn, types.MethodType):
        owner = fn.__self__
        owner_token = (
            _module_token(owner, seen)
            if torch is not None and isinstance(owner, torch.nn.Module)
            else _object_token(owner, depth, seen)
        )
        return f"method({_callable_token(fn.__func__, depth, seen)};{owner_token})"
    if isinstance(fn, types.FunctionType):
        return _function_token(fn, depth, seen)
    if isinstance(fn, (type, types.BuiltinFunctionType, types.BuiltinMethodType)) or not hasattr(
        fn, "__dict__"
    ):
        # Classes, C functions (torch.sigmoid) and ufunc-like objects: by name.
        return f"name:{_name(fn)}"
    return _object_token(fn, depth, seen)


def _object_token(obj: Any, depth: int, seen: set[int]) -> str:
    """A callable instance or a method's owner: class, ``__call__`` code and attributes."""
    if id(obj) in seen:
        return f"cycle:{_name(type(obj))}"
    seen.add(id(obj))
    call = next((vars(k)["__call__"] for k in type(obj).__mro__ if "__call__" in vars(k)), None)
    call_token = (
        _function_token(call, depth + 1, seen) if isinstance(call, types.FunctionType) else ""
    )
    try:
        state = vars(obj)
    except TypeError:
        state = {}
    attrs = ",".join(f"{k}={_value_token(state[k], depth + 1, seen)}" for k in sorted(state))
    return f"obj({_name(type(obj))};{call_token};{attrs})"


def _function_token(fn: types.FunctionType, depth: int, seen: set[int]) -> str:
    if id(fn) in seen:
        return f"cycle:{_name(fn)}"
    if depth > 0 and _is_library(fn):
        return f"libfn:{_qualname(fn)}"
    if depth > _MAX_CODE_DEPTH:
        return f"fn:{_name(fn)}"
    seen.add(id(fn))
    code = fn.__code__
    parts = [
        _name(fn),
        _code_token(code, depth, seen),
        _value_token(fn.__defaults__, depth + 1, seen),
        _value_token(fn.__kwdefaults__, depth + 1, seen),
    ]
    for var, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later in the enclosing scope)
            content = None
        try:
            parts.append(f"{var}={_value_token(content, depth + 1, seen)}")
        except _Unhashable as exc:
            raise _Unhashable(f"{exc} in its closure variable {var!r}") from None
    glb = fn.__globals__
    for name in _global_names(code):
        if name in glb:
            try:
                parts.append(f"{name}={_value_token(glb[name], depth + 1, seen)}")
            except _Unhashable as exc:
                raise _Unhashable(f"{exc} in the global {name!r} it reads") from None
    return f"fn({';'.join(parts)})"


# -- weight changes ---------------------------------------------------------------------------


class WeightWatch:
    """Notices any change to a module's tensors after its fingerprint was taken.

    Remembers, for every parameter and buffer slot (the ``_parameters`` and
    ``_buffers`` dicts of each submodule), the tensor it held and that tensor's
    version counter, which torch bumps on every in-place write (optimizer
    steps, ``load_state_dict``, ``with torch.no_grad(): w += 1``). A changed
    counter or a different tensor in a slot means the weights may differ.
    Checking reads one dict entry and one counter per tensor, far cheaper than
    walking ``parameters()`` each time. Submodules added after construction are
    not seen. Anything but an ``nn.Module`` (or ``None``) is watched as never
    changing.
    """

    def __init__(self, module: Any) -> None:
        self.slots: list[tuple[dict[str, Any], str, torch.Tensor, int]] = []
        torch = _loaded_torch()
        if torch is None or not isinstance(module, torch.nn.Module):
            return
        for mod in module.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in table.items():
                    if t is not None:
                        self.slots.append((table, name, t, t._version))

    def changed(self) -> bool:
        """Whether any slot now holds another tensor, or its tensor was written in place."""
        return any(
            table.get(name) is not t or t._version != version
            for table, name, t, version in self.slots
        )
