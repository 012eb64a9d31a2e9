"""Build numbered items in order with a helper thread, the consumer helping when it would wait.

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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["InOrderBuilder"]

P = TypeVar("P")
T = TypeVar("T")


class InOrderBuilder(Generic[P, T]):
    """Items ``start .. end-1``, each ``build(j, fetch(j))``, taken in order.

    Args:
        start, end: the item numbers.
        fetch: ``j -> plan``; called in increasing ``j``, one call at a time.
        build: ``(j, plan) -> item``; may run concurrently for different ``j``.
        ahead: the most items claimed beyond the next one to take (bounds the
            memory of finished items: their buffers).
        name: the helper thread's name.
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
        self._cond = threading.Condition()
        self._fetch_lock = threading.Lock()
        # Started by the first take(), after the consumer claimed its first item:
        # starting a thread and handing it the GIL costs the first item ~1 ms.
        self._thread = threading.Thread(target=self._helper, name=name, daemon=True)

    # -- both threads --------------------------------------------------------------------
    def _can_claim(self) -> bool:  # under self._cond
        limit = min(self._end, self._want + self._ahead)
        return not (self._stop or self._broken) and self._next_claim < limit

    def _claim_and_build(self) -> None:
        """Claim the next item, fetch its plan (in order) and build it; no-op if none."""
        with self._fetch_lock:
            with self._cond:
                if not self._can_claim():
                    return
                j = self._next_claim
                self._next_claim = j + 1
            try:
                plan = self._fetch(j)
            except BaseException as exc:
                with self._cond:
                    self._broken = True
                    self._done[j] = (False, exc)
                    self._cond.notify_all()
                return
        result: tuple[bool, T | BaseException]
        try:
            result = (True, self._build(j, plan))
        except BaseException as exc:
            result = (False, exc)
        with self._cond:
            self._done[j] = result
            self._cond.notify_all()

    def _helper(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._can_claim():
                    self._cond.wait()
                if self._stop:
                    return
            self._claim_and_build()

    # -- consumer ------------------------------------------------------------------------
    def take(self) -> T:
        """The next item in order; builds one itself rather than wait. StopIteration at the end."""
        want = self._want
        if want >= self._end:
            raise StopIteration
        if self._thread.ident is None:
            self._claim_and_build()  # the first item: nobody else can have claimed it
            self._thread.start()
        while True:
            with self._cond:
                done = self._done.pop(want, None)
                if done is not None:
                    self._want = want + 1
                    self._cond.notify_all()  # the helper may claim one more
                    break
                if not self._can_claim():
                    if self._stop:
                        raise RuntimeError("InOrderBuilder is closed")
                    self._cond.wait()
                    continue
            self._claim_and_build()
        ok, value = done
        if not ok:
            assert isinstance(value, BaseException)
            raise value
        return value  # type: ignore[return-value]

    def close(self, timeout: float | None = None) -> bool:
        """Stop the helper after the item it is building; True if it has exited.

        Finished items not taken are dropped. Idempotent.
        """
        with self._cond:
            self._stop = True
            self._done.clear()
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()
