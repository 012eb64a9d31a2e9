"""Build numbered items in order on a helper thread, the consumer helping when it would wait.

The loader makes batch ``j`` of an epoch in two steps: *fetch* its plan, which
must happen in order (plans arrive from one ordered source: the workers'
results), then *build* it (gather from shared memory and fill; mostly numpy
copies that release the GIL). :class:`InOrderBuilder` runs these steps

- on a helper thread (started with the first item), which builds up to
  ``ahead`` items from the one the consumer takes next, while the consumer
  (the training step) does other work;
- and on the consumer itself: when it asks for an item that is not finished,
  it claims and builds the next unclaimed one instead of sleeping.

So when the training step is long, loading is hidden behind it; when loading
is the bottleneck (a warm epoch with a short step), both threads copy at once
and no item waits for a thread hand-off (waking a sleeping thread and passing
it the GIL costs about as much as gathering a few samples).

Errors: an exception of ``build(j)`` is raised by :meth:`take` for item ``j``,
in order; one of ``fetch(j)`` too, and nothing after ``j`` is fetched.

Thread safety: :meth:`take` is called by one consumer thread; ``fetch`` runs
under a lock (never two at once, always in order); ``build`` may run on both
threads at once for different items and must be thread-safe.

An :class:`AssemblerThread` is one such helper thread kept for many builders,
one after another (the loader's epochs): starting and joining a thread for
each would cost the first item of every epoch a thread start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["AssemblerThread", "InOrderBuilder"]

P = TypeVar("P")
T = TypeVar("T")


def _closed(*_args: Any) -> Any:
    raise RuntimeError("InOrderBuilder is closed")


class InOrderBuilder(Generic[P, T]):
    """Items ``start .. end-1``, each ``build(j, fetch(j))``, taken in order.

    Args:
        start, end: the item numbers.
        fetch: ``j -> plan``; called in increasing ``j``, one call at a time.
        build: ``(j, plan) -> item``; may run concurrently for different ``j``.
        ahead: the most items claimed beyond the next one to take (bounds the
            memory of finished items: their buffers).
        name: the helper thread's name.
        helper: a :class:`AssemblerThread` to serve this builder (else it starts its own thread).
    """

    def __init__(
        self,
        start: int,
        end: int,
        *,
        fetch: Callable[[int], P],
        build: Callable[[int, P], T],
        ahead: int,
        name: str = "mmcache-assembler",
        helper: AssemblerThread | None = None,
    ) -> None:
        if ahead < 1:
            raise ValueError(f"ahead must be >= 1, got {ahead}")
        self._fetch = fetch
        self._build = build
        self._ahead = ahead
        self._end = end
        self._want = start  # the next item the consumer takes
        self._next_claim = start  # the next item nobody has claimed
        self._done: dict[int, tuple[bool, T | BaseException]] = {}
        self._broken = False  # a fetch failed: nothing after it is claimed
        self._stop = False
        # One lock, two conditions: the consumer (and close) wait for items on _ready,
        # the helper waits for work on _work, so each wake-up goes where it is needed
        # (a wake-up costs a GIL hand-off, every batch).
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._work = threading.Condition(self._lock)
        self._fetch_lock = threading.Lock()
        self._helping = 0  # items the helper thread is building now
        self._shared = helper
        self._started = False
        # Started by the first take(), after the consumer claimed its first item:
        # starting a thread and handing it the GIL would delay the first item. Not
        # made at all with a shared helper (an unstarted thread keeps its target, and
        # so this builder and all it refers to, in a reference cycle).
        self._thread: threading.Thread | None = None
        if helper is None:
            self._thread = threading.Thread(target=self.helper_loop, name=name, daemon=True)

    # -- both threads --------------------------------------------------------------------
    def _can_claim(self) -> bool:  # under self._lock
        limit = min(self._end, self._want + self._ahead)
        return not (self._stop or self._broken) and self._next_claim < limit

    def _claim_and_build(self, *, helper: bool = False) -> None:
        """Claim the next item, fetch its plan (in order) and build it; no-op if none.

        ``helper``: run by the helper thread (so the consumer may be waiting for it).
        """
        with self._fetch_lock:
            with self._lock:
                if not self._can_claim():
                    return
                j = self._next_claim
                self._next_claim = j + 1
            try:
                plan = self._fetch(j)
            except BaseException as exc:
                with self._lock:
                    self._broken = True
                    self._done[j] = (False, exc)
                    self._ready.notify_all()
                return
        result: tuple[bool, T | BaseException]
        try:
            result = (True, self._build(j, plan))
        except BaseException as exc:
            result = (False, exc)
        with self._lock:
            self._done[j] = result
            if helper:
                self._ready.notify_all()

    def helper_loop(self) -> None:
        """The helper thread's loop for this builder; returns once it is closed."""
        while True:
            with self._lock:
                while not self._stop and not self._can_claim():
                    self._work.wait()
                if self._stop:
                    return
                self._helping += 1
            try:
                self._claim_and_build(helper=True)
            finally:
                with self._lock:
                    self._helping -= 1
                    self._ready.notify_all()

    # -- consumer ------------------------------------------------------------------------
    def take(self) -> T:
        """The next item in order; builds one itself rather than wait. StopIteration at the end."""
        want = self._want
        if want >= self._end:
            raise StopIteration
        if not self._started:
            self._claim_and_build()  # the first item: nobody else can have claimed it
            self._started = True
            if self._shared is not None:
                self._shared.serve(self)
            elif self._thread is not None:
                self._thread.start()
        while True:
            with self._lock:
                done = self._done.pop(want, None)
                if done is not None:
                    self._want = want + 1
                    self._work.notify()  # the helper may claim one more
                    break
                if not self._can_claim():
                    if self._stop:
                        raise RuntimeError("InOrderBuilder is closed")
                    self._ready.wait()
                    continue
            self._claim_and_build()
        ok, value = done
        if not ok:
            assert isinstance(value, BaseException)
            raise value
        return value  # type: ignore[return-value]

    def close(self, timeout: float | None = None) -> bool:
        """Stop the helper after the item it is building; True if it has stopped.

        Finished items not taken are dropped. Idempotent. With a shared
        :class:`AssemblerThread`, waits only for an item it is building (its thread goes
        on to the next builder); otherwise joins the thread.
        """
        with self._lock:
            self._stop = True
            self._done.clear()
            self._work.notify_all()
            self._ready.notify_all()
            if self._shared is not None:
                stopped = self._ready.wait_for(lambda: self._helping == 0, timeout)
                if stopped:
                    # The shared thread may look at this builder once more before it
                    # moves on: it must not keep what fetch and build refer to alive.
                    self._fetch, self._build = _closed, _closed
                return stopped
        if self._thread is None:
            return True
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()


