"""mmcache: decode, resize and tokenize image-text samples once; cache them in a
node-shared memory tier and a persistent disk tier; feed them to PyTorch.

>>> import mmcache as mc
>>> pipe = mc.Pipeline(image=mc.ImageSpec(size=224),
...                    text=mc.TextSpec("tokenizer.json", max_length=32))  # doctest: +SKIP
>>> ds = mc.MultimodalDataset("train.jsonl", pipeline=pipe)               # doctest: +SKIP
>>> cache = mc.Cache("~/.cache/mmcache", memory="auto", disk="50GiB")     # doctest: +SKIP
>>> loader = mc.DataLoader(ds, cache=cache, batch_size=64, num_workers=4)  # doctest: +SKIP

The top level is what a training script uses: ``__all__`` lists it (the quick start's
and the recipes' names, and every error). The rest lives in its submodule, each with
its own ``__all__``: the sources read in place and the remote ones in
:mod:`mmcache.sources` (``CocoSource``, ``ParquetSource``, ``HFDatasetSource``,
``WebDatasetSource``; ``RawTier`` and ``RemotePrefetch`` under
:mod:`mmcache.sources.blobs`), every stats record and report in :mod:`mmcache.stats`,
the loader's hooks in :mod:`mmcache.loader`; what a new source, stage, tier or policy
is built from in :mod:`mmcache.sources`, :mod:`mmcache.transforms`,
:mod:`mmcache.stores`, :mod:`mmcache.policies` and :mod:`mmcache.testing`.
"""

from __future__ import annotations

# synth is reached as an attribute (``mc.synth.make_dataset``), as are codec, keys and
# sizing, which the modules below import.
from mmcache import synth as synth
from mmcache.cache import Cache
from mmcache.cached import CachedDataset
from mmcache.dataset import MultimodalDataset, open_source
from mmcache.errors import (
    CacheError,
    ConfigError,
    CorruptEntryError,
    ManifestError,
    MmcacheError,
    RemoteError,
    SampleError,
)
from mmcache.features import FeatureCache, warm_features
from mmcache.loader import DataLoader, PackSpec
from mmcache.plot import plot
from mmcache.shared import SharedTier
from mmcache.sources.mixture import Mixture, MixturePart
from mmcache.sources.readers import read_manifest
from mmcache.transforms import ImageSpec, TextSpec, train_tokenizer
from mmcache.transforms.chat import ChatSpec
from mmcache.transforms.hf import hf_image_processor
from mmcache.transforms.hfpipeline import hf_processor
from mmcache.transforms.normalize import normalize
from mmcache.transforms.pipeline import Pipeline
from mmcache.transforms.smart_resize import SmartResize
from mmcache.transforms.user import stage
from mmcache.transforms.video import VideoSpec
from mmcache.warm import warm

__version__ = "0.1.0"

__all__ = [
    "Cache",
    "CacheError",
    "CachedDataset",
    "ChatSpec",
    "ConfigError",
    "CorruptEntryError",
    "DataLoader",
    "FeatureCache",
    "ImageSpec",
    "ManifestError",
    "Mixture",
    "MixturePart",
    "MmcacheError",
    "MultimodalDataset",
    "PackSpec",
    "Pipeline",
    "RemoteError",
    "SampleError",
    "SharedTier",
    "SmartResize",
    "TextSpec",
    "VideoSpec",
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
