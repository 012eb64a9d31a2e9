"""The device tier of the feature cache: tensors kept where the model runs, under a byte budget.

A :class:`DeviceTier` maps 16-byte keys to tensors that live on one device
(a CUDA GPU, or the host when there is none). A hit returns the stored tensor
itself, so gathering a batch of hits is one ``torch.stack`` on the device: no
host copy, no decode. It is deliberately *not* a :class:`~mmcache.stores.base.Store`:
stores hold bytes that any process can read; this tier holds device tensors of
one process (CUDA memory cannot be shared between ranks without IPC handles,
and each rank has its own GPU anyway).

What to keep is decided by a registered :class:`~mmcache.policies.Policy`
over the tier's own metadata (size, cost, access time, insertion order,
hits), exactly as in the byte stores; the default is ``keep`` (fill once,
never evict), which reaches the C/N hit-rate bound under per-epoch shuffling.

Budget rule: ``nbytes() <= capacity()`` at every moment, where ``nbytes``
counts ``numel * element_size`` of the tensors held. The CUDA caching
allocator rounds each block up (to 512 B), so the memory really reserved can
be slightly higher; for features (hundreds of KiB to MiB each) the difference
is below 0.1%.

Thread safety: every method takes an internal lock, so one tier may be used
from several threads; it is not shared between processes.

>>> import torch
>>> tier = DeviceTier(1024, device="cpu")
>>> tier.put(b"k" * 16, torch.zeros(4, 16)), tier.nbytes()
(True, 256)
>>> tier.get(b"k" * 16).shape
torch.Size([4, 16])
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt
import torch

from mmcache.checks import check_int
from mmcache.policies import Policy, Residents, get_policy, validate_victims
from mmcache.stats import TierStats
from mmcache.stores.base import check_key
from mmcache.units import format_size

__all__ = ["DeviceTier"]

log = logging.getLogger(__name__)

_MIN_SLOTS = 64


class DeviceTier:
    """Tensors on one device under a hard byte budget, admitted by a policy.

    Args:
        capacity: the byte budget (``0`` disables the tier: every put is refused).
        device: where admitted tensors are kept; a tensor put from elsewhere is
            copied there.
        policy: a registered policy name or instance (default ``keep``).
        clock: the access-time clock for ``lru``/``lfu`` (injectable for tests).
        name: the tier's name in stats.

    Metadata lives in parallel numpy columns indexed by slot (like the shared
    memory tier), so asking the policy for victims is vectorised whatever the
    number of entries.
    """

    def __init__(
        self,
        capacity: int,
        *,
        device: torch.device | str = "cpu",
        policy: str | Policy = "keep",
        clock: Callable[[], float] = time.monotonic,
        name: str = "device",
    ) -> None:
        check_int("DeviceTier capacity (bytes)", capacity, minimum=0)
        self.name = name
        self.device = torch.device(device)
        self.policy = get_policy(policy)
        self._clock = clock
        self._capacity = capacity
        self._lock = threading.Lock()
        self._slot_of: dict[bytes, int] = {}
        self._tensors: list[torch.Tensor | None] = []
        self._key_at: list[bytes | None] = []
        self._free: list[int] = []
        self._size: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self._cost: npt.NDArray[np.float64] = np.zeros(0, np.float64)
        self._atime: npt.NDArray[np.float64] = np.zeros(0, np.float64)
        self._ctime: npt.NDArray[np.float64] = np.zeros(0, np.float64)
        self._hits: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self._seq: npt.NDArray[np.int64] = np.zeros(0, np.int64)
        self._used: npt.NDArray[np.bool_] = np.zeros(0, np.bool_)
        self._next_seq = 0
        self._nbytes = 0
        self._counts = dict.fromkeys(
            ("hits", "misses", "puts", "admitted", "refused", "evictions"), 0
        )
        self._warned_oversize = False

    # -- reads ------------------------------------------------------------------------------
    def get(self, key: bytes) -> torch.Tensor | None:
        """The stored tensor (not a copy: do not modify it in place), or None.

        Counts a hit or a miss and updates the entry's access time and hits.
        """
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """:meth:`get` for many keys under one lock acquisition."""
        now = self._clock()
        out: list[torch.Tensor | None] = []
        with self._lock:
            for key in keys:
                slot = self._slot_of.get(key)
                if slot is None:
                    self._counts["misses"] += 1
                    out.append(None)
                    continue
                self._counts["hits"] += 1
                self._atime[slot] = now
                self._hits[slot] += 1
                out.append(self._tensors[slot])
        return out

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is held (counts nothing)."""
        with self._lock:
            return key in self._slot_of

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.contains(key)

    def keys(self) -> Iterator[bytes]:
        """A snapshot of the keys held."""
        with self._lock:
            snapshot = list(self._slot_of)
        return iter(snapshot)

    def __len__(self) -> int:
        with self._lock:
            return len(self._slot_of)

    def nbytes(self) -> int:
        """Bytes of the tensors held (``numel * element_size``)."""
        with self._lock:
            return self._nbytes

    def capacity(self) -> int:
        """The hard byte budget."""
        return self._capacity

    def stats(self) -> TierStats:
        """Counters of this tier (this process only: the tier is not shared)."""
        with self._lock:
            return TierStats(
                **self._counts,
                bytes=self._nbytes,
                budget=self._capacity,
                items=len(self._slot_of),
            )

    # -- writes -----------------------------------------------------------------------------
    def put(self, key: bytes, tensor: torch.Tensor, *, cost: float = 0.0) -> bool:
        """Keep a copy of ``tensor`` under ``key`` if the budget and the policy allow it.

        The tier stores its own contiguous copy on its device, so the caller may
        reuse or modify ``tensor`` afterwards, and the entry holds exactly its
        own bytes (a view of a larger batch tensor would keep the whole batch
        alive). ``cost`` is the seconds it takes to recompute the entry (the
        ``value`` policy keeps the densest). Replacing a key is allowed; a
        refused replacement leaves the old entry out. Returns whether it was kept.
        """
        check_key(key)
        size = tensor.numel() * tensor.element_size()
        with self._lock:
            self._counts["puts"] += 1
            old = self._slot_of.get(key)
            if old is not None:
                self._remove_locked(old)
            if size > self._capacity:
                self._counts["refused"] += 1
                if not self._warned_oversize and self._capacity > 0:
                    self._warned_oversize = True
                    log.warning(
                        "%s tier: an entry of %s exceeds the whole budget of %s; refused "
                        "(logged once)",
                        self.name,
                        format_size(size),
                        format_size(self._capacity),
                    )
                return False
            need = self._nbytes + size - self._capacity
            if need > 0:
                victims = self._victims_locked(size, cost, need)
                if victims is None:
                    self._counts["refused"] += 1
                    return False
                for slot in victims:
                    self._remove_locked(int(slot))
                    self._counts["evictions"] += 1
            # Copy outside the metadata update but inside the lock: a concurrent
            # reader must never see a slot whose tensor is not there yet.
            stored = tensor.detach().to(self.device, copy=True).contiguous()
            self._insert_locked(key, stored, size, cost)
            self._counts["admitted"] += 1
            return True

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present."""
        with self._lock:
            slot = self._slot_of.get(key)
            if slot is None:
                return False
            self._remove_locked(slot)
            return True

    def clear(self) -> None:
        """Drop every entry (frees the device memory once no caller holds the tensors)."""
        with self._lock:
            for slot in list(self._slot_of.values()):
                self._remove_locked(slot)

    # -- internals (caller holds the lock) --------------------------------------------------
    def _residents_locked(self) -> tuple[npt.NDArray[np.int64], Residents]:
        slots = np.flatnonzero(self._used).astype(np.int64)
        return slots, Residents(
            size=self._size[slots],
            cost=self._cost[slots],
            atime=self._atime[slots],
            ctime=self._ctime[slots],
            hits=self._hits[slots],
            seq=self._seq[slots],
        )

    def _victims_locked(self, size: int, cost: float, need: int) -> npt.NDArray[np.int64] | None:
        slots, residents = self._residents_locked()
        if len(residents) == 0:
            return None
        rows = self.policy.select_victims(residents, size=size, cost=cost, need=need)
        check = validate_victims(self.policy, residents, rows, need=need)
        if check.rows is None:
            if check.problem is not None:  # must not break the budget: refuse instead
                log.error("%s for a %d-byte entry; refused", check.problem, size)
            return None
        return slots[check.rows]

    def _grow_locked(self) -> None:
        n = max(_MIN_SLOTS, 2 * len(self._tensors))
        extra = n - len(self._tensors)
        self._size = np.concatenate([self._size, np.zeros(extra, np.int64)])
        self._cost = np.concatenate([self._cost, np.zeros(extra, np.float64)])
        self._atime = np.concatenate([self._atime, np.zeros(extra, np.float64)])
        self._ctime = np.concatenate([self._ctime, np.zeros(extra, np.float64)])
        self._hits = np.concatenate([self._hits, np.zeros(extra, np.int64)])
        self._seq = np.concatenate([self._seq, np.zeros(extra, np.int64)])
        self._used = np.concatenate([self._used, np.zeros(extra, np.bool_)])
        # Free slots are popped from the end: reuse low slots first.
        self._free.extend(range(n - 1, len(self._tensors) - 1, -1))
        self._tensors.extend([None] * extra)
        self._key_at.extend([None] * extra)

    def _insert_locked(self, key: bytes, tensor: torch.Tensor, size: int, cost: float) -> None:
        if not self._free:
            self._grow_locked()
        slot = self._free.pop()
        now = self._clock()
        self._tensors[slot] = tensor
        self._key_at[slot] = key
        self._size[slot] = size
        self._cost[slot] = max(float(cost), 0.0)
        self._atime[slot] = now
        self._ctime[slot] = now
        self._hits[slot] = 0
        self._seq[slot] = self._next_seq
        self._used[slot] = True
        self._next_seq += 1
        self._slot_of[key] = slot
        self._nbytes += size

    def _remove_locked(self, slot: int) -> None:
        key = self._key_at[slot]
        if key is None:  # pragma: no cover - slots in _slot_of always hold an entry
            return
        del self._slot_of[key]
        self._tensors[slot] = None
        self._key_at[slot] = None
        self._nbytes -= int(self._size[slot])
        self._used[slot] = False
        self._size[slot] = 0
        self._free.append(slot)

    def __repr__(self) -> str:
        return (
            f"DeviceTier({format_size(self._capacity)} on {self.device}, policy={self.policy!r}, "
            f"{len(self)} entries, {format_size(self.nbytes())})"
        )
