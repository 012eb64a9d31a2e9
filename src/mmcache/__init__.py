"""mmcache: decode, resize and tokenize image-text samples once; cache them in a
node-shared memory tier and a persistent disk tier; feed them to PyTorch.

The public API is what ``__all__`` lists; everything else is internal.
"""

from __future__ import annotations

from mmcache.errors import (
    CacheError,
    ConfigError,
    CorruptEntryError,
    EntryTooLargeError,
    ManifestError,
    MmcacheError,
    SampleError,
)
from mmcache.policies import Policy, get_policy, policy_names, register_policy
from mmcache.stats import CacheStats, TierStats
from mmcache.units import format_size, parse_duration, parse_size

__version__ = "0.1.0"

__all__ = [
    "CacheError",
    "CacheStats",
    "ConfigError",
    "CorruptEntryError",
    "EntryTooLargeError",
    "ManifestError",
    "MmcacheError",
    "Policy",
    "SampleError",
    "TierStats",
    "__version__",
    "format_size",
    "get_policy",
    "parse_duration",
    "parse_size",
    "policy_names",
    "register_policy",
]
