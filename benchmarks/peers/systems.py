"""The systems of the side-by-side benchmark, one class each; run one per child process.

``bench.py`` starts ``python bench.py --child SPEC.json RESULT.json`` once per
(data set, system). The child builds the system named in the spec, times its
set-up (the conversion or preprocessing pass it needs before training, if any)
and each epoch, checks the first batch's format and one sample's content against
the shared pipeline, measures the bytes it left on disk, cleans up, and writes a
JSON result. Memory is measured from outside by the parent (PSS of this process
and all its children, and new files in ``/dev/shm``); the child prints
``@@phase NAME`` lines so that the parent can split the peaks by phase.

Every system delivers the same batches: ``image`` uint8 ``[B,3,224,224]``,
``input_ids`` and ``attention_mask`` int32 ``[B,32]``, made by the same
:class:`mmcache.transforms.pipeline.Pipeline` (resize 256, centre crop 224, 32 tokens).
uint8, not float32 normalised: normalisation belongs on the training device
(``mmcache.normalize``), and a uint8 sample is 4x cheaper to store and
move for every system alike. A peer whose reader returns other dtypes is
converted inside its timed loop (the work its user would have to do), and the
result says so.
"""

from __future__ import annotations

import collections
import functools
import importlib.machinery
import json
import multiprocessing
import os
import sys
import time
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

IMAGE_SHAPE = (3, 224, 224)
TEXT_LEN = 32

Batch = tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]  # idx, image, ids, mask


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------


def phase(name: str) -> None:
    """Tell the parent which phase the memory samples belong to."""
    print(f"@@phase {name}", flush=True)


def make_pipeline(tokenizer: str) -> Any:
    from mmcache.transforms import ImageSpec, TextSpec
    from mmcache.transforms.pipeline import Pipeline

    return Pipeline(
        image=ImageSpec(size=224, resize=256), text=TextSpec(tokenizer=tokenizer, max_length=32)
    )


