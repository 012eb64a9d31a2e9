"""FeatureCache benchmark: cached frozen-encoder features vs running the encoder every epoch.

Not a test. Random-weight ViTs built from torch.nn, random uint8 images with random
sample keys (no JPEG decoding: this isolates the encoder from the data path).

    python benchmarks/features.py            # CPU: ViT-S/16 at 224 px, 256 samples, batch 32
    python benchmarks/features.py --gpu      # CUDA: ViT-L/14 at 224 px, fp16, GPU vs host tiers

Rows of the table (one epoch over the same samples each; cached rows: best of 3 epochs,
``recompute``: best of 2, since the machine may be shared):

- ``recompute``: preprocess + encoder on every batch (what training without a cache does);
- ``cold``: the first epoch through a FeatureCache (encoder + writes to every tier);
- ``device tier``: later epochs (hits on the GPU tier, or its host-memory fallback);
- ``memory tier``: a FeatureCache without a device tier over the same Cache (node-shared
  memory, then a host-to-device copy);
- ``disk tier``: the same over a disk-only Cache (LMDB read + checksum + copy).

It also times the encoder fingerprint of a ~300M-parameter model (ViT-L-sized).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmcache import sizing
from mmcache.cache import Cache
from mmcache.features import FeatureCache, encoder_fingerprint


@dataclass(frozen=True)
class VitSpec:
    name: str
    dim: int
    depth: int
    heads: int
    patch: int
    size: int = 224


VIT_S16 = VitSpec("ViT-S/16", dim=384, depth=12, heads=6, patch=16)
VIT_L14 = VitSpec("ViT-L/14", dim=1024, depth=24, heads=16, patch=14)
MODELS = {"vit-s": VIT_S16, "vit-l": VIT_L14}


class ViT(nn.Module):
    """Patch embedding, class token, pre-norm Transformer blocks, final LayerNorm."""

    def __init__(self, spec: VitSpec) -> None:
        super().__init__()
        tokens = (spec.size // spec.patch) ** 2 + 1
        self.embed = nn.Conv2d(3, spec.dim, spec.patch, spec.patch)
        self.cls = nn.Parameter(torch.randn(1, 1, spec.dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, tokens, spec.dim) * 0.02)
        layer = [
            nn.TransformerEncoderLayer(
                spec.dim,
                spec.heads,
                4 * spec.dim,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(spec.depth)
        ]
        self.blocks = nn.Sequential(*layer)
        self.norm = nn.LayerNorm(spec.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.pos
        return self.norm(self.blocks(x))


MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def make_preprocess(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def preprocess(x: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
        return ((x.float() / 255 - mean) / std).to(dtype)

    return preprocess


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(n: int, batch_size: int, size: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, n, batch_size):
        b = min(batch_size, n - start)
        images = torch.from_numpy(rng.integers(0, 256, (b, 3, size, size), dtype=np.uint8))
        if torch.cuda.is_available():
            images = images.pin_memory()
        out.append({"key": [rng.bytes(16).hex() for _ in range(b)], "image": images})
    return out


def timed_epoch(
    step: Callable[[dict[str, Any]], torch.Tensor], data: list[dict[str, Any]], device: torch.device
) -> float:
    sync(device)
    t0 = time.perf_counter()
    checksum = 0.0
    for batch in data:
        z = step(batch)
        checksum += float(z[0, 0, 0])  # consume the result like a training step would
    sync(device)
    return time.perf_counter() - t0


def best_of(
    repeats: int,
    step: Callable[[dict[str, Any]], torch.Tensor],
    data: list[dict[str, Any]],
    device: torch.device,
) -> float:
    """Cached epochs are cheap: report the best of a few (the machine may be shared)."""
    return min(timed_epoch(step, data, device) for _ in range(repeats))


def fingerprint_seconds(device: torch.device) -> tuple[int, float]:
    torch.manual_seed(0)
    model = ViT(VIT_L14).to(device)  # 303M parameters, fp32
    params = sum(p.numel() for p in model.parameters())
    encoder_fingerprint(model)  # warm-up (allocator, pinned staging on CUDA)
    sync(device)
    t0 = time.perf_counter()
    encoder_fingerprint(model)
    seconds = time.perf_counter() - t0
    del model
    return params, seconds


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    spec = MODELS[args.model]
    dtype = torch.float16
    weight_dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    encoder = ViT(spec).to(device=device, dtype=weight_dtype).eval()
    preprocess = make_preprocess(weight_dtype)
    data = batches(args.samples, args.batch_size, spec.size, seed=1)
    tokens = (spec.size // spec.patch) ** 2 + 1
    per_sample = tokens * spec.dim * 2
    print(
        f"# {spec.name} ({sum(p.numel() for p in encoder.parameters()) / 1e6:.0f}M params, "
        f"{weight_dtype}) on {device}; {args.samples} samples, batch {args.batch_size}; "
        f"features {tokens}x{spec.dim} fp16 = {per_sample / 1024:.0f} KiB/sample; "
        f"torch threads {torch.get_num_threads()}"
    )

    def recompute(batch: dict[str, Any]) -> torch.Tensor:
        with torch.inference_mode():
            x = batch["image"].to(device, non_blocking=True)
            return encoder(preprocess(x)).to(dtype)

    timed_epoch(recompute, data[:1], device)  # warm-up: kernels, allocator
    first_recompute = timed_epoch(recompute, data, device)
    rows: list[tuple[str, float]] = []

    root = Path(tempfile.mkdtemp(prefix="mmcache-bench-features-"))
    need = args.samples * (per_sample + 4096)
    shm_free = sizing.host_memory().shm_free
    memory = need if shm_free is None or shm_free > 2 * need else 0
    if not memory:
        print(f"# /dev/shm has {shm_free} bytes free: the memory-tier row is skipped")
    try:
        with Cache(root / "c", memory=memory, disk=2 * need, temporary=True) as cache:
            feats = FeatureCache(
                encoder,
                cache=cache,
                dtype=dtype,
                preprocess=preprocess,
                memory=2 * need,
                batch_size=args.batch_size,
                n_samples=args.samples,
            )
            rows.append(("cold (encode + store)", timed_epoch(feats, data, device)))
            feats.flush()
            tier = "device tier (GPU)" if device.type == "cuda" else "device tier (host fallback)"
            rows.append((tier, best_of(3, feats, data, device)))
            stats = feats.stats()
            if memory:
                host = FeatureCache(
                    encoder, cache=cache, dtype=dtype, preprocess=preprocess, memory=0
                )
                rows.append(("memory tier (shm)", best_of(3, host, data, device)))
                assert host.stats().hits["memory"] == 3 * args.samples, host.stats()
        with Cache(root / "c", memory=0, disk=2 * need) as disk_only:
            from_disk = FeatureCache(
                encoder, cache=disk_only, dtype=dtype, preprocess=preprocess, memory=0
            )
            rows.append(("disk tier (LMDB)", best_of(3, from_disk, data, device)))
            assert from_disk.stats().hits["disk"] == 3 * args.samples, from_disk.stats()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    assert stats.encoder_calls == len(data), stats  # the cached epoch ran no encoder
    # The machine may be shared: the baseline is the better of two recompute epochs.
    base = min(first_recompute, timed_epoch(recompute, data, device))
    rows.insert(0, ("recompute (best of 2)", base))
    print(f"{'epoch':<30} {'seconds':>9} {'samples/s':>11} {'vs recompute':>13}")
    for name, seconds in rows:
        print(
            f"{name:<30} {seconds:>9.3f} {args.samples / seconds:>11.0f} {base / seconds:>12.1f}x"
        )
    if not args.skip_fingerprint:
        params, seconds = fingerprint_seconds(device)
        print(
            f"encoder fingerprint of a {params / 1e6:.0f}M-parameter fp32 model "
            f"({params * 4 / 2**30:.2f} GiB) on {device}: {seconds:.2f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="CUDA, ViT-L/14, 2048 samples, batch 64")
    parser.add_argument("--model", choices=sorted(MODELS), default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--skip-fingerprint", action="store_true")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs CUDA (torch.cuda.is_available() is False)")
    gpu = args.gpu
    args.model = args.model or ("vit-l" if gpu else "vit-s")
    args.device = args.device or ("cuda" if gpu else "cpu")
    args.samples = args.samples or (2048 if gpu else 256)
    args.batch_size = args.batch_size or (64 if gpu else 32)
    run(args)


if __name__ == "__main__":
    main()
