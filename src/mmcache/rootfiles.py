"""Creating, replacing and reading files inside a cache root that other users may write to.

A root shared by a team (``chgrp team ROOT; chmod 2770 ROOT``, ``Cache(mode=0o660)``)
is a folder every member can write: any of them can put a symbolic or hard link
where this process is about to write, under a name it can predict (a pid-named
temp file, the key log ``fingerprints/<fp>.keys``, ``cache.json``). Following such
a link makes the job truncate, rewrite, ``chmod`` or append to a file of the
victim's choosing, with the victim's rights. ``fs.protected_symlinks`` does not
help: it covers only sticky, world-writable folders.

Every writer of the library goes through this module, whose rules are:

* a file is **replaced** by writing a temp file under a random name created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` (it can never be an existing file or link),
  ``fchmod``-ed through its descriptor, then renamed over the target: ``rename``
  replaces a planted link itself, never what it points to
  (:func:`replace_file`);
* a file that is **appended to or updated in place** (the key log, the disk
  tier's counters and LMDB files) is opened with ``O_NOFOLLOW``, created with
  ``O_EXCL`` (and only then given its mode), and refused unless it is a regular
  file with a single link (:func:`open_file`);
* a file that is **created once** and never changed by its creator (the root's
  identity, ``root-id``; the record of a memory-only root, ``cache.json``, which
  must never replace the record of a disk tier's owner) is written whole under a
  random temp name, then hard-linked to its name: ``link`` never replaces
  anything, so of processes racing to create it one wins, and every reader sees
  the whole file or none (:func:`create_file`); the identity is read without
  following a link or blocking on a FIFO (:func:`read_root_id`);
* a **folder** is made with the exact mode asked, through a descriptor opened
  with ``O_NOFOLLOW``, and keeps the set-group-ID bit of its parent, so that
  in a ``2770`` root every file gets the team's group whatever the creator's
  primary group is (:func:`make_dir`); an existing link where a folder should
  be is refused.

What remains: LMDB opens ``data.mdb``/``lock.mdb`` by name itself; they are
checked here just before (a member racing that check could still redirect it,
which a sticky root, ``chmod 3770``, prevents for files it did not create).
Members are trusted with the cache's *contents* (they can write entries); this
module only keeps them from steering this process's writes to other files.

Reading has its own trap: a member can put a FIFO where a file is read by name
(``cache.json``), and a user can name a FIFO or ``/dev/zero`` where a manifest,
shard or image is expected. Opening a FIFO for reading blocks until a writer
comes (forever), and ``/dev/zero`` never ends. So every read of such a file goes
through :func:`open_regular` (or :func:`read_regular`, bounded): opened with
``O_NONBLOCK`` (a FIFO opens at once; no effect on a regular file) and refused by
its ``fstat`` mode, before a byte is read, unless it is a regular file.
Thread-safe and process-safe (no state).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence

from mmcache.errors import CacheError, MmcacheError

__all__ = [
    "ROOT_ID_FILE",
    "NotRegularFileError",
    "UnsafeFileError",
    "create_file",
    "make_dir",
    "open_file",
    "open_regular",
    "pinned_files",
    "read_regular",
    "read_root_id",
    "replace_file",
]

#: The file that records a cache root's identity: a random number made with the root
#: (:func:`mmcache.cacheroot.root_id`), so that a root removed and made again at the same
#: path is told from the old one (its memory tier is named after it, never adopted).
ROOT_ID_FILE = "root-id"
#: The most bytes of ``root-id`` read (16 hex digits and a newline are written).
_ROOT_ID_MAX = 64

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeFileError(CacheError):
    """A file or folder of a cache root is a link (or not what it should be): it was
    not opened, so nothing was written through it."""


class NotRegularFileError(MmcacheError, OSError):
    """A file to read is a FIFO, a device or a socket: it was not read (a FIFO would block
    the reader until some writer comes, a device like ``/dev/zero`` never ends).
    ``strerror`` says what it is; ``filename`` is the path. An ``OSError`` too, so that
    callers handling unreadable files handle it."""


#: What a file that is not a regular one is, by its ``st_mode`` (for the messages).
_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: str | os.PathLike[str], *, flags: int = 0) -> tuple[int, os.stat_result]:
    """Open the regular file ``path`` for reading without ever blocking: ``(fd, fstat)``.

    ``O_NONBLOCK`` makes opening a FIFO return at once (it has no effect on a regular
    file, so reads of the descriptor are ordinary ones); the descriptor's ``fstat``
    then refuses anything but a regular file before a byte is read: a folder with
    ``IsADirectoryError``, a FIFO, device or socket with :class:`NotRegularFileError`
    (``O_NOCTTY``: a terminal named here never becomes this process's own).
    ``flags`` are added to ``O_RDONLY`` (``O_NOFOLLOW``, ``O_BINARY``). Other
    failures raise the OSError of ``open`` (``FileNotFoundError``,
    ``PermissionError``). The caller closes the descriptor (``open(fd, "rb")``
    wraps it). Thread-safe.
    """
    name = os.fspath(path)
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | flags)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", name)
        if not stat.S_ISREG(st.st_mode):
            what = next((kind for test, kind in _KINDS if test(st.st_mode)), "not a file")
            raise NotRegularFileError(errno.EINVAL, f"{what}, not a regular file", name)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular(path: str | os.PathLike[str], *, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), at most ``max_bytes``.

    A file over ``max_bytes`` (by its ``fstat`` size, or grown while being read)
    raises OSError ``EFBIG`` naming the limit, having read at most ``max_bytes + 1``
    bytes: a small record file (``cache.json``) that is not small is refused, never
    loaded whole. Thread-safe.
    """
    name = os.fspath(path)
    fd, st = open_regular(name)
    with open(fd, "rb", closefd=True) as f:
        data = f.read(max_bytes + 1) if st.st_size <= max_bytes else b""
    if st.st_size > max_bytes or len(data) > max_bytes:
        why = (
            f"{st.st_size} bytes, over the limit of {max_bytes} bytes"
            if st.st_size > max_bytes
            else f"grew past the limit of {max_bytes} bytes while being read"
        )
        raise OSError(errno.EFBIG, why, name)
    return data


def _refuse(path: str, what: str, *, action: str = "write") -> UnsafeFileError:
    return UnsafeFileError(
        errno.EPERM,
        f"refusing to {action} {path}: it is {what}; another user of this root may have"
        f" planted it to redirect this job's {action}s (remove it, and make the root"
        " sticky: chmod 3770 ROOT)",
    )


def _checked(fd: int, path: str) -> int:
    """``fd`` if it is a regular file with one link, else close it and raise."""
    st = os.fstat(fd)
    what = None
    if stat.S_ISLNK(st.st_mode):  # an O_PATH | O_NOFOLLOW descriptor of the link itself
        what = "a symbolic link"
    elif not stat.S_ISREG(st.st_mode):
        what = "not a regular file"
    elif st.st_nlink != 1:
        what = f"a hard link ({st.st_nlink} names for one file)"
    if what is None:
        return fd
    os.close(fd)
    raise _refuse(path, what)


def open_file(path: str | os.PathLike[str], flags: int, mode: int) -> tuple[int, bool]:
    """Open ``path`` for writing without following a link: ``(fd, created)``.

    ``flags`` are the access flags (``os.O_RDWR``, ``os.O_WRONLY | os.O_APPEND``);
    with ``os.O_CREAT`` in them a missing file is created exclusively and given
    ``mode`` exactly (``fchmod``: not masked by the umask); an existing one keeps
    its mode (it may be another member's). Raises :class:`UnsafeFileError` for a
    symbolic link, a hard link or anything but a regular file, OSError otherwise
    (``FileNotFoundError`` without ``O_CREAT``).
    """
    name = os.fspath(path)
    create = bool(flags & os.O_CREAT)
    flags = (flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)) | _NOFOLLOW
    while True:
        if create:
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass  # another process made it first, or it is a planted link
            else:
                try:
                    os.fchmod(fd, mode)
                except BaseException:
                    os.close(fd)
                    raise
                return fd, True
        try:
            fd = os.open(name, flags)
        except FileNotFoundError:
            if create:
                continue  # removed between the two opens: create it after all
            raise
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refuse(name, "a symbolic link") from exc
            raise
        return _checked(fd, name), False


