"""G1 for the disk tier's LMDB files: a link swapped in *after* this process checked them.

``lmdb.open`` opens ``data.mdb`` and ``lock.mdb`` by name and follows links (py-lmdb takes
no descriptor), and LMDB truncates and writes ``lock.mdb`` at open. In a group-shared root a
member who owns those files (they made the tier first) can swap one for a link to a file the
victim can write, between the victim's check and LMDB's open. The test makes that swap at
the worst moment (inside the call to ``lmdb.open``, before LMDB runs) and checks that the
victim's file keeps its bytes: for ``lock.mdb`` (the file LMDB writes at open) the store
opens the file it had checked; ``data.mdb`` is a name LMDB resolves itself (compaction renames
a new one in while an opener waits), and a link to another file is refused as not an LMDB file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest

from mmcache.errors import CacheError
from mmcache.stores.disk import DiskStore

VICTIM_BYTES = b"the victim's own file: a swapped link must never let LMDB write here\n" * 64


def swap_at_open(
    monkeypatch: pytest.MonkeyPatch, folder: Path, name: str, victim: Path
) -> list[str]:
    """Patch ``lmdb.open`` so that, once, ``folder/name`` becomes a link to ``victim``
    just before LMDB opens anything (the member's rename + symlink)."""
    real: Callable[..., Any] = lmdb.open
    opened: list[str] = []

    def open_after_swap(path: str, **kwargs: Any) -> Any:
        if not opened:
            target = folder / name
            os.rename(target, folder / (name + ".moved"))
            os.symlink(victim, target)
        opened.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(lmdb, "open", open_after_swap)
    return opened


def test_a_lock_file_link_swapped_in_after_the_check_never_redirects_lmdb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "lock.mdb"
    folder = tmp_path / "disk"
    store = DiskStore(folder, capacity="1MiB")
    store.put(b"k" * 16, b"value before")
    store.close()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM_BYTES)

    opened = swap_at_open(monkeypatch, folder, name, victim)
    store = DiskStore(folder, capacity="1MiB")
    try:
        assert opened, "lmdb.open was not called"
        assert store.get(b"k" * 16) == b"value before"  # the files it checked
        assert store.put(b"j" * 16, b"value after")
        assert store.get(b"j" * 16) == b"value after"
    finally:
        store.close()
    assert victim.read_bytes() == VICTIM_BYTES
    assert (folder / name).is_symlink()  # the member's link is left as it was


def test_a_data_file_link_swapped_in_after_the_check_is_refused_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "disk"
    DiskStore(folder, capacity="1MiB").close()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM_BYTES)
    swap_at_open(monkeypatch, folder, "data.mdb", victim)
    with pytest.raises(CacheError, match="cannot open the disk cache"):
        DiskStore(folder, capacity="1MiB")
    assert victim.read_bytes() == VICTIM_BYTES
