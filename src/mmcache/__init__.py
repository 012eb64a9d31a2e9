"""mmcache: decode, resize and tokenize image-text samples once; cache them in a
node-shared memory tier and a persistent disk tier; feed them to PyTorch.

>>> import mmcache as mc
>>> pipe = mc.Pipeline(image=mc.ImageSpec(size=224),
...                    text=mc.TextSpec("tokenizer.json", max_length=32))  # doctest: +SKIP
>>> ds = mc.MultimodalDataset("train.jsonl", pipeline=pipe)               # doctest: +SKIP
>>> cache = mc.Cache("~/.cache/mmcache", memory="auto", disk="50GiB")     # doctest: +SKIP
>>> loader = mc.DataLoader(ds, cache=cache, batch_size=64, num_workers=4)  # doctest: +SKIP

The public API is what ``__all__`` lists; everything else is internal.
"""

from __future__ import annotations

from mmcache import codec, keys, sizing, synth
from mmcache.cache import Cache, GcReport, VerifyReport
from mmcache.cached import CachedDataset
from mmcache.dataset import MultimodalDataset, Reject, Sample, collate
from mmcache.errors import (
    CacheError,
    ConfigError,
    CorruptEntryError,
    EntryTooLargeError,
    ManifestError,
    MmcacheError,
    SampleError,
)
from mmcache.loader import DataLoader
from mmcache.manifest import Records, read_manifest
from mmcache.pipeline import (
    CLIP_MEAN,
    CLIP_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageSpec,
    Pipeline,
    TextSpec,
    normalize,
    train_tokenizer,
)
from mmcache.policies import Policy, Residents, get_policy, policy_names, register_policy
from mmcache.sampler import EpochSampler
from mmcache.stats import CacheStats, EpochStats, LoaderStats, TierStats
from mmcache.units import format_size, parse_duration, parse_size

__version__ = "0.1.0"

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Cache",
    "CacheError",
    "CacheStats",
    "CachedDataset",
    "ConfigError",
    "CorruptEntryError",
    "DataLoader",
    "EntryTooLargeError",
    "EpochSampler",
    "EpochStats",
    "GcReport",
    "ImageSpec",
    "LoaderStats",
    "ManifestError",
    "MmcacheError",
    "MultimodalDataset",
    "Pipeline",
    "Policy",
    "Records",
    "Reject",
    "Residents",
    "Sample",
    "SampleError",
    "TextSpec",
    "TierStats",
    "VerifyReport",
    "__version__",
    "codec",
    "collate",
    "format_size",
    "get_policy",
    "keys",
    "normalize",
    "parse_duration",
    "parse_size",
    "policy_names",
    "read_manifest",
    "register_policy",
    "sizing",
    "synth",
    "train_tokenizer",
]