def read_rows(manifest: str) -> list[dict[str, Any]]:
    """The manifest as a list of dicts with absolute image paths (the design note's way)."""
    base = Path(manifest).parent
    rows = []
    with open(manifest, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                row["image_path"] = str(base / row["image_path"])
                rows.append(row)
    return rows


def rle(values: list[float]) -> str:
    """``0.00, 1.00 (x7)``: per-epoch rates, repeated values folded."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and f"{values[j + 1]:.2f}" == f"{values[i]:.2f}":
            j += 1
        count = j - i + 1
        out.append(f"{values[i]:.2f}" + (f" (x{count})" if count > 2 else ""))
        if count == 2:
            out.append(f"{values[i]:.2f}")
        i = j + 1
    return ", ".join(out)


def du(path: str | os.PathLike[str]) -> int:
    """Bytes allocated on disk under ``path`` (like ``du -s``; sparse files count as used)."""
    total = 0
    p = Path(path)
    if not p.exists():
        return 0
    for root, _dirs, files in os.walk(p):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            total += st.st_blocks * 512
    return total


def decode_jpeg_bytes(pipe: Any, data: bytes, sample_id: str) -> np.ndarray:
    """The pipeline's image step on bytes already in memory (the MDS-of-JPEG row): the
    same decode step and stage as a path, so the output is identical to every other row."""
    from mmcache.transforms.image import decode_bytes

    out: np.ndarray = decode_bytes(pipe.image, data, sample_id=sample_id, path="<bytes>")
    return out


class Preprocess(torch.utils.data.Dataset[dict[str, Any]]):
    """Record ``i`` -> its preprocessed numpy sample plus ``idx``; used by conversions."""

    def __init__(self, rows: list[dict[str, Any]], pipe: Any) -> None:
        self.rows = rows
        self.pipe = pipe

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.rows[i]
        sample = self.pipe.process(row["image_path"], row["caption"], sample_id=row["id"])
        sample["idx"] = i
        return sample  # type: ignore[no-any-return]


def _identity(x: Any) -> Any:
    return x


def preprocessed(rows: list[dict[str, Any]], pipe: Any, workers: int) -> Iterator[dict[str, Any]]:
    """Every sample, preprocessed by ``workers`` processes, in order (for conversions)."""
    loader = torch.utils.data.DataLoader(
        Preprocess(rows, pipe),
        batch_size=None,
        shuffle=False,
        num_workers=workers,
        collate_fn=_identity,
        prefetch_factor=4 if workers else None,
    )
    yield from loader


def stub_torchvision() -> str | None:
    """Let ``import streaming`` work without a usable torchvision; returns a note or None.

    mosaicml-streaming imports torchvision at import time (only for its own
    CIFAR/ImageNet dataset classes, which this benchmark does not use). The only
    torchvision wheel that installs here is the CUDA build, whose compiled part
    needs ``libc10_cuda.so``: under the CPU build of torch, ``import
    torchvision`` raises ``RuntimeError: operator torchvision::nms does not
    exist``. In that case, and only then, empty stand-ins are put in
    ``sys.modules`` so that MDS writing and reading (which never call
    torchvision) can be measured.
    """
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # RuntimeError from the CUDA build, ImportError if absent
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        for name in list(sys.modules):
            if name == "torchvision" or name.startswith("torchvision."):
                del sys.modules[name]

        class VisionDataset:  # what streaming.vision subclasses
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                pass

        def to_tensor(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("torchvision stand-in (see benchmarks/peers/systems.py)")

        def module(name: str, **attrs: Any) -> types.ModuleType:
            mod = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
            mod.__path__ = []
            mod.__dict__.update(attrs)
            sys.modules[name] = mod
            return mod

        module("torchvision", __version__="0+stand-in")
        module("torchvision.datasets", VisionDataset=VisionDataset)
        module("torchvision.transforms")
        module("torchvision.transforms.functional", to_tensor=to_tensor)
        return (
            "torchvision stand-in: its only wheel here is a CUDA build that cannot load "
            f"({reason}); MDS never calls it"
        )
    return None


# ----------------------------------------------------------------------------------------------
# Systems
# ----------------------------------------------------------------------------------------------


class System:
    """One row of the table: ``setup()`` once (timed), then ``batches(epoch)`` per epoch."""

    library = ""  # the distribution whose version is reported
    # Whether every warm epoch behaves alike, so that short warm epochs may be
    # repeated for a steadier figure (see run()); not so for caches that keep filling.
    steady = True

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.n: int = spec["n"]
        self.workers: int = spec["workers"]
        self.batch_size: int = spec["batch_size"]
        self.seed: int = spec["seed"]
        self.out = Path(spec["out"])
        self.out.mkdir(parents=True, exist_ok=True)
        self.pipe = make_pipeline(spec["tokenizer"])
        self.manifest: str = spec["manifest"]
        self.rows = read_rows(self.manifest)
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}

    def given(self) -> None:
        """The data as its user already has it (e.g. tar shards), made before the set-up
        clock starts; nothing by default (the manifest and the loose JPEGs)."""

    def setup(self) -> None:
        """The one-off pass before the first epoch (conversion, preprocessing); timed."""

    def batches(self, epoch: int) -> Iterator[Batch]:
        raise NotImplementedError

    def after_epoch(self, epoch: int) -> None:
        """Collect per-epoch counters (not timed)."""

    def disk_bytes(self) -> int:
        return du(self.out)

    def close(self) -> None:
        """Release resources; the parent removes ``out`` afterwards."""

    def torch_loader(self, dataset: Any, epoch: int, **kw: Any) -> torch.utils.data.DataLoader[Any]:
        gen = torch.Generator()
        gen.manual_seed(self.seed * 1000 + epoch)
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.workers,
            generator=gen,
            **kw,
        )


def _as_batch(b: dict[str, Any], idx_key: str = "idx") -> Batch:
    idx = b[idx_key]
    idx_list = [int(i) for i in idx] if not isinstance(idx, torch.Tensor) else idx.tolist()
    return idx_list, b["image"], b["input_ids"], b["attention_mask"]


# -- the design note's pattern ------------------------------------------------------------------


class NoteDataset(torch.utils.data.Dataset[dict[str, Any]]):
    """The design note's dataset: a list of dicts and an ``OrderedDict`` LRU of
    ``capacity`` items inside it (so, with workers, one private copy per worker)."""

    def __init__(self, rows: list[dict[str, Any]], pipe: Any, capacity: int, counts: Any) -> None:
        self.rows = rows  # a Python list of dicts, as in the note
        self.pipe = pipe
        self.capacity = capacity
        self.cache: collections.OrderedDict[str, dict[str, np.ndarray]] = collections.OrderedDict()
        self.counts = counts  # shared [hits, misses], so that workers' counts reach us

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.rows[i]
        key = row["id"]
        sample = self.cache.get(key)
        if sample is not None:
            self.cache.move_to_end(key)
            slot = 0
        else:
            sample = self.pipe.process(row["image_path"], row["caption"], sample_id=key)
            self.cache[key] = sample
            if len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
            slot = 1
        with self.counts.get_lock():
            self.counts[slot] += 1
        return {
            "idx": i,
            "image": torch.from_numpy(sample["image"]),
            "input_ids": torch.from_numpy(sample["input_ids"]),
            "attention_mask": torch.from_numpy(sample["attention_mask"]),
        }


class NoteLRU(System):
    """The design note's pattern: list-of-dicts dataset, LRU of N items, 2 workers."""

    persistent = False

    def setup(self) -> None:
        self.counts = multiprocessing.get_context("fork").Array("q", 2)
        self.dataset = NoteDataset(self.rows, self.pipe, capacity=self.n, counts=self.counts)
        self.hit_rates: list[float] = []
        self.loader: torch.utils.data.DataLoader[Any] | None = None
        self.notes.append(
            f"LRU capacity {self.n} items (the whole data set); "
            + ("persistent_workers=True" if self.persistent else "default (non-persistent) workers")
        )

    def batches(self, epoch: int) -> Iterator[Batch]:
        if self.loader is None or not self.persistent:
            # One loader for every epoch when persistent (its workers keep their caches);
            # a fresh one otherwise, which is what the default settings amount to.
            self.loader = self.torch_loader(
                self.dataset, 0, persistent_workers=self.persistent and self.workers > 0
            )
        for b in self.loader:
            yield _as_batch(b)

    def after_epoch(self, epoch: int) -> None:
        hits, misses = self.counts[0], self.counts[1]
        self.hit_rates.append(round(hits / max(hits + misses, 1), 3))
        self.counts[0] = self.counts[1] = 0
        self.extra["hit_rate_per_epoch"] = self.hit_rates

    def close(self) -> None:
        self.loader = None
        self.notes.append("hit rate per epoch: " + rle(self.hit_rates))


class NoteLRUPersistent(NoteLRU):
    """The same with persistent_workers=True: each worker keeps its private copy."""

    persistent = True
    steady = False  # each worker's private cache fills over several epochs


# -- torch DataLoader over the uncached dataset ----------------------------------------------------


class TorchUncached(System):
    """mmcache.MultimodalDataset, no cache, in a plain torch DataLoader: decode every epoch."""

    library = "torch"

    def setup(self) -> None:
        from mmcache.dataset import MultimodalDataset, collate

        self.dataset = MultimodalDataset(self.manifest, pipeline=self.pipe)
        self.collate = collate

    def batches(self, epoch: int) -> Iterator[Batch]:
        for b in self.torch_loader(self.dataset, epoch, collate_fn=self.collate):
            yield [int(s) for s in b["id"]], b["image"], b["input_ids"], b["attention_mask"]


# -- Hugging Face datasets -----------------------------------------------------------------------


def _hf_process(example: dict[str, Any], pipe: Any) -> dict[str, Any]:
    sample = pipe.process(example["image_path"], example["caption"], sample_id=example["id"])
    return {
        "image": sample["image"],
        "input_ids": sample["input_ids"],
        "attention_mask": sample["attention_mask"],
    }


class HFDatasets(System):
    """``Dataset.map`` to preprocessed arrays (num_proc = workers), then ``with_format``."""

    library = "datasets"
    fmt = "torch"

    def setup(self) -> None:
        import datasets
        from datasets import Array3D, Features, Sequence, Value

        datasets.disable_progress_bars()
        raw = datasets.Dataset.from_dict(
            {
                "idx": list(range(self.n)),
                "id": [r["id"] for r in self.rows],
                "image_path": [r["image_path"] for r in self.rows],
                "caption": [r["caption"] for r in self.rows],
            }
        )
        features = Features(
            {
                "idx": Value("int64"),
                "id": Value("string"),
                "image": Array3D(shape=IMAGE_SHAPE, dtype="uint8"),
                "input_ids": Sequence(Value("int32"), length=TEXT_LEN),
                "attention_mask": Sequence(Value("int32"), length=TEXT_LEN),
            }
        )
        mapped = raw.map(
            _hf_process,
            fn_kwargs={"pipe": self.pipe},
            remove_columns=["image_path", "caption"],
            features=features,
            num_proc=self.workers if self.workers > 1 else None,
            cache_file_name=str(self.out / "mapped.arrow"),
        )
        self.dataset = mapped.with_format(
            self.fmt, columns=["idx", "image", "input_ids", "attention_mask"]
        )
        if self.fmt == "arrow":
            return
        first = self.dataset[0]
        self.native = {k: str(first[k].dtype) for k in ("image", "input_ids")}
        if self.native["image"] not in ("torch.uint8", "uint8"):
            self.notes.append(
                f'with_format("{self.fmt}") returns image as {self.native["image"]} and ids as '
                f"{self.native['input_ids']} (its integer default): converted to uint8/int32 "
                "in the timed loop"
            )

    def batches(self, epoch: int) -> Iterator[Batch]:
        for b in self.torch_loader(self.dataset, epoch):
            idx, image, ids, mask = _as_batch(b)
            if image.dtype != torch.uint8:
                image = image.to(torch.uint8)
            if ids.dtype != torch.int32:
                ids = ids.to(torch.int32)
                mask = mask.to(torch.int32)
            yield idx, image, ids, mask


def _arrow_values(table: Any, column: str) -> np.ndarray:
    """The flat values of a fixed-shape list column (one copy at most, no per-row Python)."""
    import pyarrow as pa

    arr = table.column(column).combine_chunks()
    if isinstance(arr, pa.ExtensionArray):  # datasets' Array3D
        arr = arr.storage
    while pa.types.is_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        arr = arr.flatten()
    return arr.to_numpy(zero_copy_only=False)  # type: ignore[no-any-return]


def _arrow_batch(table: Any) -> dict[str, Any]:
    n = table.num_rows
    return {
        "idx": torch.from_numpy(table.column("idx").to_numpy()),
        "image": torch.from_numpy(_arrow_values(table, "image").reshape(n, *IMAGE_SHAPE)),
        "input_ids": torch.from_numpy(_arrow_values(table, "input_ids").reshape(n, TEXT_LEN)),
        "attention_mask": torch.from_numpy(
            _arrow_values(table, "attention_mask").reshape(n, TEXT_LEN)
        ),
    }


class HFDatasetsArrow(HFDatasets):
    """Same conversion; ``with_format("arrow")``, one slice per batch, uint8 kept.

    Its formatters ("torch", "numpy") turn every integer column into int64, the
    uint8 images too (8x the bytes). Fetching a whole batch as one Arrow table
    (a BatchSampler as the sampler, ``batch_size=None``) and taking the flat
    buffers is the fastest way to read it that we know.
    """

    fmt = "arrow"

    def setup(self) -> None:
        super().setup()
        self.notes[:] = ["with_format('arrow') + batched fetch: uint8 kept, no per-row Python"]

    def batches(self, epoch: int) -> Iterator[Batch]:
        gen = torch.Generator()
        gen.manual_seed(self.seed * 1000 + epoch)
        sampler = torch.utils.data.BatchSampler(
            torch.utils.data.RandomSampler(range(self.n), generator=gen),
            self.batch_size,
            drop_last=False,
        )
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=self.workers,
            collate_fn=_arrow_batch,
        )
        for b in loader:
            yield _as_batch(b)