def _temp_copy(target: str, data: bytes, mode: int) -> str:
    """A new file beside ``target`` holding ``data`` with ``mode``: its path. Its name is
    random and it is created exclusively without following a link, so no link planted
    at a name this process could be expected to use is ever written through. Raises
    OSError, leaving nothing behind."""
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def replace_file(path: str | os.PathLike[str], data: bytes, mode: int) -> None:
    """Replace ``path`` by a file holding ``data`` with ``mode``, atomically.

    Readers see the old file or the new one, never a part. The temp file beside
    it has a random name and is created exclusively, so a link planted at any
    name this process could be expected to use is never written through; the
    rename replaces a link at ``path`` itself. Raises OSError (a read-only or
    full file system); nothing is left behind then.
    """
    target = os.fspath(path)
    tmp = _temp_copy(target, data, mode)
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def create_file(path: str | os.PathLike[str], data: bytes, mode: int) -> bool:
    """Create ``path`` holding ``data`` with ``mode``, unless something is there already:
    True if this call made it, False if another file (or link) was there first.

    For a file written once and never changed: ``data`` goes whole into a temp file of
    a random name beside it (created exclusively, never through a link), which is then
    hard-linked to ``path`` and removed. ``link`` fails when ``path`` exists, a planted
    link included, and replaces nothing; so of processes racing to create it exactly
    one wins, and readers see the whole file or none (``O_EXCL`` on ``path`` itself
    would let a reader see it empty, before its bytes). Raises OSError (a read-only or
    full file system, one without hard links); nothing is left behind then.
    """
    target = os.fspath(path)
    tmp = _temp_copy(target, data, mode)
    try:
        os.link(tmp, target, follow_symlinks=False)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return True


