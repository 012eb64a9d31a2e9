"""``mmcache gc`` prunes the identity ledger; ``stats`` and ``verify`` say where it is.

The ledger (:mod:`mmcache.sources.identity`) remembers the digest of every file a job
keyed, under the file's local evidence. Rows of files deleted or rewritten since can never
match again: ``gc`` (with ``--cache`` or ``--all`` alone) removes them, checking a bounded
number of rows each time (issue 41: never a ``stat`` of every row, never a bound on the rows
of files that did not change), and a rewritten file's old rows go when its new digest is
learned; another user's ledger is never used nor pruned.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from mmcache import Cache, keys
from mmcache.cli import main
from mmcache.errors import CacheError
from mmcache.sources import identity


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "identity"
    monkeypatch.setenv("MMCACHE_IDENTITY_DIR", str(where))
    return where


def _files(root: Path, n: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        p = root / f"f{i}.bin"
        p.write_bytes(bytes([i]) * (1000 + i))
        out.append(p)
    return out


def _learn(paths: list[Path]) -> list[str]:
    return [identity.file_identity(p) for p in paths]


def _rows(path: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT count(*) FROM digest").fetchone()[0])
    finally:
        conn.close()


def test_prune_removes_rows_of_files_gone_or_changed_and_keeps_the_rest(
    ledger_dir: Path, tmp_path: Path
) -> None:
    files = _files(tmp_path / "data", 4)
    before = _learn(files)
    book = identity.ledger_file()
    assert book is not None and Path(book).parent == ledger_dir
    assert _rows(book) == 4
    files[0].unlink()  # gone
    st = files[1].stat()
    files[1].write_bytes(b"\xff" * st.st_size)  # same size and mtime, other bytes
    os.utime(files[1], ns=(st.st_atime_ns, st.st_mtime_ns))
    report = identity.prune_ledger()
    assert (report.gone, report.changed, report.over, report.rows) == (1, 1, 0, 2)
    assert report.bytes > 0 and report.path == book
    assert _rows(book) == 2
    after = _learn(files[1:])
    assert after[0] != before[1]  # the rewritten file: its new bytes' identity
    assert after[1:] == before[2:]


def _scaled_down(monkeypatch: pytest.MonkeyPatch, *, bound: int, budget: int) -> None:
    """The numbers of a ledger of 10^8 rows, scaled down to a test's: a bound on the rows
    (the 10^6 that gc kept before issue 41, where the code still has one) and the rows
    one gc may check."""
    defaults = identity.prune_ledger.__kwdefaults__ or {}
    if "max_rows" in defaults:
        monkeypatch.setitem(defaults, "max_rows", bound)
    monkeypatch.setattr(identity, "PRUNE_BUDGET", budget, raising=False)


def _counting_stats(monkeypatch: pytest.MonkeyPatch, under: Path) -> list[str]:
    """The paths under ``under`` that ``os.stat`` is asked about from now on."""
    seen: list[str] = []
    real = os.stat

    def counting(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if os.fsdecode(path).startswith(str(under)):
            seen.append(os.fsdecode(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counting)
    return seen


def test_gc_keeps_every_row_of_files_that_did_not_change(
    ledger_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropping the row of an unchanged file costs a re-read of it at the next key (10^8
    photos: ~10 TB): a gc keeps them all, however many."""
    files = _files(tmp_path / "data", 8)
    _learn(files)
    _scaled_down(monkeypatch, bound=3, budget=100)
    report = identity.prune_ledger()
    assert (report.gone, report.changed, report.rows) == (0, 0, 8)
    book = identity.ledger_file()
    assert book is not None and _rows(book) == 8


