"""A full memory store decides on a sample of its residents, not all of them.

A store at its budget decides for every newcomer; the policy was given every published
entry (six gathered columns), which cost 0.08 s of CPU per put at 10^6 entries and
5.5 s at 2^25 (the index-cap study), so a cold epoch of a dataset larger than the
budget cost O(entries) per miss. Above ``POLICY_SAMPLE`` entries the policy now sees a
random sample of about that many; ``keep`` (never evicts) sees none. (Below
``EXACT_BELOW`` entries, 2^16, every resident is seen: the policies' exact orders.)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from mmcache.policies import LRUPolicy, Residents
from mmcache.stores.memory import MemoryStore
from mmcache.stores.memory import table as table_mod

SAMPLE = 64


class Spy(LRUPolicy):
    """LRU that records how many residents each decision saw."""

    name = "spy-lru"

    def __init__(self) -> None:
        self.seen: list[int] = []

    def select_victims(
        self, residents: Residents, *, size: int, cost: float, need: int
    ) -> np.ndarray | None:
        self.seen.append(len(residents))
        return super().select_victims(residents, size=size, cost=cost, need=need)


@pytest.fixture
def small_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(table_mod, "POLICY_SAMPLE", SAMPLE, raising=False)
    monkeypatch.setattr(table_mod, "EXACT_BELOW", SAMPLE, raising=False)


@pytest.fixture
def full_store(shm_name: str) -> Iterator[tuple[MemoryStore, Spy]]:
    spy = Spy()
    store = MemoryStore(shm_name, capacity=200 * 100, policy=spy)
    try:
        for i in range(200):  # 200 entries of 100 B: the budget, exactly
            store.put(i.to_bytes(16, "big"), bytes([i % 251]) * 100)
        spy.seen.clear()
        yield store, spy
    finally:
        store.close()


def test_a_full_store_decides_on_a_sample(
    small_sample: None, full_store: tuple[MemoryStore, Spy]
) -> None:
    store, spy = full_store
    for i in range(200, 260):
        assert store.put(i.to_bytes(16, "big"), bytes([7]) * 100)
    assert spy.seen and max(spy.seen) <= 2 * SAMPLE < 200, spy.seen
    assert store.get((259).to_bytes(16, "big")) == bytes([7]) * 100
    assert len(store) <= 200


def test_a_newcomer_larger_than_the_sample_frees_sees_every_entry(
    small_sample: None, full_store: tuple[MemoryStore, Spy]
) -> None:
    store, spy = full_store
    big = bytes([9]) * (150 * 100)  # more bytes than any sample of 2 x 64 rows holds
    assert store.put(b"b" * 16, big)
    assert spy.seen[-1] >= 150, spy.seen
    assert store.get(b"b" * 16) == big


def test_keep_reads_no_residents(
    shm_name: str, small_sample: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = table_mod.EntryTable.residents

    def counted(self: table_mod.EntryTable, *args: object, **kw: object) -> object:
        calls.append(1)
        return real(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(table_mod.EntryTable, "residents", counted)
    store = MemoryStore(shm_name, capacity=100 * 100, policy="keep")
    try:
        for i in range(150):
            store.put(i.to_bytes(16, "big"), bytes([1]) * 100)
        assert len(store) == 100
        assert calls == []
    finally:
        store.close()