def read_root_id(root: str | os.PathLike[str]) -> int | None:
    """The identity recorded in ``root``'s :data:`ROOT_ID_FILE`, None when it has none.

    Opened without following a link and without blocking (a FIFO a member of a shared
    root planted there is refused, never waited on: :func:`open_regular`), a regular
    file only, at most a few bytes read. Raises ``FileNotFoundError`` when ``root``
    itself is missing, :class:`UnsafeFileError` for a link or anything but a regular
    file, ``OSError`` when it cannot be read (permissions), and ``CacheError`` when it
    does not hold an identity (16 hex digits). Thread-safe and process-safe (reads only).
    """
    path = os.path.join(os.fspath(root), ROOT_ID_FILE)
    try:
        fd, _ = open_regular(path, flags=_NOFOLLOW)
    except FileNotFoundError:
        if not os.path.isdir(root):
            raise
        return None
    except NotRegularFileError as exc:
        raise _refuse(path, "not a regular file", action="read") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link", action="read") from exc
        raise
    try:
        raw = os.read(fd, _ROOT_ID_MAX)
    finally:
        os.close(fd)
    text = raw.decode("ascii", errors="replace").strip()
    try:
        value = int(text, 16) if len(text) == 16 else 0
    except ValueError:
        value = 0
    if value <= 0 or value >= 1 << 63:
        raise CacheError(
            f"{path} does not hold a cache root identity (16 hex digits), but {raw[:32]!r};"
            " remove it (the memory tier of the root then starts empty)"
        )
    return value


