"""How long a remote store may make us wait: one :class:`RetryPolicy` for every remote
call (listing, HEAD, ranged GET), and a :class:`CircuitBreaker` that stops paying it once
the store has stopped answering.

Three layers used to retry the same call (botocore, s3fs or gcsfs, and mmcache), so an
outage cost 33-37 s per revalidation and 3.8 s per miss; a black-holed network waited
out every timeout of every attempt. Now the layers below make one attempt
(:mod:`~mmcache.sources.blobs.options`) and mmcache alone decides:

- a call gets ``attempts`` tries, ``backoff`` seconds before the second (doubled each
  time, capped at ``max_backoff``), and never more than ``call_deadline`` seconds in all,
  its tries and sleeps included (each try is given what is left as its timeout);
- the retrying (failed tries and sleeps) of all calls of one epoch in this process may
  take ``epoch_deadline`` seconds; once spent, calls get one try each until the next epoch;
- tries that get no answer at all (not an HTTP error, which is an answer) are counted
  in a row, and the breaker opens when they show that the *store* is gone, not one
  object: ``breaker_after`` tries whose connection failed (refused, dropped, not made
  in ``connect_timeout``), or timeouts on ``breaker_after`` distinct objects, or two
  distinct objects each waiting out a call's whole deadline (a black-holed network).
  A timeout of one object (a server that trickles one object's bytes, or never answers
  for it) is that object's failure: it is retried and refused alone, and the next
  healthy object is served (H6: one slow object used to open the breaker, and the
  healthy objects after it were refused). Any answer resets the count. Once open, every
  call fails at once with a :class:`~mmcache.errors.RemoteError` of kind
  ``"circuit-open"``, except one probe (a single try, given ``connect_timeout`` seconds)
  every ``probe_every`` seconds and the first call of each epoch; the first probe that
  is answered closes it. Cached samples keep flowing at cache speed, and misses are
  rejects (``on_error="skip"``) or one clear error (``"raise"``), never minutes of
  waiting.

Why not tenacity or botocore's own retries: the breaker and the epoch budget are shared
by every call of a source in a process, whatever the backend (S3, GCS, HTTP), and the
numbers must be one setting the user can read; a loop of a dozen lines over an injected
clock and sleep is easier to test than a library configured the same way.

Thread-safe: one :class:`CircuitBreaker` per :class:`~mmcache.sources.blobs.objects.Remote`
and process, guarded by a lock; the policy is frozen. Each process (a DataLoader worker)
has its own breaker: a dead store costs each of them ``breaker_after`` failures.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from mmcache.errors import ConfigError, RemoteError

__all__ = ["CircuitBreaker", "RetryPolicy"]


@dataclass(frozen=True)
class RetryPolicy:
    """The retry and deadline settings of every remote call (see the module docstring).

    Args:
        attempts: tries of one call, the first included (``1``: no retry).
        backoff: seconds before the second try; doubled for each next one.
        max_backoff: the longest sleep between two tries.
        call_deadline: seconds one call may take, tries and sleeps included (``None``:
            no limit; each try still has the timeouts below).
        epoch_deadline: seconds of retrying (failed tries and sleeps) per epoch and
            process; then one try per call until the next epoch (``None``: no limit).
        breaker_after: tries in a row whose connection failed, or distinct objects in
            a row that timed out, that open the circuit breaker (``None``: no breaker).
        probe_every: while the breaker is open, one call per this many seconds is let
            through as a probe.
        connect_timeout: seconds to open a connection (given to botocore), and all a
            probe of an open breaker may take.

    >>> RetryPolicy(attempts=3, backoff=0.05).sleeps()
    [0.05, 0.1]
    """

    attempts: int = 4
    backoff: float = 0.1
    max_backoff: float = 5.0
    call_deadline: float | None = 20.0
    epoch_deadline: float | None = 60.0
    breaker_after: int | None = 3
    probe_every: float = 5.0
    connect_timeout: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool):
            raise ConfigError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        if self.attempts < 1:
            raise ConfigError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("backoff", "max_backoff", "probe_every", "connect_timeout"):
            _check_seconds(name, getattr(self, name), allow_none=False)
        for name in ("call_deadline", "epoch_deadline"):
            _check_seconds(name, getattr(self, name), allow_none=True)
        after = self.breaker_after
        if after is not None and (
            not isinstance(after, int) or isinstance(after, bool) or after < 1
        ):
            raise ConfigError(
                f"RetryPolicy.breaker_after must be an int >= 1 or None, got {after!r}"
            )

    @classmethod
    def from_retries(cls, retries: int) -> RetryPolicy:
        """The default policy with ``retries`` retries after the first try (the older
        ``retries=`` argument of the sources)."""
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ConfigError(f"retries must be an int >= 0 or a RetryPolicy, got {retries!r}")
        return cls(attempts=retries + 1)

    def sleeps(self) -> list[float]:
        """The sleeps between the tries of one call, in order."""
        return [min(self.backoff * 2**i, self.max_backoff) for i in range(self.attempts - 1)]

    @property
    def read_timeout(self) -> float:
        """The socket read timeout given to the layer below (the call's deadline)."""
        return self.call_deadline if self.call_deadline is not None else 60.0


def _check_seconds(name: str, value: object, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        none = " or None" if allow_none else ""
        raise ConfigError(f"RetryPolicy.{name} must be seconds >= 0{none}, got {value!r}")


class CircuitBreaker:
    """The state of one process's calls to one store: consecutive failures without an
    answer (how many, how many of them failed to connect, on which objects), whether the
    breaker is open, and the epoch's retry budget.

    ``clock`` is injected (tests pass a fake one). All methods are thread-safe.
    """

    def __init__(self, policy: RetryPolicy, *, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.clock = clock
        self._lock = threading.Lock()
        self._failures = 0  # tries in a row that got no answer
        self._connect_failures = 0  # of those, tries whose connection failed
        self._objects: set[str] = set()  # the objects those tries were for
        self._waited: set[str] = set()  # the objects whose call waited out its deadline
        self._open_since: float | None = None
        self._next_probe = 0.0
        self._probing = False
        self._retry_spent = 0.0  # seconds of retrying in this epoch
        self.last_error: RemoteError | None = None

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_since is not None

    def new_epoch(self) -> None:
        """A new epoch: the retry budget is full again, and an open breaker lets the next
        call through as a probe (the revalidation, usually)."""
        with self._lock:
            self._retry_spent = 0.0
            if self._open_since is not None:
                self._next_probe = self.clock()

    def admit(self, url: str) -> bool:
        """Whether a call may go ahead; ``False``: it is a probe (one try, no retries).
        Raises :class:`RemoteError` (``"circuit-open"``) when the breaker is open and no
        probe is due, or another thread is probing."""
        with self._lock:
            if self._open_since is None:
                return True
            now = self.clock()
            if self._probing or now < self._next_probe:
                last = self.last_error
                raise RemoteError(
                    url,
                    None,
                    False,
                    f"the store did not answer {self._failures} tries in a row, on "
                    f"{len(self._objects)} objects (for {now - self._open_since:.1f} s; last: "
                    f"{last.reason if last is not None else '?'}); failing at once until a "
                    f"probe answers (every {self.policy.probe_every:g} s and at each epoch)",
                    kind="circuit-open",
                )
            self._probing = True
            return False

    def may_retry(self, elapsed: float, sleep: float) -> bool:
        """Whether a call that has run ``elapsed`` seconds may sleep ``sleep`` and try
        again (its deadline, the epoch's budget, an open breaker)."""
        policy = self.policy
        if policy.call_deadline is not None and elapsed + sleep >= policy.call_deadline:
            return False
        with self._lock:
            budget = policy.epoch_deadline
            spent = budget is not None and self._retry_spent >= budget
            return self._open_since is None and not spent

    def spent(self, seconds: float) -> None:
        """Charge ``seconds`` of retrying (a failed try and its sleep) to the epoch."""
        with self._lock:
            self._retry_spent += seconds

    def answered(self) -> None:
        """A call got an answer (a success, or an HTTP error): close the breaker."""
        with self._lock:
            self._failures = self._connect_failures = 0
            self._objects.clear()
            self._waited.clear()
            self._open_since = None
            self._probing = False

    def unanswered(
        self, err: RemoteError, *, url: str, connect: bool, waited_out: bool = False
    ) -> None:
        """A try for the object ``url`` got no answer (``err``): count it, and open the
        breaker when the failures in a row show the store is gone (see the module
        docstring). ``connect``: the connection itself failed (refused, dropped, not
        made in time); ``waited_out``: the try waited out the call's whole deadline.
        A failed probe keeps an open breaker open until the next probe is due."""
        with self._lock:
            self.last_error = err
            self._failures += 1
            self._connect_failures += connect
            self._objects.add(url)
            if waited_out:
                self._waited.add(url)
            self._probing = False
            after = self.policy.breaker_after
            if after is None:
                return
            if (
                self._open_since is not None
                or self._connect_failures >= after
                or len(self._objects) >= after
                or len(self._waited) >= 2
            ):
                now = self.clock()
                if self._open_since is None:
                    self._open_since = now
                self._next_probe = now + self.policy.probe_every

    def release_probe(self) -> None:
        """A probe ended without telling either way (it raised something unclassified)."""
        with self._lock:
            self._probing = False
