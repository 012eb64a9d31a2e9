"""The members of a clean tar shard, found at C speed: the headers read in large windows,
their chain followed over sizes parsed for a whole window at once, and every header of
a window checked at once with numpy.

Why not :class:`~mmcache.sources.blobs.tarwalk.TarWalk` alone: :mod:`tarfile` parses every
field of every header in Python, each header with its own small read: ~30 us a member,
three members a sample, so ~100 us a sample and 2.7 hours to open 10^8 samples the first
time. Here a shard is read in windows (1 MiB while its members are small; after a member
larger than :data:`_SMALL_MEMBER`, a window of :data:`_SMALL_WINDOW`, so that a shard of
large members is read near its headers only, as tarfile reads it). In a window, the
size field of every 512-byte block is parsed at once (the usual field: 11 octal digits
and a NUL), so following the chain of headers costs a list lookup each; the headers of
the chain are then checked at once:

- each is a regular file (type ``"0"`` or NUL, and not a V7 directory named ``.../``);
- every number tarfile parses (mode, uid, gid, size, mtime, checksum, devmajor,
  devminor) is plain octal (spaces, digits, spaces, up to a NUL), so that tarfile's
  value is the one read here;
- its checksum is the unsigned or the signed byte sum tarfile accepts;
- its data lies inside the file, and the walk ends at an all-zero block or exactly at
  the end of the file.

A shard that is not clean in each of these ways (PAX or GNU long-name headers, base-256
numbers, links, directories, sparse files, an empty or all-zero file, a header cut
short or damaged, data past the end) gives ``None``: the caller walks it with
:class:`~mmcache.sources.blobs.tarwalk.TarWalk` under its bounds, which says what it is.
So on a shard the fast walk takes, the members (names, data offsets, sizes) are those
tarfile gives; and it never holds more than one window and one small member (a size
field only moves the next position: a hostile one cannot make it allocate).

Thread safety: a walk reads one file object; use one per thread.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import IO

import numpy as np
import numpy.typing as npt

__all__ = ["Walked", "quick_walk"]

_BLOCK = 512
_ZERO = bytes(_BLOCK)
#: The window read while members are small (many headers a read).
_BIG_WINDOW = 1 << 20
#: The window read after a member larger than :data:`_SMALL_MEMBER`: its neighbours'
#: headers and small members, not the large members' data.
_SMALL_WINDOW = 8 << 10
_SMALL_MEMBER = 64 << 10
_TYPE, _PREFIX = 156, slice(345, 500)
_REGTYPE, _AREGTYPE = ord("0"), 0
#: The numeric fields tarfile parses (``nti``) in every header: offset, length.
_NUMBERS = ((100, 8), (108, 8), (116, 8), (124, 12), (136, 12), (148, 8), (329, 8), (337, 8))
#: Their bytes side by side (76 columns), and where the checksum's 8 are among them.
_NUMBER_COLUMNS = np.concatenate([np.arange(a, a + n) for a, n in _NUMBERS])
_CHK_AT = sum(n for a, n in _NUMBERS if a < 148)
#: Each byte of a numeric field as a class: digit, space, NUL, anything else.
_CLASS = bytes(
    ord("d") if chr(b) in "01234567" else ord("s") if b == 32 else ord("n") if b == 0 else ord("x")
    for b in range(256)
)
_PLAIN = re.compile(rb"s*d*s*(?:n.*)?", re.DOTALL)  # a field tarfile reads as plain octal
#: 8 ** (10 - i): the value of the usual size field's 11 digits.
_POWERS = 8.0 ** np.arange(10, -1, -1)


@dataclass
class Walked:
    """The members of a shard, in tar order, and the bytes of those the walk was asked
    to read (see :func:`quick_walk`), by member number."""

    names: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    data: dict[int, bytes] = field(default_factory=dict)


def quick_walk(
    fileobj: IO[bytes], *, size: int, suffixes: tuple[str, ...], limit: int
) -> Walked | None:
    """The members of the tar in ``fileobj`` (``size`` bytes) if it is clean (see the
    module docstring), else ``None``. The data of each member whose lower-cased name
    ends with one of ``suffixes`` and whose size is at most ``limit`` is read too."""
    if size == 0:
        return None  # an empty file: tarfile's answer (not a tar)
    wanted = _Wanted(suffixes, limit)
    out = Walked()
    pos = 0
    window = _BIG_WINDOW
    while pos < size:
        if pos + _BLOCK > size:
            return None  # a header cut by the end of the file
        fileobj.seek(pos)
        buf = fileobj.read(min(size - pos, window))
        if len(buf) < _BLOCK:
            return None
        blocks = np.frombuffer(buf, dtype=np.uint8, count=len(buf) // _BLOCK * _BLOCK)
        blocks = blocks.reshape(-1, _BLOCK)
        chain, sizes, end = _chain(buf, blocks)
        if not chain:  # an all-zero block first: the end, or an empty archive (TarWalk's)
            return out if end and pos > 0 else None
        last = sizes[-1]
        if last < 0 or pos + chain[-1] * _BLOCK + _BLOCK + last > size:
            return None  # not a number, or data past the end of the file
        found = _members(blocks[chain], wanted)
        if found is None:
            return None
        names, sure, maybe = found
        offsets = ((np.asarray(chain, dtype=np.int64) + 1) * _BLOCK + pos).tolist()
        wanted.take(out, names, (sure, maybe), offsets=offsets, sizes=sizes, buf=buf, base=pos,
                    fileobj=fileobj)  # fmt: skip
        if end:
            return out  # an all-zero block: the end of the archive
        pos += (chain[-1] + 1) * _BLOCK + _padded(last)
        window = _BIG_WINDOW if last <= _SMALL_MEMBER else _SMALL_WINDOW
    return out if pos == size else None  # past the end: the last padding is cut


def _padded(n: int) -> int:
    return (n + _BLOCK - 1) // _BLOCK * _BLOCK


def _chain(buf: bytes, blocks: npt.NDArray[np.uint8]) -> tuple[list[int], list[int], bool]:
    """The block numbers and sizes of the headers chained in ``buf`` from its start,
    and whether an all-zero block ends the chain (else it leaves ``buf``, or stops at a
    size field that is not a number: its size is then -1).

    The usual size field (11 octal digits, a NUL) is parsed for every block at once;
    another is read as ``int`` reads it (leniently: signs, spaces and underscores pass)
    and the numbers are checked to be plain octal afterwards (:func:`_plain_octal`)."""
    field = blocks[:, 124:136]
    digits = field[:, :11] - np.uint8(ord("0"))  # wraps: a digit is then 0-7, else > 7
    usual = np.all(digits <= 7, axis=1) & (field[:, 11] == 0)
    # float64 holds 11 octal digits exactly (< 2^33) and takes the BLAS path
    value = (digits @ _POWERS).astype(np.int64)
    step = np.where(usual, 1 + (value + _BLOCK - 1) // _BLOCK, 0).tolist()
    chain: list[int] = []
    odd: dict[int, int] = {}  # position in the chain -> size, for the unusual fields
    i, count = 0, len(step)
    while i < count:
        s = step[i]
        if s == 0:
            rel = i * _BLOCK
            if buf[rel] == 0 and buf[rel : rel + _BLOCK] == _ZERO:
                return chain, _sizes(value, chain, odd), True
            try:
                n = int(buf[rel + 124 : rel + 136].split(b"\0", 1)[0], 8)
            except ValueError:
                n = -1
            odd[len(chain)] = n
            if n < 0:
                chain.append(i)
                break
            s = 1 + (n + _BLOCK - 1) // _BLOCK
        chain.append(i)
        i += s
    return chain, _sizes(value, chain, odd), False


def _sizes(value: npt.NDArray[np.int64], chain: list[int], odd: dict[int, int]) -> list[int]:
    sizes: list[int] = value[chain].tolist()
    for j, n in odd.items():
        sizes[j] = n
    return sizes


def _members(
    heads: npt.NDArray[np.uint8], wanted: _Wanted
) -> tuple[list[str], npt.NDArray[np.bool_], npt.NDArray[np.bool_]] | None:
    """The names of ``heads`` and which of them the walk wants or may want
    (:func:`_names`), if every header is clean (see the module docstring), else
    ``None``."""
    kind = heads[:, _TYPE]
    if not np.all((kind == _REGTYPE) | (kind == _AREGTYPE)):
        return None
    chksum = _plain_octal(heads)
    if chksum is None or not _checksums_hold(heads, chksum):
        return None
    names, sure, maybe = _names(heads, wanted.raw)
    if any(names[i].endswith("/") for i in np.flatnonzero(kind == _AREGTYPE).tolist()):
        return None  # a V7 directory: tarfile makes it one
    return names, sure, maybe


def _plain_octal(heads: npt.NDArray[np.uint8]) -> npt.NDArray[np.int64] | None:
    """The checksum field of each header if every numeric field of every header is
    plain octal (tarfile's ``nti`` then reads the value read here), else ``None``.

    Usually every header of a shard writes its numbers alike (``0000644\\0``, ...): the
    class of each byte (digit, space, NUL, other) of the first header's fields is then
    the class of every header's, which one comparison of bytes shows; the first
    header's fields are checked, and the checksums read at the digits' places. Else
    each header's fields are checked with numpy (:func:`_plain_octal_each`)."""
    numbers = heads[:, _NUMBER_COLUMNS]
    classes = numbers.tobytes().translate(_CLASS)
    width = len(_NUMBER_COLUMNS)
    first = classes[:width]
    if classes != first * heads.shape[0]:
        return _plain_octal_each(numbers)
    at = 0
    for _, n in _NUMBERS:
        if _PLAIN.fullmatch(first[at : at + n]) is None:
            return None
        at += n
    chk = first[_CHK_AT : _CHK_AT + 8].split(b"n", 1)[0]  # up to its NUL
    places = [j for j in range(len(chk)) if chk[j] == ord("d")]
    powers = 8 ** np.arange(len(places) - 1, -1, -1, dtype=np.int64)
    digits = numbers[:, [_CHK_AT + j for j in places]].astype(np.int64) - ord("0")
    out: npt.NDArray[np.int64] = digits @ powers
    return out


def _plain_octal_each(numbers: npt.NDArray[np.uint8]) -> npt.NDArray[np.int64] | None:
    """:func:`_plain_octal` header by header, vectorised: ``numbers`` holds the fields
    side by side (``_NUMBER_COLUMNS``)."""
    width = 13  # the widest field (12) and a NUL column, which ends every field
    f = np.zeros((numbers.shape[0], len(_NUMBERS), width), dtype=np.uint8)
    at = 0
    for j, (_, n) in enumerate(_NUMBERS):
        f[:, j, :n] = numbers[:, at : at + n]
        at += n
    live = np.arange(width) < np.argmax(f == 0, axis=2)[:, :, None]  # before the NUL
    digit = (f >= ord("0")) & (f <= ord("7")) & live
    if np.any(live & ~digit & (f != ord(" "))):
        return None
    runs = digit[:, :, 0].astype(np.int64) + (digit[:, :, 1:] & ~digit[:, :, :-1]).sum(axis=2)
    if np.any(runs > 1):
        return None  # digits, spaces, digits: int() refuses it
    row = [a for a, _ in _NUMBERS].index(148)
    chk, chk_digit = f[:, row].astype(np.int64) - ord("0"), digit[:, row]
    value = np.zeros(numbers.shape[0], dtype=np.int64)
    for j in range(width):  # Horner over the digits, a column at a time
        value = np.where(chk_digit[:, j], value * 8 + chk[:, j], value)
    return value


_LOW_BYTES = np.uint64(0x00FF00FF00FF00FF)
_LANE = np.uint64(0xFFFF)


def _byte_sums(heads: npt.NDArray[np.uint8]) -> npt.NDArray[np.int64]:
    """The sum of each header's 512 bytes, eight at a time: each uint64 word's bytes
    added pairwise into four 16-bit lanes (64 words of at most 2 x 255 each fit a
    lane), the lanes added last."""
    words = heads.view(np.uint64)
    lanes = ((words & _LOW_BYTES) + ((words >> np.uint64(8)) & _LOW_BYTES)).sum(axis=1)
    total = lanes & _LANE
    for shift in (16, 32, 48):
        total += (lanes >> np.uint64(shift)) & _LANE
    out: npt.NDArray[np.int64] = total.astype(np.int64)
    return out


def _checksums_hold(heads: npt.NDArray[np.uint8], chksum: npt.NDArray[np.int64]) -> bool:
    """Whether each header's checksum is its unsigned or signed byte sum, the checksum
    field counted as spaces (tarfile's ``calc_chksums``)."""
    field_sum = heads[:, 148:156].sum(axis=1, dtype=np.int64)
    unsigned = _byte_sums(heads) - field_sum + 8 * ord(" ")
    bad = unsigned != chksum
    if not bad.any():
        return True
    rows = heads[bad]
    high = (rows >= 128).sum(axis=1) - (rows[:, 148:156] >= 128).sum(axis=1)
    return bool(np.all(unsigned[bad] - 256 * high == chksum[bad]))


def _names(
    heads: npt.NDArray[np.uint8], suffixes: tuple[bytes, ...] | None
) -> tuple[list[str], npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """Each header's member name as tarfile makes it (the name field up to its NUL,
    decoded as tarfile decodes it; a ustar prefix joined with ``/``), and which names
    end with one of ``suffixes`` once lower-cased: ``sure`` (an ASCII name without a
    prefix whose last bytes, ASCII lower-cased, are a suffix: exactly what
    ``str.lower`` would say) and ``maybe`` (names a byte comparison cannot decide:
    a prefix, a byte that is not ASCII; every name when ``suffixes`` is None). A name
    never holds a NUL, so the names are cut out with one NUL after each and split in
    one call."""
    encoding = sys.getfilesystemencoding()  # tarfile's default, with surrogateescape
    k = heads.shape[0]
    field = heads[:, :100]
    ends = np.argmax(field == 0, axis=1)
    full = np.flatnonzero(field[:, 99] != 0)  # 100 bytes, no NUL: cut apart below
    ends[full] = 99  # here: its first 99 bytes and a byte that is not its NUL
    blob = field[np.arange(100) <= ends[:, None]].tobytes()  # each name and its NUL
    maybe = heads[:, _PREFIX.start] != 0  # a ustar prefix
    if blob.isascii():
        text = blob.decode("ascii").split("\0")
    else:
        text = [raw.decode(encoding, "surrogateescape") for raw in blob.split(b"\0")]
        maybe |= np.any(field >= 128, axis=1)
    if full.size:  # the split ran those names into the next: every name once more
        text = [raw.decode(encoding, "surrogateescape") for raw in _cut(field)]
        ends[full] = 100
    else:
        text.pop()  # after the last NUL
    for i in np.flatnonzero(heads[:, _PREFIX.start]).tolist():
        prefix = heads[i, _PREFIX].tobytes().split(b"\0", 1)[0]
        text[i] = prefix.decode(encoding, "surrogateescape") + "/" + text[i]
    if suffixes is None:
        return text, np.zeros(k, dtype=bool), np.ones(k, dtype=bool)
    sure = np.zeros(k, dtype=bool)
    rows = np.arange(k)[:, None]
    for suffix in suffixes:
        want = np.frombuffer(suffix, dtype=np.uint8)
        at = np.clip(ends[:, None] - len(want) + np.arange(len(want)), 0, 99)
        tail = field[rows, at]
        tail = np.where((tail >= ord("A")) & (tail <= ord("Z")), tail + 32, tail)
        sure |= np.all(tail == want, axis=1) & (ends >= len(want))
    return text, sure & ~maybe, maybe


def _cut(field: npt.NDArray[np.uint8]) -> list[bytes]:
    """Each name field's bytes up to its NUL, one by one (the rare window that holds a
    name of the field's whole 100 bytes)."""
    return [bytes(row).split(b"\0", 1)[0] for row in field]


class _Wanted:
    """Which members' data the walk reads: a lower-cased name ending with one of
    ``suffixes``, a size of at most ``limit``."""

    def __init__(self, suffixes: tuple[str, ...], limit: int) -> None:
        self.suffixes = suffixes
        self.limit = limit
        #: The suffixes as bytes for the first look at the names (None: not ASCII).
        self.raw = (
            tuple(s.encode("ascii") for s in suffixes)
            if all(s.isascii() for s in suffixes)
            else None
        )

    def take(
        self,
        out: Walked,
        names: list[str],
        marks: tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]],
        *,
        offsets: list[int],
        sizes: list[int],
        buf: bytes,
        base: int,
        fileobj: IO[bytes],
    ) -> None:
        """Add the members of one window (read at file offset ``base``) to ``out``, with
        the data of the wanted ones (``marks``: those surely wanted, those that may be:
        :func:`_names`): from the window, or read (a member past it)."""
        first = len(out.names)
        out.names += names
        out.offsets += offsets
        out.sizes += sizes
        sure, maybe = marks
        limit, data = self.limit, out.data
        for j in np.flatnonzero(sure | maybe).tolist():
            n = sizes[j]
            if n > limit or (maybe[j] and not names[j].lower().endswith(self.suffixes)):
                continue
            start = offsets[j] - base
            if start + n <= len(buf):
                data[first + j] = buf[start : start + n]
            else:
                fileobj.seek(offsets[j])
                data[first + j] = fileobj.read(n)