def make_dir(path: str | os.PathLike[str], mode: int) -> bool:
    """Make the folder ``path`` (and missing parents) with ``mode``; True if made here.

    The mode is set exactly (not masked by the umask) through a descriptor opened
    with ``O_NOFOLLOW``, so a link swapped in after ``mkdir`` is never changed;
    the set-group-ID bit is kept where the parent has it (``chmod`` would clear
    it): in a ``2770`` root, files made below get the root's group, and so reach
    members whose primary group is another. An existing folder is left as it is;
    an existing symbolic link where the folder should be raises
    :class:`UnsafeFileError`.
    """
    target = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(target)
    if parent != target and not os.path.lexists(parent):  # a file there: mkdir says so
        make_dir(parent, mode)
    try:
        os.mkdir(target, 0o700)  # never wider than asked while its mode is set below
    except FileExistsError:
        if os.path.islink(target):
            raise _refuse(target, "a symbolic link, not a folder") from None
        if not os.path.isdir(target):
            raise
        return False
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    try:
        setgid = os.stat(parent).st_mode & stat.S_ISGID
        os.fchmod(fd, mode | setgid)
    finally:
        os.close(fd)
    return True


#: Where a process finds its own descriptors as links that reopen exactly their file.
_OWN_FDS = "/proc/self/fd"


@contextlib.contextmanager
def pinned_files(
    directory: str,
    names: Sequence[str],
    *,
    create: bool,
    mode: int,
    by_name: Sequence[str] = (),
) -> Iterator[str]:
    """A folder to hand a library that opens ``directory/<name>`` by name itself (LMDB).

    A library that opens files by name (``lmdb.open`` opens ``data.mdb`` and
    ``lock.mdb`` without ``O_NOFOLLOW``, and py-lmdb takes no descriptor) would
    follow a link that a member of a shared root swapped in after this process
    checked the files: LMDB truncates and writes ``lock.mdb`` at open, so the
    member could make this job overwrite any file it can write. Checking before
    and after the open only narrows that window. Instead each file is opened here
    without following links (and checked: a regular file with one link; created
    with ``mode`` exactly when ``create``), and the library is given a new private
    folder (``0700``, in the temporary folder, removed on exit) whose entries are
    links to ``/proc/self/fd/<fd>``: opening such a link reopens the very file
    behind the descriptor, whatever happens to its name meanwhile. The
    descriptors kept are ``O_PATH`` ones: closing them drops none of the fcntl
    locks the library took meanwhile (closing a plain one would).

    ``by_name``: more entries of the folder, plain links to ``directory/<name>``: the
    library resolves those names itself when it opens them (for a file that may be
    replaced by a rename while the library waits for a lock, as compaction replaces
    ``data.mdb``).

    Yields ``directory`` itself where ``/proc`` is missing (not Linux) or, when
    not ``create``, a file is missing (the library then reports it in its own
    words; it creates nothing without ``create``). Raises :class:`UnsafeFileError`
    for a link or anything but a regular file. Thread-safe; the descriptors are
    this process's own.
    """
    if not os.path.isdir(_OWN_FDS):
        yield directory
        return
    fds: list[int] = []
    private: str | None = None
    try:
        for name in names:
            path = os.path.join(directory, name)
            # Only O_PATH descriptors of an existing file: closing any other descriptor of
            # a file drops every fcntl lock this process holds on it (LMDB's, or the lock
            # compaction holds on lock.mdb while it rebuilds it through here).
            try:
                fd = _checked(os.open(path, os.O_PATH | _NOFOLLOW), path)
            except FileNotFoundError:
                if not create:
                    yield directory
                    return
                new, _ = open_file(path, os.O_RDWR | os.O_CREAT, mode)  # new: no locks on it
                try:
                    fd = os.open(f"{_OWN_FDS}/{new}", os.O_PATH | os.O_CLOEXEC)
                finally:
                    os.close(new)
            fds.append(fd)
        private = tempfile.mkdtemp(prefix="mmcache-pinned-")
        for name, fd in zip(names, fds, strict=True):
            os.symlink(f"{_OWN_FDS}/{fd}", os.path.join(private, name))
        for name in by_name:
            os.symlink(os.path.join(os.path.abspath(directory), name), os.path.join(private, name))
        yield private
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        for fd in fds:
            os.close(fd)
