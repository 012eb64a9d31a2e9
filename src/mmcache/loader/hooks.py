"""The loader's hooks in order (:class:`Hooks`), over the contract of :mod:`mmcache.hooks`.

``LoaderHook``, ``BatchContext`` and ``EpochContext`` live in :mod:`mmcache.hooks`
(the base layer, so the cluster and the remote prefetcher type against them);
they are importable from here as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mmcache.errors import ConfigError
from mmcache.hooks import BatchContext, EpochContext, LoaderHook

__all__ = ["BatchContext", "EpochContext", "Hooks", "LoaderHook"]


class Hooks:
    """The hooks of one loader, in order; empty (false) when there are none."""

    def __init__(self, hooks: Sequence[Any]) -> None:
        if isinstance(hooks, (str, bytes)) or not isinstance(hooks, Sequence):
            raise ConfigError(f"hooks must be a list of hook objects, got {type(hooks).__name__}")
        before: list[Callable[[EpochContext], None]] = []
        after: list[Callable[[dict[str, Any], BatchContext], dict[str, Any]]] = []
        plan: list[Callable[[int, int], None]] = []
        for hook in hooks:
            b = _own(hook, "before_epoch")
            a = _own(hook, "after_assemble")
            p = _own(hook, "before_plan")
            if p is not None:
                plan.append(p)
            if b is None and a is None and p is None and not isinstance(hook, LoaderHook):
                raise ConfigError(
                    f"a loader hook needs a before_epoch or after_assemble method (or "
                    f"before_plan), got {type(hook).__name__}"
                )
            if b is not None:
                before.append(b)
            if a is not None:
                after.append(a)
        self._before = tuple(before)
        self._after = tuple(after)
        self._plan = tuple(plan)

    @property
    def after(self) -> bool:
        """Whether any hook runs after assembly (else no context is made)."""
        return bool(self._after)

    @property
    def plan(self) -> bool:
        """Whether any hook runs before a batch is planned."""
        return bool(self._plan)

    def __bool__(self) -> bool:
        return bool(self._before or self._after or self._plan)

    def before_plan(self, epoch: int, batch: int) -> None:
        for hook in self._plan:
            hook(epoch, batch)

    def before_epoch(self, ctx: EpochContext) -> None:
        for hook in self._before:
            hook(ctx)

    def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> dict[str, Any]:
        for hook in self._after:
            out = hook(batch, ctx)
            if not isinstance(out, dict):
                raise TypeError(
                    f"after_assemble hook {hook!r} returned {type(out).__name__}, not the batch "
                    "(a dict): return the batch it was given, changed or not"
                )
            batch = out
        return batch


def _own(hook: Any, name: str) -> Any:
    """``hook``'s method ``name`` unless it is missing or :class:`LoaderHook`'s no-op.

    The one place that probes a hook by name (as ``capabilities`` is for sources): a
    hook is the user's object and implements any subset of :class:`LoaderHook`'s
    methods (a subclass or not), so which ones it has is asked once, here, when the
    loader is built, and never on the hot path."""
    method = getattr(hook, name, None)
    if method is None or not callable(method):
        return None
    if getattr(type(hook), name, None) is getattr(LoaderHook, name):
        return None
    return method
