"""The rows that read WebDataset tar shards of the JPEGs in place (issue 16).

Each of these rows starts from the same shards, written from the data set's
JPEGs and captions in img2dataset's layout (``<id>.jpg``, ``<id>.txt``,
``<id>.json`` with width and height; ``mmcache.sources.wds.write_shards``).
Writing them is the data as its user already has it, so it is not set-up: it
happens before the set-up clock starts, and the shards' bytes are not counted
as the row's disk use (the loose JPEGs of the other rows are not counted
either). Every row decodes with the same pipeline step as the others (resize
256, centre crop 224, 32 tokens):

- ``webdataset-jpeg``: ``wds.WebDataset`` over the shards, its ``decode``
  with the pipeline as the ``jpg`` handler, ``shuffle(1000)``, ``batched``,
  ``WebLoader`` with the same workers; decodes every epoch.
- ``energon``: Megatron-Energon after ``energon prepare`` (the CLI, run in the
  set-up and timed as its conversion cost; it writes ``.nv-meta/`` beside the
  shards), ``get_train_dataset`` + ``get_loader`` with a ``WorkerConfig`` and a
  ``TaskEncoder`` whose ``decoder = None`` (raw bytes, its documented way to
  decode yourself) and whose ``encode_sample`` runs the pipeline; decodes every
  epoch.
- ``mmcache-shards``: mmcache reading the same shards (``WebDatasetSource``
  through ``MultimodalDataset``), memory tier, for the in-place comparison.

Used by ``bench.py`` (merged into ``systems.SYSTEMS``); each row runs in its
own child process, like every other row.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from systems import Batch, MmcacheMemory, System, decode_jpeg_bytes, du


def shard_count(n: int, workers: int) -> int:
    """Samples per shard: at least 4 shards per worker, so that every worker has a share."""
    return max(1, math.ceil(n / (4 * max(workers, 1))))


class ShardRow(System):
    """A row over the shards: ``given()`` writes them before the timed set-up."""

    def given(self) -> None:
        """Write the shards (not timed: this is the data as its user has it)."""
        from mmcache.sources.wds import write_shards

        self.shard_dir = self.out / "shards"
        per_shard = shard_count(self.n, self.workers)
        self.shards = write_shards(self.manifest, self.shard_dir, per_shard=per_shard)
        self.shard_bytes = sum(p.stat().st_blocks * 512 for p in self.shards)
        # The shards' keys are the manifest ids; the table wants the row index.
        self.index = {str(r["id"]): i for i, r in enumerate(self.rows)}
        self.notes.append(f"{len(self.shards)} shards of {per_shard} samples (jpg, txt, json)")

    def disk_bytes(self) -> int:
        """What the row adds beside the shards (an index, a cache), not the shards."""
        return max(du(self.out) - self.shard_bytes, 0)

    def sample(self, key: str, jpeg: bytes, caption: str) -> dict[str, Any]:
        """One sample through the shared pipeline, from the bytes in the shard."""
        ids, mask = self.pipe.tokenize(caption)
        return {
            "idx": self.index[key],
            "image": torch.from_numpy(decode_jpeg_bytes(self.pipe, jpeg, key)),
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(mask),
        }


def _stack(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "idx": [s["idx"] for s in samples],
        "image": torch.stack([s["image"] for s in samples]),
        "input_ids": torch.stack([s["input_ids"] for s in samples]),
        "attention_mask": torch.stack([s["attention_mask"] for s in samples]),
    }


# -- WebDataset, in place -----------------------------------------------------------------------


class WebDatasetJPEG(ShardRow):
    """WebDataset over the JPEG shards in place: decode(pipeline) + shuffle(1000) + WebLoader."""

    library = "webdataset"

    def setup(self) -> None:
        import webdataset as wds

        pipe = self.pipe

        def jpg(data: bytes) -> np.ndarray:
            return decode_jpeg_bytes(pipe, data, "wds")

        urls = [str(p) for p in self.shards]
        pipeline = (
            wds.WebDataset(urls, shardshuffle=len(urls), seed=self.seed, empty_check=False)
            .shuffle(1000)
            .decode(wds.handle_extension("jpg", jpg))  # txt: its default handler (str)
            .map(self._tokenize)
            .to_tuple("__key__", "jpg", "input_ids", "attention_mask")
            .batched(self.batch_size)
        )
        self.loader = wds.WebLoader(pipeline, batch_size=None, num_workers=self.workers)
        self.notes.append("decoded every epoch (nothing cached); sample shuffle buffer 1000")

    def _tokenize(self, sample: dict[str, Any]) -> dict[str, Any]:
        sample["input_ids"], sample["attention_mask"] = self.pipe.tokenize(sample["txt"])
        return sample

    def batches(self, epoch: int) -> Iterator[Batch]:
        for keys, image, ids, mask in self.loader:
            yield [self.index[k] for k in keys], image, ids, mask


# -- Megatron-Energon ---------------------------------------------------------------------------


def _energon_encoder(row: ShardRow) -> Any:
    """A TaskEncoder that gets the raw bytes (``decoder = None``) and runs the pipeline."""
    from megatron.energon import DefaultTaskEncoder, stateless

    class PipelineTaskEncoder(DefaultTaskEncoder):  # type: ignore[misc]
        decoder = None  # raw bytes: the image is decoded by the shared pipeline below

        @stateless  # type: ignore[misc]
        def encode_sample(self, sample: Any) -> dict[str, Any]:
            key = sample.__key__.rsplit("/", 1)[-1]
            caption = sample.caption
            if isinstance(caption, bytes):
                caption = caption.decode("utf-8")
            return row.sample(key, sample.image, caption)

        def batch(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
            return _stack(samples)

    return PipelineTaskEncoder()


class Energon(ShardRow):
    """Megatron-Energon: ``energon prepare`` (set-up), then get_train_dataset + get_loader."""

    library = "megatron-energon"

    def setup(self) -> None:
        # The CLI as its users run it, non-interactive: all shards in the train split,
        # CaptioningSample with a field map (its docs' captioning example).
        cmd = [
            sys.executable,
            "-m",
            "megatron.energon.cli.main",
            "prepare",
            str(self.shard_dir),
            "--non-interactive",
            "--no-progress",
            "--split-ratio",
            "1,0,0",
            "--sample-type",
            "CaptioningSample",
            "--field-map",
            '{"image": "jpg", "caption": "txt"}',
            "--num-workers",
            str(max(self.workers, 1)),
        ]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        self.extra["prepare_s"] = time.perf_counter() - t0
        if done.returncode != 0:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"energon prepare failed ({done.returncode}): {tail[:400]}")
        from megatron.energon import WorkerConfig, get_loader, get_train_dataset

        self.steps = math.ceil(self.n / self.batch_size)
        worker_config = WorkerConfig.default_worker_config(self.workers)
        self.dataset = get_train_dataset(
            str(self.shard_dir),
            batch_size=self.batch_size,
            # Its quick-start's values; shards are read by random access (tar index).
            shuffle_buffer_size=100,
            max_samples_per_sequence=100,
            worker_config=worker_config,
            task_encoder=_energon_encoder(self),
            # Its training datasets repeat forever: one epoch = ceil(n / batch) batches.
            virtual_epoch_length=self.steps,
        )
        self.loader = get_loader(self.dataset)
        meta = self.shard_dir / ".nv-meta"
        self.extra["nv_meta_bytes"] = du(meta)
        self.notes.append(
            "decoded every epoch (nothing cached); "
            f"`energon prepare` {self.extra['prepare_s']:.1f} s of the set-up "
            f"(.nv-meta {self.extra['nv_meta_bytes'] / 1e6:.1f} MB); "
            f"shuffle buffer 100, max 100 samples per sequence; epoch = {self.steps} batches "
            "(virtual_epoch_length: its train datasets repeat)"
        )

    def batches(self, epoch: int) -> Iterator[Batch]:
        for b in self.loader:
            yield b["idx"], b["image"], b["input_ids"], b["attention_mask"]

    def close(self) -> None:
        if hasattr(self, "loader"):
            del self.loader, self.dataset


# -- mmcache over the same shards ---------------------------------------------------------------


class MmcacheShards(ShardRow, MmcacheMemory):
    """mmcache reading the same shards in place (WebDatasetSource), memory tier."""

    def setup(self) -> None:
        # Mmcache.setup builds the dataset from self.manifest: point it at the shards.
        self.manifest = str(self.shard_dir / "*.tar")
        super().setup()
        self.notes.append("the same shards read in place (WebDatasetSource; member index built)")

    def batches(self, epoch: int) -> Iterator[Batch]:
        for b in self.raw_batches(epoch):
            yield [self.index[s] for s in b["id"]], b["image"], b["input_ids"], b["attention_mask"]


# Where each goes in the table: after the row named on the left.
AFTER = {"webdataset": ["webdataset-jpeg", "energon"], "mmcache-disk": ["mmcache-shards"]}
SYSTEMS: dict[str, type[System]] = {
    "webdataset-jpeg": WebDatasetJPEG,
    "energon": Energon,
    "mmcache-shards": MmcacheShards,
}
