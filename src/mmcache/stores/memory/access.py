"""Who may use a memory store: its private directory in ``/dev/shm`` and the checks on it.

``/dev/shm`` is world-writable, and a store's name is easy to guess (a hash of
the cache root), so another local user could create a store's files first
(mode ``0666``) and so read every decoded sample, rewrite them with valid
checksums, or block the store. ``O_EXCL``/``O_NOFOLLOW`` stop symlinks, not
that. So every store lives in a directory that only its users can enter:

* ``/dev/shm/mmcache-u<uid>/`` (mode ``0700``, owned by the user): the default,
  one user's stores;
* ``/dev/shm/mmcache-g<gid>/`` (mode ``0770``, group ``gid``, no setgid bit):
  stores shared by the members of group ``gid`` (``MemoryStore(group=gid)``);
  only members (and root) can create files in it, and every file in it is
  given that group (``fchown``), so every member maps the same copy.

The directory is checked with ``lstat`` (a directory, not a link, with exactly
that owner or group and mode) every time a store is opened, and every file
opened in it is checked again with ``fstat`` (a regular file with that owner
or group, its mode no wider than the store's). Anything else is refused with
a :class:`CacheError` naming the file and its owner: never attached.

What this cannot stop: a process of the *same* user (or root) can still
truncate or overwrite the files; a segment truncated while mapped kills the
process touching it with SIGBUS (see ``slabs.py``: the tier then fails, it is not
re-created under its users).
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass

from mmcache.checks import check_int
from mmcache.errors import CacheError, ConfigError

__all__ = ["Access", "UntrustedFileError", "describe_owner"]


class UntrustedFileError(CacheError):
    """A store file or directory that another user could control: never used, never removed."""


def describe_owner(st: os.stat_result) -> str:
    """``"uid 1001 (alice), gid 100 (users), mode 0o666"`` for an error message."""
    try:
        import pwd

        user = f" ({pwd.getpwuid(st.st_uid).pw_name})"
    except (ImportError, KeyError):
        user = ""
    try:
        import grp

        group = f" ({grp.getgrgid(st.st_gid).gr_name})"
    except (ImportError, KeyError):
        group = ""
    return f"uid {st.st_uid}{user}, gid {st.st_gid}{group}, mode {oct(stat.S_IMODE(st.st_mode))}"


@dataclass(frozen=True)
class Access:
    """The file mode of a store's files and the group sharing it (None: this user only)."""

    mode: int = 0o600
    group: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, int) or self.mode & ~0o666 or (self.mode & 0o600) != 0o600:
            raise ConfigError(
                f"mode must be a file permission mask within 0o666 including 0o600,"
                f" got {self.mode!r}"
            )
        if self.group is None:
            if self.mode & 0o077:
                raise ConfigError(
                    f"mode {oct(self.mode)} shares the memory store, so say with which group:"
                    " pass group=<gid> (Cache uses the cache root's group)"
                )
            return
        check_int("group (a gid, or None)", self.group, minimum=0)
        if not self.mode & 0o060:
            raise ConfigError(
                f"group={self.group} but mode {oct(self.mode)} gives the group no access:"
                " use mode=0o660"
            )

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.group is None else 0o770

    def directory(self, base: str) -> str:
        """The store directory under ``base`` (``/dev/shm``), for this user or group."""
        name = f"mmcache-u{os.geteuid()}" if self.group is None else f"mmcache-g{self.group}"
        return os.path.join(base, name)

    def ensure_directory(self, base: str, *, create: bool) -> str:
        """Create (``create``) and check the store directory; return its path.

        Raises ``CacheError`` if ``base`` is missing, if the directory is missing
        and not to be created (``FileNotFoundError`` is its cause), or if it is
        not exactly ours (see the module docstring).
        """
        path = self.directory(base)
        if not os.path.isdir(base):
            # Containers and some CI runners have no /dev/shm at all; saying
            # "create the store first" would send the user the wrong way.
            raise CacheError(
                f"{base} does not exist: this host has no shared-memory directory, so the"
                " memory tier cannot be used (mount a tmpfs there, or pass memory=0)"
            )
        if create:
            self._make(path)
        try:
            st = os.lstat(path)
        except FileNotFoundError as exc:
            raise CacheError(f"no memory store directory {path}: create a store first") from exc
        self.check(st, path, directory=True)
        return path

    def _make(self, path: str) -> None:
        try:
            os.mkdir(path, 0o700)  # never wider than ours while its group is set below
        except FileExistsError:
            return  # checked by the caller, whoever made it
        except OSError as exc:
            raise CacheError(f"cannot create the memory store directory {path}: {exc}") from exc
        try:
            if self.group is not None:
                os.chown(path, -1, self.group)
            os.chmod(path, self.dir_mode)  # mkdir's mode is masked by the umask
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            raise CacheError(
                f"cannot give {path} to group {self.group} with mode {oct(self.dir_mode)}:"
                f" {exc} (is this user a member of that group?)"
            ) from exc

    def check(self, st: os.stat_result, path: str, *, directory: bool = False) -> None:
        """Raise ``CacheError`` unless ``st`` (of ``path``) is a file this store may trust."""
        kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
        mode = stat.S_IMODE(st.st_mode)
        if self.group is None:
            owner_ok = st.st_uid == os.geteuid()
            want = f"owned by uid {os.geteuid()}"
        else:
            owner_ok = st.st_gid == self.group
            want = f"of group {self.group}"
        mode_ok = mode == self.dir_mode if directory else not mode & ~self.mode
        if kind_ok and owner_ok and mode_ok:
            return
        what = "directory" if directory else "regular file"
        limit = f"mode {oct(self.dir_mode)}" if directory else f"mode within {oct(self.mode)}"
        raise UntrustedFileError(
            f"refusing to use {path}: it has {describe_owner(st)}, but the memory tier needs"
            f" a {what} {want} with {limit}. Another user may have created it to read or"
            " replace this cache's data: check who did; remove it (as its owner or root) to"
            " go on, or pass memory=0"
        )

    def check_fd(self, fd: int, path: str) -> None:
        """:meth:`check` of an open descriptor (what was really opened, no race)."""
        self.check(os.fstat(fd), path)

    def created(self, fd: int) -> None:
        """Give a file this store just created its exact mode (whatever the umask) and group."""
        if self.group is not None:
            os.fchown(fd, -1, self.group)
        os.fchmod(fd, self.mode)