# -- MosaicML Streaming ----------------------------------------------------------------------------


def _streaming_import() -> tuple[Any, str | None]:
    note = stub_torchvision()
    import streaming

    return streaming, note


def _make_decoding_dataset(streaming: Any, pipe: Any, **kw: Any) -> Any:
    class DecodingStreamingDataset(streaming.StreamingDataset):  # type: ignore[misc, name-defined]
        def __getitem__(self, i: int) -> dict[str, Any]:
            obj = super().__getitem__(i)
            ids, mask = pipe.tokenize(obj["caption"])
            return {
                "idx": obj["idx"],
                "image": decode_jpeg_bytes(pipe, obj["jpeg"], str(obj["idx"])),
                "input_ids": ids,
                "attention_mask": mask,
            }

    return DecodingStreamingDataset(**kw)


class MosaicArrays(System):
    """MDS shards of the preprocessed arrays; StreamingDataset + StreamingDataLoader."""

    library = "mosaicml-streaming"
    columns: ClassVar[dict[str, str]] = {
        "idx": "int",
        "image": "ndarray:uint8:3,224,224",
        "input_ids": "ndarray:int32:32",
        "attention_mask": "ndarray:int32:32",
    }

    def setup(self) -> None:
        self.streaming, note = _streaming_import()
        if note:
            self.notes.append(note)
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        self.local = self.out / "mds"
        with self.streaming.MDSWriter(out=str(self.local), columns=self.columns) as writer:
            self.write(writer)
        self.dataset = self.make_dataset(
            local=str(self.local), shuffle=True, shuffle_seed=self.seed, batch_size=self.batch_size
        )
        self.loader = self.streaming.StreamingDataLoader(
            self.dataset, batch_size=self.batch_size, num_workers=self.workers
        )

    def write(self, writer: Any) -> None:
        for s in preprocessed(self.rows, self.pipe, self.workers):
            writer.write(
                {
                    "idx": int(s["idx"]),
                    "image": s["image"],
                    "input_ids": s["input_ids"],
                    "attention_mask": s["attention_mask"],
                }
            )

    def make_dataset(self, **kw: Any) -> Any:
        return self.streaming.StreamingDataset(**kw)

    def batches(self, epoch: int) -> Iterator[Batch]:
        # Each pass over a StreamingDataset is its next epoch (a fresh shuffle).
        for b in self.loader:
            yield _as_batch(b)

    def close(self) -> None:
        from streaming.base.util import clean_stale_shared_memory

        del self.loader, self.dataset
        clean_stale_shared_memory()


