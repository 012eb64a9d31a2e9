"""The members of a tar shard, walked with :mod:`tarfile` under bounds that a hostile
shard cannot get past: no read larger than :data:`MAX_META` bytes, no header whose size
field is negative, no header that does not lie after the previous one.

Why not :mod:`tarfile` alone: it trusts the numbers in each header. A negative size field
sends CPython's reader (before the fix of CVE-2025-8194, i.e. most Pythons the project
supports) back to the same header forever; a GNU long-name or PAX header is read whole,
``fileobj.read(size)``, so a header claiming 1 TiB allocates 1 TiB before anything can
refuse it, and a negative one reads the rest of the file. Why still :mod:`tarfile`: the
parsing of each 512-byte header (checksums, base-256 numbers, ustar prefixes, GNU long
names, PAX records and their charsets) is the library's and is correct on every shard
that is not hostile. What is bounded here is everything around it:

- the file object tarfile reads is wrapped (:class:`_Bounded`) so that any read of more
  than :data:`MAX_META` bytes, or of a negative or unlimited count, raises
  :class:`DamagedShard` instead of allocating: tarfile itself reads only headers (512
  bytes), GNU/PAX metadata blocks and, through ``extractfile``, the small ``.json``
  members the index asks for (at most :data:`MAX_META` too);
- each member tarfile yields is checked before its numbers are used: a size below zero,
  a header at or before the previous one (the loop of a negative size), or data starting
  inside its own header is a :class:`DamagedShard` naming the shard's byte offset and the
  member;
- a meta-header chain too deep for the recursion of tarfile's parser, or a sparse
  header cut by the end of the file (an ``IndexError`` inside tarfile), is damage too.

A shard cut short (the end of the file inside a header or a member's data) is not
damage: :func:`walk` stops there and says ``truncated``, keeping the members before it,
as a partly downloaded shard needs.

Thread safety: a walk reads one file object; use one per thread.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterator
from typing import IO, Any

from mmcache.errors import MmcacheError

__all__ = ["MAX_META", "DamagedShard", "TarWalk"]

#: The largest GNU long-name or PAX block (and ``.json`` member) read from a shard. A
#: real long name or PAX record set is a few hundred bytes; 1 MiB bounds what one hostile
#: header can make the process allocate.
MAX_META = 1 << 20

_BLOCK = tarfile.BLOCKSIZE


class DamagedShard(tarfile.TarError, MmcacheError):
    """A tar header that cannot be trusted: what is wrong, at which byte of the shard,
    in which member (when its name could be read). Sources turn it into a
    ``ManifestError`` naming the shard; it is an ``MmcacheError`` too, so that nothing
    mmcache raises is outside the one hierarchy."""

    def __init__(self, reason: str, *, offset: int, member: str | None = None) -> None:
        self.reason = reason
        self.offset = offset
        self.member = member
        where = f"the header at byte {offset}"
        if member is not None:
            where += f" (member {member!r})"
        super().__init__(f"damaged tar header: {where}: {reason}")


class _Bounded:
    """The file object handed to tarfile: reads over ``limit`` bytes are refused."""

    def __init__(self, raw: IO[bytes], limit: int) -> None:
        self._raw = raw
        self._limit = limit

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0 or n > self._limit:
            offset = self._raw.tell()
            what = "an unbounded count (a negative size)" if n is None or n < 0 else f"{n} bytes"
            raise DamagedShard(
                f"its GNU long-name or PAX block asks to read {what}, over the limit of "
                f"{self._limit} bytes",
                offset=max(offset - _BLOCK, 0),
            )
        return self._raw.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()


class TarWalk:
    """The regular-file members of the tar in ``fileobj`` (``size`` bytes), in tar order.

    Iterate it for ``tarfile.TarInfo`` objects whose ``offset_data + size`` lies inside
    the file; read a small member's bytes with :meth:`read` (at most :data:`MAX_META`).
    After the iteration, :attr:`truncated` says whether the shard ended early (its last
    member's data or a header cut). Raises :class:`tarfile.ReadError` when the first
    header is not a tar header, :class:`DamagedShard` as the module docstring says.
    """

    def __init__(self, fileobj: IO[bytes], *, size: int, limit: int = MAX_META) -> None:
        self._file = _Bounded(fileobj, limit)
        self._size = size
        self._limit = limit
        self.truncated = False
        self.truncation: str | None = None
        self._tar: tarfile.TarFile | None = None

    def __iter__(self) -> Iterator[tarfile.TarInfo]:
        tar = self._tar = self._guarded(
            0,
            lambda: tarfile.open(fileobj=self._file, mode="r:"),  # type: ignore[call-overload]  # noqa: SIM115 - closed below
        )
        try:
            last = -1
            while True:
                try:
                    member = self._guarded(max(last, 0), tar.next)
                except (tarfile.ReadError, EOFError) as exc:  # cut short after a header
                    self.truncated, self.truncation = True, str(exc)
                    return
                if member is None:
                    return
                self._check(member, last)
                last = member.offset
                if not member.isfile():
                    continue
                if member.offset_data + member.size > self._size:
                    self.truncated = True  # the data of the last member is cut: leave it out
                    self.truncation = (
                        f"member {member.name!r} ends at byte {member.offset_data + member.size}"
                        f", past the end of the {self._size}-byte file"
                    )
                    return
                yield member
        finally:
            tar.close()
            self._tar = None

    def read(self, member: tarfile.TarInfo) -> bytes:
        """The data of ``member`` (one just yielded, at most the walk's limit in size)."""
        if self._tar is None or member.size > self._limit:
            raise ValueError(f"cannot read member {member.name!r} here")
        handle = self._tar.extractfile(member)
        return b"" if handle is None else handle.read(member.size)

    @staticmethod
    def _check(member: tarfile.TarInfo, last: int) -> None:
        if member.size < 0:
            raise DamagedShard(
                f"its size field is negative ({member.size})",
                offset=member.offset,
                member=member.name,
            )
        if member.offset <= last:
            raise DamagedShard(
                f"it does not follow the previous header (at byte {last})",
                offset=member.offset,
                member=member.name,
            )
        if member.offset_data < member.offset + _BLOCK:
            raise DamagedShard(
                f"its data starts at byte {member.offset_data}, inside its own header",
                offset=member.offset,
                member=member.name,
            )

    @staticmethod
    def _guarded(offset: int, call: Callable[[], Any]) -> Any:
        """``call()`` with the errors of tarfile's parser on a hostile chain as damage."""
        try:
            return call()
        except RecursionError:
            raise DamagedShard(
                "a chain of GNU long-name or PAX headers too long to follow", offset=offset
            ) from None
        except (IndexError, ValueError, OverflowError, UnicodeError) as exc:
            raise DamagedShard(f"{type(exc).__name__}: {exc}", offset=offset) from None
