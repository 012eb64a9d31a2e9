"""Helpers of the reference tests: mmcache against the real open_clip, torchvision and trainers.

They run under the reference venv (``make reference``: ``.venv-ref``, built by
``make ref-env`` from ``tests/reference/requirements.txt``), which sets
``MMCACHE_REF_ENV=1``. Elsewhere (the core venv, whose CPU torch no torchvision on
the registry imports beside) each module is skipped with the reason; under
``MMCACHE_REF_ENV=1`` a missing library is an error, never a skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

IN_REF_ENV = os.environ.get("MMCACHE_REF_ENV") == "1"


def need(module: str) -> ModuleType:
    """``module`` imported, or the calling test module skipped (outside the reference env)."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # torchvision beside another torch build raises RuntimeError
        if IN_REF_ENV:
            raise
        pytest.skip(
            f"{module} is only in the reference env: run `make reference` ({exc})",
            allow_module_level=True,
        )
