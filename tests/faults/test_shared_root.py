"""A cache root shared by a team, tried with real other uids (``setpriv``).

The root is prepared as the README says (``chgrp team ROOT; chmod 2770 ROOT``) and
opened with ``Cache(mode=0o660)``. The members' primary groups are their own; the team
is a supplementary group (as on most clusters):

* G1: a member plants symbolic and hard links where another's job writes (``cache.json``,
  the key log ``fingerprints/<fp>.keys`` and its JSON, the disk tier's counters and
  ``lock.mdb``): the job never truncates, rewrites, chmods or appends to the file they
  point to.
* G15: every folder the library creates keeps the setgid bit, so a second member reads
  the first one's disk tier and writes into it, and the first reads back the second's.

The uids have no accounts (setpriv needs none). They cannot reach pytest's ``tmp_path``
(``/tmp/pytest-of-root`` is 0700), so each test works in its own folder of ``/tmp``,
removed afterwards. Nor can they reach a checkout, a venv or a Python (pyenv) under a
private folder such as a 0700 home: then each job runs in its own mount namespace
where those folders are opened up, only on the paths the interpreter needs
(:class:`Members`); where even that cannot make ``import numpy, mmcache`` work for
the other uid, the tests skip, saying why.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

VICTIM, ATTACKER, TEAM = 23401, 23402, 23500
FP = "ab" * 8
SRC = str(Path(__file__).resolve().parents[2] / "src")

# One member's job: open the shared root, write entries and tag them with a fingerprint,
# read back its own and (when asked) the other member's.
_JOB = """
import sys
import numpy as np
import mmcache

root, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
others = [int(i) for i in sys.argv[4].split(",")] if len(sys.argv) > 4 else []
mine = [i.to_bytes(16, "big") for i in range(first, last)]
with mmcache.Cache(root, memory=0, disk="1MiB", mode=0o660) as cache:
    for i, k in zip(range(first, last), mine):
        assert cache.put(k, {"x": np.arange(8) + i}), i
    cache.register(FP, "a pipeline")
    cache.tag(FP, mine)
    for i in [*range(first, last), *others]:
        got = cache.get(i.to_bytes(16, "big"))
        assert got is not None and int(got["x"][0]) == i, i