class MosaicJPEG(MosaicArrays):
    """MDS shards of the JPEG bytes and captions, decoded and tokenized at read."""

    columns: ClassVar[dict[str, str]] = {"idx": "int", "jpeg": "bytes", "caption": "str"}

    def write(self, writer: Any) -> None:
        for i, row in enumerate(self.rows):
            writer.write(
                {"idx": i, "jpeg": Path(row["image_path"]).read_bytes(), "caption": row["caption"]}
            )

    def make_dataset(self, **kw: Any) -> Any:
        return _make_decoding_dataset(self.streaming, self.pipe, **kw)


# -- LitData ---------------------------------------------------------------------------------------


def _litdata_item(row: tuple[int, str, str, str], pipe: Any) -> dict[str, Any]:
    i, path, caption, sample_id = row
    s = pipe.process(path, caption, sample_id=sample_id)
    return {
        "idx": i,
        "image": s["image"],
        "input_ids": s["input_ids"],
        "attention_mask": s["attention_mask"],
    }


def _litdata_optimize(**kwargs: Any) -> None:
    import litdata

    litdata.optimize(**kwargs)


class LitData(System):
    """``litdata.optimize`` (num_workers = workers), then StreamingDataset/StreamingDataLoader.

    ``batch_decode=False`` (per-item decoding): measured as its fastest setting for
    arrays of this size (its default "auto" was 2-3x slower in earlier runs here).
    """

    library = "litdata"

    def setup(self) -> None:
        import litdata

        inputs = [(i, r["image_path"], r["caption"], r["id"]) for i, r in enumerate(self.rows)]
        self.data_dir = self.out / "optimized"
        # optimize() forces the global multiprocessing start method to "spawn" and sets
        # DATA_OPTIMIZER_* variables; a reader in the same process then starts its
        # workers by spawn every epoch (10x slower here). Users optimize once, in
        # another process, and train later: so does this row.
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(
            target=_litdata_optimize,
            kwargs={
                "fn": functools.partial(_litdata_item, pipe=self.pipe),
                "inputs": inputs,
                "output_dir": str(self.data_dir),
                "chunk_bytes": "64MB",
                "num_workers": max(self.workers, 1),
                "mode": "overwrite",
                "verbose": False,
            },
        )
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"litdata.optimize failed (exit code {proc.exitcode})")
        self.dataset = litdata.StreamingDataset(
            str(self.data_dir),
            shuffle=True,
            seed=self.seed,
            batch_decode=False,
            cache_dir=str(self.out / "cache"),
        )
        self.loader = litdata.StreamingDataLoader(
            self.dataset, batch_size=self.batch_size, num_workers=self.workers
        )
        self.notes.append("batch_decode=False (its fastest setting for these arrays)")

    def batches(self, epoch: int) -> Iterator[Batch]:
        for b in self.loader:
            yield _as_batch(b)

    def close(self) -> None:
        del self.loader, self.dataset


