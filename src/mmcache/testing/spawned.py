"""A spawn-started worker process for the contract suites: what a spawn DataLoader worker sees.

Whatever is submitted to it (a source, a stage, their inputs) is pickled into a
fresh interpreter and the answer pickled back, by :mod:`multiprocessing`, exactly
as ``torch.utils.data.DataLoader(multiprocessing_context="spawn")`` does; the
suites compare the answers with the originals'. (The library itself never
unpickles anything: see ``tests/faults/test_security.py``.)
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

__all__ = ["spawned_worker"]


@contextlib.contextmanager
def spawned_worker() -> Iterator[ProcessPoolExecutor]:
    """One spawn-started worker process, shut down on exit."""
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
