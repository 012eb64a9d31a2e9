"""A tiny dict-based reference store passes the contract and the state machine.

This proves the suite is consistent (every rule can be met by a plain dict
with a byte budget and a policy) and shows the smallest correct store.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from hypothesis import settings

from mmcache.policies import Residents, get_policy
from mmcache.stats import TierStats
from mmcache.stores.base import EntryInfo, Store, check_key
from mmcache.testing.store_contract import StoreContract
from mmcache.testing.store_machine import make_store_machine


class DictStore(Store):
    """Entries in a dict; metadata as lists [size, cost, ctime, atime, hits, seq]."""

    name = "dict"

    def __init__(self, capacity: int, policy: str = "lru") -> None:
        self._cap = capacity
        self._policy = get_policy(policy)
        self._data: dict[bytes, bytes] = {}
        self._meta: dict[bytes, list[float]] = {}
        self._seq = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "puts", "admitted", "refused", "evictions", "expired"), 0
        )

    def get(self, key: bytes) -> bytes | None:
        value = self._data.get(check_key(key))
        self._counts["hits" if value is not None else "misses"] += 1
        if value is not None:
            self._meta[key][3] = time.monotonic()
            self._meta[key][4] += 1
        return value

    def put(
        self, key: bytes, value: bytes | memoryview, *, cost: float = 0.0, ctime: float = 0.0
    ) -> bool:
        check_key(key)
        value = bytes(value)
        self._counts["puts"] += 1
        self.delete(key)  # a new value makes the old one stale, admitted or not
        need = len(value) - (self._cap - self.nbytes())
        victims: list[bytes] | None = []
        if len(value) > self._cap:
            victims = None
        elif need > 0:
            keys = list(self._meta)
            cols = list(zip(*self._meta.values(), strict=True))
            residents = Residents.from_columns(
                size=cols[0], cost=cols[1], ctime=cols[2], atime=cols[3], hits=cols[4], seq=cols[5]
            )
            rows = self._policy.select_victims(residents, size=len(value), cost=cost, need=need)
            victims = None if rows is None else [keys[i] for i in rows]
        if victims is None:
            self._counts["refused"] += 1
            return False
        for victim in victims:
            self.delete(victim)
        self._counts["evictions"] += len(victims)
        self._data[key] = value
        self._meta[key] = [len(value), cost, ctime, time.monotonic(), 0, self._seq]
        self._seq += 1
        self._counts["admitted"] += 1
        return True

    def delete(self, key: bytes) -> bool:
        self._meta.pop(check_key(key), None)
        return self._data.pop(key, None) is not None

    def contains(self, key: bytes) -> bool:
        return check_key(key) in self._data

    def info(self, key: bytes) -> EntryInfo | None:
        m = self._meta.get(check_key(key))
        return None if m is None else EntryInfo(int(m[0]), m[1], m[2], m[3], int(m[4]))

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._data))

    def nbytes(self) -> int:
        return sum(len(v) for v in self._data.values())

    def capacity(self) -> int:
        return self._cap

    def stats(self) -> TierStats:
        return TierStats(
            **self._counts, bytes=self.nbytes(), budget=self._cap, items=len(self._data)
        )

    def expire(self, before: float) -> int:
        old = [k for k, m in self._meta.items() if m[2] < before]
        for k in old:
            self.delete(k)
        self._counts["expired"] += len(old)
        return len(old)

    def close(self) -> None:
        pass


class TestDictStoreContract(StoreContract):
    __test__ = True

    def make_store(self, capacity: int, policy: str = "lru") -> Store:
        return DictStore(capacity, policy)


TestDictStoreMachine = make_store_machine(lambda cap: DictStore(cap, "lru"), 200).TestCase
TestDictStoreMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