# -- WebDataset ------------------------------------------------------------------------------------


class WebDataset(System):
    """Tar shards of ``.npy`` arrays (ShardWriter); WebDataset + shuffle(1000) + WebLoader."""

    library = "webdataset"

    def setup(self) -> None:
        import webdataset as wds

        # At least 4 shards per worker, so that every worker gets a share.
        per_shard = max(1, -(-self.n // (4 * max(self.workers, 1))))
        pattern = str(self.out / "shard-%06d.tar")
        with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
            for s in preprocessed(self.rows, self.pipe, self.workers):
                sink.write(
                    {
                        "__key__": f"{int(s['idx']):08d}",
                        "image.npy": s["image"],
                        "input_ids.npy": s["input_ids"],
                        "attention_mask.npy": s["attention_mask"],
                    }
                )
        urls = sorted(str(p) for p in self.out.glob("shard-*.tar"))
        pipeline = (
            wds.WebDataset(urls, shardshuffle=len(urls), seed=self.seed, empty_check=False)
            .shuffle(1000)
            .decode()
            .to_tuple("__key__", "image.npy", "input_ids.npy", "attention_mask.npy")
            .batched(self.batch_size)
        )
        self.loader = wds.WebLoader(pipeline, batch_size=None, num_workers=self.workers)
        self.notes.append(f"{len(urls)} shards, sample shuffle buffer 1000")

    def batches(self, epoch: int) -> Iterator[Batch]:
        for keys, image, ids, mask in self.loader:
            yield [int(k) for k in keys], image, ids, mask


# -- mmcache ------------------------------------------------------------------------------------


class Mmcache(System):
    """mmcache's Cache + DataLoader; budgets from the preprocessed size of the data set."""

    library = "mmcache"
    memory_fraction: float = 1.5  # of the encoded data set size; 0 = no memory tier
    disk_fraction: float | None = None  # None = no disk tier

    def setup(self) -> None:
        from mmcache.cache import Cache
        from mmcache.dataset import MultimodalDataset
        from mmcache.loader import DataLoader

        data_bytes = self.spec["sample_bytes"] * self.n
        # A little slack per entry for the tiers' own bookkeeping when a budget must
        # hold everything; the 50% row gets exactly half of the data's bytes.
        memory = int(data_bytes * self.memory_fraction)
        if self.memory_fraction >= 1:
            memory += 64 * 2**20
        disk = None
        if self.disk_fraction is not None:
            disk = int(data_bytes * self.disk_fraction) + 64 * 2**20
        self.budgets = {"memory": memory, "disk": disk}
        self.extra["budgets"] = self.budgets
        self.dataset = MultimodalDataset(self.manifest, pipeline=self.pipe)
        self.cache = Cache(
            self.out / "cache", memory=memory, disk=disk, policy="value", temporary=True
        )
        self.loader = DataLoader(
            self.dataset,
            cache=self.cache,
            batch_size=self.batch_size,
            shuffle=True,
            seed=self.seed,
            num_workers=self.workers,
        )

    def raw_batches(self, epoch: int) -> Iterator[dict[str, Any]]:
        self.loader.set_epoch(epoch)
        yield from self.loader

    def batches(self, epoch: int) -> Iterator[Batch]:
        for b in self.raw_batches(epoch):
            yield [int(s) for s in b["id"]], b["image"], b["input_ids"], b["attention_mask"]

    def close(self) -> None:
        if not hasattr(self, "loader"):
            return
        stats = self.loader.stats()
        self.extra["loader_stats"] = stats.as_dict()
        try:
            self.extra["cache_stats"] = self.cache.stats().as_dict()
        except Exception as exc:
            self.extra["cache_stats_error"] = repr(exc)
        rates = [round(e.hit_rate, 3) for e in stats.epochs]
        self.notes.append("hit rate per epoch: " + rle(rates))
        memory = self.cache.memory
        shm_name = getattr(memory, "shm_name", None)
        paths = list(memory.segment_paths()) if memory is not None else []
        del self.loader
        self.cache.close()
        left = [p for p in paths if os.path.exists(p)]
        if left and shm_name is not None:
            from mmcache.stores.memory import unlink_store

            unlink_store(shm_name)
            self.notes.append(
                f"{len(left)} shared-memory file(s) still there after close(): removed"
            )


class MmcacheMemory(Mmcache):
    """Memory tier holding everything (1.5x the data + 64 MiB), no disk tier."""

    memory_fraction = 1.5


class MmcacheDisk(Mmcache):
    """Disk tier only (memory=0, LMDB budget 2x the data)."""

    memory_fraction = 0.0
    disk_fraction = 2.0


class MmcacheHalf(Mmcache):
    """Memory tier of half the preprocessed bytes, no disk tier."""

    memory_fraction = 0.5


class MmcacheFeatures(Mmcache):
    """FeatureCache over the memory tier (only when mmcache.features exists)."""

    def setup(self) -> None:
        try:
            import mmcache.features  # noqa: F401
        except ImportError as exc:
            raise Unavailable("FeatureCache row: not in this benchmark yet") from exc
        super().setup()
        from mmcache.features import FeatureCache

        torch.manual_seed(0)
        # A small frozen conv encoder: what matters is that it runs on misses only.
        encoder = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 8, stride=8),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
        ).eval()
        from mmcache.transforms.normalize import normalize

        self.features = FeatureCache(
            encoder, cache=self.cache, dtype=torch.float16, preprocess=normalize, memory="256MiB"
        )
        self.notes.append(
            "memory tier + FeatureCache of a small CNN (runs on feature misses only); "
            "batches carry images and features"
        )

    def raw_batches(self, epoch: int) -> Iterator[dict[str, Any]]:
        self.loader.set_epoch(epoch)
        yield from self.features.wrap(self.loader, keep_images=True)

    def close(self) -> None:
        if hasattr(self, "features"):
            self.extra["feature_stats"] = self.features.stats().as_dict()
        super().close()


