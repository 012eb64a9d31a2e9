"""``FeatureCache``: outputs of a frozen encoder, computed once, kept on the device and on disk.

A frozen vision tower (CLIP/SigLIP ViT in LLaVA-style training, the image
tower of LiT) gives the same output for the same pixels every epoch and every
run. ``FeatureCache`` runs it only on the samples whose features are not
cached yet and serves the rest from three tiers:

- **device**: tensors on the training GPU (:class:`~mmcache.stores.device.DeviceTier`),
  sized by ``memory="auto"`` from ``torch.cuda.mem_get_info`` minus a headroom
  (:mod:`mmcache.features.budget`). A hit costs one ``torch.stack`` on the
  device: no host copy. Without CUDA the same tier runs in host memory.
- the :class:`~mmcache.cache.Cache`'s tiers (node-shared memory, persistent
  disk), holding codec entries ``{"features": array}`` in the cached dtype
  (:mod:`mmcache.features.entry`). A hit there is copied to the device once
  and admitted to the device tier.

>>> feats = FeatureCache(vision_tower, cache=cache, dtype=torch.float16,    # doctest: +SKIP
...                      preprocess=mmcache.normalize, sample_shape=(3, 336, 336))
>>> z = feats(batch)      # [B, 577, 1024] float16 on the encoder's device  # doctest: +SKIP
>>> for batch in feats.wrap(loader): batch["features"]   # pixels replaced  # doctest: +SKIP

Keys. A feature's key is :func:`mmcache.keys.feature_key` of the sample key
(which already hashes the sample id, its stamp, its caption and the pipeline
fingerprint, so a changed image or resize gives new keys), the *encoder
fingerprint*, the dtype name and the output selection. The encoder fingerprint
(:func:`encoder_fingerprint`, in :mod:`mmcache.transforms.fingerprint`) hashes
the module's structure, plain attributes and exact weights and the fingerprint
of ``preprocess``: change one weight and every old feature is a miss.
``name=``/``version=`` pin it instead (no hashing at all: you bump ``version``
when the weights, the preprocessing or the code change). Weights changed after
construction are noticed on every call (:mod:`mmcache.features.encoder`).

Misses are computed in one batched encoder call (chunks of ``batch_size``)
under ``torch.inference_mode``. Their rows are admitted to the device tier
(device-to-device copies) and written to the Cache without the training step
waiting for it (:mod:`mmcache.features.writes`). Returned tensors are fresh
(the caller owns them, they can be modified) and normal tensors, not inference
tensors, so a trainable projector can consume them under autograd.

The package: this module (the cache: tiers, lookup, encode), ``encoder``
(fingerprint, eval mode, output selection), ``writes`` (the write path),
``budget`` (sizes and warnings), ``entry`` (the stored form), ``counts``
(stats), ``stage`` (:class:`FeatureLoader`), ``warm`` (:func:`warm_features`),
``factory`` (:func:`load_factory`).

Thread/process safety: a FeatureCache is driven by one thread, like a
DataLoader: use one per training process (each rank has its own device tier;
all of them share the Cache's node-wide memory tier and disk tier). Do not
share one across threads without a lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy.typing as npt
import torch

from mmcache import keys
from mmcache.cache import Cache
from mmcache.checks import check_int
from mmcache.dist import shard_bounds
from mmcache.errors import ConfigError
from mmcache.features.budget import (
    DEFAULT_HOST_TIER_FRACTION,
    GPU_MIN_FREE_FRACTION,
    FeatureBudgetWarning,
    GrowthGuard,
    device_budget,
    warn_if_short,
)
from mmcache.features.counts import ENCODER, ServeCounts
from mmcache.features.encoder import (
    FrozenEncoder,
    Output,
    module_device,
    output_name,
    same_device,
)
from mmcache.features.entry import DTYPE_NAMES, FEATURE_FIELD, STORAGE, entry_sizes, to_device
from mmcache.features.factory import LoadedEncoder, load_factory
from mmcache.features.stage import Augmenting, FeatureLoader
from mmcache.features.warm import FeatureWarmReport, warm_features
from mmcache.features.writes import FeatureWrites
from mmcache.policies import Policy
from mmcache.stats import FeatureStats
from mmcache.stores.device import DeviceTier
from mmcache.stores.disk import DiskStore
from mmcache.stores.memory import MemoryStore
from mmcache.transforms.fingerprint import (
    FINGERPRINT_VERSION,
    encoder_fingerprint,
    preprocess_fingerprint,
)

__all__ = [
    "DEFAULT_HOST_TIER_FRACTION",
    "FEATURE_FIELD",
    "FINGERPRINT_VERSION",
    "GPU_MIN_FREE_FRACTION",
    "FeatureBudgetWarning",
    "FeatureCache",
    "FeatureLoader",
    "FeatureWarmReport",
    "LoadedEncoder",
    "encoder_fingerprint",
    "load_factory",
    "preprocess_fingerprint",
    "shard_bounds",
    "warm_features",
]

logger = logging.getLogger(__name__)


class FeatureCache:
    """Frozen-encoder outputs for a batch, computed only for the samples not cached yet.

    Args:
        encoder: the frozen encoder, an ``nn.Module`` (its weights are
            fingerprinted), or any callable when ``name=`` pins the fingerprint.
            It is put in eval mode once (see :mod:`mmcache.features.encoder`) and
            called on a whole batch of images.
        cache: the :class:`~mmcache.cache.Cache` whose memory and disk tiers
            keep features across processes and runs; ``None``: device tier only.
        dtype: the dtype features are stored and returned in (float16,
            bfloat16, float32, float64); part of the key.
        device: where images are sent and features returned; default: the
            encoder's device (CPU for an encoder without tensors). Must match
            the encoder's device.
        memory: the device tier's byte budget: ``"auto"`` (on CUDA:
            :func:`mmcache.sizing.auto_gpu_budget`, half the free GPU memory,
            and the tier stops growing when less than 10% of the GPU is free;
            on CPU: :data:`DEFAULT_HOST_TIER_FRACTION` of available host
            memory), an int or IEC string, or 0 (no device tier).
        name, version: pin the encoder fingerprint (no weight hashing; bump
            ``version`` when the weights, the preprocessing or the code change).
        preprocess: called on the uint8 image batch (on ``device``) before the
            encoder, e.g. :func:`mmcache.normalize`; fingerprinted by
            content (:func:`preprocess_fingerprint`). Without it the encoder
            receives the uint8 batch as it comes.
        output: when the encoder returns a tuple, dict or ``ModelOutput``: an
            index or a key/attribute name (``"last_hidden_state"``); part of the key.
        batch_size: the most samples per encoder call (misses are chunked).
        n_samples: how many samples will be cached: warn (log and
            :class:`FeatureBudgetWarning`) when a tier cannot hold them all.
        sample_shape: one image's shape, e.g. ``(3, 224, 224)``: run one probe
            forward at construction to learn the feature shape (for
            :meth:`estimate` and the ``n_samples`` check); otherwise it is
            learnt from the first batch.
        policy: the device tier's policy (default ``keep``: fill once, never evict).
        write_behind: put new features into the Cache from a background thread
            (default: on CUDA, where the training step should not wait for disk
            commits; on the CPU they are immediate). :meth:`flush` waits for them.

    Raises ConfigError for invalid arguments or an unhashable ``preprocess``
    without ``name=``. Not thread-safe: one per training process.
    """

    def __init__(
        self,
        encoder: Callable[..., Any],
        *,
        cache: Cache | None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        memory: int | str = "auto",
        name: str | None = None,
        version: str | int | None = None,
        preprocess: Callable[[torch.Tensor], Any] | None = None,
        output: Output = None,
        batch_size: int = 64,
        n_samples: int | None = None,
        sample_shape: Sequence[int] | None = None,
        policy: str | Policy = "keep",
        write_behind: bool | None = None,
    ) -> None:
        if dtype not in DTYPE_NAMES:
            raise ConfigError(
                f"dtype must be one of {[str(d) for d in DTYPE_NAMES]}, got {dtype!r}"
            )
        check_int("batch_size", batch_size, minimum=1)
        FrozenEncoder.check(encoder, output=output, name=name, version=version)
        if cache is not None and not isinstance(cache, Cache):
            raise ConfigError(f"cache must be a mmcache.Cache or None, got {type(cache).__name__}")
        if n_samples is not None:
            check_int("n_samples", n_samples, minimum=0)
        self.cache = cache
        self.dtype = dtype
        self.dtype_name = DTYPE_NAMES[dtype]
        self.output_name = output_name(output)
        self.batch_size = batch_size
        self.n_samples = n_samples
        enc_device = module_device(encoder)
        if device is None:
            self.device = enc_device if enc_device is not None else torch.device("cpu")
        else:
            self.device = torch.device(device)
            if enc_device is not None and not same_device(enc_device, self.device):
                raise ConfigError(
                    f"device={self.device} but the encoder is on {enc_device}: move it first "
                    f"(encoder.to({str(self.device)!r})) or leave device=None"
                )
        self._encoder = FrozenEncoder(
            encoder,
            preprocess=preprocess,
            output=output,
            name=name,
            version=None if version is None else str(version),
        )

        budget, auto_gpu = device_budget(memory, self.device)
        self.tier = DeviceTier(budget, device=self.device, policy=policy)
        self._growth = GrowthGuard(self.tier, auto_gpu=auto_gpu)

        self._shape: tuple[int, ...] | None = None
        # Every tier that may serve a row starts at zero in the stats: the device tier,
        # the two a Cache can have (also when it has not), and any other of this cache.
        tier_names = [self.tier.name, MemoryStore.name, DiskStore.name]
        tier_names += list(cache.tiers) if cache is not None else []
        self._counts = ServeCounts(hits=dict.fromkeys(tier_names, 0))
        if write_behind is None:
            write_behind = self.device.type == "cuda"
        self._writes = FeatureWrites(
            cache, dtype, device=self.device, write_behind=write_behind, timed=self._counts.timed
        )
        self._budget_checked = False
        if sample_shape is not None:
            self._probe(tuple(int(d) for d in sample_shape))
        if n_samples is not None and self._shape is not None and not self._budget_checked:
            self._check_budget(n_samples)

    # -- configuration ---------------------------------------------------------------------
    @property
    def encoder(self) -> Callable[..., Any]:
        """The encoder module (or pinned callable)."""
        return self._encoder.module

    @property
    def preprocess(self) -> Callable[[torch.Tensor], Any] | None:
        """What runs on the uint8 image batch before the encoder."""
        return self._encoder.preprocess

    @property
    def output(self) -> Output:
        """The output selection (``None``, an index or a name)."""
        return self._encoder.output

    @property
    def name(self) -> str | None:
        """The pinned encoder name, or None (fingerprint hashed from the weights)."""
        return self._encoder.name

    @property
    def version(self) -> str | None:
        """The pinned version (a string), or None."""
        return self._encoder.version

    @property
    def fingerprint(self) -> str:
        """The encoder fingerprint in the keys (hex; pinned or hashed from the weights)."""
        return self._encoder.fingerprint

    @property
    def feature_shape(self) -> tuple[int, ...] | None:
        """One sample's feature shape, once known (probe or first batch)."""
        return self._shape

    def feature_key(self, sample_key: bytes | str) -> bytes:
        """The cache key of one sample's features (``sample_key``: 16 bytes or 32 hex digits)."""
        sk = keys.key_from_hex(sample_key) if isinstance(sample_key, str) else sample_key
        return keys.feature_key(sk, self.fingerprint, self.dtype_name, self.output_name)

    def contains(self, sample_key: bytes | str) -> bool:
        """Whether the device tier or the Cache holds this sample's features (counts nothing)."""
        fk = self.feature_key(sample_key)
        return self.tier.contains(fk) or (self.cache is not None and self.cache.contains(fk))

    # -- sizes -----------------------------------------------------------------------------
    def _entry_sizes(self) -> tuple[int, int]:
        """(payload bytes, encoded bytes in the Cache) of one sample's features."""
        if self._shape is None:
            raise ConfigError(
                "the feature shape is not known yet: pass sample_shape=(3, H, W) to "
                "FeatureCache or call it on one batch first"
            )
        return entry_sizes(self._shape, self.dtype)

    def estimate(self, n_samples: int) -> int:
        """Bytes the Cache needs to hold the features of ``n_samples`` samples.

        Codec entries: the payload (``prod(shape) * itemsize``) plus about 128
        bytes of header each; the device tier needs the payload only. Needs
        the feature shape (``sample_shape=`` or one batch seen).
        """
        check_int("n_samples", n_samples, minimum=0)
        return n_samples * self._entry_sizes()[1]

    def _check_budget(self, n: int) -> None:
        self._budget_checked = True
        payload, encoded = self._entry_sizes()
        warn_if_short(
            n,
            payload=payload,
            encoded=encoded,
            tier=self.tier,
            tiers=self.cache.tiers if self.cache is not None else {},
            what=f"{self.dtype_name} {list(self._shape or ())}",
        )

    def _learn_shape(self, shape: tuple[int, ...]) -> None:
        if self._shape is None:
            self._shape = shape
            if self.n_samples is not None and not self._budget_checked:
                self._check_budget(self.n_samples)

    def _probe(self, sample_shape: tuple[int, ...]) -> None:
        self._encoder.ensure_eval()
        x = torch.zeros((1, *sample_shape), dtype=torch.uint8, device=self.device)
        with torch.inference_mode():
            y = self._encoder.forward(x, self.dtype)
        self._learn_shape(tuple(y.shape[1:]))

    # -- calls -----------------------------------------------------------------------------
    def __call__(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Features of a loader batch (``"key"``: hex sample keys, ``"image"``: uint8 [B,3,H,W]).

        Returns a ``dtype`` tensor ``[B, ...]`` on ``device``, rows in batch
        order. ``"image"`` is only needed when something misses.
        """
        if "key" not in batch:
            raise ConfigError(
                "the batch has no 'key' field (hex sample keys): use mmcache.DataLoader or "
                "mmcache.CachedDataset, or call FeatureCache.get(keys, images)"
            )
        return self.get(batch["key"], batch.get("image"))

    def get(
        self, sample_keys: Sequence[bytes | str], images: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Features for ``sample_keys`` (16-byte or hex sample keys), ``images`` their pixels.

        The encoder runs once (chunked by ``batch_size``) on the rows no tier
        holds; ``images`` may be None when everything hits.
        """
        self._writes.drain(block=False)
        self._encoder.ensure_eval()
        self._encoder.check_weights()
        fkeys = [self.feature_key(k) for k in sample_keys]
        n = len(fkeys)
        if images is not None and len(images) != n:
            raise ConfigError(f"{n} keys but {len(images)} images: they must match row for row")
        rows, sources = self._resolve(fkeys, images)
        self._counts.served(sources)
        if n == 0:
            shape = self._shape or ()
            return torch.empty((0, *shape), dtype=self.dtype, device=self.device)
        return torch.stack(rows)

    def _resolve(
        self, fkeys: list[bytes], images: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], list[str]]:
        """Every row's features and where they came from (a tier's name or ``"encoder"``);
        admits to the device tier."""
        n = len(fkeys)
        use_tier = self.tier.capacity() > 0
        found: list[torch.Tensor | None] = self.tier.get_many(fkeys) if use_tier else [None] * n
        sources: list[str] = [self.tier.name] * n
        first: dict[bytes, int] = {}
        dups: dict[int, int] = {}
        missing: list[int] = []
        for i, (fk, t) in enumerate(zip(fkeys, found, strict=True)):
            if t is not None:
                continue
            if fk in first:
                dups[i] = first[fk]
            else:
                first[fk] = i
                missing.append(i)

        if missing and self.cache is not None:
            missing = self._from_cache(fkeys, missing, found, sources, admit=use_tier)

        if missing:
            if images is None:
                raise ConfigError(
                    f"{len(missing)} of {n} samples have no cached features and no images were "
                    "given: pass the batch's 'image' field"
                )
            computed = self._encode(images, missing, [fkeys[i] for i in missing])
            may_admit = use_tier and self._growth.may_grow()
            cost = self._counts.mean_cost()
            for j, i in enumerate(missing):
                found[i] = computed[j]
                sources[i] = ENCODER
                if may_admit:
                    self.tier.put(fkeys[i], computed[j], cost=cost)

        for i, src in dups.items():
            found[i] = found[src]
            sources[i] = sources[src]
        out = [t for t in found if t is not None]
        if len(out) != n:  # pragma: no cover - every row is filled above
            raise RuntimeError("FeatureCache left a row unfilled")
        return out, sources

    def _from_cache(
        self,
        fkeys: list[bytes],
        missing: list[int],
        found: list[torch.Tensor | None],
        sources: list[str],
        *,
        admit: bool,
    ) -> list[int]:
        """Fill rows from the Cache's tiers; return the rows still missing."""
        if self.cache is None:  # pragma: no cover - checked by the caller
            return missing
        storage = STORAGE[self.dtype]
        hits: list[tuple[int, npt.NDArray[Any], str]] = []
        still: list[int] = []
        for i in missing:
            sample, tier = self.cache.lookup(fkeys[i])
            if sample is None or tier is None:
                still.append(i)
                continue
            arr = sample.get(FEATURE_FIELD)
            if arr is None or arr.dtype != storage:
                if arr is not None:
                    logger.error(
                        "cached features %s have dtype %s, expected %s; recomputing",
                        fkeys[i].hex(),
                        arr.dtype,
                        storage,
                    )
                still.append(i)
                continue
            hits.append((i, arr, tier))
        if not hits:
            return still
        if self._shape is None:
            self._learn_shape(tuple(hits[0][1].shape))
        tensors = to_device([a for _, a, _ in hits], self.dtype, self.device)
        cost = self._counts.mean_cost()
        may_admit = admit and self._growth.may_grow()
        for (i, _, tier), t in zip(hits, tensors, strict=True):
            found[i] = t
            sources[i] = tier  # the name of the Cache's tier that served it
            if may_admit:
                self.tier.put(fkeys[i], t, cost=cost)
        return still

    def _encode(self, images: Any, rows: list[int], fkeys: list[bytes]) -> torch.Tensor:
        """Run the encoder on ``images[rows]``; hand the results to the write path."""
        imgs = images if isinstance(images, torch.Tensor) else torch.as_tensor(images)
        if len(rows) < imgs.shape[0]:
            imgs = imgs.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=imgs.device))
        cuda = self.device.type == "cuda"
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
        t0 = time.perf_counter()
        outs: list[torch.Tensor] = []
        c = self._counts
        with torch.inference_mode():
            for s in range(0, len(rows), self.batch_size):
                x = imgs[s : s + self.batch_size].to(self.device, non_blocking=True)
                c.encoder_calls += 1  # counted even if it raises: it ran
                outs.append(self._encoder.forward(x, self.dtype))
        # Every later use (stack, device-tier copy) runs outside inference mode and so
        # makes normal tensors that autograd accepts.
        y = outs[0] if len(outs) == 1 else torch.cat(outs)
        c.encoded_samples += len(rows)
        self._learn_shape(tuple(y.shape[1:]))
        if cuda:
            if end is not None:
                end.record()
            self._writes.submit(fkeys, y, timing=(start, end))
        else:
            seconds = time.perf_counter() - t0
            c.timed(seconds, len(rows))
            self._writes.submit(fkeys, y, timing=None, cost=seconds / len(rows))
        return y

    # -- write-back to the Cache -----------------------------------------------------------
    def flush(self) -> None:
        """Write every pending feature to the Cache (waits for device-to-host copies and
        for the write-behind thread)."""
        self._writes.flush()

    def close(self) -> None:
        """Flush, then stop the write-behind thread. The device tier stays usable."""
        self._writes.close()

    # -- precompute ------------------------------------------------------------------------
    def store(self, sample_keys: Sequence[bytes | str], images: torch.Tensor) -> int:
        """Encode and write to the Cache the samples it does not hold yet; return how many.

        The precompute path (:func:`warm_features`): nothing is returned or
        admitted to the device tier. Needs a Cache.
        """
        if self.cache is None:
            raise ConfigError("FeatureCache.store needs a Cache to store into (cache=None)")
        self._writes.drain(block=False)
        if len(images) != len(sample_keys):
            raise ConfigError(
                f"{len(sample_keys)} keys but {len(images)} images: they must match row for row"
            )
        self._encoder.ensure_eval()
        self._encoder.check_weights()
        fkeys = [self.feature_key(k) for k in sample_keys]
        seen: set[bytes] = set()
        rows: list[int] = []
        for i, fk in enumerate(fkeys):
            if fk not in seen and not self.cache.contains(fk):
                seen.add(fk)
                rows.append(i)
        if rows:
            self._encode(images, rows, [fkeys[i] for i in rows])
        return len(rows)

    # -- construction from a factory spec ---------------------------------------------------
    @classmethod
    def from_factory(
        cls,
        spec: str,
        *,
        cache: Cache | None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        memory: int | str = "auto",
        batch_size: int = 64,
    ) -> FeatureCache:
        """A FeatureCache over the encoder of :func:`load_factory` ``(spec)``.

        The factory's ``preprocess``, ``name``, ``version`` and ``output`` are
        used as they come. What ``mmcache warm --features module:factory`` runs.
        """
        loaded = load_factory(spec)
        return cls(
            loaded.encoder,
            cache=cache,
            dtype=dtype,
            device=device,
            memory=memory,
            name=loaded.name,
            version=loaded.version,
            preprocess=loaded.preprocess,
            output=loaded.output,
            batch_size=batch_size,
        )

    # -- loader stage ----------------------------------------------------------------------
    def wrap(
        self, loader: Iterable[Mapping[str, Any]], *, keep_images: bool = False
    ) -> FeatureLoader:
        """A loader stage: iterate ``loader`` and yield its batches with ``"features"`` added.

        ``"image"`` is dropped from each batch unless ``keep_images`` (the
        training loop then never touches pixels). The loader's batches need
        ``"key"`` and ``"image"`` fields, as :class:`mmcache.DataLoader` makes.

        >>> for batch in feats.wrap(loader):       # doctest: +SKIP
        ...     loss = model(batch["features"], batch["input_ids"])
        """
        augment = loader.augment if isinstance(loader, Augmenting) else None
        if augment is not None:
            raise ConfigError(
                f"FeatureCache.wrap: the loader has augment={augment!r}; features of "
                "augmented pixels differ every epoch, so caching them would serve stale "
                "ones. Wrap a loader without augment (features of the cached images), or "
                "run the encoder on the augmented batches yourself without a FeatureCache"
            )
        return FeatureLoader(loader, self, keep_images=keep_images)

    # -- reporting -------------------------------------------------------------------------
    def stats(self) -> FeatureStats:
        """Counters so far (puts the writes whose copies finished; never waits)."""
        self._writes.drain(block=False)
        return self._counts.stats(self.tier.stats())

    def __repr__(self) -> str:
        pinned = f", name={self.name!r}, version={self.version!r}" if self.name else ""
        return (
            f"FeatureCache({type(self.encoder).__name__}, dtype={self.dtype_name}, "
            f"device={self.device}, output={self.output_name!r}, "
            f"fingerprint={self.fingerprint[:12]}{pinned}, tier={self.tier!r})"
        )
