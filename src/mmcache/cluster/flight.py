"""The in-flight tier of ``scope="cluster"``: a node's entries of samples homed on other nodes.

The memory budget of a node holds its *home* samples only (the placement gives
it as many as its budget is worth). What the exchange holds for a while for
other nodes' samples sits in a second node-shared memory store,
``<memory tier name>-flight``, outside that budget and its policy:

- the entries received ahead of the batches that read them (pushed by their home
  node), deleted once their window is consumed;
- the samples of other homes produced here because their home had not got them
  (cold, the first epoch), deleted once they are sent home.

It is bounded by the exchange, not by a policy: at most the entries of
:func:`flight_bound` batches per rank of the node are there at once (the
windows between the last consumed and the furthest exchanged or planned one).
Its index is made twice that size; a put that finds it full is refused (the
sample is then produced where it is read, as without the exchange). Its pages
are allocated only when written and returned when freed, so its byte capacity
(the memory budget, at least :data:`MIN_BYTES`) is a ceiling, not a reservation.
It is a side tier of the cache (``Cache.open_side_tier("flight", ...)``, named
:data:`FLIGHT` in the tier list, right after the memory tier): the loader gathers
from it after the memory tier, so its entries are ordinary memory hits; it is
never promoted into nor offered the cache's puts. A worker writes a sample of
another home there with ``Cache.put_side(FLIGHT, ...)``.

The store is temporary (gone with the last process of the node). Thread- and
process-safe (a :class:`~mmcache.stores.memory.MemoryStore`).
"""

from __future__ import annotations

from mmcache.cache import Cache
from mmcache.stores.memory import MemoryStore

__all__ = ["FLIGHT", "MIN_BYTES", "flight_bound", "flight_name", "open_flight"]

#: The in-flight tier's name in the cache's tier list (``Cache.side_tier(FLIGHT)``).
FLIGHT = "flight"

#: The smallest byte ceiling of an in-flight tier.
MIN_BYTES = 256 << 20


def flight_bound(window: int, ahead: int) -> int:
    """Batches of one rank whose other-home samples can be in flight at once.

    The exchange runs up to ``ahead + 2`` batches beyond the last one assembled
    (rounded up to a whole window; workers plan at most ``ahead`` batches ahead)
    and deletes a window's received entries after its last batch is assembled;
    the cold samples of a window are sent home with the next window exchanged
    and, when the node reads them there, kept until that one is consumed (up to
    three windows behind).
    """
    return 4 * window + ahead + 3


def flight_name(cache: Cache) -> str:
    """The in-flight tier's shared-memory name (``<memory tier name>-flight``)."""
    return f"{cache.memory_name}-{FLIGHT}"


def open_flight(cache: Cache, entries: int) -> MemoryStore:
    """Create (or attach to) the node's in-flight tier of ``cache``, indexing
    ``2 * entries`` entries (the first process of the node sets its sizes), and put it
    in the cache's tier list (a side tier after the memory tier)."""
    return cache.open_side_tier(
        FLIGHT, capacity=max(cache.memory_budget, MIN_BYTES), entries=max(2 * entries, 64)
    )
