"""``load_factory``: import the user's encoder factory named by ``"module:function"``.

What ``mmcache warm --features module:factory`` and
:meth:`FeatureCache.from_factory` use to get an encoder (and its
preprocessing, pinned name/version, output selection) from user code;
:func:`load_callable`, the import itself, also loads ``warm --pipeline``'s function.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import xxhash

from mmcache.errors import ConfigError
from mmcache.features.encoder import Output

__all__ = ["LoadedEncoder", "load_callable", "load_factory"]


@dataclass(frozen=True)
class LoadedEncoder:
    """What :func:`load_factory` got from a factory: pass the fields to :class:`FeatureCache`."""

    encoder: Any
    preprocess: Callable[[torch.Tensor], Any] | None = None
    name: str | None = None
    version: str | None = None
    output: Output = None


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


def load_callable(spec: str, *, what: str = "factory") -> Callable[[], Any]:
    """The callable ``"module:function"`` (or ``"path/to/file.py:function"``) names.

    A ``.py`` path is imported as a module of its own (its folder need not be on
    ``sys.path``); a dotted ``function`` is followed attribute by attribute. ``what``
    names the spec in errors (``"factory"``, ``"pipeline"``). Importing runs the
    module's code: pass only specs you trust. Raises ConfigError.
    """
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ConfigError(f"a {what} spec is 'module:function' or 'file.py:function', got {spec!r}")
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise ConfigError(f"a {what} spec is 'module:function' or 'file.py:function', got {spec!r}")
    try:
        module = _import_target(module_part)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_part!r} for {what} {spec!r}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{module_part!r} has no attribute {attr!r} ({what} {spec!r})")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{what} {spec!r} is a {type(target).__name__}, not callable")
    return cast(Callable[[], Any], target)


def load_factory(spec: str) -> LoadedEncoder:
    """Import ``"module:factory"`` (or ``"path/to/file.py:factory"``) and call ``factory()``.

    The factory returns the encoder (an ``nn.Module``), a tuple ``(encoder,
    preprocess)``, or a dict with ``"encoder"`` and optionally ``"preprocess"``,
    ``"name"``, ``"version"``, ``"output"``. This runs the factory's code: pass
    only specs you trust (it is what ``mmcache warm --features`` does).
    """
    target = load_callable(spec, what="factory")
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
