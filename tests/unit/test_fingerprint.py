"""transforms.fingerprint: callables hashed by content, as preprocess functions are, without torch.

The feature tests (test_features.py) cover encoders and preprocess functions in
depth; these check what a user stage relies on: ``callable_fingerprint`` itself,
that it agrees with ``preprocess_fingerprint``, and that fingerprinting plain
Python code never needs torch.
"""

from __future__ import annotations

import doctest
import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mmcache.transforms
from mmcache.errors import ConfigError
from mmcache.features import preprocess_fingerprint as features_preprocess_fingerprint
from mmcache.transforms import fingerprint
from mmcache.transforms.fingerprint import (
    WeightWatch,
    callable_fingerprint,
    encoder_fingerprint,
    preprocess_fingerprint,
)

SCALE = 3.0


def _scaled(x: Any, k: float = 2.0) -> Any:
    return x * k * SCALE


def _make(offset: Any) -> Any:
    return lambda x: x + offset


class _Opaque:
    __slots__ = ()


class _Callable:
    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, x: Any) -> Any:
        return x * self.k


def test_callable_fingerprint_follows_content() -> None:
    assert callable_fingerprint(_scaled) == callable_fingerprint(_scaled)
    assert callable_fingerprint(_make(1.0)) == callable_fingerprint(_make(1.0))
    assert callable_fingerprint(_make(1.0)) != callable_fingerprint(_make(2.0))
    part = functools.partial(_scaled, k=3.0)
    assert callable_fingerprint(part) != callable_fingerprint(functools.partial(_scaled, k=4.0))
    assert callable_fingerprint(_Callable(2)) != callable_fingerprint(_Callable(3))
    arr = np.arange(4)
    assert callable_fingerprint(_make(arr)) == callable_fingerprint(_make(arr.copy()))
    assert callable_fingerprint(_make(arr)) != callable_fingerprint(_make(arr + 1))
    assert callable_fingerprint(np.sqrt) != callable_fingerprint(np.exp)  # library code by name


def test_callable_fingerprint_equals_preprocess_fingerprint() -> None:
    for fn in (_scaled, _make(1.0), functools.partial(_scaled, k=3.0), _Callable(2), len):
        assert callable_fingerprint(fn) == preprocess_fingerprint(fn)
    assert features_preprocess_fingerprint is preprocess_fingerprint  # one implementation


def test_callable_fingerprint_refuses_what_it_cannot_hash() -> None:
    opaque = _Opaque()
    with pytest.raises(ConfigError, match="version"):
        callable_fingerprint(lambda x: x if opaque is not None else -x)
    with pytest.raises(ConfigError, match="needs a callable"):
        callable_fingerprint(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"nn\.Module"):
        encoder_fingerprint(_scaled)  # type: ignore[arg-type]
    assert not WeightWatch(_scaled).changed()  # not a module: nothing to watch


def test_fingerprint_docstring_examples() -> None:
    result = doctest.testmod(fingerprint)
    assert result.failed == 0 and result.attempted > 0


_WITHOUT_TORCH = """
import importlib.abc, sys, types

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")

sys.meta_path.insert(0, Block())
# Stand-ins for the package __init__ modules (mmcache's imports torch for the loader):
# only transforms/fingerprint.py and what it imports are loaded from {src!r}.
for pkg in ("mmcache", "mmcache.transforms", "mmcache.stores"):
    mod = types.ModuleType(pkg)
    mod.__path__ = [{src!r} + "/" + pkg.replace(".", "/")]
    sys.modules[pkg] = mod
from mmcache.transforms.fingerprint import callable_fingerprint, preprocess_fingerprint

K = 2
def f(x, k=3):
    return x * K + k
assert callable_fingerprint(f) == preprocess_fingerprint(f)
print(callable_fingerprint(f))
assert "torch" not in sys.modules
"""


def test_fingerprinting_plain_code_never_imports_torch() -> None:
    src = str(Path(mmcache.transforms.__file__).parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH.format(src=src)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) == 32
