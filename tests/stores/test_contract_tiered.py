"""TieredStore passes the store contract and the dict-model state machine, over the
cache's own tiers: a node-shared memory tier in front of an LMDB disk tier.

The memory tier gets a quarter of the budget (in the cache it is the smaller
tier), so entries live in both tiers, in the disk tier only, and, after the
disk tier evicted them, in the memory tier only: the Store face (the disk tier,
the store of record) must stay right in all three cases.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from mmcache.stores.base import Store
from mmcache.stores.disk import DiskStore
from mmcache.stores.memory import MemoryStore, unlink_store
from mmcache.stores.tiered import Tier, TieredStore
from mmcache.testing.store_contract import StoreContract, flip_in_files
from mmcache.testing.store_machine import make_store_machine


def _tiered(name: str, path: Path | str, capacity: int, policy: str) -> TieredStore:
    memory = MemoryStore(name, capacity=max(capacity // 4, 1), policy=policy)
    disk = DiskStore(path, capacity=capacity, policy=policy)
    return TieredStore([Tier(memory), Tier(disk, deferred=True)])  # every read checked


class TestTieredStoreContract(StoreContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path) -> Iterator[None]:
        self.root = tmp_path
        self.prefix = f"ttier-{uuid.uuid4().hex[:12]}"
        self.names: list[str] = []
        yield
        for name in self.names:
            unlink_store(name)

    def make_store(self, capacity: int, policy: str = "lru") -> Store:
        name = f"{self.prefix}-{len(self.names)}"
        self.names.append(name)
        return _tiered(name, self.root / uuid.uuid4().hex, capacity, policy)

    def reopen(self, store: Store) -> Store | None:
        assert isinstance(store, TieredStore)
        memory, disk = store.tiers
        assert isinstance(memory, MemoryStore) and isinstance(disk, DiskStore)
        store.close()
        return TieredStore(
            [
                Tier(
                    MemoryStore(memory.shm_name, capacity=memory.capacity(), policy=memory.policy)
                ),
                Tier(DiskStore(disk.path, capacity=disk.capacity(), policy=disk.policy)),
            ]
        )

    def flip_stored_byte(self, store: Store, k: bytes, value: bytes) -> bool:
        """The same byte flipped in both tiers: neither copy may be served."""
        assert isinstance(store, TieredStore)
        memory, disk = store.tiers
        assert isinstance(memory, MemoryStore) and isinstance(disk, DiskStore)
        needle = value[len(value) // 2 - 200 :][:400]
        flip_in_files(memory.segment_paths(), needle)
        flip_in_files([str(Path(disk.path) / "data.mdb")], needle)
        return True


def _machine_store(capacity: int) -> TieredStore:
    return _tiered(
        f"ttier-m-{uuid.uuid4().hex[:12]}",
        tempfile.mkdtemp(prefix="mmcache-tiered-machine-"),
        capacity,
        "lru",
    )


def _machine_teardown(store: Store) -> None:
    assert isinstance(store, TieredStore)
    memory, disk = store.tiers
    assert isinstance(memory, MemoryStore) and isinstance(disk, DiskStore)
    assert memory.check() == []
    path = disk.path
    memory.unlink()
    store.close()
    shutil.rmtree(path)


TestTieredStoreMachine = make_store_machine(
    _machine_store, 200, teardown=_machine_teardown
).TestCase
TestTieredStoreMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
