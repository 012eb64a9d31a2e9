"""``ClusterExchange``: the loader hook that brings other nodes' samples ahead of the batches.

Runs in the training process (DataLoader workers cannot use a process group),
in one background thread with its own gloo process group, so it never
interleaves with the model's collectives. For each window of batches, in
order and up to ``ahead + 2`` batches beyond the last one assembled here, it
sends each peer the entries the :class:`~mmcache.cluster.schedule.Schedule`
says, receives what the peers send, checks each received entry (its key is the
one this process computes for that sample, its checksum holds and its layout is
this pipeline's: :mod:`~mmcache.cluster.received`) and puts it in
the node's in-flight tier (:mod:`~mmcache.cluster.flight`; a home sample sent
home goes to the memory tier, under the budget), where the loader finds it as an
ordinary hit. The loader asks :meth:`ClusterExchange.before_plan` before it plans
a batch, which waits for that batch's window (or gives up after the timeout: the
batch is then produced locally, as without the exchange). ``ahead`` is at least
how far the loader's workers plan ahead (one batch a task under an exchange), so
every batch they plan is waited for. A batch planned further ahead than that is
not: the model's collectives keep ranks within a batch of each other, and a rank
waiting for a window its peer may not exchange yet would stall both.

After a window is consumed (its last batch assembled), the entries received for
it are deleted (the node keeps only its home samples), and the samples of it
that were read here although homed elsewhere and that nobody sent (cold: the
home node had not got them) were produced here, into the in-flight tier: they
are sent home in the next window, to every rank of the home node, and deleted
here. The exchange does not cross into the next epoch before this epoch's last
window is consumed, so what an epoch produced is home before the next one is planned.

Failures: a peer that times out or closes its connection is dropped for the rest
of the run (gloo closes a pair on a timeout), logged and counted
(:class:`ExchangeStats`); what it would have sent is produced locally.

Thread safety: ``before_epoch``, ``before_plan`` and ``after_assemble`` are called by
the loader's threads; state shared with the exchange thread is guarded by one
condition variable. The thread reads keys through its own copy of the source
(``key_rows`` is single-threaded).
"""

from __future__ import annotations

import copy
import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from mmcache import codec
from mmcache.cache import Cache
from mmcache.cluster.flight import flight_bound, open_flight
from mmcache.cluster.placement import home_nodes
from mmcache.cluster.received import EntryCheck
from mmcache.cluster.schedule import Schedule
from mmcache.cluster.topology import Topology
from mmcache.cluster.wire import Message, Wire, pack, unpack
from mmcache.errors import ConfigError
from mmcache.hooks import BatchContext, EpochContext, LoaderHook
from mmcache.sources.base import SampleSource
from mmcache.sources.capabilities import index_count

__all__ = ["ClusterExchange", "ExchangeStats"]

logger = logging.getLogger(__name__)

#: Batches per exchange window, and how many batches beyond the one planned the
#: exchange may run (the received entries of that many batches are in memory at once).
WINDOW = 2
AHEAD = 2
_TAG_SPAN = 1 << 27  # tags wrap after this many windows


@dataclass
class ExchangeStats:
    """What the exchange did so far in this process."""

    windows: int = 0
    sent: int = 0
    sent_bytes: int = 0
    received: int = 0
    received_bytes: int = 0
    sent_home: int = 0  # cold samples produced here, sent to their home node
    refused: int = 0  # received entries whose key, checksum or layout did not match
    peer_failures: int = 0  # peers dropped (timeout, closed connection)
    late_batches: int = 0  # batches planned before their window came (produced locally)
    dropped: int = 0  # received entries deleted after their window was consumed
    dead_peers: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Window:
    received: set[int]
    transient: list[bytes]


Pos = tuple[int, int]  # (epoch, window)


