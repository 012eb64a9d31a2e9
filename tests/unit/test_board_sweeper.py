"""FileCheckBoard (shared stat results) and StatPrefetcher (the process that fills it)."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmcache.loader.warm_epoch.board import FileCheckBoard, seal
from mmcache.loader.warm_epoch.prefetch import StatPrefetcher

_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(size=_INT64, mtime=_INT64, round_=st.integers(min_value=1, max_value=2**40))
def test_seal_tells_stamps_and_rounds_apart(size: int, mtime: int, round_: int) -> None:
    stamps = np.array([[size, mtime]], dtype=np.int64)
    value = seal(stamps, round_)
    assert value[0] != 0  # zero means "never published"
    assert seal(stamps.copy(), round_)[0] == value[0]
    assert seal(stamps, round_ + 1)[0] != value[0]  # another round: not verified
    changed = stamps.copy()
    changed[0, 1] ^= 1  # mtime one nanosecond off
    assert seal(changed, round_)[0] != value[0]
    grown = stamps.copy()
    grown[0, 0] ^= 1
    assert seal(grown, round_)[0] != value[0]


def test_board_verifies_only_what_was_published_in_that_round() -> None:
    board = FileCheckBoard(10)
    idx = np.array([1, 3, 5], dtype=np.int64)
    stamps = np.array([[10, 100], [20, 200], [30, 300]], dtype=np.int64)
    assert not board.verified(idx, stamps, 1).any()  # nothing published yet
    board.publish(idx[:2], stamps[:2], 1)
    assert board.verified(idx, stamps, 1).tolist() == [True, True, False]
    assert not board.verified(idx, stamps, 2).any()  # a later round starts unverified
    other = stamps.copy()
    other[1, 1] = 201  # the file changed after its key was made
    assert board.verified(idx, other, 1).tolist() == [True, False, False]


def _publish_in_child(board: FileCheckBoard, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    board.publish(np.array([0, 2]), np.array([[1, 2], [3, 4]], dtype=np.int64), 7)
    out.put("published")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_board_is_shared_with_processes(method: str) -> None:
    ctx = multiprocessing.get_context(method)
    board = FileCheckBoard(3, ctx)
    out = ctx.Queue()
    proc = ctx.Process(target=_publish_in_child, args=(board, out))
    proc.start()
    try:
        assert out.get(timeout=60) == "published"
    finally:
        proc.join(30)
    stamps = np.array([[1, 2], [9, 9], [3, 4]], dtype=np.int64)
    assert board.verified(np.arange(3), stamps, 7).tolist() == [True, False, True]


class _Files:
    """What the sweeper needs of a dataset: the (size, mtime_ns) of each row's file."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = [str(p) for p in paths]

    def stamps(self, indices: np.ndarray) -> np.ndarray:
        out = np.full((len(indices), 2), -2, dtype=np.int64)
        for j, i in enumerate(indices.tolist()):
            st = os.stat(self.paths[i])
            out[j] = st.st_size, st.st_mtime_ns
        return out


class _Order:
    def __init__(self, n: int, batch: int) -> None:
        self.n, self.batch = n, batch

    def batches(self, epoch: int) -> list[np.ndarray]:
        order = np.random.default_rng(epoch).permutation(self.n)
        return [order[i : i + self.batch] for i in range(0, self.n, self.batch)]


def _wait_verified(board: FileCheckBoard, files: _Files, round_: int, timeout: float = 30) -> bool:
    idx = np.arange(len(files.paths))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if board.verified(idx, files.stamps(idx), round_).all():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sweeper_publishes_every_file_of_an_epoch_at_the_lowest_priority(
    tmp_path: Path, method: str
) -> None:
    paths = []
    for i in range(23):
        p = tmp_path / f"{i}.jpg"
        p.write_bytes(b"x" * (i + 1))
        paths.append(p)
    files = _Files(paths)
    board = FileCheckBoard(len(paths), method)
    sweeper = StatPrefetcher(board, files, _Order(len(paths), 5), method)
    try:
        sweeper.request(1, epoch=0)
        assert _wait_verified(board, files, 1)
        pid = sweeper.pid
        assert pid is not None
        assert psutil.Process(pid).nice() == 19
        # The next epoch, after a file changed: the new round shows the new stamp.
        paths[4].write_bytes(b"changed, and longer")
        sweeper.request(2, epoch=1)
        assert _wait_verified(board, files, 2)
        assert sweeper.pid == pid  # one process for all epochs
    finally:
        sweeper.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    sweeper.close()  # idempotent


