"""``FormedDiskStore``: a disk tier that stores each value in a compact form.

A :class:`~mmcache.stores.disk.DiskStore` whose values pass through a *form*
(an object with ``pack(value) -> bytes`` and ``unpack(stored) -> bytes``, e.g.
:class:`mmcache.codec.compact.DiskForm`) on the way in and out: ``put`` stores
``pack(value)``, ``get``/``view``/``get_many`` return ``unpack(stored)``. The
budget counts the stored (compact) bytes, so the same budget holds more entries.
A stored value that does not unpack (raises) is damaged: it is discarded
(counted ``corrupt``) and reads as absent. It never gathers batches in the
training process (a decode is not a byte-range copy): its hits go through the
cache's verified read (``Cache.lookup``), in the loader's workers.

Thread/process safety: as :class:`~mmcache.stores.disk.DiskStore`; the form
must be pure (it is pickled with the store for spawned workers).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from mmcache.stores.disk import DiskStore

__all__ = ["FormedDiskStore", "ValueForm"]

logger = logging.getLogger(__name__)


class ValueForm(Protocol):
    """What a :class:`FormedDiskStore` needs of a form."""

    def pack(self, raw: bytes | memoryview) -> bytes: ...

    def unpack(self, stored: bytes | memoryview) -> bytes: ...


class FormedDiskStore(DiskStore):
    """A :class:`DiskStore` whose values are stored as ``form.pack(value)``.

    Args: those of :class:`DiskStore`, and ``form``.
    """

    def __init__(self, path: Any, *, form: ValueForm, **kwargs: Any) -> None:
        self._form = form
        super().__init__(path, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "form": self._form}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        form = state.pop("form")
        self.__init__(state.pop("path"), form=form, **state)  # type: ignore[misc]

    @property
    def form(self) -> ValueForm:
        """The form of the stored values."""
        return self._form

    def _unpack(self, key: bytes, stored: bytes | None) -> bytes | None:
        if stored is None:
            return None
        try:
            return self._form.unpack(stored)
        except Exception as exc:  # damaged bytes: whatever the decoder raises
            logger.error("corrupt disk-tier entry %s dropped: %s", key.hex(), exc)
            self.discard(key, why="corrupt")
            return None

    def get(self, key: bytes) -> bytes | None:
        """The unpacked value, or None (absent or damaged). Counts a hit or a miss."""
        return self._unpack(key, super().get(key))

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self._unpack(k, v) for k, v in zip(keys, super().get_many(keys), strict=True)]

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        """A buffer of the unpacked value (a copy: the stored bytes are another form)."""
        value = self.get(key)
        yield None if value is None else memoryview(value)

    def put_many(
        self, entries: Iterable[tuple[bytes, bytes | memoryview, float, float]]
    ) -> list[bool]:
        """``put`` each ``(key, value, cost, ctime)`` as ``form.pack(value)``."""
        return super().put_many((k, self._form.pack(v), c, t) for k, v, c, t in entries)

    def verify(self, check: Callable[[bytes], bool]) -> list[bytes]:
        """Keys whose stored value does not unpack, or whose unpacked value fails ``check``."""

        def unpacked_ok(stored: bytes) -> bool:
            try:
                return check(self._form.unpack(stored))
            except Exception:
                return False

        return super().verify(unpacked_ok)
