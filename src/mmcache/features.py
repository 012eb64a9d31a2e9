"""``FeatureCache``: outputs of a frozen encoder, computed once, kept on the device and on disk.

A frozen vision tower (CLIP/SigLIP ViT in LLaVA-style training, the image
tower of LiT) gives the same output for the same pixels every epoch and every
run. ``FeatureCache`` runs it only on the samples whose features are not
cached yet and serves the rest from three tiers:

- **device**: tensors on the training GPU (:class:`~mmcache.stores.gpu.DeviceTier`),
  sized by ``memory="auto"`` from ``torch.cuda.mem_get_info`` minus a headroom
  (:func:`mmcache.sizing.auto_gpu_budget`). A hit costs one ``torch.stack`` on the
  device: no host copy. Without CUDA the same tier runs in host memory.
- the :class:`~mmcache.cache.Cache`'s **memory** (node-shared) and **disk**
  (persistent) tiers, holding codec entries ``{"features": array}`` in the
  cached dtype (bfloat16 as its uint16 bits). A hit there is copied to the
  device once and admitted to the device tier.

>>> feats = FeatureCache(vision_tower, cache=cache, dtype=torch.float16,    # doctest: +SKIP
...                      preprocess=mmcache.normalize, sample_shape=(3, 336, 336))
>>> z = feats(batch)      # [B, 577, 1024] float16 on the encoder's device  # doctest: +SKIP
>>> for batch in feats.wrap(loader): batch["features"]   # pixels replaced  # doctest: +SKIP

Keys. A feature's key is :func:`mmcache.keys.feature_key` of the sample key
(which already hashes the sample id, its file stamp, its caption and the
pipeline fingerprint, so a changed image or resize gives new keys), the
*encoder fingerprint*, the dtype name and the output selection. The encoder
fingerprint (:func:`encoder_fingerprint`) hashes the module's class, every
submodule's class and plain attributes (``eps``, ``stride``, library
activation functions by name, a ``partial`` with its arguments, a lambda by
code and closure...), every parameter and buffer (name, dtype, shape and
exact bytes) and the fingerprint of ``preprocess`` (:func:`preprocess_fingerprint`).
Change one weight and every old feature is a miss. ``name=``/``version=`` pin
the fingerprint instead (no hashing at all: you bump ``version`` when the
weights, the preprocessing or the code change). Not seen by the fingerprint:
code changes inside ``forward`` (pin a version), the device (features from
any GPU type are reused), autocast or TF32 settings around the call.

Weights that change after construction (``load_state_dict``, an optimizer
step, a replaced ``Parameter``) are detected on every call from the tensors'
identities and version counters (30 us per call for a ViT-L's 292 tensors),
and the fingerprint is recomputed: stale features are never served. A FeatureCache
over an encoder that really trains recomputes it every step; it is meant for
frozen encoders.

Hashing cost. On the CPU the weights are hashed in place with xxh3-128: a
303M-parameter fp32 ViT-L (1.13 GiB) takes 0.07-0.10 s on this 2-core VM
(``python benchmarks/features.py``). On CUDA they are copied to the host in
64 MiB pinned chunks and hashed exactly, adding roughly 0.05-0.1 s per GiB at
PCIe speed. A cheaper device-side checksum (a strided sum
plus a few sampled elements) was rejected: it can miss a change of a single
weight, and a missed change serves stale features silently.

Eval mode. The encoder is put in eval mode once, at construction (features
computed with dropout would be random and not cacheable). FeatureCache never
puts it back in train mode; if your code does (``model.train()`` on a parent
module is the usual way), the next call sets eval mode again and logs a
warning once.

Write path. Misses are computed in one batched encoder call (chunks of
``batch_size``) under ``torch.inference_mode``. Their rows are admitted to the
device tier (device-to-device copies) and written to the Cache. On CUDA the
device-to-host copy for the Cache is issued ``non_blocking`` into pinned
memory and handed over at the *next* call (or :meth:`FeatureCache.flush`),
when the copy has long finished: the training step never waits for it (a
synchronous copy would stall the GPU queue every step, as mlx-vlm#976
measured). A write-behind thread then encodes the entries and commits them to
the Cache's tiers (the disk tier fsyncs each commit: ~4 ms per 150 KB entry
on the VM here, far longer than the GPU takes to encode it). On the CPU there
is nothing to overlap and the put is immediate (``write_behind=False``). A
process killed before a flush loses at most a few batches of writes (the
queue's depth), which the next run recomputes; at normal exit they are written.

Returned tensors are fresh (the caller owns them, they can be modified) and
normal tensors, not inference tensors, so a trainable projector can consume
them under autograd.

Thread/process safety: a FeatureCache is driven by one thread, like a
DataLoader: use one per training process (each rank has its own device tier;
all of them share the Cache's node-wide memory tier and disk tier). Do not
share one across threads without a lock.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import logging
import math
import os
import queue
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
import xxhash

from mmcache import codec, keys, sizing
from mmcache.cache import Cache
from mmcache.dist import rank_and_world, shard_bounds
from mmcache.errors import ConfigError, SampleError
from mmcache.policies import Policy
from mmcache.stats import TierStats
from mmcache.stores.gpu import DeviceTier
from mmcache.units import format_size, parse_size

__all__ = [
    "DEFAULT_HOST_TIER_FRACTION",
    "FEATURE_FIELD",
    "FINGERPRINT_VERSION",
    "GPU_MIN_FREE_FRACTION",
    "FeatureBudgetWarning",
    "FeatureCache",
    "FeatureLoader",
    "FeatureStats",
    "LoadedEncoder",
    "WarmReport",
    "encoder_fingerprint",
    "load_factory",
    "preprocess_fingerprint",
    "shard_bounds",
    "warm_features",
]

logger = logging.getLogger(__name__)

#: Field name of the features in a codec entry.
FEATURE_FIELD = "features"
#: Version of the fingerprint scheme; bump it when what is hashed changes.
FINGERPRINT_VERSION = 1
#: ``memory="auto"`` on a CPU device: this share of the host's available memory
#: (the Cache's own memory tier takes up to another half, see mmcache.sizing).
DEFAULT_HOST_TIER_FRACTION = 0.25
#: ``memory="auto"`` on CUDA: stop growing the device tier when less than this
#: share of the GPU is free (construction-time budgets cannot know how much the
#: optimizer states and activations created later will need).
GPU_MIN_FREE_FRACTION = 0.1
_HASH_CHUNK = 64 << 20
_SMALL_TENSOR = 1 << 20
# Functions reached through globals and closures are hashed by code up to this
# depth, by name beyond it (bounded work, no runaway through library code).
_MAX_CODE_DEPTH = 3

Output = int | str | None
Source = Literal["device", "memory", "disk", "encoder"]

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}
# The numpy dtype a decoded entry of each dtype has (bfloat16: its uint16 bits).
_STORAGE: dict[torch.dtype, np.dtype[Any]] = {
    torch.float16: np.dtype("<f2"),
    torch.bfloat16: np.dtype("<u2"),
    torch.float32: np.dtype("<f4"),
    torch.float64: np.dtype("<f8"),
}


class FeatureBudgetWarning(UserWarning):
    """A tier of a :class:`FeatureCache` cannot hold the features of every sample."""


# ---------------------------------------------------------------------------------------------
# Fingerprints
# ---------------------------------------------------------------------------------------------


class _Unhashable(Exception):
    """Raised inside preprocess fingerprinting for a value that cannot be hashed by content."""


def _bytes_view(a: npt.NDArray[Any]) -> memoryview:
    """The raw bytes of an array, C order, as a flat memoryview (no copy when contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


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


def _feed_tensor(h: _Hasher, t: torch.Tensor, staging: list[torch.Tensor]) -> None:
    """Hash the exact bytes of ``t``; device tensors go through a reused pinned buffer."""
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
    if not isinstance(encoder, torch.nn.Module):
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
    features (safe, merely slower once).
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
    return xxhash.xxh3_128_hexdigest(token.encode("utf-8", "surrogatepass"))


def _attrs_token(mod: torch.nn.Module, inside: set[int]) -> str:
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
    if isinstance(v, (torch.dtype, torch.device, torch.Size, np.dtype)):
        return f"{type(v).__name__}:{v}"
    if isinstance(v, torch.Tensor):
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
    import enum

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
    return f"code:{xxhash.xxh3_128_hexdigest(blob.encode('utf-8', 'surrogatepass'))}"


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


def _module_token(m: torch.nn.Module, seen: set[int]) -> str:
    if id(m) in seen:  # the encoder being hashed (or a part of it), captured by a closure
        return f"nn-inside:{type(m).__qualname__}"
    return f"nn:{_module_fingerprint(m, None, seen)}"


def _callable_token(fn: Any, depth: int, seen: set[int]) -> str:
    if isinstance(fn, torch.nn.Module):
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
            if isinstance(owner, torch.nn.Module)
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


class _WeightWatch:
    """Notices any change to a module's tensors after its fingerprint was taken.

    Remembers, for every parameter and buffer slot (the ``_parameters`` and
    ``_buffers`` dicts of each submodule), the tensor it held and that tensor's
    version counter, which torch bumps on every in-place write (optimizer
    steps, ``load_state_dict``, ``with torch.no_grad(): w += 1``). A changed
    counter or a different tensor in a slot means the weights may differ.
    Checking costs 0.03 ms for a ViT-L (292 tensors); walking ``parameters()``
    each time cost 0.6 ms. Submodules added after construction are not seen.
    """

    def __init__(self, module: Any) -> None:
        self.slots: list[tuple[dict[str, Any], str, torch.Tensor, int]] = []
        if not isinstance(module, torch.nn.Module):
            return
        for mod in module.modules():
            for table in (mod._parameters, mod._buffers):
                for name, t in table.items():
                    if t is not None:
                        self.slots.append((table, name, t, t._version))

    def changed(self) -> bool:
        return any(
            table.get(name) is not t or t._version != version
            for table, name, t, version in self.slots
        )


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FeatureStats:
    """Counters of a :class:`FeatureCache` in this process.

    ``samples`` rows were requested; ``hits`` counts those served by each tier
    (``device``, ``memory``, ``disk``), ``misses`` those computed by the
    encoder (a sample repeated within a batch counts once per row but is
    encoded once). ``encoder_calls`` forward calls ran on ``encoded_samples``
    samples in ``encoder_seconds`` (on CUDA timed with events, so a batch's
    time appears once it finished). ``device`` is the device tier's own record.
    """

    samples: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    misses: int = 0
    encoder_calls: int = 0
    encoded_samples: int = 0
    encoder_seconds: float = 0.0
    device: TierStats = field(default_factory=TierStats)

    @property
    def hit_rate(self) -> float:
        """Rows served from any tier / rows requested (0.0 before any call)."""
        return sum(self.hits.values()) / self.samples if self.samples else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["device"] = self.device.as_dict()
        out["hit_rate"] = self.hit_rate
        return out


@dataclass(frozen=True)
class WarmReport:
    """What :func:`warm_features` did on this rank.

    ``total`` samples were in this rank's shard; ``skipped`` were already
    stored, ``computed`` were encoded and stored now, ``rejected`` could not be
    produced (``on_error="skip"``).
    """

    rank: int
    world_size: int
    total: int
    skipped: int
    computed: int
    rejected: int
    seconds: float
    encoder_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LoadedEncoder:
    """What :func:`load_factory` got from a factory: pass the fields to :class:`FeatureCache`."""

    encoder: Any
    preprocess: Callable[[torch.Tensor], Any] | None = None
    name: str | None = None
    version: str | None = None
    output: Output = None


# ---------------------------------------------------------------------------------------------
# FeatureCache
# ---------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    """Features copied (non-blocking) to pinned host memory, to be put once the copy is done."""

    fkeys: list[bytes]
    host: torch.Tensor | None
    done: Any  # torch.cuda.Event recorded after the copy, or None (CPU: already done)
    timing: tuple[Any, Any] | None  # CUDA (start, end) events around the encoder
    cost: float  # seconds per sample, when already known (CPU)


@dataclass
class _Counters:
    samples: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"device": 0, "memory": 0, "disk": 0})
    misses: int = 0
    encoder_calls: int = 0
    encoded_samples: int = 0
    encoder_seconds: float = 0.0
    timed_samples: int = 0