def test_a_sweeper_left_by_a_killed_parent_exits(tmp_path: Path) -> None:
    """kill -9 of the training process: its sweeper notices within a second or two."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import os, sys, time
        import numpy as np
        from mmcache.loader.warm_epoch.board import FileCheckBoard
        from mmcache.loader.warm_epoch.prefetch import StatPrefetcher

        class Files:
            def stamps(self, idx):
                return np.zeros((len(idx), 2), dtype=np.int64)

        class Order:
            def batches(self, epoch):
                return [np.arange(4)]

        s = StatPrefetcher(FileCheckBoard(4), Files(), Order())
        s.start()
        print(s.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert psutil.pid_exists(pid)
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and time.monotonic() < deadline:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.05)
        gone = not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert gone
    finally:
        if parent.poll() is None:  # pragma: no cover - the test kills it
            parent.kill()


@given(
    fields=st.lists(_INT64, min_size=4, max_size=4),
    column=st.integers(min_value=0, max_value=3),
    round_=st.integers(min_value=1, max_value=2**40),
)
def test_seal_sees_a_change_of_any_stamp_field(fields: list[int], column: int, round_: int) -> None:
    # The stamp of mmcache.keys.STAT_FIELDS: size, mtime, ctime, inode. A file
    # rewritten with its size and mtime restored differs only in ctime (and
    # maybe inode); another file of the same size and mtime in inode and ctime.
    stamps = np.array([fields], dtype=np.int64)
    other = stamps.copy()
    other[0, column] ^= 1 << (column * 7)
    assert seal(other, round_)[0] != seal(stamps, round_)[0]
    both = stamps.copy()
    both[0, 2] ^= 1
    both[0, 3] ^= 1
    assert seal(both, round_)[0] != seal(stamps, round_)[0]  # changes do not cancel out


def test_the_board_compares_every_field_the_dataset_stamps(tmp_path: Path) -> None:
    from mmcache.keys import STAT_FIELDS, stat_fields

    path = tmp_path / "img.bmp"
    path.write_bytes(b"a" * 100)
    before = os.stat(path)
    stamps = np.array([stat_fields(before)], dtype=np.int64)
    assert stamps.shape[1] == len(STAT_FIELDS)
    board = FileCheckBoard(1)
    board.publish(np.arange(1), stamps, 3)
    path.write_bytes(b"b" * 100)  # same size, mtime restored: only the ctime differs
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    now = np.array([stat_fields(os.stat(path))], dtype=np.int64)
    board.publish(np.arange(1), now, 4)
    assert not board.verified(np.arange(1), stamps, 4).any()
    assert board.verified(np.arange(1), now, 4).all()


def test_published_keys_pass_only_whole_rows_of_the_round_asked_for() -> None:
    board = FileCheckBoard(6, key_stamps=2)
    idx = np.array([0, 2, 4], dtype=np.int64)
    keys = np.arange(48, dtype=np.uint8).reshape(3, 16)
    stamps = np.array([[10, 100], [20, 200], [30, 300]], dtype=np.int64)
    assert board.carries_keys and not FileCheckBoard(6).carries_keys
    assert board.published(idx, 1) is None  # nothing published yet
    board.publish_keys(idx[:2], keys[:2], stamps[:2], 1)
    assert board.published(idx, 1) is None  # one row not there yet
    got = board.published(idx[:2], 1)
    assert got is not None
    assert np.array_equal(got[0], keys[:2]) and np.array_equal(got[1], stamps[:2])
    assert board.published(idx[:2], 2) is None  # another round's rows never pass
    board.publish_keys(idx, keys, stamps, 2)
    assert board.published(idx, 2) is not None
    # A row rewritten (or seen before its key) under an old seal: the seal no longer
    # matches what was copied, and the batch is keyed elsewhere.
    _, key_rows, stamp_rows = board._key_arrays()
    key_rows[2, 5] ^= 1
    assert board.published(idx, 2) is None
    key_rows[2, 5] ^= 1
    stamp_rows[0, 1] += 1
    assert board.published(idx, 2) is None


class _KeyedFiles(_Files):
    def key_rows(self, indices: np.ndarray, *, stamps: np.ndarray | None = None) -> np.ndarray:
        st = self.stamps(indices) if stamps is None else stamps
        return (st[:, :1] * 7 + np.arange(16)).astype(np.uint8)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sweeper_publishes_the_keys_of_an_epoch_when_asked(tmp_path: Path, method: str) -> None:
    paths = []
    for i in range(12):
        p = tmp_path / f"{i}.jpg"
        p.write_bytes(b"x" * (i + 1))
        paths.append(p)
    files = _KeyedFiles(paths)
    board = FileCheckBoard(len(paths), method, key_stamps=2)
    sweeper = StatPrefetcher(board, files, _Order(len(paths), 4), method)
    idx = np.arange(len(paths))
    try:
        sweeper.request(3, epoch=0, keys=True)
        deadline = time.monotonic() + 30
        while board.published(idx, 3) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        got = board.published(idx, 3)
        assert got is not None
        assert np.array_equal(got[0], files.key_rows(idx))
        assert np.array_equal(got[1], files.stamps(idx))
        assert not board.verified(idx, files.stamps(idx), 3).any()  # a key round only
    finally:
        sweeper.close()


def test_the_sweeper_is_forked_with_the_orders_random_generator_imported() -> None:
    """numpy imports numpy.random at first use (~15 ms of CPU): imported before the fork,
    the sweeper shares the training process's copy instead of importing it at its first
    request, which delayed a new run's first published keys by as much (main: imported
    in the sweeper). Checked in a fresh interpreter, where nothing imported it yet."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import numpy as np\n"
        "from mmcache.loader.warm_epoch.board import FileCheckBoard\n"
        "from mmcache.loader.warm_epoch.prefetch import StatPrefetcher\n"
        "before = 'numpy.random' in sys.modules\n"
        "class Order:\n"
        "    def batches(self, epoch):\n"
        "        return [np.arange(2, dtype=np.int64)]\n"
        "sweeper = StatPrefetcher(FileCheckBoard(2, 'fork'), None, Order(), 'fork')\n"
        "sweeper.start()\n"
        "print(before, 'numpy.random' in sys.modules)\n"
        "sweeper.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "True"]
