"""Racy stamps (issue 37 H1): a digest taken within a tick of its file's last change never
vouches for the file's evidence (:mod:`mmcache.sources.identity`, "Racy stamps").

On ext2/ext3 with 128-byte inodes (1 s timestamps), NFS or a kernel before 6.13 (coarse
ctimes), a same-size rewrite right after a file's digest keeps its size, mtime, ctime and
inode: the ledger served the old digest, so the old pixels (199/200 keys stale). These tests
pin a file system's stamps to one tick (what such a file system shows for writes within it)
and drive the ledger's clock by hand; ``tests/faults/test_ledger_racy_ext2.py`` shows the
same on a real ext2.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from mmcache import keys
from mmcache.sources import identity

TICK_NS = 1_700_000_000_000_000_000  # the one tick every write below falls in


class FakeClock:
    """The ledger's clock (seconds since the epoch), moved by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def one_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file's mtime and ctime read as :data:`TICK_NS`: a file system whose clock did
    not tick between the writes of a test (size and inode stay real)."""
    real = keys.stat_fields

    def coarse(st: os.stat_result) -> tuple[int, int, int, int]:
        size, _, _, ino = real(st)
        return size, TICK_NS, TICK_NS, ino

    monkeypatch.setattr(keys, "stat_fields", coarse)


@pytest.fixture
def book(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[], tuple[identity.Ledger, FakeClock]]:
    """``book()``: a new process's ledger (a new :class:`~identity.Ledger` on one file),
    with a fake clock half a second after the tick, made the process's ledger."""

    def make() -> tuple[identity.Ledger, FakeClock]:
        clock = FakeClock(TICK_NS / 1e9 + 0.5)
        made = identity.Ledger(str(tmp_path / "ledger" / "l.sqlite"), clock=clock)
        monkeypatch.setattr(identity, "ledger", lambda: made)
        return made, clock

    return make


def _rewrite(path: Path, fill: int) -> None:
    """Rewrite ``path`` in place at the same size (same inode)."""
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.write(bytes([fill]) * size)


def _truth(path: Path) -> str:
    """The identity of ``path``'s bytes now, found without the ledger (which
    ``content=True`` would update)."""
    return identity.content_digest(path.read_bytes())


def test_a_same_size_rewrite_in_the_digests_tick_is_fresh(
    tmp_path: Path, one_tick: None, book: Callable[[], tuple[identity.Ledger, FakeClock]]
) -> None:
    files = [tmp_path / f"f{i}.bin" for i in range(20)]
    for i, path in enumerate(files):
        path.write_bytes(bytes([i]) * 4096)
    stamps = [keys.stat_fields(p.stat()) for p in files]
    book()
    assert [identity.file_identity(p) for p in files] == [_truth(p) for p in files]
    for i, path in enumerate(files):  # within the same tick: all four fields kept
        _rewrite(path, 100 + i)
        assert keys.stat_fields(path.stat()) == stamps[i]
    got = [identity.file_identity(p) for p in files]
    assert got == [_truth(p) for p in files], "old digests served for rewritten files"
    book()  # a new process (the same ledger file): its racy rows are not served either
    assert [identity.file_identity(p) for p in files] == [_truth(p) for p in files]


def test_a_stamp_old_enough_is_served_after_one_stat(
    tmp_path: Path,
    one_tick: None,
    book: Callable[[], tuple[identity.Ledger, FakeClock]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The common case keeps its cost: a file whose stamp is :data:`RACY_SECONDS` older
    than its digest is read once, then served from the ledger (also to a new process)."""
    path = tmp_path / "old.bin"
    path.write_bytes(b"o" * 4096)
    want = _truth(path)
    reads: list[object] = []
    digest = identity._digest_file

    def counted(*args: object) -> tuple[str, bool]:
        reads.append(args[0])
        return digest(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(identity, "_digest_file", counted)
    _, clock = book()
    clock.now = TICK_NS / 1e9 + identity.RACY_SECONDS - 0.01  # still within the margin
    for _ in range(3):
        assert identity.file_identity(path) == want
    assert len(reads) == 3  # read at each key computation while racy
    clock.now = TICK_NS / 1e9 + identity.RACY_SECONDS  # old enough from now on
    for _ in range(3):
        assert identity.file_identity(path) == want
    assert len(reads) == 4  # read once more, then remembered
    book()  # a new process: served from the ledger file without a read
    assert identity.file_identity(path) == want
    assert len(reads) == 4


def test_a_shard_rewritten_in_its_spans_tick_is_fresh(
    tmp_path: Path, one_tick: None, book: Callable[[], tuple[identity.Ledger, FakeClock]]
) -> None:
    """Spans of a local shard (WebDataset members) follow the same rule."""
    shard = tmp_path / "shard.tar"
    shard.write_bytes(b"a" * 8192)
    fields = keys.stat_fields(shard.stat())
    spans = [(0, 4096), (4096, 8192)]

    def read(start: int, end: int) -> bytes:
        with open(shard, "rb") as fh:
            fh.seek(start)
            return fh.read(end - start)

    def truth() -> list[str]:
        return [identity.content_digest(read(a, b)) for a, b in spans]

    book()
    assert identity.span_identities(shard, fields, spans, read) == truth()
    _rewrite(shard, ord("b"))
    assert keys.stat_fields(shard.stat()) == fields
    assert identity.span_identities(shard, fields, spans, read) == truth()


def test_a_file_stamped_in_the_future_is_read_each_time_with_one_warning(
    tmp_path: Path,
    book: Callable[[], tuple[identity.Ledger, FakeClock]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stamp ahead of the clock (a file server's clock ahead, ``tar x`` of future
    mtimes) could be a rewrite in the digest's tick: never served, and said once."""
    path = tmp_path / "future.bin"
    path.write_bytes(b"f" * 4096)
    ahead = path.stat().st_ctime + 3600
    os.utime(path, (ahead, ahead))
    _, clock = book()
    clock.now = ahead - 3600 + identity.RACY_SECONDS + 1  # the ctime is old enough
    with caplog.at_level("WARNING", logger=identity.__name__):
        for fill in (1, 2):
            _rewrite(path, fill)
            os.utime(path, (ahead, ahead))
            assert identity.file_identity(path) == _truth(path)
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1 and "in the future" in told[0] and str(path) in told[0], told
