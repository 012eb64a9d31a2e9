"""Old path of :mod:`mmcache.stores.device` (the feature cache's device tier lives there now)."""

from mmcache.stores.device import DeviceTier

__all__ = ["DeviceTier"]
