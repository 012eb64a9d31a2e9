"""One preparation per node: processes that miss the same key at once decode it once.

The production claims (:mod:`mmcache.stores.claims`) are record locks on the memory tier's
lock file; these tests use them from real processes: a holder killed with ``kill -9``
never leaves a waiter waiting, a stopped one (SIGSTOP) is named and not waited for, a
running one is waited for then named, threads of one process exclude each other, and
three training jobs started together with the same order decode each sample about once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.stores.claims import Claims, claim_holders, process_state
from support.together import run_together, wait_for_start

KEY = b"k" * 16


def _holder(path: Path) -> subprocess.Popen[str]:
    """A process that claims KEY on ``path``, says so, and sleeps until killed."""
    code = (
        "import sys, time\n"
        "from mmcache.stores.claims import Claims\n"
        f"c = Claims({str(path)!r}).acquire({KEY!r})\n"
        "assert c is not None and c.fd >= 0\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_claim_held_by_another_process_is_waited_for_and_dies_with_it(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    path.touch()
    proc = _holder(path)
    try:
        short = Claims(str(path), timeout=0.3).acquire(KEY)
        assert short is not None and short.waited and short.fd == -1  # held: timed out
        other = Claims(str(path), timeout=0.3).acquire(b"x" * 16)  # another slot is free
        assert other is not None and other.fd >= 0 and not other.waited
        other.release()
        got: list[Any] = []
        waiter = threading.Thread(
            target=lambda: got.append(Claims(str(path), timeout=300).acquire(KEY))
        )
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive()  # still waiting while the holder lives
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        waiter.join(120)
        elapsed = time.monotonic() - t0
        assert not waiter.is_alive()
        claim = got[0]
        assert claim is not None and claim.fd >= 0 and claim.waited  # a real claim, not a pass
        assert elapsed < 300 / 5  # released by the kernel, not by the waiter's timeout
        claim.release()
    finally:
        proc.kill()
        proc.wait()


def test_a_stopped_holder_is_named_and_not_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 37, H10: a holder stopped (SIGSTOP, Ctrl-Z) is alive, so the kernel keeps its
    claim; waiters waited the whole 30 s timeout, with nothing logged."""
    path = tmp_path / "lock"
    path.touch()
    proc = _holder(path)
    try:
        # The holder has said it holds the claim; on a loaded machine it may still be
        # running (R) on its way to sleep: wait for it to sleep (S) before looking.
        deadline = time.monotonic() + 30
        while process_state(proc.pid) != "S" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert claim_holders(str(path), Claims.slot(KEY)) == [(proc.pid, "S")]
        os.kill(proc.pid, signal.SIGSTOP)
        caplog.set_level(logging.WARNING, logger="mmcache.stores.claims")
        t0 = time.monotonic()
        claim = Claims(str(path)).acquire(KEY)  # the default 30 s timeout
        waited = time.monotonic() - t0
        assert claim is not None and claim.fd == -1 and claim.waited  # a pass: produce it
        assert waited < 10, waited  # was the whole 30 s timeout
        (warning,) = [r.getMessage() for r in caplog.records]
        assert f"pid {proc.pid}" in warning and KEY.hex() in warning and "stopped" in warning
        # a running holder is waited for (not cut short), then named with the key
        os.kill(proc.pid, signal.SIGCONT)
        caplog.clear()
        t0 = time.monotonic()
        claim = Claims(str(path), timeout=1.5, notice=0.2).acquire(KEY)
        assert claim is not None and claim.fd == -1
        assert time.monotonic() - t0 >= 1.5
        (warning,) = [r.getMessage() for r in caplog.records]
        assert f"pid {proc.pid} (state S)" in warning and KEY.hex() in warning
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_threads_of_one_process_exclude_each_other(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    path.touch()
    claims = Claims(str(path), timeout=60)
    first = claims.acquire(KEY)
    assert first is not None and first.fd >= 0
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(claims.acquire(KEY)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()  # per open file description, not per process
    first.release()
    first.release()  # idempotent
    t.join(30)
    assert got and got[0].fd >= 0 and got[0].waited
    got[0].release()


def test_claims_need_an_existing_file(tmp_path: Path) -> None:
    assert Claims(str(tmp_path / "absent")).acquire(KEY) is None  # produce unclaimed


def _slow_image(im: Any) -> np.ndarray:
    """A decode-sized stage (30 ms a sample) that first waits for the common start: every
    job's workers begin their misses at one instant and stay in step
    (:mod:`support.together`)."""
    wait_for_start()
    time.sleep(0.03)
    return np.asarray(im.resize((64, 64)))


def _job(paths: tuple[str, str, str], claims: bool, barrier: Any, out: Any) -> None:
    """One training job: (manifest, tokenizer, cache root); reports its misses and batches."""
    import mmcache as mc
    from mmcache.cache import Cache

    if not claims:  # what main did: every job decodes what it misses
        Cache.claims = property(lambda self: None)  # type: ignore[assignment,method-assign]
    manifest, tokenizer, root = paths
    pipe = mc.Pipeline(
        image=mc.stage(_slow_image, version="1"), text=mc.TextSpec(tokenizer, max_length=16)
    )
    ds = mc.MultimodalDataset(manifest, pipeline=pipe)
    cache = Cache(root, memory="16MiB", disk=None, temporary=True)
    loader = mc.DataLoader(  # forked workers: they inherit the patch above
        ds,
        cache=cache,
        batch_size=8,
        shuffle=True,
        seed=0,
        num_workers=2,
        multiprocessing_context="fork",
    )
    batches = iter(loader)  # the workers start, and wait for the start file
    out.put("ready")
    digest = hashlib.sha256()
    for batch in batches:
        digest.update(np.asarray(batch["image"]).tobytes())
    out.put((loader.stats().epochs[0].misses, digest.hexdigest()))
    loader.close()
    barrier.wait(120)  # nobody closes the shared tier while another job still reads it
    cache.close()


def _sweep(tiny_data: Path, tokenizer_json: Path, root: Path, k: int, claims: bool) -> list[Any]:
    paths = (str(tiny_data), str(tokenizer_json), str(root))
    return run_together(_job, (paths, claims), k, root.parent / "start")


@pytest.mark.timeout(600)
def test_three_jobs_with_one_order_decode_each_sample_about_once(
    tiny_data: Path, tokenizer_json: Path, cache_root: Path
) -> None:
    n = 48
    results = _sweep(tiny_data, tokenizer_json, cache_root, 3, claims=True)
    print("decodes per job", [r[0] for r in results])
    decodes = sum(r[0] for r in results)
    assert decodes <= 1.1 * n, f"3 jobs decoded {decodes} samples of {n}"
    assert len({r[1] for r in results}) == 1  # every job got the same batches
