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
:mod:`mmcache.testing`, each with its own ``__all__``.
"""

from __future__ import annotations

# synth is reached as an attribute (``mc.synth.make_dataset``), as are codec, keys and
# sizing, which the modules below import.
from mmcache import synth as synth
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
from mmcache.sources.blobs import RawTier
from mmcache.sources.blobs.prefetch import RemotePrefetch
from mmcache.sources.chat import TextReport
from mmcache.sources.coco import CocoSource
from mmcache.sources.hfdataset import HFDatasetSource
from mmcache.sources.mixture import Mixture, MixturePart
from mmcache.sources.parquet import ParquetSource
from mmcache.sources.readers import read_manifest
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
    "Mixture",
    "MixturePart",
    "MmcacheError",
    "MultimodalDataset",
    "PackSpec",
    "ParquetSource",
    "Pipeline",
    "RawTier",
    "RemoteError",
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
