"""The one read-through (:func:`mmcache.readthrough.read_through`) under the node's claims.

A claim is an open-file-description lock, so a second claim from this process (another
thread, as another process would) is excluded too: these tests hold a key's claim as
"another producer" and check what every read-through path does meanwhile.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from mmcache.cache import Cache
from mmcache.readthrough import read_through

KEY = b"r" * 16


def _sample(i: int) -> dict[str, np.ndarray]:
    return {"i": np.array([i], dtype=np.int64)}


def _publish_later(cache: Cache, delay: float) -> threading.Thread:
    """Hold ``KEY``'s claim as another producer would, put the sample, then release."""
    claims = cache.claims
    assert claims is not None
    claim = claims.acquire(KEY)
    assert claim is not None and claim.fd >= 0

    def finish() -> None:
        time.sleep(delay)
        cache.put(KEY, _sample(7))
        claim.release()

    thread = threading.Thread(target=finish)
    thread.start()
    return thread


def test_get_or_produce_waits_for_the_producer_and_takes_its_sample(cache_root: Path) -> None:
    calls: list[int] = []

    def produce() -> dict[str, np.ndarray]:
        calls.append(1)
        return _sample(1)

    with Cache(cache_root, memory="1MiB", disk=None, temporary=True) as cache:
        thread = _publish_later(cache, 0.3)
        got = cache.get_or_produce(KEY, produce)
        thread.join()
        assert calls == []  # produced once on the node: by the claim's holder
        assert got["i"].tolist() == [7]


def test_read_through_says_deferred_instead_of_waiting_and_waited_after(cache_root: Path) -> None:
    with Cache(cache_root, memory="1MiB", disk=None, temporary=True) as cache:
        thread = _publish_later(cache, 0.3)
        claims = cache.claims
        early = read_through(cache, KEY, lambda: _sample(1), claims=claims, wait=False)
        assert early.deferred and early.sample is None and not early.admitted
        later = read_through(cache, KEY, lambda: _sample(1), claims=claims, lookup=False)
        thread.join()
        assert later.waited and later.tier == "memory" and later.sample is not None
        assert later.sample["i"].tolist() == [7]
        # claimed at once and absent: produced here, admitted, the claim released
        other = b"s" * 16
        made = read_through(cache, other, lambda: _sample(2), claims=claims)
        assert not made.hit and made.admitted and not made.waited
        again = claims.acquire(other, wait=False)
        assert again is not None and again.fd >= 0
        again.release()
