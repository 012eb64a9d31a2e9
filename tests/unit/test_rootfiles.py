"""mmcache.rootfiles: writes inside a shared root never go through a planted link."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mmcache.errors import CacheError
from mmcache.rootfiles import (
    ROOT_ID_FILE,
    UnsafeFileError,
    create_file,
    make_dir,
    open_file,
    read_root_id,
    replace_file,
)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    path.chmod(0o600)
    return path


def test_replace_file_replaces_a_planted_link_not_its_target(tmp_path: Path, victim: Path) -> None:
    target = tmp_path / "cache.json"
    target.symlink_to(victim)
    replace_file(target, b"{}", 0o660)
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not target.is_symlink() and target.read_bytes() == b"{}"
    assert stat.S_IMODE(target.stat().st_mode) == 0o660  # exactly, whatever the umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json", "victim.txt"]


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "dangling"])
def test_open_file_refuses_links(tmp_path: Path, victim: Path, kind: str) -> None:
    path = tmp_path / "x.keys"
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, path)
    else:
        path.symlink_to(tmp_path / "missing")
    with pytest.raises(UnsafeFileError, match=f"refusing to write {path}"):
        open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "missing").exists()


def test_open_file_creates_with_the_mode_and_reopens(tmp_path: Path) -> None:
    path = tmp_path / "log"
    fd, created = open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    os.close(fd)
    assert created and stat.S_IMODE(path.stat().st_mode) == 0o640
    fd, created = open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.close(fd)
    assert not created and stat.S_IMODE(path.stat().st_mode) == 0o640  # left as it is
    with pytest.raises(FileNotFoundError):
        open_file(tmp_path / "none", os.O_RDWR, 0o600)


def test_make_dir_keeps_the_parents_setgid_bit_and_refuses_a_link(
    tmp_path: Path, victim: Path
) -> None:
    tmp_path.chmod(0o2770)
    assert make_dir(tmp_path / "a" / "b", 0o770)
    for folder in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o2770, folder
    assert not make_dir(tmp_path / "a", 0o700)  # an existing folder is left as it is
    (tmp_path / "link").symlink_to(tmp_path / "a")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        make_dir(tmp_path / "link", 0o700)


def test_create_file_makes_it_once_whole_and_never_through_a_link(
    tmp_path: Path, victim: Path
) -> None:
    path = tmp_path / "root-id"
    assert create_file(path, b"first\n", 0o640)
    assert not create_file(path, b"second\n", 0o600)  # there already: left as it is
    assert path.read_bytes() == b"first\n" and stat.S_IMODE(path.stat().st_mode) == 0o640
    planted = tmp_path / "planted"
    planted.symlink_to(victim)
    assert not create_file(planted, b"x", 0o600)  # a link is "something there": untouched
    assert victim.read_text() == "precious\n" and planted.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["planted", "root-id", "victim.txt"]


def test_read_root_id_reads_only_a_regular_file_of_16_hex_digits(tmp_path: Path) -> None:
    path = tmp_path / ROOT_ID_FILE
    assert read_root_id(tmp_path) is None  # none yet
    path.write_text(f"{0x1234:016x}\n")
    assert read_root_id(tmp_path) == 0x1234
    path.write_text("0" * 16)
    with pytest.raises(CacheError, match=str(path)):
        read_root_id(tmp_path)
    path.unlink()
    os.mkfifo(path)  # never waited on
    with pytest.raises(UnsafeFileError, match=f"refusing to read {path}"):
        read_root_id(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_root_id(tmp_path / "gone")
