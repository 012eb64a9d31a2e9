"""Stable content keys: what a cached entry was computed from, as a 16-byte digest.

A sample's key hashes everything its cached bytes depend on: the format version,
the sample id, a stamp of the source file, the pipeline's fingerprint and the
caption. Change the image file, the caption or any pipeline parameter and the
key changes, so the old entry is simply never asked for again (``mmcache gc`` or
the TTL reclaims it). Nothing is ever "invalidated" in place.

Keys are **digests**, never user strings: stores use them as LMDB keys or, hashed,
as file names, so an id like ``"../../etc/passwd"`` or one with NUL bytes is
just hashed like any other. The hash is xxh3_128 (fast, stable across platforms
and versions of the ``xxhash`` package); it is not a cryptographic hash: it
guards against accidental collisions (~2^-64 for 2^32 entries), not against an
adversary who chooses sample ids to collide.

Encoding of the key material (:func:`digest`): each part is written as a
one-byte type tag, its length as uint64 little-endian, and its bytes::

    str   -> b"s" + len + UTF-8 (lone surrogates kept with "surrogatepass")
    bytes -> b"b" + len + the bytes
    int   -> b"i" + len + decimal ASCII ("-12")
    None  -> b"n" + len 0

Every part is self-delimiting, so the encoding of a tuple of parts is
unambiguous: ``("ab", "c")``, ``("a", "bc")``, ``("abc",)`` and ``(b"abc",)``
all differ, and so do ``None`` and ``""``. Each kind of key starts with its own
domain string (``"mmcache.sample"``, ``"mmcache.feature"``), so a sample key can
never equal a feature key.

All functions are pure and thread- and process-safe.

>>> key = sample_key("img-001", "1043:1700000000000000000:1700000000000000000:42", "fp", "a cat")
>>> len(key), key_from_hex(key_hex(key)) == key
(16, True)
>>> source_stamp(None)
'none'
"""

from __future__ import annotations

import errno
import os
import re
import struct
from collections.abc import Sequence

import xxhash

__all__ = [
    "FORMAT_VERSION",
    "KEY_SIZE",
    "STAT_FIELDS",
    "as_key",
    "digest",
    "feature_key",
    "fields_stamp",
    "key_from_hex",
    "key_hex",
    "sample_key",
    "source_stamp",
    "stat_fields",
    "stat_stamp",
]

#: Keys are 128-bit digests (xxh3_128 of the key material); every store is keyed by them.
KEY_SIZE = 16

#: Version of the cached bytes and of this key scheme. Part of every key: bump
#: it whenever :mod:`mmcache.codec`'s format, a pipeline's output meaning or
#: this module's encoding changes, and every old entry stops being served.
FORMAT_VERSION = 1

_LEN = struct.Struct("<Q")
_HEX_RE = re.compile(r"[0-9a-fA-F]{32}")
_CHUNK = 1 << 20


def digest(*parts: str | bytes | int | None) -> bytes:
    """Return the 16-byte xxh3_128 digest of ``parts``, encoded unambiguously.

    See the module docstring for the encoding. ``bool`` is refused (``True``
    would silently hash like ``1``); so are other types (``TypeError``).
    """
    hasher = xxhash.xxh3_128()
    for part in parts:
        if isinstance(part, str):
            tag, data = b"s", part.encode("utf-8", "surrogatepass")
        elif isinstance(part, bytes):
            tag, data = b"b", part
        elif isinstance(part, bool):
            raise TypeError(f"digest parts are str, bytes, int or None; got bool {part!r}")
        elif isinstance(part, int):
            tag, data = b"i", str(part).encode("ascii")
        elif part is None:
            tag, data = b"n", b""
        else:
            raise TypeError(f"digest parts are str, bytes, int or None; got {type(part).__name__}")
        hasher.update(tag)
        hasher.update(_LEN.pack(len(data)))
        hasher.update(data)
    return hasher.digest()


#: The ``os.stat`` fields a default source stamp is made of, in this order. Size
#: and mtime see an ordinary rewrite; ``st_ino`` tells a file from every other
#: file of its file system (two datasets with equal ids, captions, sizes and
#: mtimes; a record pointed at another file); ``st_ctime_ns`` is set to the
#: current time by every write, ``utime``, rename, ``chmod`` or new inode, and no
#: system call sets it back (short of changing the clock), so a rewrite with the
#: size and mtime restored (``touch -d``, ``cp -p``, ``rsync -a``, ``tar x``) is
#: seen too. ``st_dev`` is left out on purpose: it is not stable (overlayfs in a
#: container, NFS, btrfs subvolumes and FUSE get a new device number at each
#: mount or boot), so a persistent disk tier would miss after each; two files on
#: two file systems with the same inode number, size, mtime and ctime to the
#: nanosecond do not occur by chance. Every comparison of file stamps (the keys,
#: the dataset's key memo, the loader's check of warm epochs on the sweeper's
#: stamp board) uses exactly these fields, through :func:`stat_fields`.
STAT_FIELDS = ("st_size", "st_mtime_ns", "st_ctime_ns", "st_ino")

_WRAP = 1 << 64
_INT64_MAX = (1 << 63) - 1


def stat_fields(st: os.stat_result) -> tuple[int, int, int, int]:
    """The :data:`STAT_FIELDS` of ``st`` as int64 values (an inode number over
    2**63 wraps to a negative one), ready for an ``int64`` array row."""
    ino = st.st_ino - _WRAP if st.st_ino > _INT64_MAX else st.st_ino
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, ino


