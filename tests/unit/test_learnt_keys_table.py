"""Learnt keys read from the node's key table (issue 41): the training process keeps one
byte per sample, not the 49 of a private copy of every key and stamp."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mmcache.loader.tasks import STAMP_WORDS, BatchPlan
from mmcache.loader.warm_epoch import LearntKeys
from mmcache.sources import keytable

N = 200_000
BATCH = 1_000


def rss_anon() -> int:
    """This process's resident anonymous memory, in bytes (``RssAnon``)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_keys_the_table_holds_take_no_private_row(tmp_path: Path) -> None:
    table = keytable.open_table(str(tmp_path), keytable.table_identity(["learnt"]), N, STAMP_WORDS)
    assert table is not None
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 256, size=(N, 16), dtype=np.uint8)
    stamps = rng.integers(1, 2**62, size=(N, STAMP_WORDS), dtype=np.int64)
    everyone = np.arange(N, dtype=np.int64)
    table.store(everyone, keys, stamps)  # what the workers wrote as they keyed
    young = everyone[:BATCH]  # keys the table does not hold (a file changed just now)
    stamps_now = stamps.copy()
    stamps_now[young, 1] += 1
    learnt = LearntKeys(N, table)
    plans = [
        BatchPlan(b, keys[b], np.ones(len(b), dtype=bool), [], stamps_now[b])
        for b in np.array_split(everyone, N // BATCH)
    ]
    before = rss_anon()
    for plan in plans:
        learnt.learn(plan)
    grown = rss_anon() - before
    assert learnt.count() == N
    # One byte per sample and the pages of the young batch's own rows: a private copy
    # of every key and stamp was 49 bytes per sample (9.8 MB here).
    assert grown < 8 * N, f"{grown / N:.1f} B per sample"
    for b in (young, everyone[-BATCH:], rng.permutation(N)[:BATCH]):
        plan = learnt.guess(b, 3)
        assert plan is not None
        assert np.array_equal(plan.keys, keys[b]) and np.array_equal(plan.stamps, stamps_now[b])


def test_a_row_that_no_longer_verifies_fails_the_guess(tmp_path: Path) -> None:
    table = keytable.open_table(str(tmp_path), keytable.table_identity(["torn"]), 10, STAMP_WORDS)
    assert table is not None
    idx = np.arange(10, dtype=np.int64)
    keys = np.full((10, 16), 7, dtype=np.uint8)
    stamps = np.full((10, STAMP_WORDS), 5, dtype=np.int64)
    table.store(idx, keys, stamps)
    learnt = LearntKeys(10, table)
    learnt.learn(BatchPlan(idx, keys, np.ones(10, dtype=bool), [], stamps))
    assert learnt.guess(idx, 1) is not None
    with open(table.path, "r+b") as f:  # row 4's key torn: its old check stays
        f.seek(keytable.HEADER + 4 * 8 * (3 + STAMP_WORDS))
        f.write(b"\x08")
    assert learnt.guess(idx, 1) is None
    assert learnt.guess(idx[:4], 1) is not None