class ClusterExchange(LoaderHook):
    """The exchange of one loader (made by the loader when its cache has ``scope="cluster"``).

    Collective at construction (every rank makes its loader at the same point):
    gathers every rank's node and memory budget, makes the exchange's own
    process group (gloo; ``backend="nccl"`` stages payloads in pinned memory and
    sends CUDA tensors: written for GPUs, untested here). ``batches(rank, epoch)``:
    any rank's batches of any epoch.
    """

    def __init__(
        self,
        cache: Cache,
        dataset: SampleSource,
        batches: Callable[[int, int], list[np.ndarray]],
        *,
        seed: int,
        timeout: float,
        window: int = WINDOW,
        ahead: int = AHEAD,
        backend: str = "gloo",
        planned_ahead: int = 2,
        fixed_shapes: bool = True,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"the exchange backend is 'gloo' or 'nccl', got {backend!r}")
        # Workers plan up to ``planned_ahead`` batches ahead: the exchange runs that far
        # ahead too, so that each of those batches is waited for (before_plan), not missed.
        ahead = max(ahead, planned_ahead)
        memory = cache.memory
        if memory is None:
            raise ConfigError(
                'scope="cluster" needs a memory tier (the node-shared tier the exchange '
                "fills): give the cache a memory budget"
            )
        self._memory = memory
        self._timeout = timeout
        delta = datetime.timedelta(seconds=timeout)
        group = torch.distributed.new_group(backend=backend, timeout=delta)
        # Gathered on a gloo group: CPU objects, whatever the training backend is.
        meta = group if backend == "gloo" else torch.distributed.new_group(backend="gloo")
        self.topology = Topology.gather(cache.memory_budget, group=meta)
        self.home = home_nodes(index_count(dataset), self.topology.budgets, seed)
        #: Samples homed on another node: produced here, they go to the in-flight tier.
        self.guests: npt.NDArray[np.bool_] = self.home != self.topology.node
        mine = self.topology.ranks_of(self.topology.node)
        size = max((len(b) for b in batches(self.topology.rank, 0)), default=1)
        #: Most entries the node's in-flight tier holds at once (see :mod:`.flight`).
        self.flight_entries = len(mine) * size * flight_bound(window, ahead)
        self._flight = open_flight(cache, self.flight_entries)  # in the cache's tier list
        self._wire = Wire(group, backend, timeout)
        self._source: SampleSource = copy.deepcopy(dataset)
        self.schedule = Schedule(self.topology, self.home, batches, window)
        self._ahead = ahead
        self._peers = list(self.topology.peers(self.topology.rank))
        self._stats = ExchangeStats()
        # Each received entry must be what this rank would make (received.py).
        self._check = EntryCheck(fixed_shapes=fixed_shapes)
        self._dead: list[int] = []
        self._warned_keys = False  # the one warning of entries refused for their keys
        self._cond = threading.Condition()
        self._cursor: Pos | None = None  # the next window to exchange
        self._done: tuple[int, int] = (0, -1)  # the last (epoch, batch) assembled here
        self._consumed: dict[int, int] = {}  # epoch -> windows consumed (in order)
        self._windows: dict[Pos, _Window] = {}
        self._finished: list[Pos] = []  # consumed windows to clean up (thread)
        self._offers: list[tuple[int, bytes]] = []  # (index, key) to send home
        self._later: dict[Pos, list[bytes]] = {}  # keys sent home, deleted once pos is consumed
        self._begun: int | None = None  # the epoch of the last before_epoch
        self._late: Pos | None = None  # the last window waited for in vain
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- loader hooks (training process threads) -----------------------------------------
    def before_epoch(self, ctx: EpochContext) -> None:
        start = (ctx.epoch, self.schedule.window_of(ctx.start))
        with self._cond:
            if self._cursor != start:  # a new epoch, a resumed or replayed one
                self.schedule.clear()  # a resumed epoch's batches may have changed
                self._cursor = start
                self._consumed[ctx.epoch] = start[1]
            self._done = (ctx.epoch, ctx.start - 1)
            self._begun = ctx.epoch
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mmcache-exchange", daemon=True)
            self._thread.start()
        # Persistent workers were given this epoch's first tasks before it began; they
        # plan them once the loader opens the epoch, after this: have those windows here.
        if ctx.num_batches > ctx.start:
            self.before_plan(ctx.epoch, min(ctx.start + self._ahead, ctx.num_batches - 1))

    def _horizon(self, batch: int) -> int:
        """The last window the exchange may run while ``batch`` is the last assembled."""
        return self.schedule.window_of(max(batch + self._ahead + 2, 0))

    def before_plan(self, epoch: int, batch: int) -> None:
        """Wait until the window of ``batch`` has been exchanged (or the timeout passed)."""
        logger.debug("before_plan %d %d cursor %s", epoch, batch, self._cursor)
        target = (epoch, self.schedule.window_of(batch))
        deadline = time.monotonic() + 2 * self._timeout + 5.0
        with self._cond:
            if self._begun is None or epoch > self._begun:
                return  # a task for an epoch not begun (persistent workers): see before_epoch
            done_e, done_b = self._done
            if epoch == done_e and target[1] > self._horizon(done_b - 1):
                # Planned far ahead (workers' prefetch): a peer one batch behind may not
                # be allowed this window yet, and waiting for it could stall both (the
                # model's collectives keep ranks in step); not waited for.
                return
            if self._late is not None and target <= self._late:
                return  # waited for this window already
            while not self._closed and self._cursor is not None and self._cursor <= target:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._late = target
                    self._stats.late_batches += 1
                    logger.warning(
                        "cluster exchange: batch %d of epoch %d planned before its window "
                        "arrived (waited %.0f s): its samples from other nodes are produced here",
                        batch,
                        epoch,
                        2 * self._timeout + 5.0,
                    )
                    return
                self._cond.wait(left)

    def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> dict[str, Any]:
        w = self.schedule.window_of(ctx.batch)
        with self._cond:
            self._done = max(self._done, (ctx.epoch, ctx.batch))
            self._cond.notify_all()
        if ctx.batch == self.schedule.last_batch(ctx.epoch, w):
            with self._cond:
                self._consumed[ctx.epoch] = max(self._consumed.get(ctx.epoch, 0), w + 1)
                self._finished.append((ctx.epoch, w))
                self._cond.notify_all()
        return batch

    def stats(self) -> ExchangeStats:
        """A copy of the counters so far."""
        with self._cond:
            return ExchangeStats(**{**asdict(self._stats), "dead_peers": list(self._dead)})

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:  # a daemon: not waited for when stuck on a peer
            self._thread.join(timeout=1.0)

    # -- the exchange thread ---------------------------------------------------------------
    def _next(self) -> Pos | None:
        """The next window to exchange, once the loader is near it (None: closed)."""
        with self._cond:
            while not self._closed:
                cur = self._cursor
                if cur is not None:
                    cur = self._roll(cur)
                    self._cursor = cur
                    if cur is not None and self._allowed(cur):
                        return cur
                if self._finished:
                    return None if self._closed else (-1, -1)  # clean up first
                self._cond.wait(1.0)
            return None

    def _roll(self, cur: Pos) -> Pos | None:
        """``cur``, or the next epoch's first window once this epoch is done and consumed."""
        e, w = cur
        if w < self.schedule.windows(e):
            return cur
        if self._consumed.get(e, 0) >= self.schedule.windows(e):
            return (e + 1, 0)
        return cur  # wait: the epoch's cold samples are sent home first

    def _allowed(self, cur: Pos) -> bool:
        e, w = cur
        if w >= self.schedule.windows(e):
            return False
        done_e, done_b = self._done
        if e < done_e:
            return True
        return e == done_e and w <= self._horizon(done_b)

    def _run(self) -> None:
        try:
            while True:
                pos = self._next()
                if pos is None:
                    return
                self._clean_up()
                if pos == (-1, -1):
                    continue
                logger.debug("exchange window %s of rank %d", pos, self.topology.rank)
                self._exchange(*pos)
                with self._cond:
                    if self._cursor == pos:
                        self._cursor = (pos[0], pos[1] + 1)
                    self._stats.windows += 1
                    self._cond.notify_all()
        except Exception:  # never leave the loader waiting on a dead thread
            logger.exception("cluster exchange thread failed; batches are produced locally")
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def _clean_up(self) -> None:
        """Delete the received entries of consumed windows; queue their cold samples."""
        with self._cond:
            done, self._finished = self._finished, []
            windows = [self._windows.pop(p, None) for p in done]
        for pos, win in zip(done, windows, strict=True):
            for key in self._later.pop(pos, []):
                self._forget(key)
            if win is None:
                continue
            for key in win.transient:
                if self._forget(key):
                    self._stats.dropped += 1
            foreign = self.schedule.foreign(*pos)
            cold = np.array([i for i in foreign.tolist() if i not in win.received], np.int64)
            if cold.size:
                keys = self._keys(cold)
                self._offers.extend(zip(cold.tolist(), keys, strict=True))

    def _node_reads(self, epoch: int, w: int) -> set[int]:
        """What the ranks of this node read in window ``w`` of ``epoch``."""
        out: set[int] = set()
        for r in self.topology.ranks_of(self.topology.node):
            out.update(self.schedule.reads(r, epoch, w).tolist())
        return out

    def _keys(self, indices: npt.NDArray[np.int64]) -> list[bytes]:
        rows = self._source.key_rows(indices)
        return [bytes(r) for r in rows]

    def _exchange(self, epoch: int, w: int) -> None:
        sched = self.schedule
        offers, self._offers = self._offers, []
        out: dict[int, Message] = {}
        home_ranks = {n: set(self.topology.ranks_of(n)) for n in range(self.topology.nodes)}
        for peer in self._peers:
            idx = sched.serve(epoch, w, peer)
            keys = self._keys(idx) if idx.size else []
            chosen = [(int(i), k) for i, k in zip(idx.tolist(), keys, strict=True)]
            chosen += [(i, k) for i, k in offers if peer in home_ranks[int(self.home[i])]]
            raws = [self._read(i, k) for i, k in chosen]
            present = [(i, k, r) for (i, k), r in zip(chosen, raws, strict=True) if r is not None]
            out[peer] = Message(
                [k for _, k, _ in present], [i for i, _, _ in present], [r for _, _, r in present]
            )
        tag = 2 * ((epoch * 4096 + w) % _TAG_SPAN)
        got, failed = self._wire.exchange({p: pack(m) for p, m in out.items()}, tag)
        for peer, why in failed.items():
            self._drop(peer, why)
        for peer, msg in out.items():
            if peer not in failed:
                self._stats.sent += len(msg.raws)
                self._stats.sent_bytes += msg.nbytes
        # Cold samples sent home to every rank there: gone from here (kept when a rank
        # of their home failed: this node may need them again). One this node reads in
        # this window stays until the next is consumed: the home got it too late to
        # serve it in this window.
        live = set(self._peers)
        near = self._node_reads(epoch, w)
        later = self._later.setdefault((epoch, min(w + 1, sched.windows(epoch) - 1)), [])
        for i, key in offers:
            ranks = home_ranks[int(self.home[i])]
            if ranks <= live:
                self._stats.sent_home += 1
                if i in near:
                    later.append(key)
                else:
                    self._forget(key)
            else:  # kept for this node: under the memory budget and its policy
                self._keep(key)
        self._receive(epoch, w, got)

    def _read(self, index: int, key: bytes) -> bytes | None:
        """The entry of sample ``index``: other homes' in the in-flight tier first."""
        first, then = (self._flight, self._memory) if self.guests[index] else (self._memory, None)
        raw = first.get(key)
        raw = raw if raw is not None or then is None else then.get(key)
        if raw is not None:
            self._check.learn(raw)  # this node's own entry: the layout its pipeline makes
        return raw

    def _forget(self, key: bytes) -> bool:
        """Delete an entry held for another node (the in-flight tier, or memory)."""
        return self._flight.delete(key) or self._memory.delete(key)

    def _keep(self, key: bytes) -> None:
        """Move an entry from the in-flight tier to the memory tier (its home failed)."""
        raw = self._flight.get(key)
        if raw is not None:
            header = codec.read_header(raw)
            self._memory.put(key, raw, cost=header.cost, ctime=header.ctime)
            self._flight.delete(key)

    def _receive(self, epoch: int, w: int, got: dict[int, npt.NDArray[np.uint8]]) -> None:
        me = self.topology.node
        foreign = set(self.schedule.foreign(epoch, w).tolist())
        window = _Window(set(), [])
        entries: list[tuple[int, bytes, bytes]] = []
        for peer, buf in got.items():
            try:
                msg = unpack(buf)
            except ValueError as exc:
                self._drop(peer, f"malformed message: {exc}")
                continue
            entries += zip(msg.indices, msg.keys, msg.raws, strict=True)
        if entries:
            indices = np.array([i for i, _, _ in entries], dtype=np.int64)
            ok = (indices >= 0) & (indices < self.home.shape[0])
            mine = self._keys(indices[ok]) if ok.any() else []
            want = dict(zip(indices[ok].tolist(), mine, strict=True))
            other_keys = 0
            for i, key, raw in entries:
                home = int(self.home[i]) if 0 <= i < self.home.shape[0] else -1
                why = self._check.refusal(want.get(i), key, raw)
                if why is not None or not (home == me or i in foreign):
                    other_keys += i in want and want[i] != key  # for the one warning below
                    self._stats.refused += 1  # another version of the sample, or damaged
                    logger.debug("cluster exchange: refused sample %d: %s", i, why)
                    continue
                # Home samples go under the budget; other homes' to the in-flight tier.
                tier = self._memory if home == me else self._flight
                if tier.contains(key) or (home != me and self._memory.contains(key)):
                    if home != me:  # here already (a cold one of this node): its home
                        window.received.add(i)  # has it, so it goes with the window
                        window.transient.append(key)
                    continue
                header = codec.read_header(raw)
                if tier.put(key, raw, cost=header.cost, ctime=header.ctime):
                    self._stats.received += 1
                    self._stats.received_bytes += len(raw)
                    if home != me:
                        window.received.add(i)
                        window.transient.append(key)
            if other_keys:
                self._warn_keys(other_keys, len(entries))
        with self._cond:
            self._windows[(epoch, w)] = window

    def _warn_keys(self, refused: int, entries: int) -> None:
        """Say once why entries are refused for their keys (G17: it was silent before)."""
        if self._warned_keys:
            return
        self._warned_keys = True
        logger.warning(
            "cluster exchange: %d of %d entries received from other nodes were refused "
            "because their keys differ from this node's keys of the same samples: the "
            "nodes read other bytes (another version of the data, or copies that differ; "
            "copies made with cp -a/rsync -a of one dataset give equal keys) or another "
            "pipeline; those samples are produced locally (stats().refused counts them)",
            refused,
            entries,
        )

    def _drop(self, peer: int, why: str) -> None:
        if peer in self._peers:
            self._peers.remove(peer)
            self._stats.peer_failures += 1
            self._dead.append(peer)
            logger.warning(
                "cluster exchange: rank %d dropped (%s); its samples are produced locally "
                "from now on",
                peer,
                why,
            )
