"""DiskStore passes the store contract and the dict-model state machine."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from hypothesis import settings

from mmcache.stores.base import Store
from mmcache.stores.disk import DiskStore
from mmcache.testing.store_contract import StoreContract, flip_in_files
from mmcache.testing.store_machine import make_store_machine


class TestDiskStoreContract(StoreContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path

    def make_store(self, capacity: int, policy: str = "lru") -> Store:
        return DiskStore(self.root / uuid.uuid4().hex, capacity=capacity, policy=policy)

    def reopen(self, store: Store) -> Store | None:
        assert isinstance(store, DiskStore)
        store.close()
        return DiskStore(store.path, capacity=store.capacity(), policy=store.policy)

    def flip_stored_byte(self, store: Store, k: bytes, value: bytes) -> bool:
        assert isinstance(store, DiskStore)
        needle = value[len(value) // 2 - 200 :][:400]
        flip_in_files([str(Path(store.path) / "data.mdb")], needle)
        return True


def _machine_store(capacity: int) -> DiskStore:
    return DiskStore(tempfile.mkdtemp(prefix="mmcache-machine-"), capacity=capacity, policy="lru")


def _machine_teardown(store: Store) -> None:
    assert isinstance(store, DiskStore)
    store.close()
    shutil.rmtree(store.path)


TestDiskStoreMachine = make_store_machine(_machine_store, 200, teardown=_machine_teardown).TestCase
TestDiskStoreMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