def fields_stamp(fields: Sequence[int]) -> str:
    """The source stamp of a file from its :func:`stat_fields` (for batched ``stat`` loops:
    ``fields_stamp(row.tolist())`` of an ``int64`` row equals :func:`stat_stamp`)."""
    return ":".join(str(int(f)) for f in fields)


def stat_stamp(st: os.stat_result) -> str:
    """The default source stamp of a file from its ``os.stat`` result:
    ``"<size>:<mtime_ns>:<ctime_ns>:<inode>"`` (see :data:`STAT_FIELDS`)."""
    return fields_stamp(stat_fields(st))


def source_stamp(path: str | os.PathLike[str] | None, *, content: bool = False) -> str:
    """Return a short string that changes when the file at ``path`` changes.

    - ``None`` (a text-only record): ``"none"``.
    - default: :func:`stat_stamp`, ``"<size>:<mtime_ns>:<ctime_ns>:<inode>"``
      from ``os.stat`` (symlinks followed), which costs one ``stat``, tells
      different files apart and catches any rewrite, also one with the size and
      the mtime restored (the ctime cannot be restored; see :data:`STAT_FIELDS`).
      Costs and caveats: a ``chmod``, ``chown``, new hard link or a copy
      elsewhere changes the stamp (the sample is produced again once); a file
      system without real ctimes or stable inode numbers (some FUSE mounts give
      new inode numbers at each mount: every key changes) hides changes or
      defeats the disk tier: use ``content=True`` for such data.
    - ``content=True``: ``"xxh3:<32 hex>"``, the xxh3_128 of the file's bytes,
      read in 1 MiB chunks; changes exactly when the bytes change (and survives
      copies), at the price of reading the file.
    - a file that does not exist: ``"missing"``; another error (permission,
      a directory with ``content=True``...): ``"error:<ERRNO NAME>"``. The key
      still computes; loading the sample then reports the real error.
    """
    if path is None:
        return "none"
    try:
        if not content:
            return stat_stamp(os.stat(path))
        hasher = xxhash.xxh3_128()
        with open(path, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                hasher.update(chunk)
        return f"xxh3:{hasher.hexdigest()}"
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except ValueError:  # embedded NUL byte: no such file can exist
        return "missing"
    except OSError as exc:
        name = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else "unknown"
        return f"error:{name}"


def sample_key(
    sample_id: str,
    stamp: str,
    pipeline_fingerprint: str,
    text: str | None = None,
) -> bytes:
    """Return the 16-byte key of a sample's cached bytes.

    ``stamp`` comes from :func:`source_stamp`, ``pipeline_fingerprint`` from the
    pipeline (every parameter that changes its output), ``text`` is the caption
    (``None`` and ``""`` give different keys). Any id is accepted (paths, NUL
    bytes, unicode): it is hashed, never used as a name.
    """
    return digest("mmcache.sample", FORMAT_VERSION, sample_id, stamp, pipeline_fingerprint, text)


def feature_key(sample_key: bytes, encoder_fingerprint: str, dtype: str, output: str) -> bytes:
    """Return the 16-byte key of a frozen encoder's output for one sample.

    ``encoder_fingerprint`` identifies the encoder's weights and preprocessing,
    ``dtype`` the stored precision (``"float16"``, ``"bfloat16"``), ``output`` which
    output is cached (``"last_hidden_state"``, ``"pooled"``...). Raises
    ``ValueError`` if ``sample_key`` is not a 16-byte key.
    """
    _check_key(sample_key)
    return digest("mmcache.feature", FORMAT_VERSION, sample_key, encoder_fingerprint, dtype, output)


def key_hex(key: bytes) -> str:
    """Return the 32-character lowercase hex form of a key (for logs, CLI, reports)."""
    return _check_key(key).hex()


def key_from_hex(s: str) -> bytes:
    """Parse the hex form of a key. Raises ``ValueError`` unless ``s`` is exactly 32
    hex digits (either case; no spaces, no ``0x``)."""
    if not isinstance(s, str) or _HEX_RE.fullmatch(s) is None:
        raise ValueError(f"a key is 32 hex digits, got {s!r}")
    return bytes.fromhex(s)


def as_key(key: str | bytes) -> bytes:
    """Return the 16-byte key that ``key``, as given to :class:`~mmcache.cache.Cache`, names.

    - ``bytes`` of exactly 16: the key itself (what :func:`sample_key` returns).
    - a ``str`` of exactly 32 hex digits, either case: the key it spells
      (:func:`key_from_hex`; what :func:`key_hex`, logs and the CLI print).
    - any other ``str`` or ``bytes`` (``"k0"``, ``"sample/001.jpg"``, ``b"abc"``,
      ``""``): ``digest("mmcache.key", key)``, hashed to 16 bytes. The type is
      part of the hash, so ``"abc"`` and ``b"abc"`` are two keys; the domain
      string keeps them apart from sample and feature keys.

    The first two rules are how keys were read before any string was accepted,
    so existing caches keep their meaning. Raises ``TypeError`` for other types.

    >>> as_key("k0") == digest("mmcache.key", "k0")
    True
    >>> k = sample_key("img-001", "stamp", "fp")
    >>> as_key(k) == as_key(key_hex(k)) == as_key(key_hex(k).upper()) == k
    True
    """
    if isinstance(key, bytes):
        return key if len(key) == KEY_SIZE else digest("mmcache.key", key)
    if isinstance(key, str):
        return key_from_hex(key) if _HEX_RE.fullmatch(key) else digest("mmcache.key", key)
    raise TypeError(f"a cache key is str or bytes, got {type(key).__name__} {key!r}")


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_SIZE:
        raise ValueError(f"a key is {KEY_SIZE} bytes, got {key!r}")
    return key
