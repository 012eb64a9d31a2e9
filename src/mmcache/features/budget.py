"""How much room a FeatureCache's tiers have: the device budget, its growth guard, the warning.

- :func:`device_budget`: the device tier's byte budget from ``memory=``. With
  ``"auto"`` on CUDA it is :func:`mmcache.sizing.auto_gpu_budget` (half the free
  GPU memory); on the CPU a share of the host's available memory.
- :class:`GrowthGuard`: with ``"auto"`` on CUDA, stops admitting to the device
  tier once the GPU itself runs short (a construction-time budget cannot know
  what the optimizer states and activations created later will need).
- :func:`warn_if_short`: the :class:`FeatureBudgetWarning` when a tier cannot
  hold the features of every sample.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Mapping

import torch

from mmcache import sizing
from mmcache.stores.base import Store
from mmcache.stores.device import DeviceTier
from mmcache.units import format_size, parse_size

__all__ = [
    "DEFAULT_HOST_TIER_FRACTION",
    "GPU_MIN_FREE_FRACTION",
    "FeatureBudgetWarning",
    "GrowthGuard",
    "device_budget",
    "warn_if_short",
]

logger = logging.getLogger(__name__)

#: ``memory="auto"`` on a CPU device: this share of the host's available memory
#: (the Cache's own memory tier takes up to another half, see mmcache.sizing).
DEFAULT_HOST_TIER_FRACTION = 0.25
#: ``memory="auto"`` on CUDA: stop growing the device tier when less than this
#: share of the GPU is free (construction-time budgets cannot know how much the
#: optimizer states and activations created later will need).
GPU_MIN_FREE_FRACTION = 0.1

# Frames in this package are skipped when a warning names its caller.
_PACKAGE_DIR = os.path.dirname(__file__) + os.sep


class FeatureBudgetWarning(UserWarning):
    """A tier of a :class:`FeatureCache` cannot hold the features of every sample."""


def device_budget(memory: int | str, device: torch.device) -> tuple[int, bool]:
    """``(bytes, auto_gpu)``: the device tier's budget, and whether it is CUDA's "auto" one
    (which :class:`GrowthGuard` then watches)."""
    if memory != "auto":
        return parse_size(memory), False
    if device.type == "cuda":
        budget = sizing.auto_gpu_budget(device)
        if budget is not None:
            return budget, True
    return sizing.auto_memory_budget(DEFAULT_HOST_TIER_FRACTION), False


class GrowthGuard:
    """Whether the device tier may still grow: always, unless its budget is CUDA's "auto"
    and less than :data:`GPU_MIN_FREE_FRACTION` of the GPU is free (logged once)."""

    def __init__(self, tier: DeviceTier, *, auto_gpu: bool) -> None:
        self.tier = tier
        self.auto_gpu = auto_gpu
        self._warned = False

    def may_grow(self) -> bool:
        if not self.auto_gpu:
            return True
        device = self.tier.device
        free, total = torch.cuda.mem_get_info(device)
        spare = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if free + spare >= GPU_MIN_FREE_FRACTION * total:
            return True
        if not self._warned:
            self._warned = True
            logger.warning(
                "device tier stops growing at %s: less than %.0f%% of the GPU is free "
                "(pass memory= to FeatureCache to fix its budget; logged once)",
                format_size(self.tier.nbytes()),
                100 * GPU_MIN_FREE_FRACTION,
            )
        return False


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside this package."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def warn_if_short(
    n: int,
    *,
    payload: int,
    encoded: int,
    tier: DeviceTier,
    tiers: Mapping[str, Store],
    what: str,
) -> None:
    """Warn (log and :class:`FeatureBudgetWarning`) when the features of ``n`` samples do not fit.

    ``payload``/``encoded``: one sample's bytes on the device and in the Cache;
    ``tier``: the device tier; ``tiers``: the Cache's tiers by name; ``what``:
    the features' dtype and shape, for the message.
    """
    notes: list[str] = []
    device_short = tier.capacity() < n * payload
    if device_short:
        held = tier.capacity() // payload if payload else n
        notes.append(
            f"the {tier.name} tier on {tier.device} has {format_size(tier.capacity())} "
            f"({held:,} samples, {100 * held / max(n, 1):.0f}%)"
        )
    best = max((t.capacity() for t in tiers.values()), default=0)
    host_short = best < n * encoded
    for tname, store in tiers.items():
        if store.capacity() < n * encoded:
            held = store.capacity() // encoded
            notes.append(
                f"the {tname} tier has {format_size(store.capacity())} "
                f"({held:,} samples, {100 * held / max(n, 1):.0f}%)"
            )
    if not (device_short or host_short):
        return
    need = n * encoded
    if host_short:
        fix = (
            "Features no tier holds are re-encoded every epoch; give the disk tier at "
            f"least {format_size(need)} (Cache(disk=...))"
        )
    else:
        fix = f"Features beyond the {tier.name} tier are read from the Cache's tiers each epoch"
    msg = (
        f"FeatureCache: the features of {n:,} samples ({what}, {format_size(encoded)} each) "
        f"take {format_size(need)}; " + "; ".join(notes) + f". {fix}."
    )
    logger.warning("%s", msg)
    warnings.warn(msg, FeatureBudgetWarning, stacklevel=_caller_stacklevel())