def test_gc_stats_at_most_its_budget_and_goes_on_where_it_stopped(
    ledger_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _files(tmp_path / "data", 10)
    _learn(files)
    for p in files[:3]:
        p.unlink()
    _scaled_down(monkeypatch, bound=3, budget=4)
    stats = _counting_stats(monkeypatch, tmp_path / "data")
    reports = []
    for _ in range(3):  # 10 rows, 4 a gc: every row checked in three (the third wraps)
        stats.clear()
        reports.append(identity.prune_ledger())
        assert len(stats) <= 4, stats
    assert [r.checked for r in reports] == [4, 4, 4]
    assert sum(r.gone for r in reports) == 3 and reports[-1].rows == 7
    assert all(r.changed == 0 for r in reports)


def test_the_spans_of_one_file_cost_gc_one_stat(
    ledger_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's samples are one row each (a span of its bytes): gc stats the shard once."""
    (shard,) = _files(tmp_path / "data", 1)
    data = shard.read_bytes()
    fields = list(keys.stat_fields(shard.stat()))
    spans = [(i * 10, i * 10 + 10) for i in range(50)]
    identity.span_identities(str(shard), fields, spans, lambda a, b: data[a:b])
    stats = _counting_stats(monkeypatch, tmp_path / "data")
    report = identity.prune_ledger()
    assert stats == [str(shard)]
    assert (report.checked, report.rows, report.gone, report.changed) == (50, 50, 0, 0)


def test_a_rewritten_files_rows_go_when_its_new_digest_is_learned(
    ledger_dir: Path, tmp_path: Path
) -> None:
    """Lazy pruning: the rows of a file's earlier versions never wait for a gc."""
    (one,) = _files(tmp_path / "data", 1)
    first = _learn([one])
    one.write_bytes(b"other bytes, another size")
    assert _learn([one]) != first
    book = identity.ledger_file()
    assert book is not None and _rows(book) == 1
    conn = sqlite3.connect(book)
    (size,) = conn.execute("SELECT size FROM digest").fetchone()
    conn.close()
    assert size == one.stat().st_size


def test_a_ledger_of_schema_2_keeps_its_rows(
    ledger_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The schema before issue 41's: its rows stay (each would cost a re-read)."""
    (one,) = _files(tmp_path / "data", 1)
    want = identity.content_digest(one.read_bytes())
    book = identity.ledger_file()
    assert book is not None
    ledger_dir.mkdir(mode=0o700, exist_ok=True)
    fields = list(keys.stat_fields(one.stat()))
    conn = sqlite3.connect(book)
    conn.execute(
        "CREATE TABLE digest (ev BLOB PRIMARY KEY, d BLOB NOT NULL, path BLOB NOT NULL,"
        " size INT, mtime INT, ctime INT, ino INT, lo INT, hi INT, t REAL NOT NULL)"
        " WITHOUT ROWID"
    )
    conn.execute(
        "INSERT INTO digest VALUES (?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?)",
        (
            identity.evidence(str(one), fields),
            bytes.fromhex(want[len(identity.CONTENT_PREFIX) :]),
            os.fsencode(str(one)),
            *fields,
            time.time() + 3600,  # long after its stamp: it vouches
        ),
    )
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()

    def no_read(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read again: the row was dropped")

    monkeypatch.setattr(identity, "_digest_file", no_read)
    assert identity.file_identity(one) == want
    assert identity.prune_ledger().rows == 1


def test_a_ledger_of_the_old_schema_is_emptied_not_trusted(
    ledger_dir: Path, tmp_path: Path
) -> None:
    book = identity.ledger_file()
    assert book is not None
    ledger_dir.mkdir(mode=0o700)
    conn = sqlite3.connect(book)
    conn.execute("CREATE TABLE digest (ev BLOB PRIMARY KEY, d BLOB NOT NULL) WITHOUT ROWID")
    conn.execute("INSERT INTO digest VALUES (?, ?)", (b"\x00" * 16, b"\x01" * 16))
    conn.commit()
    conn.close()
    assert identity.prune_ledger().rows == 0
    files = _files(tmp_path / "data", 1)
    _learn(files)
    assert identity.ledger_report().rows == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_ledger_is_refused_with_a_clear_message(
    ledger_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _files(tmp_path / "data", 2)
    _learn(files)
    book = identity.ledger_file()
    assert book is not None
    os.chown(book, 4242, 4242)
    with pytest.raises(CacheError, match=r"uid 4242.*MMCACHE_IDENTITY_DIR"):
        identity.prune_ledger()
    assert _rows(book) == 2  # untouched
    files[0].unlink()
    assert main(["gc", "--all"]) == 1
    err = capsys.readouterr().err
    assert "identity ledger not pruned" in err and "uid 4242" in err
    assert _rows(book) == 2
    # a job never uses it either: digests are kept in memory, keys stay right
    identity._LEDGERS.clear()
    fresh = identity.Ledger(book)
    assert fresh.get_many([b"\x00" * 16]) == [None] and fresh._failed


def test_gc_prunes_the_ledger_and_stats_and_verify_say_where_it_is(
    ledger_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    with Cache(root, memory=0, disk="16MiB"):
        pass
    files = _files(tmp_path / "data", 3)
    _learn(files)
    book = identity.ledger_file()
    assert book is not None
    assert main(["stats", "--cache", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"identity ledger: {book} (3 rows," in out
    assert main(["verify", "--cache", str(root), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["identity_ledger"]
    assert got["path"] == book and got["rows"] == 3 and got["bytes"] > 0
    files[2].unlink()
    assert main(["gc", "--cache", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"identity ledger: {book} (2 rows," in out and "removed 1 rows of files gone" in out
    files[1].unlink()
    assert main(["gc", "--all", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["identity_ledger"]
    assert (got["gone"], got["rows"]) == (1, 1)


def test_off_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMCACHE_IDENTITY_DIR", "off")
    assert identity.ledger_file() is None
    assert str(identity.prune_ledger()).startswith("identity ledger: off")
