"""``FileSource`` passes the identity contract (issue 24): clips on the local moto
S3 server, read through the raw-bytes tier.

A clip's identity is its S3 ETag (the MD5 of its bytes for a single-part upload), not its
URL (:func:`mmcache.sources.blobs.objects.object_identity`): clips of the same names, sizes
and frame counts but other pixels (uncompressed ``rawvideo`` in AVI, so every seed gives
one size) share no entry, a same-size rewrite is fresh, a copy under another bucket has
the same keys, and a flipped byte of the raw-bytes tier is never served. The contract
compares each sample's decoded frames (``videos``) with what the source produces.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache.sources.blobs import RawTier
from mmcache.sources.files import FileSource
from mmcache.testing.identity_contract import IdentityContract, flip_raw_spans
from support.s3 import S3Endpoint

av = pytest.importorskip("av")
pytest.importorskip("jinja2")
pytest.importorskip("moto")

sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
import test_remote_identity as remote_identity  # noqa: E402 (the same folder)
from video_support import video_chat_pipeline  # noqa: E402

N = 4
# The moto server with a second bucket for the remote ``cp -a`` copies (module-scoped),
# as FileSource's identity test has it.
COPIES = remote_identity.COPIES
s3 = remote_identity.s3


def noise_clip(seed: int, frames: int = 8, side: int = 56) -> bytes:
    """An AVI of ``frames`` frames of seeded random pixels, uncompressed (``rawvideo``):
    every seed gives other bytes of one size."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as container:
        stream = container.add_stream("rawvideo", rate=8)
        stream.width, stream.height, stream.pix_fmt = side, side, "rgb24"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def _names() -> list[str]:
    return [f"clips/{i:04d}.avi" for i in range(N)]


def _write_manifest(folder: Path, urls: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {"id": f"{i:04d}", "video": url, "conversations": [
            {"from": "human", "value": "<video>\nWhat?"}, {"from": "gpt", "value": "Noise."}]}
        for i, url in enumerate(urls)
    ]  # fmt: skip
    out = folder / "remote.json"
    out.write_text(json.dumps(rows))
    return out


class TestS3VideoIdentity(IdentityContract):
    """A dataset is ``N`` clips under a prefix of its own (from the test's folder) and a
    local manifest of their URLs; each source keeps its raw-bytes tier."""

    __test__ = True
    field = "videos"

    @pytest.fixture(autouse=True)
    def _where(self, s3: S3Endpoint) -> None:
        self.pipeline, self.s3 = video_chat_pipeline(), s3

    prefix = staticmethod(remote_identity.RemoteIdentity.prefix)  # unique per test, dataset

    def write_dataset(self, folder: Path, variant: int) -> Path:
        prefix = self.prefix(folder)
        for i, name in enumerate(_names()):
            body = noise_clip(variant * 100 + i)
            self.s3.client.put_object(Bucket="data", Key=f"{prefix}/{name}", Body=body)
        return _write_manifest(folder, [f"s3://data/{prefix}/{n}" for n in _names()])

    def copy_dataset(self, folder: Path, copy: Path, location: Path) -> Path:
        prefix, to = self.prefix(folder), self.prefix(copy)
        for name in _names():
            source = {"Bucket": "data", "Key": f"{prefix}/{name}"}
            self.s3.client.copy_object(Bucket=COPIES, Key=f"{to}/{name}", CopySource=source)
        return _write_manifest(copy, [f"s3://{COPIES}/{to}/{n}" for n in _names()])

    def open_source(self, location: Path) -> FileSource:
        self.opened = getattr(self, "opened", 0) + 1
        return FileSource(
            location,
            pipeline=self.pipeline,
            storage_options=self.s3.storage_options(),
            raw=RawTier(location.parent / f"raw-{self.opened}", budget="8MiB"),
            retries=1,
            state_dir=location.parent / f"state-{self.opened}",
        )

    def served_values(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """One clip per sample (``video_counts`` all 1): its frames, flat as produced."""
        assert batch["video_counts"].tolist() == [1] * len(batch["id"])
        return [clip.reshape(-1) for clip in batch["videos"]]

    def flip_source_tiers(self, source: Any) -> int:
        objects = source.blobs  # each clip's stamp and size are the blobs'
        spans = [
            (url, stamp, 0, int(size))
            for url, stamp, size in zip(
                objects.urls, objects.object_stamps, objects.object_sizes, strict=True
            )
        ]
        return flip_raw_spans(source.raw, spans)
