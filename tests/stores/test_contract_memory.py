"""MemoryStore passes the store contract and the dict-model state machine."""

from __future__ import annotations

import glob
import uuid
from collections.abc import Iterator
from unittest import mock

import pytest
from hypothesis import settings

from mmcache.stores.base import Store
from mmcache.stores.memory import MemoryStore, layout, store_dir, unlink_store
from mmcache.testing.store_contract import StoreContract, flip_in_files
from mmcache.testing.store_machine import make_store_machine


class TestMemoryStoreContract(StoreContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _names(self) -> Iterator[None]:
        prefix = f"tmemc-{uuid.uuid4().hex[:12]}"
        self.prefix = prefix
        self.names: list[str] = []
        yield
        for name in self.names:
            unlink_store(name)
        assert glob.glob(f"{store_dir()}/mmcache-{prefix}-*") == []

    def make_store(self, capacity: int, policy: str = "lru") -> Store:
        name = f"{self.prefix}-{len(self.names)}"
        self.names.append(name)
        return MemoryStore(name, capacity=capacity, policy=policy)

    def reopen(self, store: Store) -> Store | None:
        assert isinstance(store, MemoryStore)
        store.close()  # the segments stay in /dev/shm: a later process finds the entries
        return MemoryStore(store.shm_name, capacity=store.capacity(), policy=store.policy)

    def flip_stored_byte(self, store: Store, k: bytes, value: bytes) -> bool:
        assert isinstance(store, MemoryStore)
        flip_in_files(store.segment_paths(), value[len(value) // 2 - 200 :][:400])
        return True


def _machine_store(capacity: int) -> MemoryStore:
    return MemoryStore(f"tmemc-m-{uuid.uuid4().hex[:12]}", capacity=capacity, policy="lru")


def _machine_teardown(store: Store) -> None:
    assert isinstance(store, MemoryStore)
    assert store.check() == []
    store.unlink()


TestMemoryStoreMachine = make_store_machine(
    _machine_store, 200, teardown=_machine_teardown
).TestCase
TestMemoryStoreMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def _growing_store(capacity: int) -> MemoryStore:
    """A store whose index starts at one entry and grows (F13) up to 3 (capacity / 64 B),
    as the machine's six keys arrive: every grow, and the evictions of a full index at
    its maximum."""
    with mock.patch.object(layout, "MIN_INDEX_CAPACITY", 1):
        name = f"tmemc-g-{uuid.uuid4().hex[:12]}"
        store = MemoryStore(name, capacity=capacity, policy="lru")
    assert store.index_entries == 1 and store.index_capacity == 3
    return store


def _growing_teardown(store: Store) -> None:
    assert isinstance(store, MemoryStore)
    assert store.check() == [] and 1 <= store.index_entries <= 3
    assert len(glob.glob(f"{store_dir()}/mmcache-{store.shm_name}-i*")) == 1
    store.unlink()


TestGrowingMemoryStoreMachine = make_store_machine(
    _growing_store, 200, teardown=_growing_teardown
).TestCase
TestGrowingMemoryStoreMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
