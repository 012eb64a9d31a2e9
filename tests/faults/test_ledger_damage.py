"""A damaged identity ledger is rebuilt, once, with one warning (issue 37 H11).

Before, every new process met the damaged file, warned and kept its digests in memory, so
every job of the node read every file again, for ever. Now the first process to meet it
moves it aside (``<ledger>.damaged``) under an ``flock`` and starts an empty one; the
processes after it use the new file without a word. What the ledger refuses stays refused:
another user's file, a link, a folder not ours, a lock file planted as a link.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from mmcache import keys
from mmcache.errors import CacheError
from mmcache.sources import identity

OLD_NS = 1_600_000_000_000_000_000  # stamps long before any digest: every row vouches
ROWS = 3000


def _rows(n: int, salt: str = "d") -> list[identity.Learned]:
    return [
        (keys.digest("ev", i), keys.digest(salt, i), f"/data/{i}.jpg", (i, OLD_NS, OLD_NS, i), None)
        for i in range(n)
    ]


def _evs(rows: list[identity.Learned]) -> list[bytes]:
    return [row[0] for row in rows]


def _garbage(path: str) -> None:
    Path(path).write_bytes(b"not a database" * 1000)


def _truncated(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size // 2 + 100)  # mid-page


@pytest.fixture
def damaged(tmp_path: Path) -> str:
    """A ledger file of :data:`ROWS` rows, checkpointed (no WAL left), to be damaged."""
    where = str(tmp_path / "identity" / "l.sqlite")
    book = identity.Ledger(where)
    book.put_many(_rows(ROWS))
    assert book._conn is not None
    book._conn.close()  # the last connection: the WAL is folded in and removed
    assert not os.path.exists(where + "-wal")
    return where


def _is_database(path: str) -> bool:
    conn = sqlite3.connect(path)
    try:
        conn.execute("SELECT count(*) FROM digest").fetchone()
        return True
    except sqlite3.DatabaseError:
        return False
    finally:
        conn.close()


@pytest.mark.parametrize("damage", [_garbage, _truncated], ids=["garbage", "truncated"])
def test_a_damaged_ledger_is_rebuilt_once_with_one_warning(
    damaged: str, damage: object, caplog: pytest.LogCaptureFixture
) -> None:
    damage(damaged)  # type: ignore[operator]
    first = identity.Ledger(damaged)  # a new process meets the damage
    with caplog.at_level(logging.WARNING, logger=identity.__name__):
        assert first.get_many(_evs(_rows(ROWS))) == [None] * ROWS  # never a wrong digest
    assert [r.getMessage() for r in caplog.records if "was damaged" in r.getMessage()] != []
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    assert os.path.exists(damaged + ".damaged") and _is_database(damaged)
    assert not first._failed  # it goes on with the new file, not in memory
    first.put_many(_rows(10, "new"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=identity.__name__):
        later = identity.Ledger(damaged)  # the next process: no warning, the new rows
        assert later.get_many(_evs(_rows(10))) == [r[1] for r in _rows(10, "new")]
    assert caplog.records == [] and not later._failed


def _meet(path: str, start: Any, out: Any) -> None:
    """One process of :func:`test_processes_meeting_the_damage_at_once_rebuild_it_once`."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger(identity.__name__).addHandler(Keep(logging.WARNING))
    book = identity.Ledger(path)
    start.wait()
    book.get_many(_evs(_rows(50)))
    book.put_many(_rows(50, f"p{os.getpid()}"))
    out.put((messages, book._failed))


def test_processes_meeting_the_damage_at_once_rebuild_it_once(damaged: str) -> None:
    _garbage(damaged)
    ctx = multiprocessing.get_context("fork")
    n = 6
    start, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_meet, args=(damaged, start, out)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    messages = [m for got, _ in results for m in got]
    assert len([m for m in messages if "was damaged" in m]) == 1, messages
    assert [m for m in messages if "cannot be used" in m] == []
    assert not any(failed for _, failed in results)  # none went on in memory
    assert _is_database(damaged)
    conn = sqlite3.connect(damaged)
    try:  # every process wrote to the one new ledger
        assert conn.execute("SELECT count(*) FROM digest").fetchone()[0] == 50
    finally:
        conn.close()


def test_gc_rebuilds_a_damaged_ledger(
    damaged: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``mmcache gc`` (:func:`identity.prune_ledger`) met a damaged ledger with a traceback."""
    _truncated(damaged)
    with caplog.at_level(logging.WARNING, logger=identity.__name__):
        report = identity.prune_ledger(damaged)
    assert (report.exists, report.rows) == (True, 0)
    assert "was damaged" in caplog.text and _is_database(damaged)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_damaged_ledger_is_never_moved(damaged: str) -> None:
    _garbage(damaged)
    os.chown(damaged, 4242, 4242)
    book = identity.Ledger(damaged)
    assert book.get_many(_evs(_rows(3))) == [None] * 3 and book._failed
    # nor by a rebuild that finds it given away after the damage was met
    with pytest.raises(CacheError, match=r"uid 4242"):
        identity._rebuild_ledger(damaged, identity._file_id(damaged))
    assert Path(damaged).read_bytes() == b"not a database" * 1000
    assert not os.path.exists(damaged + ".damaged")


def test_a_symlinked_folder_or_lock_is_never_followed(
    damaged: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _garbage(damaged)
    folder = Path(damaged).parent
    link = tmp_path / "linked"
    link.symlink_to(folder)  # a folder reached through a link: refused, never rebuilt
    through = identity.Ledger(str(link / Path(damaged).name))
    assert through.get_many(_evs(_rows(3))) == [None] * 3 and through._failed
    assert not os.path.exists(damaged + ".damaged")
    target = tmp_path / "elsewhere"  # a lock planted as a link (a group-writable folder)
    Path(damaged + ".lock").symlink_to(target)
    with caplog.at_level(logging.WARNING, logger=identity.__name__):
        book = identity.Ledger(damaged)
        assert book.get_many(_evs(_rows(3))) == [None] * 3 and book._failed
    assert "cannot be used" in caplog.text
    assert not target.exists() and not os.path.exists(damaged + ".damaged")
    assert Path(damaged).read_bytes() == b"not a database" * 1000
