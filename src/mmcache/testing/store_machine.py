"""A Hypothesis state machine that checks a store against a dict under a byte budget.

The model is a dict of everything put and not deleted (key -> last value put).
A store may hold fewer keys than the model (it evicts and refuses), but never a
key that was deleted or expired, never a value other than the last one put, and
never more bytes than its capacity. After every step the machine checks:

* ``nbytes() <= capacity()`` (for a store with a budget: ``Store.bounded``);
* ``set(keys())`` equals the keys for which ``contains()`` is true, and is a
  subset of the model's keys;
* every present key reads back (through ``view``) as the model's last value,
  and ``info().size`` is its length;
* ``nbytes()`` equals the sum of the sizes present (no orphaned bytes) and
  ``len()`` the number of keys present;
* ``puts``, ``admitted`` and ``refused`` count every put.

>>> import tempfile, uuid
>>> from mmcache.stores.disk import DiskStore
>>> root = tempfile.mkdtemp()
>>> Machine = make_store_machine(
...     lambda cap: DiskStore(f"{root}/{uuid.uuid4().hex}", capacity=cap, policy="lru"), 256
... )
>>> TestDisk = Machine.TestCase  # collected by pytest/unittest
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mmcache.stores.base import KEY_SIZE, Store

__all__ = ["make_store_machine"]

#: A small key pool so that overwrites, deletes of present keys and evictions are common.
_POOL = [bytes([i]) * KEY_SIZE for i in range(6)]


def make_store_machine(
    factory: Callable[[int], Store],
    capacity: int,
    *,
    teardown: Callable[[Store], None] | None = None,
) -> type[RuleBasedStateMachine]:
    """Return a state machine class testing stores made by ``factory(capacity)``.

    ``factory`` must return a new, empty store with that byte budget and an
    evicting policy (``"lru"``), so that eviction happens. ``teardown`` (default:
    ``store.close()``) runs after each example. Run it through the class's
    ``TestCase`` attribute; set ``.settings`` there to size the run.
    """
    if capacity < 8:
        raise ValueError(f"capacity must be >= 8 bytes for a useful run, got {capacity}")
    keys = st.sampled_from(_POOL)
    values = st.binary(max_size=max(1, capacity // 3))
    costs = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
    finish = teardown if teardown is not None else Store.close

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.store = factory(capacity)
            self.model: dict[bytes, bytes] = {}
            self.ctime: dict[bytes, float] = {}
            self.clock = 0.0
            self.puts = 0
            self.admitted = 0

        def _put(self, k: bytes, value: bytes, cost: float) -> bool:
            self.clock += 1.0
            ok = self.store.put(k, value, cost=cost, ctime=self.clock)
            self.puts += 1
            self.admitted += int(ok)
            self.model[k] = value
            self.ctime[k] = self.clock
            return ok

        @rule(k=keys, value=values, cost=costs)
        def put(self, k: bytes, value: bytes, cost: float) -> None:
            if self._put(k, value, cost):
                with self.store.view(k) as buf:
                    assert buf is not None, "an admitted put is not readable"
                    assert bytes(buf) == value

        @rule(k=keys, extra=st.integers(min_value=1, max_value=8))
        def put_oversize(self, k: bytes, extra: int) -> None:
            if not self.store.bounded:  # no budget to be over (the shared tier)
                return
            assert not self._put(k, bytes(capacity + extra), 0.0)
            assert not self.store.contains(k)

        @rule()
        def commit(self) -> None:
            self.store.commit()  # the shared tier publishes its open pack; others: nothing

        @rule(k=keys)
        def get(self, k: bytes) -> None:
            value = self.store.get(k)
            if value is not None:
                assert isinstance(value, bytes)
                assert k in self.model, "a deleted key is still readable"
                assert value == self.model[k], "a stale value was served"

        @rule(k=keys)
        def delete(self, k: bytes) -> None:
            present = self.store.contains(k)
            assert self.store.delete(k) == present
            self.model.pop(k, None)
            assert not self.store.contains(k)

        @rule(k=keys)
        def contains(self, k: bytes) -> None:
            if self.store.contains(k):
                assert k in self.model

        @rule(back=st.integers(min_value=0, max_value=12))
        def expire(self, back: int) -> None:
            before = self.clock + 1.0 - back
            old = {k for k in self.model if self.ctime[k] < before}
            present_old = {k for k in old if self.store.contains(k)}
            assert self.store.expire(before) == len(present_old)
            for k in old:
                del self.model[k]
                assert not self.store.contains(k)

        @invariant()
        def within_budget(self) -> None:
            if self.store.bounded:
                assert self.store.nbytes() <= self.store.capacity() == capacity

        @invariant()
        def agrees_with_model(self) -> None:
            present = {k for k in _POOL if self.store.contains(k)}
            assert set(self.store.keys()) == present
            assert present <= self.model.keys(), "a deleted or expired key is present"
            for k in present:
                with self.store.view(k) as buf:
                    assert buf is not None
                    assert bytes(buf) == self.model[k], "a stale value is held"
                info = self.store.info(k)
                assert info is not None
                assert info.size == len(self.model[k])
            assert self.store.nbytes() == sum(len(self.model[k]) for k in present)
            assert len(self.store) == len(present)

        @invariant()
        def counts_puts(self) -> None:
            stats = self.store.stats()
            assert (stats.puts, stats.admitted) == (self.puts, self.admitted)
            assert stats.refused == self.puts - self.admitted

        def teardown(self) -> None:
            finish(self.store)

    StoreMachine.__name__ = StoreMachine.__qualname__ = "StoreMachine"
    return StoreMachine
