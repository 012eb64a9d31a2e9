"""LLaVA-style SFT samples: ``__getitem__`` every epoch against mmcache (issue 15). Not a test.

Side by side in one run, on the same synthetic LLaVA records (COCO-sized JPEGs, one
``<image>`` per image record, a share of text-only records, batch 16, same workers):

(a) a torch DataLoader whose dataset does what LLaVA-1.5's ``LazySupervisedDataset``
    does per sample, every epoch: PIL open, ``expand2square`` (CLIP mean), HF
    ``CLIPImageProcessor`` (float32 ``pixel_values``), chat template rendered with
    jinja2, tokenized, ``<image>`` expanded to 576 image tokens, labels masked (-100
    outside the assistant turns, found from token offsets), then padded by a collate;
(b) ``mmcache.DataLoader`` over a source doing the deterministic prefix of the same
    work once (decode, ``expand2square``, the processor's resize and centre crop, kept
    uint8; the same render/tokenize/mask, int32): a cold epoch, warm epochs, and a
    second process opening the same root (the next run: its first epoch is warm).
    ``mmcache.normalize`` of each batch's uint8 images on the CPU is inside the timing,
    so both sides hand the model the same float32 ``pixel_values``; the warm epochs are
    also timed without it (the recipe: uint8 to the device, normalised there), as is
    the second process.

The mmcache pipeline uses ``mmcache.ChatSpec`` (``--text-stage chatspec``, the default);
``--text-stage own`` runs the source below instead, with the same render/tokenize/mask code
as (a) as its text stage. Ratios are of epoch times measured in this run.

    .venv/bin/python benchmarks/sft.py            # needs mmcache[hf] (transformers)
    .venv/bin/python benchmarks/sft.py --quick
    .venv/bin/python benchmarks/sft.py --compare-src ../other-checkout/src   # row (c) A/B
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import torch
import xxhash
from PIL import Image

import mmcache as mc
from mmcache.sources.base import StampKind
from mmcache.transforms import CLIP_MEAN

torch.set_num_threads(1)

IMAGE = "<image>"
IMAGE_TOKENS = 576  # LLaVA-1.5 at 336 px: (336 / 14) ** 2
SIZE = 336
CLIP_MEAN_U8 = tuple(round(255 * m) for m in CLIP_MEAN)
#: Vicuna v1 (LLaVA-1.5's conversation template) as an HF-style Jinja chat template.
TEMPLATE = (
    "{{ bos_token }}A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions. "
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
    "{% else %}ASSISTANT: {% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% endif %}{% endfor %}"
)


# -- the per-sample work both sides share ------------------------------------------------
def expand2square(im: Image.Image, fill: tuple[int, int, int]) -> Image.Image:
    """LLaVA's ``expand2square``: pad the shorter side to a square, centred."""
    w, h = im.size
    if w == h:
        return im
    side = max(w, h)
    out = Image.new(im.mode, (side, side), fill)
    out.paste(im, ((side - w) // 2, (side - h) // 2))
    return out


class Chat:
    """Render a conversation with the template, tokenize, expand images, mask labels."""

    def __init__(self, tokenizer_json: str, max_length: int = 2048) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(tokenizer_json)
        self.image_id = self.tok.token_to_id(IMAGE)
        self.max_length = max_length
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
        # The generation tag marks the assistant spans (transformers' {% generation %}).
        self.template = env.from_string(
            TEMPLATE.replace("{% generation %}", "\x02").replace("{% endgeneration %}", "\x03")
        )

    def __call__(self, conversations: Sequence[Mapping[str, str]]) -> dict[str, np.ndarray]:
        messages = [
            {"role": "user" if c["from"] == "human" else "assistant", "content": c["value"]}
            for c in conversations
        ]
        marked = self.template.render(messages=messages, bos_token="<s>", eos_token="</s>")
        spans, text, at = [], [], 0
        for part in marked.split("\x02"):
            head, sep, tail = part.partition("\x03")
            if sep:
                spans.append((at, at + len(head)))
                text.append(head + tail)
                at += len(head) + len(tail)
            else:
                text.append(head)
                at += len(head)
        enc = self.tok.encode("".join(text), add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        train = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            train |= (offsets[:, 0] >= a) & (offsets[:, 1] <= b) & (offsets[:, 1] > offsets[:, 0])
        labels = np.where(train, ids, -100).astype(np.int32)
        # Each <image> token becomes IMAGE_TOKENS image tokens (not trained).
        reps = np.where(ids == self.image_id, IMAGE_TOKENS, 1)
        ids, labels = np.repeat(ids, reps), np.repeat(labels, reps)
        return {"input_ids": ids[: self.max_length], "labels": labels[: self.max_length]}


# -- (a) LLaVA's __getitem__ -------------------------------------------------------------
class LlavaGetitem(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, records: list[dict[str, Any]], root: Path, tok: str) -> None:
        from transformers import CLIPImageProcessor

        self.records, self.root = records, root
        self.processor = CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size=SIZE)
        self.chat = Chat(tok)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        rec = self.records[i]
        out: dict[str, Any] = {
            k: torch.from_numpy(v) for k, v in self.chat(rec["conversations"]).items()
        }
        if "image" in rec:
            im = Image.open(self.root / rec["image"]).convert("RGB")
            im = expand2square(im, CLIP_MEAN_U8)
            out["pixel_values"] = self.processor(im, return_tensors="pt")["pixel_values"][0]
        return out


def pad_collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    n = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), n, dtype=torch.int64)
    labels = torch.full((len(items), n), -100, dtype=torch.int64)
    mask = torch.zeros(len(items), n, dtype=torch.int64)
    for r, x in enumerate(items):
        k = len(x["input_ids"])
        ids[r, :k], labels[r, :k], mask[r, :k] = x["input_ids"], x["labels"], 1
    pix = [x["pixel_values"] for x in items if "pixel_values" in x]
    out = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if pix:
        out["pixel_values"] = torch.stack(pix)
    return out