print("ok")
""".replace("FP", repr(FP))


class Members:
    """Runs commands as the team's members: other uids, their own primary group, the
    team as a supplementary one.

    ``wrap`` goes before ``setpriv``: empty where the other uids can run this
    interpreter with mmcache as it is, or an ``unshare -m`` script that, in the job's
    own mount namespace, covers each folder they may not search (a 0700 home holding
    the checkout, its venv or a pyenv Python) with a 0755 tmpfs and binds back only
    the entries on the interpreter's paths. The host's mounts are untouched, and the
    namespace ends with the job. Copying the venv instead would cost gigabytes (torch).
    """

    def __init__(self, wrap: list[str]) -> None:
        self.wrap = wrap

    def run(self, uid: int, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [*self.wrap, "setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={TEAM}"]
        env = {**os.environ, "PYTHONPATH": SRC, "PYTHONWARNINGS": "ignore"}
        result = subprocess.run([*cmd, *argv], capture_output=True, text=True, env=env, timeout=120)
        if check:
            assert result.returncode == 0, result.stderr
        return result

    def job(self, uid: int, root: Path, first: int, last: int, others: str = "") -> str:
        script = root.parent / "job.py"
        if not script.exists():
            script.write_text(textwrap.dedent(_JOB))
            script.chmod(0o644)
        argv = [sys.executable, str(script), str(root), str(first), str(last)]
        return self.run(uid, *argv, *([others] if others else [])).stdout


def _interpreter_paths() -> set[str]:
    """What the interpreter reads to start and import mmcache: every hop of the
    ``sys.executable`` link chain, the prefixes, ``sys.path`` and ``src``."""
    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, SRC}
    paths.update(p for p in sys.path if p and os.path.exists(p))
    hop = sys.executable
    for _ in range(40):  # a link chain (venv python -> python3 -> pyenv's python3.11) is short
        paths.add(os.path.dirname(hop))
        if not os.path.islink(hop):
            break
        hop = os.path.join(os.path.dirname(hop), os.readlink(hop))
    return {os.path.realpath(p) for p in paths}


def _closed_folders(paths: Iterable[str]) -> dict[str, set[str]]:
    """The folders above ``paths`` that others may not search, each with the names
    under it on those paths. The members own nothing there and are in no group of
    it, so the "others" bits are theirs."""
    closed: dict[str, set[str]] = {}
    for path in paths:
        parts = Path(path).parts
        for depth in range(1, len(parts)):
            folder = str(Path(*parts[:depth]))
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                closed.setdefault(folder, set()).add(parts[depth])
    return closed


def _namespace_wrap(closed: dict[str, set[str]], stash: Path) -> list[str]:
    """``unshare -m sh -c SCRIPT sh``: the script opens each closed folder (outermost
    first, so the deeper ones are reached through it), then execs its arguments."""
    lines = ["set -e"]
    for n, folder in enumerate(sorted(closed, key=lambda f: len(Path(f).parts))):
        (stash / str(n)).mkdir()
        was, now = shlex.quote(str(stash / str(n))), shlex.quote(folder)
        lines += [f"mount --bind {now} {was}", f"mount -t tmpfs -o mode=0755,size=1m none {now}"]
        for name in sorted(closed[folder]):
            entry = os.path.join(folder, name)
            make = "mkdir" if os.path.isdir(entry) else ": >"
            lines += [
                f"{make} {shlex.quote(entry)}",
                f"mount --bind {was}/{shlex.quote(name)} {shlex.quote(entry)}",
            ]
    lines.append('exec "$@"')
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", "\n".join(lines), "sh"]


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1][:300] if lines else "no message"


@pytest.fixture(scope="module")
def members() -> Iterator[Members]:
    """:class:`Members`, opened up where the checkout or Python is private; skips
    (naming why) where other uids cannot run it at all."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("running as another user needs root and setpriv")
    probe = [sys.executable, "-c", "import numpy, mmcache"]
    plain = Members([])
    tried = plain.run(VICTIM, *probe, check=False)
    if tried.returncode == 0:
        yield plain
        return
    closed = _closed_folders(_interpreter_paths())
    why = f"uid {VICTIM} cannot run {sys.executable} with mmcache ({_last_line(tried.stderr)})"
    if not closed:
        pytest.skip(f"{why} (and no folder on its paths is closed to others)")
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip(f"{why}; opening {sorted(closed)} to it needs unshare and mount")
    stash = Path(tempfile.mkdtemp(prefix="mmcache-open-", dir="/tmp"))  # root's only: 0700
    try:
        opened = Members(_namespace_wrap(closed, stash))
        tried = opened.run(VICTIM, *probe, check=False)
        if tried.returncode != 0:
            pytest.skip(
                f"{why}; still so with {sorted(closed)} opened in a mount namespace "
                f"(files not readable by others?): {_last_line(tried.stderr)}"
            )
        yield opened
    finally:  # the mount points, empty: the mounts ended with each job's namespace
        shutil.rmtree(stash, ignore_errors=True)


@pytest.fixture
def team_root() -> Iterator[Path]:
    """``base/root``: owned by root, group TEAM, mode 2770, as the README prepares it."""
    base = Path(tempfile.mkdtemp(prefix="mmcache-team-", dir="/tmp"))  # not a private $TMPDIR
    base.chmod(0o755)
    root = base / "root"
    root.mkdir()
    os.chown(root, 0, TEAM)
    root.chmod(0o2770)
    yield root
    shutil.rmtree(base, ignore_errors=True)


def victims_files(base: Path) -> dict[str, Path]:
    """The victim's private files, which links in the root will point to."""
    home = base / "vhome"
    home.mkdir(mode=0o700)
    os.chown(home, VICTIM, VICTIM)
    files = {}
    for name in ("notes.txt", "train.log", "hardlinked.txt"):
        path = home / name
        path.write_text(f"the victim's {name}\n")
        os.chown(path, VICTIM, VICTIM)
        path.chmod(0o600)
        files[name] = path
    return files


def untouched(files: dict[str, Path]) -> None:
    for name, path in files.items():
        st = path.stat()
        assert path.read_text() == f"the victim's {name}\n", name
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, VICTIM, VICTIM)


