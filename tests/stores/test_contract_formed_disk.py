"""FormedDiskStore passes the store contract (with a size-preserving test form)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from mmcache.stores.base import Store
from mmcache.stores.disk.formed import FormedDiskStore
from mmcache.testing.store_contract import StoreContract, flip_in_files


class XorForm:
    """Flips every bit: stored bytes differ from the values, sizes do not."""

    def pack(self, raw: bytes | memoryview) -> bytes:
        return bytes(b ^ 0xFF for b in bytes(raw))

    def unpack(self, stored: bytes | memoryview, *, limit: int | None = None) -> bytes:
        return bytes(b ^ 0xFF for b in bytes(stored))


class TestFormedDiskStoreContract(StoreContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path

    def make_store(self, capacity: int, policy: str = "lru") -> Store:
        path = self.root / uuid.uuid4().hex
        return FormedDiskStore(path, form=XorForm(), capacity=capacity, policy=policy)

    def reopen(self, store: Store) -> Store | None:
        assert isinstance(store, FormedDiskStore)
        store.close()
        return FormedDiskStore(
            store.path, form=XorForm(), capacity=store.capacity(), policy=store.policy
        )

    def flip_stored_byte(self, store: Store, k: bytes, value: bytes) -> bool:
        assert isinstance(store, FormedDiskStore)
        stored = XorForm().pack(value[len(value) // 2 - 200 :][:400])  # as the file holds it
        flip_in_files([str(Path(store.path) / "data.mdb")], stored)
        return True


def test_values_are_stored_in_their_form(tmp_path: Path) -> None:
    import lmdb

    with FormedDiskStore(tmp_path / "d", form=XorForm(), capacity="1MiB") as store:
        store.put(bytes(16), b"hello")
        assert store.get(bytes(16)) == b"hello"
        with store.view(bytes(16)) as v:
            assert v is not None and bytes(v) == b"hello"
    env = lmdb.open(str(tmp_path / "d"), max_dbs=8, readonly=True, lock=False)
    with env.begin() as txn:
        db = env.open_db(b"data", txn=txn)
        assert txn.get(bytes(16), db=db) == XorForm().pack(b"hello")
    env.close()