# -- the upper bound -----------------------------------------------------------------------------


class NumpyGather(System):
    """All preprocessed samples in numpy arrays; each batch one fancy-index gather."""

    library = "numpy"

    def setup(self) -> None:
        self.images = np.empty((self.n, *IMAGE_SHAPE), dtype=np.uint8)
        self.ids = np.empty((self.n, TEXT_LEN), dtype=np.int32)
        self.mask = np.empty((self.n, TEXT_LEN), dtype=np.int32)
        for s in preprocessed(self.rows, self.pipe, self.workers):
            i = int(s["idx"])
            self.images[i] = s["image"]
            self.ids[i] = s["input_ids"]
            self.mask[i] = s["attention_mask"]
        self.notes.append("set-up = preprocessing every sample into RAM (no cold epoch)")

    def batches(self, epoch: int) -> Iterator[Batch]:
        order = np.random.default_rng((self.seed, epoch)).permutation(self.n)
        for start in range(0, self.n, self.batch_size):
            idx = order[start : start + self.batch_size]
            yield (
                idx.tolist(),
                torch.from_numpy(self.images[idx]),
                torch.from_numpy(self.ids[idx]),
                torch.from_numpy(self.mask[idx]),
            )


class _ArrayDataset(torch.utils.data.Dataset[dict[str, Any]]):
    def __init__(self, images: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> None:
        self.images, self.ids, self.mask = images, ids, mask

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "idx": i,
            "image": self.images[i],
            "input_ids": self.ids[i],
            "attention_mask": self.mask[i],
        }


