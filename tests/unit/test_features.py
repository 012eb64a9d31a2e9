"""FeatureCache: frozen-encoder outputs served from a device tier and the Cache, never stale.

Real (tiny) models with random weights: a ViT built from torch.nn (patch-embedding
convolution, class token, two TransformerEncoderLayers with dropout, LayerNorm) on
32x32 images. Encoder calls are counted with a forward hook.
"""

from __future__ import annotations

import doctest
import functools
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from mmcache import codec, sizing
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError
from mmcache.features import (
    FeatureBudgetWarning,
    FeatureCache,
    encoder_fingerprint,
    load_factory,
    preprocess_fingerprint,
    shard_bounds,
    warm_features,
)
from mmcache.keys import key_hex
from mmcache.loader import DataLoader
from mmcache.stores import device
from mmcache.stores.device import DeviceTier
from mmcache.synth import make_dataset, synth_captions
from mmcache.transforms import ImageSpec, TextSpec, train_tokenizer
from mmcache.transforms.normalize import normalize
from mmcache.transforms.pipeline import Pipeline

SIZE = 32
DIM = 64
TOKENS = (SIZE // 8) ** 2 + 1  # 16 patches + the class token


class TinyViT(nn.Module):
    """ViT-style encoder: [B,3,32,32] float -> [B,17,64] (or a dict/tuple, see ``returns``)."""

    def __init__(self, *, dim: int = DIM, depth: int = 2, patch: int = 8, returns: str = "tensor"):
        super().__init__()
        self.returns = returns
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (SIZE // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(
            *[
                nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.1, batch_first=True)
                for _ in range(depth)
            ]
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> Any:
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.pos
        hidden = self.norm(self.blocks(x))
        if self.returns == "dict":
            return {"last_hidden_state": hidden, "pooled": hidden[:, 0]}
        if self.returns == "tuple":
            return hidden, hidden[:, 0]
        return hidden


def make_vit(seed: int = 0, **kwargs: Any) -> TinyViT:
    torch.manual_seed(seed)
    return TinyViT(**kwargs)


def to_float(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255


def count_calls(encoder: nn.Module) -> list[int]:
    """Batch sizes of every forward call of ``encoder`` from now on."""
    calls: list[int] = []
    encoder.register_forward_hook(lambda mod, args, out: calls.append(int(args[0].shape[0])))
    return calls


def direct(encoder: nn.Module, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The encoder's own output (through ``forward``, so forward hooks do not count it)."""
    with torch.no_grad():
        return encoder.forward(to_float(images)).to(dtype)


def random_batch(n: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    return {
        "key": [rng.bytes(16).hex() for _ in range(n)],
        "image": torch.randint(0, 256, (n, 3, SIZE, SIZE), dtype=torch.uint8, generator=g),
    }


def subset(batch: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    return {"key": [batch["key"][r] for r in rows], "image": batch["image"][rows]}


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Cache]:
    c = Cache(tmp_path / "cache", memory="32MiB", disk="64MiB", temporary=True)
    yield c
    c.close()


def feature_cache(encoder: nn.Module, cache: Cache | None, **kwargs: Any) -> FeatureCache:
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("memory", "4MiB")
    return FeatureCache(encoder, cache=cache, preprocess=to_float, **kwargs)


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_features_equal_direct_outputs_in_every_tier(
    tmp_path: Path, cache: Cache, dtype: torch.dtype
) -> None:
    enc = make_vit()
    batch = random_batch(6, seed=1)
    feats = feature_cache(enc, cache, dtype=dtype)
    expected = direct(enc, batch["image"], dtype)

    fresh = feats(batch)  # misses: the encoder ran on exactly this batch
    assert fresh.dtype == dtype and fresh.shape == (6, TOKENS, DIM)
    assert torch.equal(fresh, expected)
    # Within the dtype's rounding of the fp32 features.
    fp32 = direct(enc, batch["image"], torch.float32)
    tol = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(fresh.float(), fp32, rtol=tol, atol=tol)

    assert torch.equal(feats(batch), expected)  # device tier
    host_only = feature_cache(enc, cache, dtype=dtype, memory=0)
    assert torch.equal(host_only(batch), expected)  # Cache memory tier
    assert host_only.stats().hits["memory"] == 6
    cache.close()
    reopened = Cache(tmp_path / "cache", memory=0, disk="64MiB")
    try:
        from_disk = feature_cache(enc, reopened, dtype=dtype, memory=0)
        assert torch.equal(from_disk({"key": batch["key"]}), expected)  # disk, no images needed
        assert from_disk.stats().hits["disk"] == 6
    finally:
        reopened.close()


def test_bfloat16_is_stored_as_codec_bfloat16(cache: Cache) -> None:
    feats = feature_cache(make_vit(), cache, dtype=torch.bfloat16)
    batch = random_batch(2, seed=2)
    feats(batch)
    raw = cache.disk.get(feats.feature_key(batch["key"][0])) if cache.disk else None
    assert raw is not None
    field = codec.read_header(raw).field("features")
    assert field.logical_dtype == "bfloat16" and field.shape == (TOKENS, DIM)


def test_features_feed_a_trainable_projector(cache: Cache) -> None:
    enc = make_vit()
    feats = feature_cache(enc, cache)
    projector = nn.Linear(DIM, 8)
    batch = random_batch(4, seed=3)
    for _ in range(2):  # first misses, then device-tier hits
        z = feats(batch)
        assert not z.is_inference() and not z.requires_grad
        projector(z).sum().backward()
        assert projector.weight.grad is not None
    z.add_(1.0)  # the caller owns the result: the cached copy is untouched
    assert torch.equal(feats(batch), direct(enc, batch["image"], torch.float32))


# ----------------------------------------------------------------------------- encoder calls


def test_encoder_runs_once_per_batch_of_misses_and_never_on_hits(cache: Cache) -> None:
    enc = make_vit()
    calls = count_calls(enc)
    feats = feature_cache(enc, cache)
    batch = random_batch(8, seed=4)
    feats(batch)
    assert calls == [8]

    feats(subset(batch, [5, 1, 7, 0, 2, 3, 6, 4]))  # second epoch, new order: all hits
    assert calls == [8]

    new = random_batch(5, seed=5)
    mixed = {
        "key": batch["key"][:3] + new["key"],
        "image": torch.cat([batch["image"][:3], new["image"]]),
    }
    out = feats(mixed)
    assert calls == [8, 5]  # only the misses, in one call
    assert torch.equal(out[3:], direct(enc, new["image"], torch.float32))
    s = feats.stats()
    assert (s.samples, s.misses, s.encoder_calls, s.encoded_samples) == (24, 13, 2, 13)
    assert s.hits["device"] == 11
    assert s.encoder_seconds > 0
    assert s.as_dict()["hit_rate"] == pytest.approx(11 / 24)


def test_misses_are_chunked_by_batch_size(cache: Cache) -> None:
    enc = make_vit()
    calls = count_calls(enc)
    feats = feature_cache(enc, cache, batch_size=4)
    batch = random_batch(10, seed=6)
    out = feats(batch)
    assert calls == [4, 4, 2]
    torch.testing.assert_close(out, direct(enc, batch["image"], torch.float32))


def test_repeated_sample_in_a_batch_is_encoded_once(cache: Cache) -> None:
    enc = make_vit()
    calls = count_calls(enc)
    feats = feature_cache(enc, cache)
    batch = random_batch(3, seed=7)
    dup = subset(batch, [0, 1, 0, 2, 1])
    out = feats(dup)
    assert calls == [3]
    assert torch.equal(out[0], out[2]) and torch.equal(out[1], out[4])


def test_images_only_needed_for_misses(cache: Cache) -> None:
    feats = feature_cache(make_vit(), cache)
    batch = random_batch(3, seed=8)
    with pytest.raises(ConfigError, match="no images"):
        feats({"key": batch["key"]})
    feats(batch)
    assert feats({"key": batch["key"]}).shape == (3, TOKENS, DIM)
    with pytest.raises(ConfigError, match="'key'"):
        feats({"image": batch["image"]})
    with pytest.raises(ConfigError, match="match row for row"):
        feats.get(batch["key"], batch["image"][:2])


def test_new_object_over_same_root_serves_from_disk_without_encoder(tmp_path: Path) -> None:
    root = tmp_path / "persist"
    batch = random_batch(6, seed=9)
    with Cache(root, memory=0, disk="64MiB") as first:
        feature_cache(make_vit(), first, dtype=torch.float16)(batch)
    enc = make_vit()  # same seed: same weights, a different object
    calls = count_calls(enc)
    with Cache(root, memory="16MiB", disk="64MiB", temporary=True) as second:
        feats = feature_cache(enc, second, dtype=torch.float16)
        out = feats(batch)
        assert calls == []
        assert feats.stats().hits == {"device": 0, "memory": 0, "disk": 6}
        assert torch.equal(out, direct(enc, batch["image"], torch.float16))
        feats(batch)
        assert feats.stats().hits["device"] == 6


# ----------------------------------------------------------------------------- invalidation


def test_changing_one_weight_makes_every_feature_a_miss(cache: Cache) -> None:
    enc = make_vit()
    batch = random_batch(5, seed=10)
    before = feature_cache(enc, cache)
    old = before(batch)
    changed = make_vit()
    with torch.no_grad():
        changed.blocks[1].linear2.weight[3, 7] += 1e-3
    assert encoder_fingerprint(changed) != encoder_fingerprint(enc)
    calls = count_calls(changed)
    after = feature_cache(changed, cache)
    new = after(batch)
    assert calls == [5]
    assert after.stats().hits == {"device": 0, "memory": 0, "disk": 0}
    assert not torch.equal(new, old)
    assert torch.equal(new, direct(changed, batch["image"], torch.float32))


def test_weights_changed_after_construction_are_detected(
    cache: Cache, caplog: pytest.LogCaptureFixture
) -> None:
    enc = make_vit()
    calls = count_calls(enc)
    feats = feature_cache(enc, cache)
    batch = random_batch(4, seed=11)
    feats(batch)
    original = {k: v.clone() for k, v in enc.state_dict().items()}
    fp = feats.fingerprint
    with torch.no_grad():
        enc.norm.bias[0] += 0.5  # in place, e.g. a stray optimizer step
    with caplog.at_level(logging.WARNING, logger="mmcache.features"):
        out = feats(batch)
    assert "weights changed" in caplog.text
    assert calls == [4, 4] and feats.fingerprint != fp
    assert torch.equal(out, direct(enc, batch["image"], torch.float32))

    enc.norm.weight = nn.Parameter(enc.norm.weight.detach() * 2)  # a swapped Parameter
    out = feats(batch)
    assert calls == [4, 4, 4]
    assert torch.equal(out, direct(enc, batch["image"], torch.float32))

    enc.load_state_dict(original)  # back to the original weights: old features hit again
    feats(batch)
    assert calls == [4, 4, 4] and feats.fingerprint == fp


def test_fingerprint_covers_structure_dtype_and_preprocess() -> None:
    a = make_vit()
    assert encoder_fingerprint(a) == encoder_fingerprint(make_vit())  # deterministic
    assert encoder_fingerprint(a) != encoder_fingerprint(make_vit(seed=1))
    b = make_vit()
    b.norm.eps = 1e-3  # a hyperparameter, not a weight
    assert encoder_fingerprint(b) != encoder_fingerprint(a)
    assert encoder_fingerprint(make_vit().half()) != encoder_fingerprint(a)
    assert encoder_fingerprint(a, preprocess=to_float) != encoder_fingerprint(a)
    with pytest.raises(ConfigError, match="meta"):
        encoder_fingerprint(nn.Linear(2, 2, device="meta"))


class _Activated(nn.Module):
    """A tiny encoder whose activation is a plain attribute (a partial, a lambda...)."""

    def __init__(self, act: Any, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(3 * SIZE * SIZE, 8)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x.flatten(1)))


def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _self_scaled() -> _Activated:
    enc = _Activated(None)
    enc.scale = 2.0
    enc.act = lambda x: x * enc.scale  # captures the module itself: no endless recursion
    return enc


def _self_method() -> _Activated:
    enc = _Activated(None)
    enc.act = enc.proj.forward  # a bound method of its own submodule
    return enc


def test_opaque_callable_attribute_falls_back_to_its_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    opaque = _Opaque()
    enc = _Activated(lambda x: x if opaque is not None else -x)
    with caplog.at_level(logging.WARNING, logger="mmcache.features"):
        fp = encoder_fingerprint(enc)
    assert fp == encoder_fingerprint(_Activated(lambda x: x if opaque is not None else -x))
    assert "_Activated.act is fingerprinted by name only" in caplog.text


def test_callable_attributes_are_fingerprinted_by_content(cache: Cache) -> None:
    batch = random_batch(3, seed=14)
    pairs = [
        (
            _Activated(functools.partial(torch.nn.functional.gelu, approximate="none")),
            _Activated(functools.partial(torch.nn.functional.gelu, approximate="tanh")),
        ),
        (_Activated(lambda x: x * 2), _Activated(lambda x: x * 3)),
    ]
    for a, b in pairs:
        assert encoder_fingerprint(a) != encoder_fingerprint(b)
        from_a = feature_cache(a, cache, memory=0)(batch)
        calls = count_calls(b)
        from_b = feature_cache(b, cache, memory=0)(batch)
        assert calls == [3]  # B is run: A's features are not served for it
        assert torch.equal(from_b, direct(b, batch["image"], torch.float32))
        assert not torch.equal(from_a, from_b)
    # Built twice the same way: the same fingerprint (nothing id()-dependent leaks in).
    same = [
        lambda: _Activated(functools.partial(torch.nn.functional.gelu, approximate="tanh")),
        lambda: _Activated(lambda x: x * 2),
        lambda: _Activated(_twice),
        lambda: _Activated(torch.tanh),
        lambda: _Activated(torch.nn.functional.relu),
        lambda: _Activated(nn.GELU()),
        _self_scaled,
        _self_method,
    ]
    for build in same:
        assert encoder_fingerprint(build()) == encoder_fingerprint(build())
    assert encoder_fingerprint(_Activated(torch.tanh)) != encoder_fingerprint(
        _Activated(torch.sigmoid)
    )
    changed = _self_scaled()
    changed.scale = 3.0
    assert encoder_fingerprint(changed) != encoder_fingerprint(_self_scaled())


def _scale_by(k: float) -> Any:
    return lambda x: x.float() / k


def _minus(mean: torch.Tensor) -> Any:
    return lambda x: x.float() - mean.view(3, 1, 1)


def test_preprocess_fingerprint_by_content() -> None:
    assert preprocess_fingerprint(None) == "none"
    assert preprocess_fingerprint(to_float) == preprocess_fingerprint(to_float)
    # Same code, different captured constant / tensor value / bound argument.
    assert preprocess_fingerprint(_scale_by(255.0)) == preprocess_fingerprint(_scale_by(255.0))
    assert preprocess_fingerprint(_scale_by(255.0)) != preprocess_fingerprint(_scale_by(127.0))
    mean_a, mean_b = torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.5, 0.4, 0.31])
    assert preprocess_fingerprint(_minus(mean_a)) != preprocess_fingerprint(_minus(mean_b))
    assert preprocess_fingerprint(_minus(mean_a)) == preprocess_fingerprint(_minus(mean_a.clone()))
    assert preprocess_fingerprint(lambda x: x.float() / 255) != preprocess_fingerprint(
        lambda x: x.float() / 256
    )

    def scale(x: torch.Tensor, k: float) -> torch.Tensor:
        return x.float() / k

    assert preprocess_fingerprint(functools.partial(scale, k=2.0)) != preprocess_fingerprint(
        functools.partial(scale, k=3.0)
    )
    assert preprocess_fingerprint(nn.Identity()) == preprocess_fingerprint(nn.Identity())
    # The same code in a script's __main__ and imported by `mmcache warm` from a file.
    source = "def prep(x):\n    return x.float() / 255\n"
    as_main: dict[str, Any] = {"__name__": "__main__"}
    as_factory: dict[str, Any] = {"__name__": "_mmcache_factory_0123"}
    exec(source, as_main)
    exec(source, as_factory)
    assert preprocess_fingerprint(as_main["prep"]) == preprocess_fingerprint(as_factory["prep"])
    # mmcache's own normalisation, plain, with bound statistics, or called from a lambda.
    plain = preprocess_fingerprint(normalize)
    clip = preprocess_fingerprint(functools.partial(normalize, mean=(0.5,) * 3, std=(0.5,) * 3))
    assert len({plain, clip, preprocess_fingerprint(lambda x: normalize(x))}) == 3


class _Opaque:
    """An object whose content cannot be hashed (like a tokenizer or an open file)."""

    __slots__ = ()


def test_unhashable_preprocess_needs_a_pinned_name(cache: Cache) -> None:
    opaque = _Opaque()

    def pre(x: torch.Tensor) -> torch.Tensor:
        return x.float() if opaque is not None else x

    with pytest.raises(ConfigError, match="name="):
        preprocess_fingerprint(pre)
    with pytest.raises(ConfigError, match="version"):
        FeatureCache(make_vit(), cache=cache, preprocess=pre, memory=0)
    pinned = FeatureCache(
        make_vit(), cache=cache, preprocess=pre, memory=0, name="vit-tiny", version=1
    )
    assert pinned.fingerprint


def test_name_and_version_pin_the_fingerprint(cache: Cache) -> None:
    batch = random_batch(3, seed=12)
    enc = make_vit()
    v1 = feature_cache(enc, cache, name="vit-tiny", version="1")
    v1(batch)
    other_weights = make_vit(seed=5)
    calls = count_calls(other_weights)
    same_pin = feature_cache(other_weights, cache, name="vit-tiny", version="1", memory=0)
    same_pin(batch)  # pinned: the weights are not looked at (the user's promise)
    assert calls == []
    v2 = feature_cache(other_weights, cache, name="vit-tiny", version="2")
    v2(batch)
    assert calls == [3]
    assert v1.fingerprint != v2.fingerprint != encoder_fingerprint(enc)
    with pytest.raises(ConfigError, match="needs name"):
        FeatureCache(enc, cache=cache, version="1")
    with pytest.raises(ConfigError, match=r"nn\.Module"):
        FeatureCache(lambda x: x, cache=cache)
    fn_encoder = FeatureCache(
        lambda x: x.float().flatten(1), cache=cache, name="flatten", memory=0, dtype=torch.float32
    )
    assert fn_encoder(batch).shape == (3, 3 * SIZE * SIZE)


def test_dtype_and_output_are_part_of_the_key(cache: Cache) -> None:
    enc = make_vit(returns="dict")
    calls = count_calls(enc)
    batch = random_batch(2, seed=13)
    hidden = FeatureCache(enc, cache=cache, preprocess=to_float, output="last_hidden_state")
    pooled = FeatureCache(enc, cache=cache, preprocess=to_float, output="pooled")
    assert hidden(batch).shape == (2, TOKENS, DIM)
    assert pooled(batch).shape == (2, DIM)
    fp32 = FeatureCache(enc, cache=cache, preprocess=to_float, output=0, dtype=torch.float32)
    assert torch.equal(fp32(batch)[:, 0], fp32(batch)[:, 0])
    assert calls == [2, 2, 2]
    assert len({hidden.feature_key(batch["key"][0]), pooled.feature_key(batch["key"][0])}) == 2

    tup = make_vit(returns="tuple")
    assert FeatureCache(tup, cache=cache, preprocess=to_float, output=1)(batch).shape == (2, DIM)
    with pytest.raises(ConfigError, match="output="):
        FeatureCache(tup, cache=cache, preprocess=to_float)(batch)
    with pytest.raises(ConfigError, match="no key 'nope'"):
        FeatureCache(enc, cache=cache, preprocess=to_float, output="nope")(batch)
    with pytest.raises(ConfigError, match="dtype"):
        FeatureCache(enc, cache=cache, dtype=torch.int32)


def test_pipeline_change_gives_new_sample_keys_so_features_miss(
    tmp_path: Path, cache: Cache
) -> None:
    manifest = make_dataset(tmp_path / "data", 6, seed=3, workers=1)
    base = Pipeline(image=ImageSpec(size=SIZE))
    ds = MultimodalDataset(manifest, pipeline=base)
    ds_resized = MultimodalDataset(
        manifest, pipeline=Pipeline(image=ImageSpec(size=SIZE, resize=40))
    )
    enc = make_vit()
    calls = count_calls(enc)
    feats = feature_cache(enc, cache)
    warm_features(ds, feats, batch_size=4, progress=False)
    assert sum(calls) == 6
    assert all(feats.contains(ds.key(i)) for i in range(6))
    assert not any(feats.contains(ds_resized.key(i)) for i in range(6))
    report = warm_features(ds_resized, feats, batch_size=4, progress=False)
    assert report.computed == 6 and sum(calls) == 12


# ----------------------------------------------------------------------------- eval mode


def test_encoder_runs_in_eval_mode_and_is_set_back_once(
    cache: Cache, caplog: pytest.LogCaptureFixture
) -> None:
    enc = make_vit()
    enc.train()
    batch = random_batch(4, seed=14)
    feats = feature_cache(enc, cache, memory=0)
    assert not enc.training  # set once, at construction
    first = feats(batch)
    assert torch.equal(first, direct(enc, batch["image"], torch.float32))  # no dropout
    enc.train()  # e.g. model.train() on a parent module
    with caplog.at_level(logging.WARNING, logger="mmcache.features"):
        feats(random_batch(2, seed=15))
        enc.train()
        feats(random_batch(2, seed=16))
    assert not enc.training
    assert caplog.text.count("train mode") == 1


# ----------------------------------------------------------------------------- device tier


def test_device_tier_holds_its_budget(cache: Cache) -> None:
    enc = make_vit()
    entry = TOKENS * DIM * 4
    feats = feature_cache(enc, cache, memory=3 * entry + 100)
    assert feats.tier.device == torch.device("cpu")  # the CPU fallback of the GPU tier
    batch = random_batch(8, seed=17)
    feats(batch)
    tier = feats.stats().device
    assert tier.bytes <= tier.budget and tier.items == 3 and tier.refused == 5
    out = feats(batch)
    s = feats.stats()
    assert s.hits == {"device": 3, "memory": 5, "disk": 0}
    assert s.device.bytes <= 3 * entry + 100
    assert torch.equal(out, direct(enc, batch["image"], torch.float32))


def test_device_tier_memory_zero_and_auto(cache: Cache, monkeypatch: pytest.MonkeyPatch) -> None:
    off = feature_cache(make_vit(), cache, memory=0)
    batch = random_batch(2, seed=18)
    off(batch)
    off(batch)
    assert off.stats().hits["device"] == 0 and off.stats().device.puts == 0
    seen: list[float] = []

    def fake_budget(fraction: float = 0.5, **_: Any) -> int:
        seen.append(fraction)
        return 12345

    monkeypatch.setattr(sizing, "auto_memory_budget", fake_budget)
    auto = feature_cache(make_vit(), cache, memory="auto")
    if not torch.cuda.is_available():
        assert auto.tier.capacity() == 12345 and seen == [0.25]
    assert feature_cache(make_vit(), cache, memory="1MiB").tier.capacity() == 1 << 20


def test_device_tier_policy_contract() -> None:
    tier = DeviceTier(1000, policy="lru", clock=iter(range(1000)).__next__)
    k = [bytes([i]) * 16 for i in range(5)]
    row = torch.zeros(100, dtype=torch.float16)  # 200 bytes
    for key in k:
        assert tier.put(key, row)
    assert len(tier) == 5 and tier.nbytes() == 1000
    tier.get(k[0])  # k[1] is now the least recently used
    assert tier.put(bytes([9]) * 16, torch.zeros(150))  # 600 bytes: evicts k1, k2, k3
    assert [key in tier for key in k] == [True, False, False, False, True]
    assert tier.nbytes() <= tier.capacity()
    assert not tier.put(bytes([8]) * 16, torch.zeros(300))  # larger than the budget
    kept = DeviceTier(400, policy="keep")
    assert kept.put(k[0], row) and kept.put(k[1], row) and not kept.put(k[2], row)
    source = torch.ones(100)
    kept.put(k[0], source[:50])
    source.zero_()  # the tier holds its own copy
    stored = kept.get(k[0])
    assert stored is not None and stored.sum() == 50
    st = kept.stats()
    assert (st.puts, st.admitted, st.refused, st.items) == (4, 3, 1, 2)
    assert kept.delete(k[0]) and not kept.delete(k[0])
    kept.clear()
    assert len(kept) == 0 and kept.nbytes() == 0


def test_device_tier_docstring_examples() -> None:
    result = doctest.testmod(device)
    assert result.failed == 0 and result.attempted > 0


def test_device_tier_budget_invariant_under_random_puts() -> None:
    rng = np.random.default_rng(0)
    for policy in ("keep", "lru", "fifo", "lfu", "value"):
        tier = DeviceTier(5000, policy=policy)
        model: dict[bytes, int] = {}
        for _ in range(300):
            key = bytes([int(rng.integers(40))]) * 16
            op = rng.random()
            if op < 0.6:
                n = int(rng.integers(1, 400))
                if tier.put(key, torch.zeros(n, dtype=torch.int32), cost=float(rng.random())):
                    model[key] = n * 4
                else:
                    model.pop(key, None)
            elif op < 0.8:
                assert tier.delete(key) == (key in model)
                model.pop(key, None)
            else:
                got = tier.get(key)
                assert (got is not None) == (key in model)
            model = {k: v for k, v in model.items() if k in tier}
            assert set(tier.keys()) == set(model)
            assert tier.nbytes() == sum(model.values()) <= tier.capacity()


# ----------------------------------------------------------------------------- sizes


def test_estimate_from_a_probe_and_budget_warning(cache: Cache) -> None:
    enc = make_vit()
    calls = count_calls(enc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 100 samples fit everywhere: no warning
        feats = feature_cache(
            enc, cache, dtype=torch.float16, sample_shape=(3, SIZE, SIZE), n_samples=100
        )
    assert calls == [1]  # the probe
    assert feats.feature_shape == (TOKENS, DIM)
    per_entry = codec.encoded_size({"features": np.zeros((TOKENS, DIM), np.float16)})
    assert feats.estimate(1000) == 1000 * per_entry
    assert per_entry - TOKENS * DIM * 2 < 256  # header and alignment only
    with pytest.warns(FeatureBudgetWarning, match=r"100,000 samples .* take 2\d\d\.\d\d MiB"):
        feature_cache(
            enc, cache, dtype=torch.float16, sample_shape=(3, SIZE, SIZE), n_samples=100_000
        )


def test_budget_warning_at_first_batch_without_sample_shape(cache: Cache) -> None:
    feats = feature_cache(make_vit(), cache, memory="64KiB", n_samples=1000)
    with pytest.raises(ConfigError, match="sample_shape"):
        feats.estimate(10)
    with pytest.warns(FeatureBudgetWarning, match="device tier on cpu has 64.00 KiB") as rec:
        feats(random_batch(2, seed=19))
    assert rec[0].filename == __file__  # points at the caller, not at mmcache
    assert feats.estimate(10) > 0


# ----------------------------------------------------------------------------- write path


def test_deferred_writes_reach_the_cache_at_the_next_call_or_flush(cache: Cache) -> None:
    # The CUDA write path (copy now, put at the next call), exercised on the CPU.
    feats = feature_cache(make_vit(), cache, memory=0)
    feats._writes.defer = True
    a, b = random_batch(2, seed=20), random_batch(2, seed=21)
    feats(a)
    assert not any(cache.contains(feats.feature_key(k)) for k in a["key"])
    feats(b)
    assert all(cache.contains(feats.feature_key(k)) for k in a["key"])
    assert not any(cache.contains(feats.feature_key(k)) for k in b["key"])
    feats.flush()
    assert all(cache.contains(feats.feature_key(k)) for k in b["key"])


def test_write_behind_thread_puts_everything_by_flush(tmp_path: Path) -> None:
    batches = [random_batch(4, seed=30 + i) for i in range(6)]
    with Cache(tmp_path / "wb", memory=0, disk="64MiB") as c:
        enc = make_vit()
        feats = feature_cache(enc, c, memory=0, write_behind=True, dtype=torch.bfloat16)
        outs = [feats(b) for b in batches]  # more batches than the queue holds
        feats.flush()
        keys = [k for b in batches for k in b["key"]]
        assert all(c.contains(feats.feature_key(k)) for k in keys)
        calls = count_calls(enc)
        again = feature_cache(enc, c, memory=0, dtype=torch.bfloat16)
        assert torch.equal(again.get(keys), torch.cat(outs)) and calls == []
        feats.close()
        feats.close()  # idempotent
        assert feats._writes.writer is None


def test_without_a_cache_only_the_device_tier_serves() -> None:
    enc = make_vit()
    calls = count_calls(enc)
    feats = feature_cache(enc, None)
    batch = random_batch(3, seed=22)
    feats(batch)
    feats(batch)
    assert calls == [3] and feats.stats().hits["device"] == 3
    with pytest.raises(ConfigError, match="Cache"):
        feats.store(batch["key"], batch["image"])


# ----------------------------------------------------------------------------- loader stage


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("feat-data"), 12, seed=4, workers=1)


def make_ds(manifest: Path) -> MultimodalDataset:
    tok = train_tokenizer(synth_captions(50, seed=4), vocab_size=200)
    return MultimodalDataset(
        manifest,
        pipeline=Pipeline(image=ImageSpec(size=SIZE), text=TextSpec(tokenizer=tok, max_length=8)),
    )


def test_wrap_turns_a_loader_into_feature_batches(manifest: Path, tmp_path: Path) -> None:
    ds = make_ds(manifest)
    with Cache(tmp_path / "wrap", memory=0, disk="64MiB") as cache:
        check_wrap(ds, cache)


def check_wrap(ds: MultimodalDataset, cache: Cache) -> None:
    loader = DataLoader(ds, cache=cache, batch_size=5, shuffle=True, seed=1)
    enc = make_vit()
    calls = count_calls(enc)
    feats = feature_cache(enc, cache, dtype=torch.float16)
    wrapped = feats.wrap(loader)
    assert len(wrapped) == len(loader) == 3
    for epoch in range(2):
        wrapped.set_epoch(epoch)
        seen = []
        for batch in wrapped:
            assert "image" not in batch
            assert batch["features"].shape == (len(batch["id"]), TOKENS, DIM)
            assert batch["input_ids"].shape == (len(batch["id"]), 8)
            seen += batch["id"]
        assert sorted(seen) == [f"{i:06d}" for i in range(12)]
        if epoch == 0:
            assert sum(calls) == 12
    assert sum(calls) == 12  # second epoch: zero encoder calls
    kept = next(iter(feats.wrap(loader, keep_images=True)))
    assert kept["image"].dtype == torch.uint8
    expected = direct(enc, kept["image"], torch.float16)
    assert torch.equal(kept["features"], expected)
    assert kept["key"][0] == key_hex(ds.key(int(kept["id"][0])))


# ----------------------------------------------------------------------------- warm


class Crash(Exception):
    pass


def test_warm_features_fills_everything_and_resumes(manifest: Path, tmp_path: Path) -> None:
    ds = make_ds(manifest)
    root = tmp_path / "warm"
    enc = make_vit()
    calls = count_calls(enc)
    budget = [2]  # batches the "killed" run gets through

    def crash_after_budget(mod: nn.Module, args: Any) -> None:
        if not budget[0]:
            raise Crash
        budget[0] -= 1

    hook = enc.register_forward_pre_hook(crash_after_budget)
    with Cache(root, memory=0, disk="64MiB") as c, pytest.raises(Crash):
        warm_features(ds, feature_cache(enc, c), batch_size=4, progress=False)
    assert calls == [4, 4]
    hook.remove()

    with Cache(root, memory=0, disk="64MiB") as c:
        feats = feature_cache(enc, c)
        report = warm_features(ds, feats, batch_size=4, progress=False)
        assert calls == [4, 4, 4]  # only the rest
        assert (report.total, report.skipped, report.computed, report.rejected) == (12, 8, 4, 0)
        assert all(feats.contains(ds.key(i)) for i in range(12))
        again = warm_features(ds, feats, batch_size=4, progress=False)
        assert (again.skipped, again.computed) == (12, 0) and calls == [4, 4, 4]
        images = torch.from_numpy(np.stack([ds.produce(i)["image"] for i in range(12)]))
        served = feats.get([ds.key(i) for i in range(12)])
        torch.testing.assert_close(served, direct(enc, images, torch.float32))


def test_warm_features_shards_and_workers(manifest: Path, tmp_path: Path) -> None:
    ds = make_ds(manifest)
    assert [shard_bounds(12, r, 5) for r in range(5)] == [(0, 2), (2, 4), (4, 7), (7, 9), (9, 12)]
    enc = make_vit()
    with Cache(tmp_path / "shard", memory=0, disk="64MiB") as c:
        feats = feature_cache(enc, c)
        r1 = warm_features(ds, feats, rank=1, world_size=3, num_workers=2, progress=False)
        assert (r1.rank, r1.total, r1.computed) == (1, 4, 4)
        held = [feats.contains(ds.key(i)) for i in range(12)]
        assert held == [False] * 4 + [True] * 4 + [False] * 4
        with pytest.raises(ConfigError, match="rank"):
            warm_features(ds, feats, rank=3, world_size=3, progress=False)


def test_warm_features_skips_bad_samples_when_asked(tmp_path: Path) -> None:
    manifest = make_dataset(tmp_path / "bad", 5, seed=6, workers=1)
    (tmp_path / "bad" / "images" / "000002.jpg").write_bytes(b"not a jpeg")
    pipe = Pipeline(image=ImageSpec(size=SIZE))
    with Cache(tmp_path / "c", memory=0, disk="16MiB") as c:
        feats = feature_cache(make_vit(), c)
        skip = MultimodalDataset(manifest, pipeline=pipe, on_error="skip")
        report = warm_features(skip, feats, batch_size=2, progress=False)
        assert (report.computed, report.rejected) == (4, 1)
        assert [r.sample_id for r in skip.rejects()] == ["000002"]
        strict = MultimodalDataset(manifest, pipeline=pipe)
        with pytest.raises(ValueError, match="000002"):
            warm_features(strict, feats, batch_size=2, progress=False)


# ----------------------------------------------------------------------------- load_factory


FACTORIES = """
import torch

def encoder():
    return torch.nn.Linear(4, 2)

def pair():
    return torch.nn.Linear(4, 2), (lambda x: x.float())

def spec():
    return {"encoder": torch.nn.Linear(4, 2), "name": "lin", "version": 3, "output": None}

def bad():
    return {"model": 1}

NOT_CALLABLE = 3
"""


def test_load_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "my_factories.py"
    path.write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    plain = load_factory("my_factories:encoder")
    assert isinstance(plain.encoder, nn.Linear) and plain.preprocess is None
    pair = load_factory("my_factories:pair")
    assert callable(pair.preprocess)
    spec = load_factory(f"{path}:spec")  # a file path works too
    assert (spec.name, spec.version, spec.output) == ("lin", "3", None)
    with Cache(tmp_path / "c", memory=0, disk="16MiB") as c:
        feats = FeatureCache.from_factory("my_factories:spec", cache=c, memory=0)
        assert (feats.name, feats.version) == ("lin", "3")
        assert feats.get([os.urandom(16)], torch.ones(1, 4)).shape == (1, 2)
    for bad, match in [
        ("my_factories:bad", "needs 'encoder'"),
        ("my_factories:NOT_CALLABLE", "not callable"),
        ("my_factories:missing", "no attribute"),
        ("no_such_module_xyz:f", "cannot import"),
        ("nocolon", "module:function"),
        (f"{tmp_path / 'absent.py'}:f", "does not exist"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_factory(bad)


def test_repr_and_os_independent_keys(cache: Cache) -> None:
    feats = feature_cache(make_vit(), cache)
    assert "FeatureCache(TinyViT" in repr(feats) and "DeviceTier" in repr(feats)
    key = os.urandom(16)
    assert feats.feature_key(key) == feats.feature_key(key.hex())


def test_features_of_an_interleaved_cache_equal_the_planar_ones(
    manifest: Path, tmp_path: Path
) -> None:
    """ImageSpec(channels_last=True): warm_features and wrap give the encoder [B,3,H,W]."""
    tok = train_tokenizer(synth_captions(50, seed=4), vocab_size=200)
    pipe = Pipeline(
        image=ImageSpec(size=SIZE, channels_last=True), text=TextSpec(tokenizer=tok, max_length=8)
    )
    ds = MultimodalDataset(manifest, pipeline=pipe)
    planar = make_ds(manifest)
    enc = make_vit()
    images = torch.from_numpy(np.stack([planar.produce(i)["image"] for i in range(12)]))
    with Cache(tmp_path / "cl", memory=0, disk="64MiB") as c:
        feats = feature_cache(enc, c)
        warm_features(ds, feats, batch_size=4, progress=False)
        served = feats.get([ds.key(i) for i in range(12)])
        torch.testing.assert_close(served, direct(enc, images, torch.float32))
        loader = DataLoader(ds, cache=c, batch_size=4, seed=0)
        for batch in feats.wrap(loader):
            ids = [int(i) for i in batch["id"]]
            torch.testing.assert_close(batch["features"], direct(enc, images[ids], torch.float32))
