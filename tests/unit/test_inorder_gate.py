"""InOrderBuilder (in-order assembly on two threads) and Gate (holds worker tasks back)."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from mmcache.gate import Gate
from mmcache.inorder import InOrderBuilder


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


def _wait_and_report(gate: Gate, number: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put("ready")
    t0 = time.monotonic()
    gate.wait(number)
    out.put(time.monotonic() - t0)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_gate_holds_a_worker_until_opened(method: str) -> None:
    ctx = multiprocessing.get_context(method)
    gate = Gate(method)
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
