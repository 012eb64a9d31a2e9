"""InOrderBuilder (in-order assembly on two threads) and EpochGate (holds worker tasks back)."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from mmcache.loader.warm_epoch.assembler import InOrderBuilder
from mmcache.loader.warm_epoch.gate import EpochGate


def test_items_come_in_order_and_both_threads_build() -> None:
    fetched: list[int] = []
    builders: set[str] = set()

    def fetch(j: int) -> int:
        fetched.append(j)
        return j * 10

    def build(j: int, plan: int) -> tuple[int, int]:
        builders.add(threading.current_thread().name)
        time.sleep(0.002)  # a copy that releases the GIL
        return j, plan

    b: InOrderBuilder[int, tuple[int, int]] = InOrderBuilder(
        3, 40, fetch=fetch, build=build, ahead=2, name="helper"
    )
    got = [b.take() for _ in range(37)]
    assert got == [(j, j * 10) for j in range(3, 40)]
    assert fetched == list(range(3, 40))  # each fetched once, in order
    assert builders == {"helper", threading.current_thread().name}
    with pytest.raises(StopIteration):
        b.take()
    assert b.close(timeout=5)


def test_a_build_error_is_raised_at_its_item_and_not_before() -> None:
    def build(j: int, plan: int) -> int:
        if j == 4:
            raise ValueError("bad batch 4")
        return j

    b: InOrderBuilder[int, int] = InOrderBuilder(0, 10, fetch=lambda j: j, build=build, ahead=3)
    assert [b.take() for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="bad batch 4"):
        b.take()
    assert b.take() == 5  # later items are still there, in order
    assert b.close(timeout=5)


def test_a_fetch_error_stops_fetching() -> None:
    fetched: list[int] = []

    def fetch(j: int) -> int:
        fetched.append(j)
        if j == 2:
            raise OSError("source gone")
        return j

    b: InOrderBuilder[int, int] = InOrderBuilder(0, 10, fetch=fetch, build=lambda j, p: p, ahead=2)
    assert [b.take(), b.take()] == [0, 1]
    with pytest.raises(OSError, match="source gone"):
        b.take()
    time.sleep(0.05)
    assert fetched == [0, 1, 2]
    assert b.close(timeout=5)


def test_ahead_bounds_what_is_built_before_it_is_taken() -> None:
    started: list[int] = []
    b: InOrderBuilder[int, int] = InOrderBuilder(
        0, 100, fetch=lambda j: j, build=lambda j, p: started.append(j) or j, ahead=1
    )
    assert b.take() == 0
    time.sleep(0.05)  # the helper may build item 1, never 2
    assert max(started) <= 1
    assert b.close(timeout=5)
    with pytest.raises(RuntimeError, match="closed"):
        b.take()
    with pytest.raises(ValueError):
        InOrderBuilder(0, 1, fetch=lambda j: j, build=lambda j, p: p, ahead=0)


def _wait_and_report(gate: EpochGate, number: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put("ready")
    t0 = time.monotonic()
    gate.wait(number)
    out.put(time.monotonic() - t0)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_gate_holds_a_worker_until_opened(method: str) -> None:
    ctx = multiprocessing.get_context(method)
    gate = EpochGate(method)
    out = ctx.Queue()
    proc = ctx.Process(target=_wait_and_report, args=(gate, 2, out))
    proc.start()
    try:
        assert out.get(timeout=60) == "ready"
        gate.open_to(1)
        time.sleep(0.3)
        assert out.empty()  # 1 < 2: still held
        gate.open_to(2)
        waited = out.get(timeout=10)
        assert waited >= 0.25  # it was held until opened
        assert gate.value == 2
        gate.open_to(1)  # never closes again
        assert gate.value == 2
        assert gate.open_all() > 2
        gate.wait(3)  # open: returns at once
    finally:
        proc.join(10)
        if proc.is_alive():  # pragma: no cover - a hang is the failure
            proc.kill()
    assert proc.exitcode == 0


def test_a_shared_helper_serves_builders_one_after_another() -> None:
    from mmcache.loader.warm_epoch.assembler import AssemblerThread

    helper = AssemblerThread(name="shared-helper")
    builders: set[str] = set()

    def build(j: int, plan: int) -> int:
        builders.add(threading.current_thread().name)
        time.sleep(0.002)  # a copy that releases the GIL
        return plan

    threads_before = threading.active_count()
    for epoch in range(3):
        b: InOrderBuilder[int, int] = InOrderBuilder(
            0, 20, fetch=lambda j, e=epoch: 100 * e + j, build=build, ahead=2, helper=helper
        )
        assert [b.take() for _ in range(20)] == [100 * epoch + j for j in range(20)]
        assert b.close(timeout=5)
        with pytest.raises(RuntimeError, match="closed"):
            b._fetch(0)  # a closed builder keeps nothing its callables refer to
    assert "shared-helper" in builders  # the helper built some items
    assert threading.active_count() <= threads_before + 1  # one thread for all builders
    helper.close(timeout=5)
    assert threading.active_count() <= threads_before
    # A closed helper starts a new thread for the next builder.
    b = InOrderBuilder(0, 5, fetch=lambda j: j, build=build, ahead=1, helper=helper)
    assert [b.take() for _ in range(5)] == list(range(5))
    assert b.close(timeout=5)
    helper.close(timeout=5)


def _wait_slot(gate: EpochGate, number: int, slot: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(("ready", slot))
    gate.wait(number, slot=slot)
    out.put(("passed", slot))


def test_gate_wakes_each_sleeper_when_its_number_is_reached() -> None:
    """Two workers held at different numbers: opening the lower one releases only its
    waiter, and the other is still woken later (one wake-up cannot be taken by both)."""
    ctx = multiprocessing.get_context("fork")
    gate = EpochGate(ctx, slots=2)
    out = ctx.Queue()
    procs = [ctx.Process(target=_wait_slot, args=(gate, 1 + k, k, out)) for k in range(2)]
    for p in procs:
        p.start()
    try:
        assert sorted(out.get(timeout=60) for _ in range(2)) == [("ready", 0), ("ready", 1)]
        time.sleep(0.1)  # both asleep
        t0 = time.monotonic()
        gate.open_to(1)
        assert out.get(timeout=10) == ("passed", 0)
        assert time.monotonic() - t0 < 0.5  # woken, not found by the once-a-second check
        time.sleep(0.2)
        assert out.empty()  # slot 1 waits for 2
        t0 = time.monotonic()
        gate.open_to(2)
        assert out.get(timeout=10) == ("passed", 1)
        assert time.monotonic() - t0 < 0.5
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():  # pragma: no cover - a hang is the failure
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
