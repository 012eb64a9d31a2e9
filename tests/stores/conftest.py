"""Fixtures shared by the memory store tests of this folder."""

from __future__ import annotations

import glob
import uuid
from collections.abc import Iterator

import pytest

from mmcache.stores.memory import store_dir, unlink_store


@pytest.fixture
def shm_name(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh memory store name (prefixed by the test module's), removed after the test,
    with a check that none of its files is left in /dev/shm."""
    prefix = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")[:12]
    name = f"t{prefix}-{uuid.uuid4().hex[:12]}"
    yield name
    unlink_store(name)
    assert glob.glob(f"{store_dir()}/mmcache-{glob.escape(name)}*") == []