# -- (b) the same work as a cached source ------------------------------------------------
class LlavaSource:
    """LLaVA records as a ``SampleSource`` whose samples are the cached SFT format."""

    stamp_kind = StampKind.FIXED
    varying_fields = frozenset({"input_ids", "labels", "images", "image_sizes"})
    pad_token_id = 0

    def __init__(self, records: list[dict[str, Any]], root: Path, tok: str) -> None:
        self.records, self.root, self.tok = records, root, tok
        self.on_error: Any = "raise"
        self._chat: Chat | None = None
        self._fp = xxhash.xxh3_128_hexdigest(f"{tok}|{TEMPLATE}|{SIZE}|{IMAGE_TOKENS}".encode())
        self._stamps = [
            mc.keys.stat_stamp(os.stat(root / r["image"])) if "image" in r else "none"
            for r in records
        ]

    def __len__(self) -> int:
        return len(self.records)

    def sample_id(self, index: int) -> str:
        return str(self.records[index]["id"])

    def ids(self, indices: Any) -> list[str]:
        return [self.sample_id(int(i)) for i in np.asarray(indices).reshape(-1)]

    def ids_digest(self) -> str:
        return xxhash.xxh3_128_hexdigest("\n".join(self.ids(range(len(self)))).encode())

    def fingerprint(self) -> str:
        return self._fp

    def describe(self) -> str:
        return "benchmarks/sft.py LlavaSource"

    def stamps(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return np.stack([idx, idx], axis=1)

    def key(self, index: int) -> bytes:
        text = json.dumps(self.records[index]["conversations"])
        return mc.keys.sample_key(self.sample_id(index), self._stamps[index], self._fp, text)

    def key_rows(self, indices: Any, *, stamps: Any = None) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return np.stack([np.frombuffer(self.key(int(i)), np.uint8) for i in idx])

    def produce(self, index: int) -> dict[str, np.ndarray]:
        if self._chat is None:
            self._chat = Chat(self.tok)
        rec = self.records[index]
        out = self._chat(rec["conversations"])
        if "image" in rec:
            im = expand2square(Image.open(self.root / rec["image"]).convert("RGB"), CLIP_MEAN_U8)
            w, h = im.size  # the processor's resize (shortest edge, bicubic) and centre crop
            s = SIZE / min(w, h)
            im = im.resize((max(SIZE, round(w * s)), max(SIZE, round(h * s))), Image.BICUBIC)
            w, h = im.size
            left, top = (w - SIZE) // 2, (h - SIZE) // 2
            im = im.crop((left, top, left + SIZE, top + SIZE))
            arr = np.asarray(im, dtype=np.uint8).transpose(2, 0, 1)
            out["images"] = np.ascontiguousarray(arr).reshape(-1)
            out["image_sizes"] = np.array([[SIZE, SIZE]], dtype=np.int32)
        else:
            out["images"] = np.zeros(0, dtype=np.uint8)
            out["image_sizes"] = np.zeros((0, 2), dtype=np.int32)
        return out

    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {
            "id": self.sample_id(index),
            **{k: torch.from_numpy(np.array(v)) for k, v in sample.items()},
        }

    def record_reject(self, err: Exception) -> None:
        print("reject", err, file=sys.stderr)


def chatspec_dataset(manifest: Path, tok_json: str) -> Any:
    """The same pipeline with mmcache's own ChatSpec."""
    tok_path = manifest.parent / "tokenizer.json"
    tok_path.write_text(tok_json)
    plain = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    text = mc.ChatSpec(
        str(tok_path),
        plain,
        2048,
        image_token=IMAGE,
        image_tokens=IMAGE_TOKENS,
        bos_token="<s>",
        eos_token="</s>",
    )
    image = mc.ImageSpec(size=SIZE, pad_to_square=True)
    return mc.MultimodalDataset(manifest, pipeline=mc.Pipeline(image=image, text=text))


# -- data ------------------------------------------------------------------------------
def make_data(out: Path, n: int, text_share: float) -> tuple[list[dict[str, Any]], Path, str]:
    manifest = mc.synth.make_dataset(out, n, seed=0)
    rows = [json.loads(line) for line in manifest.open()]
    rng = random.Random(0)
    records = []
    for i, row in enumerate(rows):
        caption = row.get("caption") or row.get("text") or "a photo"
        if rng.random() < text_share:
            conv = [
                {"from": "human", "value": f"Write a sentence about {caption.split()[-1]}."},
                {"from": "gpt", "value": caption},
                {"from": "human", "value": "And another one?"},
                {"from": "gpt", "value": caption[::-1]},
            ]
            records.append({"id": f"t{i}", "conversations": conv})
        else:
            conv = [
                {"from": "human", "value": f"{IMAGE}\nDescribe the image briefly."},
                {"from": "gpt", "value": caption},
            ]
            records.append({"id": f"i{i}", "image": row["image_path"], "conversations": conv})
    llava = out / "llava.json"
    llava.write_text(json.dumps(records))
    tok = mc.train_tokenizer(mc.synth.synth_captions(2000, seed=0), vocab_size=2048)
    tok.add_special_tokens([IMAGE, "<s>", "</s>"])
    return records, llava, tok.to_str()


def epoch_time(loader: Any, *, normalize: bool) -> float:
    t = time.perf_counter()
    for b in loader:
        if normalize and isinstance(b.get("images"), torch.Tensor) and len(b["images"]):
            b["pixel_values"] = mc.normalize(b["images"])
    return time.perf_counter() - t


def mm_loader(source: Any, cache: Any, workers: int) -> Any:
    return mc.DataLoader(
        source, cache=cache, batch_size=16, num_workers=workers, persistent_workers=workers > 0
    )


def child(args: argparse.Namespace) -> None:
    """The second process: the same data, the same root; prints its epoch times."""
    records = json.loads(Path(args.records).read_text())
    tok = Path(args.tok).read_text()
    source = (
        chatspec_dataset(Path(args.llava), tok)
        if args.text_stage == "chatspec"
        else LlavaSource(records, Path(args.data), tok)
    )
    cache = mc.Cache(args.child, memory=args.memory, disk=args.disk)
    loader = mm_loader(source, cache, args.workers)
    times, cpu = [], []
    for e in range(2):
        loader.set_epoch(e)
        c0 = time.process_time()
        times.append(epoch_time(loader, normalize=False))
        cpu.append(time.process_time() - c0)
    hits = loader.stats().epochs[0].hits
    loader.close()
    cache.close()
    print(json.dumps({"times": times, "cpu": cpu, "hits_first_epoch": hits}))


def compare_second(cmd: list[str], src: str, turns: int, n: int) -> None:
    """Row (c) with this tree and with ``src`` in turns, over the same filled cache: the
    second process's first and second epochs, and its training-process CPU per sample."""
    here = os.environ.get("PYTHONPATH", "")
    trees = {"this tree": here, src: os.pathsep.join(p for p in (src, here) if p)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for _ in range(turns):
        for name, path in trees.items():
            env = {**os.environ, "PYTHONPATH": path}
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            runs[name].append(json.loads(out.stdout))
    print(f"(c) in turns ({turns} each, medians): 1st epoch s, 2nd epoch s, CPU ms/sample 1st, 2nd")
    for name, got in runs.items():
        t1, t2 = (statistics.median(r["times"][e] for r in got) for e in (0, 1))
        c1, c2 = (statistics.median(1e3 * r["cpu"][e] / n for r in got) for e in (0, 1))
        print(f"  {name:40s} {t1:7.3f} {t2:7.3f} {c1:7.3f} {c2:7.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3, help="warm epochs")
    ap.add_argument("--text-share", type=float, default=0.2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--compare-src",
        metavar="DIR",
        help="also run the second process (c) over the same cache with DIR (another "
        "checkout's src) first on PYTHONPATH, in turns with this tree's, --turns times",
    )
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument(
        "--text-stage",
        choices=("chatspec", "own"),
        default="chatspec",
        help="mmcache.ChatSpec (default), or this file's own render/tokenize/mask source",
    )
    ap.add_argument("--llava", help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--records", help=argparse.SUPPRESS)
    ap.add_argument("--tok", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--memory", default="2GiB", help=argparse.SUPPRESS)
    ap.add_argument("--disk", default="2GiB", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.n, args.epochs = 128, 2
    tmp = Path(tempfile.mkdtemp(prefix="mmcache-bench-sft-"))
    root = tmp / "cache"
    try:
        records, llava, tok = make_data(tmp / "data", args.n, args.text_share)
        data = tmp / "data"
        kw: dict[str, Any] = {"batch_size": 16, "num_workers": args.workers}
        torch_loader = torch.utils.data.DataLoader(
            LlavaGetitem(records, data, tok),
            collate_fn=pad_collate,
            persistent_workers=args.workers > 0,
            **kw,
        )
        base = [epoch_time(torch_loader, normalize=False) for _ in range(2)]
        a = statistics.median(base)
        if args.text_stage == "chatspec":
            source: Any = chatspec_dataset(llava, tok)
            pipeline = "mmcache.ChatSpec + ImageSpec(pad_to_square=True)"
        else:
            source = LlavaSource(records, data, tok)
            pipeline = "benchmark source running (a)'s render/tokenize/mask code (no ChatSpec)"
        # temporary: the shared memory goes when the last process (this one, after the
        # second process) closes it; the creator's flag is the store's.
        cache = mc.Cache(root, memory=args.memory, disk=args.disk, temporary=True)
        loader = mm_loader(source, cache, args.workers)
        cold = epoch_time(loader, normalize=True)
        warm, warm_u8 = [], []
        for e in range(1, 1 + args.epochs):
            loader.set_epoch(e)
            warm.append(epoch_time(loader, normalize=True))
        for e in range(1 + args.epochs, 1 + 2 * args.epochs):
            loader.set_epoch(e)
            warm_u8.append(epoch_time(loader, normalize=False))
        hits = loader.stats().epochs[-1].hits
        loader.close()
        b = statistics.median(warm)
        b8 = statistics.median(warm_u8)
        # Bytes per sample: what the cache holds against float32 pixel_values.
        first_image = next(i for i, r in enumerate(records) if "image" in r)
        sample = source.produce(first_image)
        cached_bytes = sum(v.nbytes for v in sample.values())
        float_bytes = 3 * SIZE * SIZE * 4 + sum(
            v.nbytes for k, v in sample.items() if k != "images"
        )
        (tmp / "records.json").write_text(json.dumps(records))
        (tmp / "tok.json").write_text(tok)
        cmd = [
            sys.executable, __file__, "--child", str(root), "--records", str(tmp / "records.json"),
            "--tok", str(tmp / "tok.json"), "--data", str(data), "--workers", str(args.workers),
            "--memory", args.memory, "--disk", args.disk, "--text-stage", args.text_stage,
            "--llava", str(llava),
        ]  # fmt: skip
        second = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        if args.compare_src:
            compare_second(cmd, args.compare_src, args.turns, args.n)
        cache.close()
        n = args.n
        rows = [
            ("(a) LLaVA __getitem__ (torch DataLoader)", a, None),
            ("(b) mmcache cold (first epoch)", cold, None),
            ("(b) warm, normalize on the CPU (median)", b, None),
            ("(b) warm, uint8 batch (normalised on device)", b8, None),
            ("(c) second process, 1st epoch (uint8 batch)", second["times"][0], None),
            ("(c) second process, 2nd epoch (uint8 batch)", second["times"][1], None),
        ]
        print(f"{n} samples ({args.text_share:.0%} text-only), batch 16, {args.workers} workers;")
        print(f"mmcache text stage: {pipeline}")
        print(f"{'':44s} {'samples/s':>10s} {'x (a)':>7s}")
        for name, t, _ in rows:
            print(f"{name:44s} {n / t:10.1f} {a / t:7.2f}")
        print(
            f"warm hits {hits}/{n}; second process's first epoch hits "
            f"{second['hits_first_epoch']}/{n}"
        )
        # CPU of the second process (its training process only, not its workers): on a
        # busy machine steadier than its epoch times.
        c1, c2 = (1e3 * c / n for c in second["cpu"])
        print(f"(c) training-process CPU per sample: 1st epoch {c1:.3f} ms, 2nd {c2:.3f} ms")
        print(
            f"bytes per image sample: cached {cached_bytes} (uint8 pixels + int32 tokens) vs "
            f"{float_bytes} with float32 pixel_values ({float_bytes / cached_bytes:.2f}x)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
