"""mmcache: decode, resize and tokenize image-text samples once; cache them in a
node-shared memory tier and a persistent disk tier; feed them to PyTorch.

>>> import mmcache as mc
>>> pipe = mc.Pipeline(image=mc.ImageSpec(size=224),
...                    text=mc.TextSpec("tokenizer.json", max_length=32))  # doctest: +SKIP
>>> ds = mc.MultimodalDataset("train.jsonl", pipeline=pipe)               # doctest: +SKIP
>>> cache = mc.Cache("~/.cache/mmcache", memory="auto", disk="50GiB")     # doctest: +SKIP
>>> loader = mc.DataLoader(ds, cache=cache, batch_size=64, num_workers=4)  # doctest: +SKIP

The top level is what a training script uses: ``__all__`` lists it. What a new source,
stage, tier or policy is built from lives in :mod:`mmcache.sources`,
:mod:`mmcache.transforms`, :mod:`mmcache.stores`, :mod:`mmcache.policies` and
:mod:`mmcache.testing`, each with its own ``__all__``. The names that were at the top
level before still work for one release, with a ``DeprecationWarning`` naming their
new home (see :data:`MOVED`).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from mmcache.cache import Cache
from mmcache.cached import CachedDataset
from mmcache.dataset import MultimodalDataset, SourceDataset, open_source
from mmcache.errors import (
    CacheError,
    ConfigError,
    CorruptEntryError,
    ManifestError,
    MmcacheError,
    RemoteError,
    SampleError,
)
from mmcache.features import FeatureCache, FeatureStats, warm_features
from mmcache.hfpipeline import hf_processor
from mmcache.loader import BatchContext, DataLoader, EpochContext, LoaderHook, PackSpec
from mmcache.pipeline import ImageSpec, Pipeline, TextSpec, normalize, train_tokenizer
from mmcache.plot import plot
from mmcache.shared import SharedTier
from mmcache.sources.chat import TextReport
from mmcache.sources.coco import CocoSource
from mmcache.sources.hfdataset import HFDatasetSource
from mmcache.sources.parquet import ParquetSource
from mmcache.sources.readers import read_manifest
from mmcache.sources.remote import RawTier
from mmcache.sources.remote.files import RemoteFileSource
from mmcache.sources.remote.prefetch import RemotePrefetch
from mmcache.sources.wds import WebDatasetSource
from mmcache.stats import CacheStats, EpochStats, LoaderStats, TierStats
from mmcache.transforms.chat import ChatSpec
from mmcache.transforms.hf import hf_image_processor
from mmcache.transforms.smart_resize import SmartResize
from mmcache.transforms.user import stage
from mmcache.transforms.video import VideoSpec
from mmcache.warm import WarmReport, warm

__version__ = "0.1.0"

__all__ = [
    "BatchContext",
    "Cache",
    "CacheError",
    "CacheStats",
    "CachedDataset",
    "ChatSpec",
    "CocoSource",
    "ConfigError",
    "CorruptEntryError",
    "DataLoader",
    "EpochContext",
    "EpochStats",
    "FeatureCache",
    "FeatureStats",
    "HFDatasetSource",
    "ImageSpec",
    "LoaderHook",
    "LoaderStats",
    "ManifestError",
    "MmcacheError",
    "MultimodalDataset",
    "PackSpec",
    "ParquetSource",
    "Pipeline",
    "RawTier",
    "RemoteError",
    "RemoteFileSource",
    "RemotePrefetch",
    "SampleError",
    "SharedTier",
    "SmartResize",
    "SourceDataset",
    "TextReport",
    "TextSpec",
    "TierStats",
    "VideoSpec",
    "WarmReport",
    "WebDatasetSource",
    "__version__",
    "hf_image_processor",
    "hf_processor",
    "normalize",
    "open_source",
    "plot",
    "read_manifest",
    "stage",
    "train_tokenizer",
    "warm",
    "warm_features",
]

#: Old top-level name -> the module that holds it now. ``mmcache.<name>`` still works
#: for one release, with a DeprecationWarning naming the new spelling.
MOVED: dict[str, str] = {
    **dict.fromkeys(
        ["BatchReader", "DiskStore", "MemoryStore", "Store", "TieredStore", "reclaim_orphans"],
        "mmcache.stores",
    ),
    **dict.fromkeys(
        [
            "CLIP_MEAN",
            "CLIP_STD",
            "IGNORE_INDEX",
            "IMAGENET_MEAN",
            "IMAGENET_STD",
            "Chat",
            "ChatEncoding",
            "Stage",
            "callable_fingerprint",
        ],
        "mmcache.transforms",
    ),
    **dict.fromkeys(
        ["FileSource", "Records", "SampleSource", "StampKind", "register_source_format"],
        "mmcache.sources",
    ),
    **dict.fromkeys(
        ["Policy", "Residents", "get_policy", "policy_names", "register_policy"],
        "mmcache.policies",
    ),
    **dict.fromkeys(
        ["FeatureBudgetWarning", "FeatureLoader", "FeatureWarmReport", "load_factory"],
        "mmcache.features",
    ),
    **dict.fromkeys(["Reject", "Sample", "collate"], "mmcache.dataset"),
    **dict.fromkeys(["GcReport", "VerifyReport"], "mmcache.cache"),
    **dict.fromkeys(["format_size", "parse_duration", "parse_size"], "mmcache.units"),
    "EpochSampler": "mmcache.sampler",
}

# Submodules that were imported by ``import mmcache`` and are reached as attributes
# (``mc.synth.make_dataset``): still reachable, imported on first use, no warning.
_SUBMODULES = frozenset({"codec", "keys", "sizing", "synth"})


def __getattr__(name: str) -> Any:
    """The old top-level spellings (with a DeprecationWarning) and lazy submodules."""
    home = MOVED.get(name)
    if home is not None:
        warnings.warn(
            f"mmcache.{name} moved to {home}.{name}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"mmcache.{name}")
    raise AttributeError(f"module 'mmcache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | _SUBMODULES)
