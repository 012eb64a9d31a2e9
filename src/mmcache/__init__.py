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
    ManifestError,
    MmcacheError,
    SampleError,
)
from mmcache.features import (
    FeatureBudgetWarning,
    FeatureCache,
    FeatureLoader,
    FeatureStats,
    FeatureWarmReport,
    load_factory,
    warm_features,
)
from mmcache.hfpipeline import hf_processor
from mmcache.loader import BatchContext, DataLoader, EpochContext, LoaderHook, PackSpec
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
from mmcache.plot import plot
from mmcache.policies import Policy, Residents, get_policy, policy_names, register_policy
from mmcache.sampler import EpochSampler
from mmcache.sources.base import SampleSource, StampKind
from mmcache.sources.chat import TextReport
from mmcache.sources.coco import CocoSource
from mmcache.sources.files import FileSource
from mmcache.sources.hfdataset import HFDatasetSource
from mmcache.sources.open import register_source_format
from mmcache.sources.parquet import ParquetSource
from mmcache.sources.remote import RawTier
from mmcache.sources.remote.files import RemoteFileSource
from mmcache.sources.remote.prefetch import RemotePrefetch
from mmcache.sources.wds import WebDatasetSource
from mmcache.stats import CacheStats, EpochStats, LoaderStats, TierStats
from mmcache.stores.base import BatchReader, Store
from mmcache.stores.disk import DiskStore
from mmcache.stores.memory import MemoryStore, reclaim_orphans
from mmcache.stores.tiered import TieredStore
from mmcache.transforms.chat import IGNORE_INDEX, Chat, ChatEncoding, ChatSpec
from mmcache.transforms.fingerprint import callable_fingerprint
from mmcache.transforms.hf import hf_image_processor
from mmcache.transforms.smart_resize import SmartResize
from mmcache.transforms.stage import Stage
from mmcache.transforms.user import stage
from mmcache.units import format_size, parse_duration, parse_size
from mmcache.warm import WarmReport, warm

__version__ = "0.1.0"

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "IGNORE_INDEX",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "BatchContext",
    "BatchReader",
    "Cache",
    "CacheError",
    "CacheStats",
    "CachedDataset",
    "Chat",
    "ChatEncoding",
    "ChatSpec",
    "CocoSource",
    "ConfigError",
    "CorruptEntryError",
    "DataLoader",
    "DiskStore",
    "EpochContext",
    "EpochSampler",
    "EpochStats",
    "FeatureBudgetWarning",
    "FeatureCache",
    "FeatureLoader",
    "FeatureStats",
    "FeatureWarmReport",
    "FileSource",
    "GcReport",
    "HFDatasetSource",
    "ImageSpec",
    "LoaderHook",
    "LoaderStats",
    "ManifestError",
    "MemoryStore",
    "MmcacheError",
    "MultimodalDataset",
    "PackSpec",
    "ParquetSource",
    "Pipeline",
    "Policy",
    "RawTier",
    "Records",
    "Reject",
    "RemoteFileSource",
    "RemotePrefetch",
    "Residents",
    "Sample",
    "SampleError",
    "SampleSource",
    "SmartResize",
    "Stage",
    "StampKind",
    "Store",
    "TextReport",
    "TextSpec",
    "TierStats",
    "TieredStore",
    "VerifyReport",
    "WarmReport",
    "WebDatasetSource",
    "__version__",
    "callable_fingerprint",
    "codec",
    "collate",
    "format_size",
    "get_policy",
    "hf_image_processor",
    "hf_processor",
    "keys",
    "load_factory",
    "normalize",
    "parse_duration",
    "parse_size",
    "plot",
    "policy_names",
    "read_manifest",
    "reclaim_orphans",
    "register_policy",
    "register_source_format",
    "sizing",
    "stage",
    "synth",
    "train_tokenizer",
    "warm",
    "warm_features",
]