def test_links_planted_by_a_member_never_redirect_a_jobs_writes(
    team_root: Path, members: Members
) -> None:
    """G1. The attacker makes the folders first and plants links at every fixed name
    the victim's job writes; a hard link (what ``protected_hardlinks=0``, or a victim's
    file the attacker may write, allows) stands for the key log's JSON. The job runs,
    and each of the victim's files keeps its bytes, mode and owner."""
    files = victims_files(team_root.parent)
    fingerprints, disk = team_root / "fingerprints", team_root / "disk"
    plant = (
        f"umask 007; mkdir {fingerprints} {disk}"
        f" && ln -s {files['notes.txt']} {team_root}/cache.json"
        f" && ln -s {files['train.log']} {fingerprints}/{FP}.keys"
        f" && ln -s {files['notes.txt']} {disk}/stats.i64"
    )
    members.run(ATTACKER, "sh", "-c", plant)
    os.link(files["hardlinked.txt"], fingerprints / f"{FP}.json")
    assert members.job(VICTIM, team_root, 0, 4).strip() == "ok"
    untouched(files)
    config = team_root / "cache.json"  # the link itself was replaced by the real file
    assert not config.is_symlink() and json.loads(config.read_text())["format"] == 1
    assert (fingerprints / f"{FP}.keys").is_symlink()  # refused, left as it was

    # Now the disk tier's lock file, owned by the victim in the attacker's folder:
    # swapped for a link, the next open is refused, naming it, and writes nothing.
    lock = disk / "lock.mdb"
    members.run(ATTACKER, "sh", "-c", f"mv {lock} {disk}/x && ln -s {files['notes.txt']} {lock}")
    script = team_root.parent / "job.py"
    refused = members.run(
        VICTIM, sys.executable, str(script), str(team_root), "0", "1", check=False
    )
    assert refused.returncode != 0
    assert f"refusing to write {lock}: it is a symbolic link" in refused.stderr
    untouched(files)


def test_members_of_another_primary_group_share_the_disk_tier(
    team_root: Path, members: Members
) -> None:
    """G15. The first member creates the disk tier; a member whose primary group is
    not the team reads its entries and adds its own, which the first reads back."""
    assert members.job(VICTIM, team_root, 0, 4).strip() == "ok"
    for folder in (team_root / "disk", team_root / "fingerprints"):
        st = folder.stat()
        assert st.st_gid == TEAM and st.st_mode & stat.S_ISGID, (folder, oct(st.st_mode))
        assert stat.S_IMODE(st.st_mode) & 0o070 == 0o070, folder
    for path in team_root.rglob("*"):
        if path.is_file():
            assert path.stat().st_gid == TEAM, path
    assert members.job(ATTACKER, team_root, 4, 8, others="0,1,2,3").strip() == "ok"
    assert members.job(VICTIM, team_root, 8, 9, others="4,5,6,7").strip() == "ok"


# One member's job on a memory-only root: its memory tier's name, after writing its entries
# and reading back the other member's (which only the shared memory tier can hold).
_MEMORY_JOB = """
import sys
import numpy as np
import mmcache

root, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
others = [int(i) for i in sys.argv[4].split(",")] if len(sys.argv) > 4 else []
with mmcache.Cache(root, memory="1MiB", disk=None, mode=0o660) as cache:
    for i in range(first, last):
        assert cache.put(i.to_bytes(16, "big"), {"x": np.arange(8) + i}), i
    for i in others:
        got = cache.get(i.to_bytes(16, "big"))
        assert got is not None and int(got["x"][0]) == i, i
    print(cache.memory_name)
"""


def test_members_share_one_memory_tier_named_after_the_roots_identity(
    members: Members, team_root: Path
) -> None:
    """Issue 37, item 12: the memory tier is named after the root's identity
    (``root-id``); every member must read the one the first made, and find one store."""
    script = team_root.parent / "memory_job.py"
    script.write_text(textwrap.dedent(_MEMORY_JOB))
    script.chmod(0o644)
    argv = [sys.executable, str(script), str(team_root)]
    name = members.run(VICTIM, *argv, "0", "4").stdout.strip()
    try:
        ident = team_root / "root-id"
        st = ident.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (VICTIM, TEAM, 0o660)
        assert members.run(ATTACKER, *argv, "4", "8", "0,1,2,3").stdout.strip() == name
    finally:
        from mmcache.stores.memory import store_dir

        for path in Path(store_dir(TEAM)).glob(f"mmcache-{name}*"):
            path.unlink()