def _put_features(
    cache: Cache, dtype: torch.dtype, fkeys: list[bytes], host: torch.Tensor, cost: float
) -> None:
    """Encode each row of ``host`` as a codec entry and offer it to every tier of ``cache``."""
    bits = _host_bits(host)
    bf = {FEATURE_FIELD} if dtype == torch.bfloat16 else set()
    for j, fk in enumerate(fkeys):
        raw = codec.encode({FEATURE_FIELD: bits[j]}, ctime=cache.clock(), cost=cost, bfloat16=bf)
        cache.put_encoded(fk, raw, cost=cost)


class _Writer:
    """Write-behind: one daemon thread puts finished feature batches into the Cache.

    The training thread only hands over ``(keys, host tensor, cost)``; encoding
    and the disk tier's commits (fsynced: ~4 ms per 150 KB entry on the 2-core
    VM here, so ~0.25 s for a batch of 64 that the GPU encoded in a few tens
    of ms) run here, overlapped with training (lmdb releases the GIL during
    I/O). The queue holds at most ``depth`` batches: when the disk is slower
    than the encoder, the training thread waits, which bounds host memory.
    A failed put is logged and counted; those features are recomputed later.
    Thread-safe: ``submit``/``join``/``close`` may be called from any thread.
    """

    def __init__(self, cache: Cache, dtype: torch.dtype, depth: int = 4) -> None:
        self._cache = cache
        self._dtype = dtype
        self._queue: queue.Queue[tuple[list[bytes], torch.Tensor, float] | None] = queue.Queue(
            depth
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def submit(self, fkeys: list[bytes], host: torch.Tensor, cost: float) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="mmcache-feature-writer", daemon=True
                )
                self._thread.start()
        self._queue.put((fkeys, host, cost))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                _put_features(self._cache, self._dtype, *item)
            except Exception:  # never kill the writer: the entries are just recomputed later
                self.failures += 1
                n = len(item[0]) if item is not None else 0
                logger.exception("writing %d features to the cache failed", n)
            finally:
                self._queue.task_done()

    def join(self) -> None:
        """Wait until every submitted batch is in the Cache."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread (idempotent)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this module."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def _module_device(encoder: Any) -> torch.device | None:
    if isinstance(encoder, torch.nn.Module):
        for t in itertools.chain(encoder.parameters(), encoder.buffers()):
            return t.device
    return None


def _output_name(output: Output) -> str:
    if output is None:
        return "tensor"
    if isinstance(output, int):
        return f"index:{output}"
    return f"name:{output}"


def _host_bits(t: torch.Tensor) -> npt.NDArray[Any]:
    """A numpy view of a CPU tensor's memory (bfloat16 as uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class FeatureCache:
    """Frozen-encoder outputs for a batch, computed only for the samples not cached yet.

    Args:
        encoder: the frozen encoder, an ``nn.Module`` (its weights are
            fingerprinted), or any callable when ``name=`` pins the fingerprint.
            It is put in eval mode once (see the module docstring) and called
            on a whole batch of images.
        cache: the :class:`~mmcache.cache.Cache` whose memory and disk tiers
            keep features across processes and runs; ``None``: device tier only.
        dtype: the dtype features are stored and returned in (float16,
            bfloat16, float32, float64); part of the key.
        device: where images are sent and features returned; default: the
            encoder's device (CPU for an encoder without tensors). Must match
            the encoder's device.
        memory: the device tier's byte budget: ``"auto"`` (on CUDA:
            :func:`mmcache.sizing.auto_gpu_budget`, half the free GPU memory,
            and the tier stops growing when less than 10% of the GPU is free;
            on CPU: :data:`DEFAULT_HOST_TIER_FRACTION` of available host
            memory), an int or IEC string, or 0 (no device tier).
        name, version: pin the encoder fingerprint (no weight hashing; bump
            ``version`` when the weights, the preprocessing or the code change).
        preprocess: called on the uint8 image batch (on ``device``) before the
            encoder, e.g. :func:`mmcache.pipeline.normalize`; fingerprinted by
            content (:func:`preprocess_fingerprint`). Without it the encoder
            receives the uint8 batch as it comes.
        output: when the encoder returns a tuple, dict or ``ModelOutput``: an
            index or a key/attribute name (``"last_hidden_state"``); part of the key.
        batch_size: the most samples per encoder call (misses are chunked).
        n_samples: how many samples will be cached: warn (log and
            :class:`FeatureBudgetWarning`) when a tier cannot hold them all.
        sample_shape: one image's shape, e.g. ``(3, 224, 224)``: run one probe
            forward at construction to learn the feature shape (for
            :meth:`estimate` and the ``n_samples`` check); otherwise it is
            learnt from the first batch.
        policy: the device tier's policy (default ``keep``: fill once, never evict).
        write_behind: put new features into the Cache from a background thread
            (default: on CUDA, where the training step should not wait for disk
            commits; on the CPU they are immediate). :meth:`flush` waits for them.

    Raises ConfigError for invalid arguments or an unhashable ``preprocess``
    without ``name=``. Not thread-safe: one per training process.
    """

    def __init__(
        self,
        encoder: Callable[..., Any],
        *,
        cache: Cache | None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        memory: int | str = "auto",
        name: str | None = None,
        version: str | int | None = None,
        preprocess: Callable[[torch.Tensor], Any] | None = None,
        output: Output = None,
        batch_size: int = 64,
        n_samples: int | None = None,
        sample_shape: Sequence[int] | None = None,
        policy: str | Policy = "keep",
        write_behind: bool | None = None,
    ) -> None:
        if dtype not in _DTYPE_NAMES:
            raise ConfigError(
                f"dtype must be one of {[str(d) for d in _DTYPE_NAMES]}, got {dtype!r}"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if output is not None and (isinstance(output, bool) or not isinstance(output, (int, str))):
            raise ConfigError(f"output must be None, an int index or a name, got {output!r}")
        if version is not None and name is None:
            raise ConfigError("version= needs name= (the pair pins the encoder fingerprint)")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"name must be a non-empty string, got {name!r}")
        if not callable(encoder):
            raise ConfigError(f"encoder must be callable, got {type(encoder).__name__}")
        if not isinstance(encoder, torch.nn.Module) and name is None:
            raise ConfigError(
                f"encoder is a {type(encoder).__name__}, not a torch.nn.Module, so its weights "
                "cannot be fingerprinted: pass name=/version= to pin the fingerprint"
            )
        if cache is not None and not isinstance(cache, Cache):
            raise ConfigError(f"cache must be a mmcache.Cache or None, got {type(cache).__name__}")
        if n_samples is not None and (
            isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 0
        ):
            raise ConfigError(f"n_samples must be an int >= 0 or None, got {n_samples!r}")
        self.encoder = encoder
        self.cache = cache
        self.dtype = dtype
        self.dtype_name = _DTYPE_NAMES[dtype]
        self.preprocess = preprocess
        self.output = output
        self.output_name = _output_name(output)
        self.batch_size = batch_size
        self.name = name
        self.version = None if version is None else str(version)
        self.n_samples = n_samples
        enc_device = _module_device(encoder)
        if device is None:
            self.device = enc_device if enc_device is not None else torch.device("cpu")
        else:
            self.device = torch.device(device)
            if enc_device is not None and not _same_device(enc_device, self.device):
                raise ConfigError(
                    f"device={self.device} but the encoder is on {enc_device}: move it first "
                    f"(encoder.to({str(self.device)!r})) or leave device=None"
                )

        if isinstance(encoder, torch.nn.Module) and encoder.training:
            encoder.eval()
            logger.info(
                "FeatureCache put the encoder in eval mode (features must be deterministic)"
            )
        self._warned_train = False

        self._fingerprint = self._compute_fingerprint()
        self._watch = _WeightWatch(encoder if name is None else None)

        budget, self._auto_gpu = self._device_budget(memory)
        self.tier = DeviceTier(budget, device=self.device, policy=policy)
        self._warned_gpu_full = False

        self._shape: tuple[int, ...] | None = None
        self._counters = _Counters()
        self._pending: list[_Pending] = []
        # On CUDA, puts to the Cache wait for a non-blocking copy (see the module docstring).
        self._defer_writes = self.device.type == "cuda"
        if write_behind is None:
            write_behind = self.device.type == "cuda"
        self._writer = _Writer(cache, dtype) if write_behind and cache is not None else None
        if self._writer is not None:
            # Queued writes reach the Cache when this object dies or at interpreter exit.
            self._finalizer = weakref.finalize(self, self._writer.close)
        self._budget_checked = False
        if sample_shape is not None:
            self._probe(tuple(int(d) for d in sample_shape))
        if n_samples is not None and self._shape is not None and not self._budget_checked:
            self._check_budget(n_samples)

    # -- configuration ---------------------------------------------------------------------
    def _compute_fingerprint(self) -> str:
        if self.name is not None:
            return keys.digest("mmcache.encoder.pinned", self.name, self.version).hex()
        if not isinstance(self.encoder, torch.nn.Module):  # pragma: no cover - checked above
            raise ConfigError("unpinned encoders must be nn.Modules")
        t0 = time.perf_counter()
        fp = encoder_fingerprint(self.encoder, preprocess=self.preprocess)
        logger.info("encoder fingerprint %s computed in %.2f s", fp[:12], time.perf_counter() - t0)
        return fp

    def _device_budget(self, memory: int | str) -> tuple[int, bool]:
        if memory != "auto":
            return parse_size(memory), False
        if self.device.type == "cuda":
            budget = sizing.auto_gpu_budget(self.device)
            if budget is not None:
                return budget, True
        return sizing.auto_memory_budget(DEFAULT_HOST_TIER_FRACTION), False

    @property
    def fingerprint(self) -> str:
        """The encoder fingerprint in the keys (hex; pinned or hashed from the weights)."""
        return self._fingerprint

    @property
    def feature_shape(self) -> tuple[int, ...] | None:
        """One sample's feature shape, once known (probe or first batch)."""
        return self._shape

    def feature_key(self, sample_key: bytes | str) -> bytes:
        """The cache key of one sample's features (``sample_key``: 16 bytes or 32 hex digits)."""
        sk = keys.key_from_hex(sample_key) if isinstance(sample_key, str) else sample_key
        return keys.feature_key(sk, self._fingerprint, self.dtype_name, self.output_name)

    def contains(self, sample_key: bytes | str) -> bool:
        """Whether the device tier or the Cache holds this sample's features (counts nothing)."""
        fk = self.feature_key(sample_key)
        return self.tier.contains(fk) or (self.cache is not None and self.cache.contains(fk))

    # -- sizes -----------------------------------------------------------------------------
    def _entry_sizes(self) -> tuple[int, int]:
        """(payload bytes, encoded bytes in the Cache) of one sample's features."""
        if self._shape is None:
            raise ConfigError(
                "the feature shape is not known yet: pass sample_shape=(3, H, W) to "
                "FeatureCache or call it on one batch first"
            )
        storage = _STORAGE[self.dtype]
        payload = math.prod(self._shape) * storage.itemsize
        bf = {FEATURE_FIELD} if self.dtype == torch.bfloat16 else set()
        # np.empty only reserves address space and encoded_size never reads the data.
        dummy = np.empty(self._shape, storage)
        return payload, codec.encoded_size({FEATURE_FIELD: dummy}, bfloat16=bf)

    def estimate(self, n_samples: int) -> int:
        """Bytes the Cache needs to hold the features of ``n_samples`` samples.

        Codec entries: the payload (``prod(shape) * itemsize``) plus about 128
        bytes of header each; the device tier needs the payload only. Needs
        the feature shape (``sample_shape=`` or one batch seen).
        """
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 0:
            raise ConfigError(f"n_samples must be an int >= 0, got {n_samples!r}")
        return n_samples * self._entry_sizes()[1]

    def _check_budget(self, n: int) -> None:
        self._budget_checked = True
        payload, encoded = self._entry_sizes()
        notes: list[str] = []
        device_short = self.tier.capacity() < n * payload
        if device_short:
            held = self.tier.capacity() // payload if payload else n
            notes.append(
                f"the device tier on {self.device} has {format_size(self.tier.capacity())} "
                f"({held:,} samples, {100 * held / max(n, 1):.0f}%)"
            )
        tiers = self.cache.tiers if self.cache is not None else {}
        best = max((t.capacity() for t in tiers.values()), default=0)
        host_short = best < n * encoded
        for tname, store in tiers.items():
            if store.capacity() < n * encoded:
                held = store.capacity() // encoded
                notes.append(
                    f"the {tname} tier has {format_size(store.capacity())} "
                    f"({held:,} samples, {100 * held / max(n, 1):.0f}%)"
                )
        if not (device_short or host_short):
            return
        need = n * encoded
        if host_short:
            fix = (
                "Features no tier holds are re-encoded every epoch; give the disk tier at "
                f"least {format_size(need)} (Cache(disk=...))"
            )
        else:
            fix = "Features beyond the device tier are read from the Cache's tiers each epoch"
        msg = (
            f"FeatureCache: the features of {n:,} samples ({self.dtype_name} "
            f"{list(self._shape or ())}, {format_size(encoded)} each) take {format_size(need)}; "
            + "; ".join(notes)
            + f". {fix}."
        )
        logger.warning("%s", msg)
        warnings.warn(msg, FeatureBudgetWarning, stacklevel=_caller_stacklevel())

    def _learn_shape(self, shape: tuple[int, ...]) -> None:
        if self._shape is None:
            self._shape = shape
            if self.n_samples is not None and not self._budget_checked:
                self._check_budget(self.n_samples)

    # -- the encoder -----------------------------------------------------------------------
    def _ensure_eval(self) -> None:
        enc = self.encoder
        if isinstance(enc, torch.nn.Module) and enc.training:
            enc.eval()
            if not self._warned_train:
                self._warned_train = True
                logger.warning(
                    "the encoder was back in train mode (model.train() on a parent module?); "
                    "FeatureCache set eval mode again: cached features come from eval mode "
                    "(logged once)"
                )

    def _check_weights(self) -> None:
        if self.name is not None:
            return
        if self._watch.changed():
            logger.warning(
                "the encoder's weights changed since its fingerprint was computed; recomputing "
                "it (features of the old weights are no longer served). A FeatureCache is meant "
                "for frozen encoders."
            )
            self._watch = _WeightWatch(self.encoder)
            self._fingerprint = self._compute_fingerprint()

    def _select(self, out: Any) -> torch.Tensor:
        sel = self.output
        if sel is None:
            value = out
        elif isinstance(out, Mapping) and isinstance(sel, str):
            if sel not in out:
                raise ConfigError(f"encoder output has no key {sel!r}; keys: {list(out)}")
            value = out[sel]
        elif isinstance(sel, int):
            seq = list(out.values()) if isinstance(out, Mapping) else out
            try:
                value = seq[sel]
            except (IndexError, TypeError, KeyError) as exc:
                raise ConfigError(
                    f"cannot take output={sel} of a {type(out).__name__}: {exc}"
                ) from None
        else:
            if not hasattr(out, sel):
                raise ConfigError(f"encoder output {type(out).__name__} has no attribute {sel!r}")
            value = getattr(out, sel)
        if not isinstance(value, torch.Tensor):
            hint = "" if self.output is not None else " (pass output= to select one)"
            raise ConfigError(
                f"the encoder's selected output is a {type(value).__name__}, not a tensor{hint}"
            )
        return value

    def _forward(self, images: torch.Tensor) -> torch.Tensor:
        """Preprocess + encoder + output selection on a device batch; ``dtype`` result."""
        x = self.preprocess(images) if self.preprocess is not None else images
        y = self._select(self.encoder(x))
        if y.dim() == 0 or y.shape[0] != images.shape[0]:
            raise ConfigError(
                f"the encoder returned shape {list(y.shape)} for a batch of {images.shape[0]}: "
                "the first dimension must be the batch"
            )
        return y.to(self.dtype)

    def _probe(self, sample_shape: tuple[int, ...]) -> None:
        self._ensure_eval()
        x = torch.zeros((1, *sample_shape), dtype=torch.uint8, device=self.device)
        with torch.inference_mode():
            y = self._forward(x)
        self._learn_shape(tuple(y.shape[1:]))

    # -- calls -----------------------------------------------------------------------------
    def __call__(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Features of a loader batch (``"key"``: hex sample keys, ``"image"``: uint8 [B,3,H,W]).

        Returns a ``dtype`` tensor ``[B, ...]`` on ``device``, rows in batch
        order. ``"image"`` is only needed when something misses.
        """
        if "key" not in batch:
            raise ConfigError(
                "the batch has no 'key' field (hex sample keys): use mmcache.DataLoader or "
                "mmcache.CachedDataset, or call FeatureCache.get(keys, images)"
            )
        return self.get(batch["key"], batch.get("image"))

    def get(
        self, sample_keys: Sequence[bytes | str], images: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Features for ``sample_keys`` (16-byte or hex sample keys), ``images`` their pixels.

        The encoder runs once (chunked by ``batch_size``) on the rows no tier
        holds; ``images`` may be None when everything hits.
        """
        self._drain(block=False)
        self._ensure_eval()
        self._check_weights()
        fkeys = [self.feature_key(k) for k in sample_keys]
        n = len(fkeys)
        if images is not None and len(images) != n:
            raise ConfigError(f"{n} keys but {len(images)} images: they must match row for row")
        rows, sources = self._resolve(fkeys, images)
        c = self._counters
        c.samples += n
        for src in sources:
            if src == "encoder":
                c.misses += 1
            else:
                c.hits[src] = c.hits.get(src, 0) + 1
        if n == 0:
            shape = self._shape or ()
            return torch.empty((0, *shape), dtype=self.dtype, device=self.device)
        return torch.stack(rows)

    def _resolve(
        self, fkeys: list[bytes], images: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], list[Source]]:
        """Every row's features and where they came from; admits to the device tier."""
        n = len(fkeys)
        use_tier = self.tier.capacity() > 0
        found: list[torch.Tensor | None] = self.tier.get_many(fkeys) if use_tier else [None] * n
        sources: list[Source] = ["device"] * n
        first: dict[bytes, int] = {}
        dups: dict[int, int] = {}
        missing: list[int] = []
        for i, (fk, t) in enumerate(zip(fkeys, found, strict=True)):
            if t is not None:
                continue
            if fk in first:
                dups[i] = first[fk]
            else:
                first[fk] = i
                missing.append(i)

        if missing and self.cache is not None:
            missing = self._from_cache(fkeys, missing, found, sources, admit=use_tier)

        if missing:
            if images is None:
                raise ConfigError(
                    f"{len(missing)} of {n} samples have no cached features and no images were "
                    "given: pass the batch's 'image' field"
                )
            computed = self._encode(images, missing, [fkeys[i] for i in missing])
            may_admit = use_tier and self._device_may_grow()
            cost = self._mean_cost()
            for j, i in enumerate(missing):
                found[i] = computed[j]
                sources[i] = "encoder"
                if may_admit:
                    self.tier.put(fkeys[i], computed[j], cost=cost)

        for i, src in dups.items():
            found[i] = found[src]
            sources[i] = sources[src]
        out = [t for t in found if t is not None]
        if len(out) != n:  # pragma: no cover - every row is filled above
            raise RuntimeError("FeatureCache left a row unfilled")
        return out, sources

    def _from_cache(
        self,
        fkeys: list[bytes],
        missing: list[int],
        found: list[torch.Tensor | None],
        sources: list[Source],
        *,
        admit: bool,
    ) -> list[int]:
        """Fill rows from the Cache's tiers; return the rows still missing."""
        if self.cache is None:  # pragma: no cover - checked by the caller
            return missing
        storage = _STORAGE[self.dtype]
        hits: list[tuple[int, npt.NDArray[Any], str]] = []
        still: list[int] = []
        for i in missing:
            sample, tier = self.cache.lookup(fkeys[i])
            arr = None if sample is None else sample.get(FEATURE_FIELD)
            if arr is None or arr.dtype != storage:
                if arr is not None:
                    logger.error(
                        "cached features %s have dtype %s, expected %s; recomputing",
                        fkeys[i].hex(),
                        arr.dtype,
                        storage,
                    )
                still.append(i)
                continue
            hits.append((i, arr, tier or "memory"))
        if not hits:
            return still
        if self._shape is None:
            self._learn_shape(tuple(hits[0][1].shape))
        tensors = self._to_device([a for _, a, _ in hits])
        cost = self._mean_cost()
        may_admit = admit and self._device_may_grow()
        for (i, _, tier), t in zip(hits, tensors, strict=True):
            found[i] = t
            sources[i] = "disk" if tier == "disk" else "memory"
            if may_admit:
                self.tier.put(fkeys[i], t, cost=cost)
        return still

    def _to_device(self, arrays: list[npt.NDArray[Any]]) -> list[torch.Tensor]:
        """Copy host arrays to the device: one staging buffer and one transfer per shape."""
        pin = self.device.type == "cuda"
        out: list[torch.Tensor | None] = [None] * len(arrays)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for j, a in enumerate(arrays):
            by_shape.setdefault(tuple(a.shape), []).append(j)
        for shape, idx in by_shape.items():
            host = torch.empty((len(idx), *shape), dtype=self.dtype, pin_memory=pin)
            bits = _host_bits(host)
            for r, j in enumerate(idx):
                bits[r] = arrays[j]
            dev = host if self.device.type == "cpu" else host.to(self.device, non_blocking=pin)
            for r, j in enumerate(idx):
                out[j] = dev[r]
        return [t for t in out if t is not None]

    def _device_may_grow(self) -> bool:
        """With ``memory="auto"`` on CUDA: stop admitting when the GPU itself runs short."""
        if not self._auto_gpu:
            return True
        free, total = torch.cuda.mem_get_info(self.device)
        spare = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if free + spare >= GPU_MIN_FREE_FRACTION * total:
            return True
        if not self._warned_gpu_full:
            self._warned_gpu_full = True
            logger.warning(
                "device tier stops growing at %s: less than %.0f%% of the GPU is free "
                "(pass memory= to FeatureCache to fix its budget; logged once)",
                format_size(self.tier.nbytes()),
                100 * GPU_MIN_FREE_FRACTION,
            )
        return False

    def _mean_cost(self) -> float:
        c = self._counters
        return c.encoder_seconds / c.timed_samples if c.timed_samples else 0.0

    def _encode(self, images: Any, rows: list[int], fkeys: list[bytes]) -> torch.Tensor:
        """Run the encoder on ``images[rows]``; queue the results for the Cache."""
        imgs = images if isinstance(images, torch.Tensor) else torch.as_tensor(images)
        if len(rows) < imgs.shape[0]:
            imgs = imgs.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=imgs.device))
        cuda = self.device.type == "cuda"
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
        t0 = time.perf_counter()
        outs: list[torch.Tensor] = []
        with torch.inference_mode():
            for s in range(0, len(rows), self.batch_size):
                x = imgs[s : s + self.batch_size].to(self.device, non_blocking=True)
                self._counters.encoder_calls += 1  # counted even if it raises: it ran
                outs.append(self._forward(x))
        # Every later use (stack, device-tier copy) runs outside inference mode and so
        # makes normal tensors that autograd accepts.
        y = outs[0] if len(outs) == 1 else torch.cat(outs)
        c = self._counters
        c.encoded_samples += len(rows)
        self._learn_shape(tuple(y.shape[1:]))
        if cuda:
            if end is not None:
                end.record()
            self._queue_write(fkeys, y, timing=(start, end))
        else:
            seconds = time.perf_counter() - t0
            c.encoder_seconds += seconds
            c.timed_samples += len(rows)
            self._queue_write(fkeys, y, timing=None, cost=seconds / len(rows))
        return y

    # -- write-back to the Cache -----------------------------------------------------------
    def _queue_write(
        self,
        fkeys: list[bytes],
        y: torch.Tensor,
        *,
        timing: tuple[Any, Any] | None,
        cost: float = 0.0,
    ) -> None:
        if self.device.type == "cuda":
            host = None
            if self.cache is not None:
                host = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
                host.copy_(y, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
            self._pending.append(_Pending(fkeys, host, done, timing, 0.0))
            return
        host = y if y.device.type == "cpu" else y.to("cpu")
        if self._defer_writes:  # exercised on the CPU by tests of the deferred path
            self._pending.append(_Pending(fkeys, host, None, None, cost))
            return
        self._put(fkeys, host, cost)

    def _drain(self, *, block: bool) -> None:
        """Put the pending writes whose copies are done (all of them with ``block``)."""
        while self._pending:
            p = self._pending[0]
            if p.done is not None:
                if block:
                    p.done.synchronize()
                elif not p.done.query():
                    return
            self._pending.pop(0)
            cost = self._resolve_timing(p)
            if p.host is not None:
                self._put(p.fkeys, p.host, cost)

    def _resolve_timing(self, p: _Pending) -> float:
        """Seconds per sample of a pending batch; CUDA timings are counted once complete."""
        if p.timing is None:
            return p.cost
        start, end = p.timing  # both recorded before `done`, so complete once it is
        seconds = float(start.elapsed_time(end)) / 1000.0
        c = self._counters
        c.encoder_seconds += seconds
        c.timed_samples += len(p.fkeys)
        return seconds / max(len(p.fkeys), 1)

    def _put(self, fkeys: list[bytes], host: torch.Tensor, cost: float) -> None:
        if self.cache is None:
            return
        if self._writer is not None:
            self._writer.submit(fkeys, host, cost)
        else:
            _put_features(self.cache, self.dtype, fkeys, host, cost)

    def flush(self) -> None:
        """Write every pending feature to the Cache (waits for device-to-host copies and
        for the write-behind thread)."""
        self._drain(block=True)
        if self._writer is not None:
            self._writer.join()

    def close(self) -> None:
        """Flush, then stop the write-behind thread. The device tier stays usable."""
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- precompute ------------------------------------------------------------------------
    def store(self, sample_keys: Sequence[bytes | str], images: torch.Tensor) -> int:
        """Encode and write to the Cache the samples it does not hold yet; return how many.

        The precompute path (:func:`warm_features`): nothing is returned or
        admitted to the device tier. Needs a Cache.
        """
        if self.cache is None:
            raise ConfigError("FeatureCache.store needs a Cache to store into (cache=None)")
        self._drain(block=False)
        if len(images) != len(sample_keys):
            raise ConfigError(
                f"{len(sample_keys)} keys but {len(images)} images: they must match row for row"
            )
        self._ensure_eval()
        self._check_weights()
        fkeys = [self.feature_key(k) for k in sample_keys]
        seen: set[bytes] = set()
        rows: list[int] = []
        for i, fk in enumerate(fkeys):
            if fk not in seen and not self.cache.contains(fk):
                seen.add(fk)
                rows.append(i)
        if rows:
            self._encode(images, rows, [fkeys[i] for i in rows])
        return len(rows)

    # -- construction from a factory spec ---------------------------------------------------
    @classmethod
    def from_factory(
        cls,
        spec: str,
        *,
        cache: Cache | None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        memory: int | str = "auto",
        batch_size: int = 64,
    ) -> FeatureCache:
        """A FeatureCache over the encoder of :func:`load_factory` ``(spec)``.

        The factory's ``preprocess``, ``name``, ``version`` and ``output`` are
        used as they come. What ``mmcache warm --features module:factory`` runs.
        """
        loaded = load_factory(spec)
        return cls(
            loaded.encoder,
            cache=cache,
            dtype=dtype,
            device=device,
            memory=memory,
            name=loaded.name,
            version=loaded.version,
            preprocess=loaded.preprocess,
            output=loaded.output,
            batch_size=batch_size,
        )

    # -- loader stage ----------------------------------------------------------------------
    def wrap(
        self, loader: Iterable[Mapping[str, Any]], *, keep_images: bool = False
    ) -> FeatureLoader:
        """A loader stage: iterate ``loader`` and yield its batches with ``"features"`` added.

        ``"image"`` is dropped from each batch unless ``keep_images`` (the
        training loop then never touches pixels). The loader's batches need
        ``"key"`` and ``"image"`` fields, as :class:`mmcache.DataLoader` makes.

        >>> for batch in feats.wrap(loader):       # doctest: +SKIP
        ...     loss = model(batch["features"], batch["input_ids"])
        """
        return FeatureLoader(loader, self, keep_images=keep_images)

    # -- reporting -------------------------------------------------------------------------
    def stats(self) -> FeatureStats:
        """Counters so far (puts the writes whose copies finished; never waits)."""
        self._drain(block=False)
        c = self._counters
        return FeatureStats(
            samples=c.samples,
            hits=dict(c.hits),
            misses=c.misses,
            encoder_calls=c.encoder_calls,
            encoded_samples=c.encoded_samples,
            encoder_seconds=c.encoder_seconds,
            device=self.tier.stats(),
        )

    def __repr__(self) -> str:
        pinned = f", name={self.name!r}, version={self.version!r}" if self.name else ""
        return (
            f"FeatureCache({type(self.encoder).__name__}, dtype={self.dtype_name}, "
            f"device={self.device}, output={self.output_name!r}, "
            f"fingerprint={self._fingerprint[:12]}{pinned}, tier={self.tier!r})"
        )


class FeatureLoader:
    """Batches of ``loader`` with ``"features"`` added (see :meth:`FeatureCache.wrap`).

    Iterating runs the FeatureCache on each batch in the iterating thread; at
    the end of an iteration the pending writes are flushed. ``len()`` and
    :meth:`set_epoch` pass through to the wrapped loader.
    """

    def __init__(
        self, loader: Iterable[Mapping[str, Any]], feats: FeatureCache, *, keep_images: bool = False
    ) -> None:
        self.loader = loader
        self.feats = feats
        self.keep_images = keep_images

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for batch in self.loader:
                out = dict(batch)
                out["features"] = self.feats(batch)
                if not self.keep_images:
                    out.pop("image", None)
                yield out
        finally:  # also when the training loop breaks out early
            self.feats.flush()

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forward to the wrapped loader's ``set_epoch`` (ConfigError if it has none)."""
        set_epoch = getattr(self.loader, "set_epoch", None)
        if set_epoch is None:
            raise ConfigError(f"{type(self.loader).__name__} has no set_epoch")
        set_epoch(epoch)


# ---------------------------------------------------------------------------------------------
# Precompute: warm_features, load_factory
# ---------------------------------------------------------------------------------------------


@dataclass
class _Produced:
    index: int
    image: npt.NDArray[Any] | None
    error: SampleError | None


class _WarmImages(torch.utils.data.Dataset[_Produced]):
    """The images of the samples still to encode (picklable: runs in DataLoader workers)."""

    def __init__(self, dataset: Any, indices: list[int]) -> None:
        self.dataset = dataset
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> _Produced:
        index = self.indices[j]
        try:
            sample = self.dataset.produce(index)
        except SampleError as err:  # returned, not raised: the parent re-raises it unwrapped
            return _Produced(index, None, err)
        image = sample.get("image")
        if image is None:
            raise ConfigError("warm_features needs a pipeline with an ImageSpec (no 'image' field)")
        return _Produced(index, image, None)


def _collate_list(items: list[_Produced]) -> list[_Produced]:
    return items


def warm_features(
    dataset: Any,
    feats: FeatureCache,
    *,
    batch_size: int = 64,
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = True,
    num_workers: int = 0,
) -> WarmReport:
    """Compute and store the features of every sample of ``dataset`` (a MultimodalDataset).

    Resumable: a sample whose features the Cache already holds is skipped
    before its image is even decoded, so a run killed midway and started again
    encodes only the rest. Under ``torchrun`` each rank takes a disjoint
    contiguous part (:func:`shard_bounds`; ``rank``/``world_size`` default to
    torch.distributed's when it is initialised); no collective is called, so
    ranks finish independently. ``num_workers`` processes decode images
    (torch DataLoader workers); the encoder runs here. The progress bar
    (tqdm) shows on rank 0. Rejected samples follow ``dataset.on_error``.
    """
    if feats.cache is None:
        raise ConfigError("warm_features needs a FeatureCache with a Cache (cache=None)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be an int >= 0, got {num_workers!r}")
    rank, world_size = rank_and_world(rank, world_size)
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    enc0 = feats.stats().encoder_seconds
    start, stop = shard_bounds(len(dataset), rank, world_size)
    todo: list[int] = []
    todo_keys: dict[int, bytes] = {}
    for i in range(start, stop):
        sk = dataset.key(i)
        if not feats.cache.contains(feats.feature_key(sk)):
            todo.append(i)
            todo_keys[i] = sk
    total = stop - start
    skipped = total - len(todo)
    computed = rejected = 0
    loader = torch.utils.data.DataLoader(
        _WarmImages(dataset, todo),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_collate_list,
    )
    desc = "features" if world_size == 1 else f"features (rank {rank}/{world_size})"
    with tqdm(
        total=total, initial=skipped, desc=desc, unit="img", disable=not progress or rank != 0
    ) as bar:
        for items in loader:
            good: list[_Produced] = []
            for item in items:
                if item.error is None:
                    good.append(item)
                elif getattr(dataset, "on_error", "raise") == "raise":
                    raise item.error
                else:
                    dataset.record_reject(item.error)
                    rejected += 1
            if good:
                images = torch.from_numpy(
                    np.stack([item.image for item in good if item.image is not None])
                )
                computed += feats.store([todo_keys[item.index] for item in good], images)
            bar.update(len(items))
    feats.flush()
    return WarmReport(
        rank=rank,
        world_size=world_size,
        total=total,
        skipped=skipped,
        computed=computed,
        rejected=rejected,
        seconds=time.perf_counter() - t0,
        encoder_seconds=feats.stats().encoder_seconds - enc0,
    )


_FACTORY_KEYS = frozenset({"encoder", "preprocess", "name", "version", "output"})


def _import_target(module_part: str) -> types.ModuleType:
    if module_part.endswith(".py"):
        path = Path(module_part).expanduser().absolute()
        if not path.is_file():
            raise ConfigError(f"factory file {path} does not exist")
        mod_name = f"_mmcache_factory_{xxhash.xxh3_64_hexdigest(str(path).encode())}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has one
            raise ConfigError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(module_part)


def load_factory(spec: str) -> LoadedEncoder:
    """Import ``"module:factory"`` (or ``"path/to/file.py:factory"``) and call ``factory()``.

    The factory returns the encoder (an ``nn.Module``), a tuple ``(encoder,
    preprocess)``, or a dict with ``"encoder"`` and optionally ``"preprocess"``,
    ``"name"``, ``"version"``, ``"output"``. This runs the factory's code: pass
    only specs you trust (it is what ``mmcache warm --features`` does).
    """
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ConfigError(
            f"a factory spec is 'module:function' or 'file.py:function', got {spec!r}"
        )
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise ConfigError(
            f"a factory spec is 'module:function' or 'file.py:function', got {spec!r}"
        )
    try:
        module = _import_target(module_part)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_part!r} for factory {spec!r}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{module_part!r} has no attribute {attr!r} (factory {spec!r})")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"factory {spec!r} is a {type(target).__name__}, not callable")
    result = target()
    if isinstance(result, Mapping):
        unknown = set(result) - _FACTORY_KEYS
        if unknown or "encoder" not in result:
            raise ConfigError(
                f"factory {spec!r} returned a dict with keys {sorted(result)}; it needs "
                f"'encoder' and may have {sorted(_FACTORY_KEYS - {'encoder'})}"
            )
        version = result.get("version")
        return LoadedEncoder(
            encoder=result["encoder"],
            preprocess=result.get("preprocess"),
            name=result.get("name"),
            version=None if version is None else str(version),
            output=result.get("output"),
        )
    if isinstance(result, tuple):
        if len(result) != 2:
            raise ConfigError(
                f"factory {spec!r} returned a tuple of {len(result)} items; "
                "expected (encoder, preprocess)"
            )
        return LoadedEncoder(encoder=result[0], preprocess=result[1])
    if not callable(result):
        raise ConfigError(f"factory {spec!r} returned a {type(result).__name__}, not an encoder")
    return LoadedEncoder(encoder=result)