class NumpyWorkers(NumpyGather):
    """The same arrays served per sample through a torch DataLoader with workers."""

    def setup(self) -> None:
        super().setup()
        self.dataset = _ArrayDataset(self.images, self.ids, self.mask)
        self.notes.append("per-sample __getitem__ through the workers (fork, shared pages)")

    def batches(self, epoch: int) -> Iterator[Batch]:
        for b in self.torch_loader(self.dataset, epoch):
            yield _as_batch(b)


class Unavailable(Exception):
    """The system cannot run here; the message says why."""


SYSTEMS: dict[str, type[System]] = {
    "note-lru": NoteLRU,
    "note-lru-persistent": NoteLRUPersistent,
    "torch-uncached": TorchUncached,
    "hf-datasets": HFDatasets,
    "hf-datasets-arrow": HFDatasetsArrow,
    "mosaic-mds-arrays": MosaicArrays,
    "mosaic-mds-jpeg": MosaicJPEG,
    "litdata": LitData,
    "webdataset": WebDataset,
    "mmcache-memory": MmcacheMemory,
    "mmcache-disk": MmcacheDisk,
    "mmcache-50pct": MmcacheHalf,
    "mmcache-features": MmcacheFeatures,
    "numpy-gather": NumpyGather,
    "numpy-workers": NumpyWorkers,
}


# ----------------------------------------------------------------------------------------------
# The child's main
# ----------------------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    if not dist:
        return None
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def tree_cpu_s() -> float:
    """CPU seconds of this process and its descendants so far (user + system).

    Less sensitive than wall time to other work on a shared machine. Exited and
    reaped workers are in ``children_*``; live ones are asked directly.
    """
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            ct = child.cpu_times()
        except psutil.Error:
            continue
        total += ct.user + ct.system
    return float(total)


