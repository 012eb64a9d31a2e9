"""Processes started together: jobs that begin their work at one instant, as the jobs of a
sweep started by one script do (without a common start, process start-up on a busy machine
staggers them, and one that lags simply hits what the first one made).

:func:`run_together` starts ``k`` spawned processes of ``target(*args, barrier, out)``;
each puts ``"ready"`` on ``out`` once set up, then its result. When every one is ready the
start file is written, whole, naming an instant one second later; work that must begin
together (a pipeline stage) calls :func:`wait_for_start` first.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_together", "wait_for_start"]

#: The environment variable naming the start file (inherited by the jobs and their workers).
START_ENV = "MMCACHE_TEST_START_TOGETHER"


def wait_for_start() -> None:
    """Wait until the start file exists and the instant it names has come (at once
    outside :func:`run_together`: nothing to start together with)."""
    name = os.environ.get(START_ENV)
    if name is None:
        return
    start = Path(name)
    while not start.exists():
        time.sleep(0.005)
    at = float(start.read_text() or "0")
    if time.time() < at:
        time.sleep(at - time.time())


def run_together(
    target: Callable[..., None], args: tuple[Any, ...], k: int, start: Path, *, timeout: float = 300
) -> list[Any]:
    """The results of ``k`` processes of ``target`` started together (see the module)."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(k), ctx.Queue()
    before = os.environ.get(START_ENV)
    os.environ[START_ENV] = str(start)  # inherited by the jobs and their workers
    procs = [ctx.Process(target=target, args=(*args, barrier, out)) for _ in range(k)]
    try:
        for p in procs:
            p.start()
        assert [out.get(timeout=timeout) for _ in procs] == ["ready"] * k
        tmp = start.with_suffix(".tmp")
        tmp.write_text(str(time.time() + 1.0))
        tmp.rename(start)  # whole, at once
        results = [out.get(timeout=timeout) for _ in procs]
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(60)
                if p.is_alive():
                    p.kill()
        if before is None:
            del os.environ[START_ENV]
        else:
            os.environ[START_ENV] = before
    assert all(p.exitcode == 0 for p in procs)
    return results
