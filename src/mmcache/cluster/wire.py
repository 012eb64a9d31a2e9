"""One message per peer and window: entries packed into one byte tensor, sent point-to-point.

A message is ``[n][n keys of 16 bytes][n indices][n lengths][payload]``
(little-endian int64 counts): the entries exactly as the memory tier stores
them (codec-encoded, checksum included). It travels as two ``isend``/``irecv``
pairs on the exchange's own process group, the length then the bytes, tagged by
the window so a late message is never taken for another window's. Every wait
has a timeout: gloo closes the pair on a timeout, so a peer that timed out is
dropped for the rest of the run by the caller.

NCCL: when the exchange group's backend is ``nccl`` the payload is staged in
pinned host memory and sent as a CUDA tensor (written for GPUs, not tested
here: the CI machines have none; gloo is the default and is tested).

Thread safety: one exchange thread per process uses a :class:`Wire`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from mmcache.keys import KEY_SIZE

__all__ = ["Message", "Wire", "pack", "unpack"]

_I64 = np.dtype("<i8")


@dataclass(frozen=True)
class Message:
    """Entries of one message: their keys, dataset indices and encoded bytes."""

    keys: list[bytes]
    indices: list[int]
    raws: list[bytes]

    @property
    def nbytes(self) -> int:
        return sum(len(r) for r in self.raws)


def pack(msg: Message) -> npt.NDArray[np.uint8]:
    n = len(msg.raws)
    head = np.empty(1 + 2 * n, dtype=_I64)
    head[0] = n
    head[1 : 1 + n] = msg.indices
    head[1 + n :] = [len(r) for r in msg.raws]
    parts = [head[:1].tobytes(), b"".join(msg.keys), head[1:].tobytes(), *msg.raws]
    return np.frombuffer(bytearray(b"".join(parts)), dtype=np.uint8)  # writable for torch


def unpack(buf: npt.NDArray[np.uint8]) -> Message:
    """The entries of a packed message; raises ValueError if it is malformed."""
    data = buf.tobytes()
    if len(data) < 8:
        raise ValueError("exchange message shorter than its header")
    n = int(np.frombuffer(data[:8], dtype=_I64)[0])
    keys_end = 8 + KEY_SIZE * n
    head_end = keys_end + 16 * n
    if n < 0 or head_end > len(data):
        raise ValueError(f"exchange message header says {n} entries, too many for its size")
    keys = [data[8 + KEY_SIZE * i : 8 + KEY_SIZE * (i + 1)] for i in range(n)]
    head = np.frombuffer(data[keys_end:head_end], dtype=_I64)
    indices, lengths = head[:n].tolist(), head[n:].tolist()
    if sum(lengths) != len(data) - head_end or min(lengths, default=0) < 0:
        raise ValueError("exchange message lengths do not add up to its payload")
    raws, at = [], head_end
    for length in lengths:
        raws.append(data[at : at + length])
        at += length
    return Message(keys, indices, raws)


class Wire:
    """Send one message to each peer and receive one from each, within a timeout."""

    def __init__(self, group: Any, backend: str, timeout: float) -> None:
        self.group = group
        self.cuda = backend == "nccl"
        self.timeout = datetime.timedelta(seconds=timeout)

    def _tensor(self, arr: npt.NDArray[np.generic]) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(arr))
        if self.cuda:  # pragma: no cover - needs a GPU
            return t.pin_memory().cuda(non_blocking=True)
        return t

    def _empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        if self.cuda:  # pragma: no cover - needs a GPU
            return torch.empty(n, dtype=dtype, device="cuda")
        return torch.empty(n, dtype=dtype)

    def exchange(
        self, out: dict[int, npt.NDArray[np.uint8]], tag: int
    ) -> tuple[dict[int, npt.NDArray[np.uint8]], dict[int, str]]:
        """Send ``out[peer]`` to each peer and receive each peer's message to us.

        Returns what was received and, for each peer that failed (timeout, closed
        connection), the reason: its message is missing.
        """
        dist = torch.distributed
        failed: dict[int, str] = {}
        sizes_in = {p: self._empty(1, torch.int64) for p in out}
        works: list[tuple[int, Any]] = []
        for p, arr in out.items():
            try:
                size = self._tensor(np.array([arr.shape[0]], dtype=np.int64))
                works.append((p, dist.isend(size, p, group=self.group, tag=tag)))
                works.append((p, dist.irecv(sizes_in[p], p, group=self.group, tag=tag)))
            except RuntimeError as exc:
                failed[p] = str(exc)
        self._wait(works, failed)
        works = []
        bufs: dict[int, torch.Tensor] = {}
        for p, arr in out.items():
            if p in failed:
                continue
            try:
                if arr.shape[0]:
                    works.append(
                        (p, dist.isend(self._tensor(arr), p, group=self.group, tag=tag + 1))
                    )
                n = int(sizes_in[p].cpu().item())
                bufs[p] = self._empty(n, torch.uint8)
                if n:
                    works.append((p, dist.irecv(bufs[p], p, group=self.group, tag=tag + 1)))
            except RuntimeError as exc:
                failed[p] = str(exc)
        self._wait(works, failed)
        got = {}
        for p, t in bufs.items():
            if p not in failed:
                host = t.cpu() if self.cuda else t
                got[p] = host.numpy()
        return got, failed

    def _wait(self, works: list[tuple[int, Any]], failed: dict[int, str]) -> None:
        for p, work in works:
            if p in failed:
                continue
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as exc:
                failed[p] = str(exc)