def _check_format(image: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> str | None:
    problems = []
    if image.dtype != torch.uint8 or tuple(image.shape[1:]) != IMAGE_SHAPE:
        problems.append(f"image {image.dtype} {list(image.shape)}")
    for name, t in (("input_ids", ids), ("attention_mask", mask)):
        if t.dtype != torch.int32 or tuple(t.shape[1:]) != (TEXT_LEN,):
            problems.append(f"{name} {t.dtype} {list(t.shape)}")
    return "; ".join(problems) or None


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, time and check one system; the result dict bench.py tabulates."""
    cls = SYSTEMS[spec["system"]]
    result: dict[str, Any] = {
        "system": spec["system"],
        "status": "ok",
        "version": _version(cls.library),
    }
    epochs: list[dict[str, Any]] = []
    result["epochs"] = epochs
    system: System | None = None
    try:
        system = cls(spec)  # the pipeline and the manifest rows: the same for every row
        phase("given")
        t0 = time.perf_counter()
        system.given()
        result["given_s"] = time.perf_counter() - t0
        phase("setup")
        t0 = time.perf_counter()
        system.setup()
        result["setup_s"] = time.perf_counter() - t0
        phase("epochs")
        probe: tuple[int, torch.Tensor, torch.Tensor] | None = None
        wanted = spec["epochs"]
        # Short warm epochs (a fraction of a second) are dominated by noise and
        # per-epoch start-up: run more of them, until they add up to min_warm_s.
        min_warm_s = float(spec.get("min_warm_s", 0.0))
        max_epochs = max(wanted, int(spec.get("max_epochs", wanted)))
        epoch = 0
        while epoch < wanted or (
            wanted > 1
            and system.steady
            and epoch < max_epochs
            and sum(e["s"] for e in epochs[1:]) < min_warm_s
        ):
            cpu0 = tree_cpu_s()
            t0 = time.perf_counter()
            samples = nbatches = 0
            seen: set[int] | None = set() if epoch == 0 else None
            for idx, image, ids, mask in system.batches(epoch):
                if probe is None:
                    bad = _check_format(image, ids, mask)
                    if bad:
                        raise RuntimeError(f"batch format differs from the common one: {bad}")
                    probe = (idx[0], image[0].clone(), ids[0].clone())
                if seen is not None:
                    seen.update(idx)
                samples += len(idx)
                nbatches += 1
            seconds = time.perf_counter() - t0
            cpu = tree_cpu_s() - cpu0
            system.after_epoch(epoch)
            epochs.append(
                {
                    "epoch": epoch,
                    "samples": samples,
                    "batches": nbatches,
                    "s": seconds,
                    "cpu_s": cpu,
                }
            )
            if seen is not None and len(seen) != system.n:
                system.notes.append(f"epoch 0 saw {len(seen)} distinct samples of {system.n}")
            epoch += 1
        if len(epochs) > wanted:
            system.notes.append(
                f"{len(epochs) - 1} warm epochs (short ones: run until >= {min_warm_s:g} s)"
            )
        phase("check")
        if probe is not None:
            i, image, ids = probe
            row = system.rows[i]
            ref = system.pipe.process(row["image_path"], row["caption"], sample_id=row["id"])
            same = bool(
                np.array_equal(image.numpy(), ref["image"])
                and np.array_equal(ids.numpy(), ref["input_ids"])
            )
            result["content_ok"] = same
            if not same:
                system.notes.append(f"sample {i}: content differs from the shared pipeline's")
        result["disk_bytes"] = system.disk_bytes()
    except Unavailable as exc:
        result["status"] = "unavailable"
        result["reason"] = str(exc)
    except ImportError as exc:
        result["status"] = "unavailable"
        result["reason"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    except Exception as exc:
        result["status"] = "error"
        result["reason"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
        result["traceback"] = traceback.format_exc()
    finally:
        phase("close")
        if system is not None:
            try:
                system.close()
            except Exception as exc:
                system.notes.append(f"close() failed: {type(exc).__name__}: {exc}")
            result["notes"] = system.notes
            result["extra"] = system.extra
    return result


def child_main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = run(spec)
    Path(result_path).write_text(json.dumps(result, indent=1, default=str))
    # Some peers leave non-daemon threads behind; the parent has what it needs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
