"""SharedTier passes the store contract where it applies (``bounded = False``: no budget
tests) and the dict-model state machine, on a local folder."""

from __future__ import annotations

import glob
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from hypothesis import settings

from mmcache.shared import SharedTier
from mmcache.stores.base import Store
from mmcache.stores.tiered import Tier, TieredStore
from mmcache.testing.store_contract import StoreContract, _decoded, _entry, flip_in_files
from mmcache.testing.store_machine import make_store_machine


def _files(store: SharedTier) -> list[str]:
    """Where an entry's bytes may lie: the spools of open packs and the share's packs."""
    share = store.url.removeprefix("file://")
    return glob.glob(f"{store.spool_dir}/mmcache-pack-*") + glob.glob(f"{share}/packs/*.pack")


class TestSharedTierContract(StoreContract):
    __test__ = True

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path

    def make_store(self, capacity: int, policy: str = "lru") -> Store:
        folder = self.root / uuid.uuid4().hex
        return SharedTier(folder / "share", linger=0, spool_dir=folder / "spool")

    def reopen(self, store: Store) -> Store | None:
        assert isinstance(store, SharedTier)
        store.close()
        return SharedTier(store.url, linger=0, spool_dir=store.spool_dir)

    def flip_stored_byte(self, store: Store, k: bytes, value: bytes) -> bool:
        assert isinstance(store, SharedTier)
        flip_in_files(_files(store), value[len(value) // 2 - 200 :][:400])
        return True

    def test_a_flipped_byte_in_a_committed_pack_is_never_served(self) -> None:
        """The contract flips the open pack's spool; here a committed pack, read by
        another handle (another node), is flipped."""
        store = self._store(1 << 20)
        assert isinstance(store, SharedTier)
        value = _entry(7)
        assert store.put(bytes(16), value)
        store.commit()
        assert not glob.glob(f"{store.spool_dir}/mmcache-pack-*")  # published: spool gone
        self.flip_stored_byte(store, bytes(16), value)
        other = SharedTier(store.url, linger=0, spool_dir=store.spool_dir)
        self._made.append(other)
        assert other.contains(bytes(16))
        assert TieredStore([Tier(other)]).lookup(bytes(16), _decoded) is None
        assert not other.contains(bytes(16)) and other.stats().corrupt == 1


def _machine_store(capacity: int) -> SharedTier:
    folder = tempfile.mkdtemp(prefix="mmcache-machine-")
    return SharedTier(f"{folder}/share", linger=0, spool_dir=f"{folder}/spool")


def _machine_teardown(store: Store) -> None:
    assert isinstance(store, SharedTier)
    store.close()
    shutil.rmtree(Path(store.url.removeprefix("file://")).parent)


TestSharedTierMachine = make_store_machine(_machine_store, 200, teardown=_machine_teardown).TestCase
TestSharedTierMachine.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)
