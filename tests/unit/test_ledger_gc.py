"""``mmcache gc`` prunes the identity ledger; ``stats`` and ``verify`` say where it is.

The ledger (:mod:`mmcache.sources.identity`) remembers the digest of every file a job
keyed, under the file's local evidence. Rows of files deleted or rewritten since can never
match again: ``gc`` (with ``--cache`` or ``--all`` alone) removes them, then the oldest beyond
the bound; another user's ledger is never used nor pruned.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from mmcache import Cache
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


def test_prune_keeps_the_ledger_bounded_dropping_the_oldest(
    ledger_dir: Path, tmp_path: Path
) -> None:
    files = _files(tmp_path / "data", 5)
    for p in files:  # learned one by one: each row its own time
        _learn([p])
    book = identity.ledger_file()
    assert book is not None
    report = identity.prune_ledger(max_rows=2)
    assert (report.gone, report.changed, report.over, report.rows) == (0, 0, 3, 2)
    conn = sqlite3.connect(book)
    left = sorted(os.fsdecode(r[0]) for r in conn.execute("SELECT path FROM digest"))
    conn.close()
    assert left == sorted(str(p) for p in files[3:])  # the two learned last


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
