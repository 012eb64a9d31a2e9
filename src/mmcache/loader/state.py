"""Reading a loader state: the checks of each version and where the resumed run starts.

What :meth:`mmcache.DataLoader.load_state_dict` does with a state dict, apart from
applying it: version 1 (before the ids digest) and 2 resume by batch position on
the same rank and world size; version 3 (``consumed``: the global position, the
samples of the epoch's order all ranks together have consumed) resumes by batch
position on the same world size, or as the part ``[consumed, stop)`` of the
epoch's order split over another world size (see :mod:`mmcache.sampler`).
Pure functions: thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmcache.checks import check_int, shown
from mmcache.errors import ConfigError

__all__ = [
    "STATE_GLOBAL",
    "STATE_ORDER",
    "STATE_VERSION",
    "Resume",
    "check_batching",
    "read_state",
]

logger = logging.getLogger(__name__)

STATE_VERSION = 3  # 2: the ids digest, distributed_drop_last; 3: the global position
#: What fixes the order of the batches: a state to resume must match the loader in each.
STATE_ORDER = (
    "seed",
    "shuffle",
    "size",
    "ids",
    "rank",
    "world_size",
    "batch_size",
    "drop_last",
    "distributed_drop_last",
)
#: What a version-3 state must match: the order of every epoch, whatever the world size.
STATE_GLOBAL = tuple(n for n in STATE_ORDER if n not in ("rank", "world_size"))


@dataclass(frozen=True)
class Resume:
    """Where a resumed loader starts: the epoch, the batch in it, and the part of the
    epoch's order it covers (None: the whole epoch)."""

    epoch: int
    position: int
    span: tuple[int, int] | None


def read_state(
    state: Any, mine: dict[str, Any], *, world_size: int, count: Callable[[int], int]
) -> Resume:
    """Check ``state`` against this loader's own state ``mine`` and say where to resume.

    ``count(epoch)``: this loader's batches in the whole epoch. Raises
    :class:`ConfigError` naming the key for a missing, mistyped or out-of-range
    value, or one that differs from this loader's.
    """
    if not isinstance(state, dict):
        raise ConfigError(
            f"a loader state is a dict (from state_dict()), got {type(state).__name__}"
        )
    if state.get("version") == 1:  # saved before the ids digest: order not checkable
        logger.warning(
            "loader state version 1 has no digest of the dataset's ids: resuming "
            "without checking that the manifest lists the same ids in the same order"
        )
        state = {**state, "version": 2, "ids": mine["ids"]}
        # Its drop_last also trimmed across ranks (distributed_drop_last), which
        # changes nothing in a single process.
        alone = state.get("world_size") == 1
        state["distributed_drop_last"] = (
            mine["distributed_drop_last"] if alone else state.get("drop_last")
        )
    version = state.get("version")
    if version not in (2, STATE_VERSION):
        raise ConfigError(
            f"unsupported loader state version {shown(version)} (this mmcache reads 1, 2 and "
            f"{STATE_VERSION}): it was saved by another mmcache version"
        )
    _check_order(state, mine, STATE_GLOBAL if version == STATE_VERSION else STATE_ORDER)
    epoch = _state_int(state, "epoch", 0, None)
    if version == 2:  # same rank and world size (checked above): by batch position
        return Resume(epoch, _state_int(state, "position", 0, count(epoch)), None)
    # Every field of a version-3 state is checked, read or not: a value that
    # state_dict() never writes means the state was edited or damaged, and this
    # resume would silently ignore what another world size's resume would use.
    saved_world = _state_int(state, "world_size", 1, None)
    _state_int(state, "rank", 0, saved_world - 1)
    consumed, stop, span = _global_position(state, mine["size"])
    if saved_world == world_size and span is None:
        return Resume(epoch, _state_int(state, "position", 0, count(epoch)), None)
    _state_int(state, "position", 0, None)  # counted in the saver's batches: no bound here
    return Resume(epoch, 0, (consumed, stop))


def check_batching(state: dict[str, Any], batching: str, world_size: int) -> None:
    """Refuse a state of other batches (``group_by_length`` / ``pack``: ``batching`` is
    ``"plain"``, ``"grouped"`` or ``"packed"``; a state without it is plain), and a
    grouped or packed state from another world size (their plans are per world size:
    only plain batches resume elastically)."""
    if (saved := state.get("batching", "plain")) != batching:
        raise ConfigError(
            f"cannot resume: state has batching={shown(saved)} but this loader has "
            f"{batching!r} (group_by_length / pack differ): other batches"
        )
    if batching != "plain" and state.get("world_size") != world_size:
        raise ConfigError(
            f"cannot resume {batching} batches saved with world_size="
            f"{shown(state.get('world_size'))} on world_size={world_size}: grouped and packed "
            "plans resume on the same world size only"
        )


def _check_order(state: dict[str, Any], mine: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if name not in state:
            raise ConfigError(f"cannot resume: the loader state has no {name!r}")
        if state[name] != mine[name]:
            what = "the dataset's ids in order" if name == "ids" else name
            raise ConfigError(
                f"cannot resume: state has {name}={shown(state[name])} but this loader has "
                f"{shown(mine[name])} ({what} differs); the order (and so the remaining "
                "batches) would differ"
            )


def _state_int(state: dict[str, Any], name: str, low: int, high: int | None) -> int:
    """``state[name]`` checked to be an int in ``[low, high]`` (ConfigError otherwise)."""
    if name not in state:
        raise ConfigError(f"cannot resume: the loader state has no {name!r}")
    return check_int(f"cannot resume: state {name}", state[name], minimum=low, maximum=high)


def _global_position(state: dict[str, Any], size: int) -> tuple[int, int, tuple[int, int] | None]:
    """A version-3 state's ``consumed``, ``stop`` and ``span``, checked against each
    other as :meth:`DataLoader.state_dict` writes them: ``stop`` in ``[0, size]``,
    ``span`` None or ``[start, stop]`` (the part of the epoch's order that run was
    given) and ``consumed`` in ``[start, stop]`` (``start`` 0 without a span)."""
    stop = _state_int(state, "stop", 0, size)
    if "span" not in state:
        raise ConfigError("cannot resume: the loader state has no 'span'")
    span = state["span"]
    if span is None:
        return _state_int(state, "consumed", 0, stop), stop, None
    ints = isinstance(span, list | tuple) and len(span) == 2
    if not ints or any(isinstance(v, bool) or not isinstance(v, int) for v in span):
        raise ConfigError(
            f"cannot resume: state span must be None or [start, stop] (two ints), got {shown(span)}"
        )
    start, end = span
    if not 0 <= start <= end == stop:
        raise ConfigError(
            f"cannot resume: state span must be [start, stop] with 0 <= start <= stop "
            f"and stop equal to the state's stop ({stop}), got {shown(span)}"
        )
    return _state_int(state, "consumed", start, stop), stop, (start, end)
