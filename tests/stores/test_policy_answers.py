"""Every tier reacts the same way to what a policy answers (``policies.validate_victims``).

A policy is user code: it may free too little (refused, the budget holds), name a row
twice (counted once), or name rows that do not exist (a ConfigError naming the policy,
never the eviction of a wrong entry). The memory, disk and device tiers used to check
the answer three different ways.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache.errors import ConfigError
from mmcache.policies import Policy, Residents
from mmcache.stores.device import DeviceTier
from mmcache.stores.disk import DiskStore
from mmcache.stores.memory import MemoryStore, unlink_store


class Answer(Policy):
    """Answers ``rows`` whatever is asked."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def select_victims(self, residents: Residents, *, size: int, cost: float, need: int) -> Any:
        return np.array(self.rows, dtype=np.int64)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture(params=["memory", "disk", "device"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[Policy], Any]]:
    opened: list[Any] = []
    names: list[str] = []

    def make(policy: Policy) -> Any:
        if request.param == "memory":
            name = f"tpol-{uuid.uuid4().hex[:10]}"
            names.append(name)
            t: Any = MemoryStore(name, capacity=4000, policy=policy)
        elif request.param == "disk":
            t = DiskStore(tmp_path / f"d{len(opened)}", capacity=4000, policy=policy)
        else:
            t = DeviceTier(4000, policy=policy)
        opened.append(t)
        return t

    yield make
    for t in opened:
        close = getattr(t, "close", None)
        if close is not None:
            close()
    for name in names:
        unlink_store(name)


def _put(t: Any, i: int, n: int) -> bool:
    if isinstance(t, DeviceTier):
        return t.put(key(i), torch.zeros(n, dtype=torch.uint8))
    return bool(t.put(key(i), bytes([i % 256]) * n))


def _fill(t: Any) -> None:
    for i in range(4):
        assert _put(t, i, 1000)


def test_too_little_freed_is_refused_and_the_budget_holds(tier: Callable[[Policy], Any]) -> None:
    t = tier(Answer([0]))
    _fill(t)
    assert not _put(t, 10, 2500)  # one 1000-byte victim cannot make room for 2500
    assert t.nbytes() <= 4000


def test_a_row_given_twice_counts_once(tier: Callable[[Policy], Any]) -> None:
    t = tier(Answer([1, 1]))
    _fill(t)
    assert not _put(t, 10, 1500)  # rows [1, 1] free 1000 bytes, not 2000
    assert t.nbytes() <= 4000
    assert _put(t, 11, 1000)  # row 1 once is enough here
    assert t.nbytes() <= 4000


def test_rows_outside_the_residents_name_the_policy(tier: Callable[[Policy], Any]) -> None:
    t = tier(Answer([0, 99]))
    _fill(t)
    with pytest.raises(ConfigError, match="Answer"):
        _put(t, 10, 1000)