class AssemblerThread:
    """One daemon thread that serves :class:`InOrderBuilder` s one after another.

    :meth:`serve` hands it a builder (the previous one must be closed); it
    runs that builder's helper loop until the builder is closed, then waits
    for the next. It holds no builder in between, so nothing a builder refers
    to is kept alive by the thread. :meth:`close` ends the thread; a later
    :meth:`serve` starts a new one. Thread-safe.
    """

    def __init__(self, name: str = "mmcache-assembler") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: list[InOrderBuilder[Any, Any]] = []
        self._current: InOrderBuilder[Any, Any] | None = None
        self._generation = 0  # a thread of an older generation exits
        self._thread: threading.Thread | None = None

    def serve(self, builder: InOrderBuilder[Any, Any]) -> None:
        with self._cond:
            self._queue.append(builder)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, args=(self._generation,), name=self._name, daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def _run(self, generation: int) -> None:
        while True:
            with self._cond:
                while not self._queue and self._generation == generation:
                    self._cond.wait()
                if self._generation != generation:
                    return
                builder = self._current = self._queue.pop(0)
            builder.helper_loop()
            with self._cond:
                self._current = None
            del builder

    def close(self, timeout: float | None = None) -> None:
        """End the thread (after the item it is building, if any). Idempotent."""
        with self._cond:
            self._generation += 1
            pending, self._queue = self._queue, []
            if self._current is not None:
                pending.append(self._current)
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        for builder in pending:
            builder.close(0)  # its consumer goes on alone
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
