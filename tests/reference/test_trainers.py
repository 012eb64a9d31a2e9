"""A real ``transformers.Trainer`` trains a tiny LLaVA (random weights, built from configs)
on mmcache batches, and resuming from the Trainer's checkpoint resumes the loader exactly.

The documented way (README "Trainers"): a Trainer subclass whose
``get_train_dataloader`` returns the mmcache DataLoader (so accelerate does not wrap
it), a loader hook that turns a batch into the model's inputs (``pixel_values``
normalised), ``ignore_data_skip=True`` (the Trainer would otherwise replay batches to
skip them), and a callback that saves ``loader.state_dict()`` in each checkpoint and
restores it on resume. (Needs accelerate: reference env.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from refenv import need

transformers = need("transformers")
need("accelerate")
sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
from test_llava_client import IMAGE_TOKEN, PATCH, SIZE, _model  # noqa: E402

import mmcache  # noqa: E402
from mmcache.loader import LoaderHook  # noqa: E402
from mmcache.testing.sft import SyntheticSFTSource  # noqa: E402

STATE = "mmcache_loader.json"


class ToModelInputs(LoaderHook):
    """A batch -> the model's keyword arguments (and the ids, which the test records)."""

    def after_assemble(self, batch: dict[str, Any], ctx: Any) -> dict[str, Any]:
        out = {k: batch[k] for k in ("id", "input_ids", "attention_mask", "labels")}
        out["pixel_values"] = mmcache.normalize(batch["images"], "clip")
        return out


class LoaderState(transformers.TrainerCallback):
    """Saves the loader's position with each checkpoint (JSON: no pickle)."""

    def __init__(self, loader: mmcache.DataLoader) -> None:
        self.loader = loader

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        (folder / STATE).write_text(json.dumps(self.loader.state_dict()))


class MmcacheTrainer(transformers.Trainer):
    def __init__(self, *args: Any, loader: mmcache.DataLoader, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.loader = loader
        self.seen: list[list[str]] = []

    def get_train_dataloader(self) -> Any:
        return self.loader

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kw: Any) -> Any:
        self.seen.append(list(inputs.pop("id")))
        return super().compute_loss(model, inputs, *args, **kw)


def _source() -> SyntheticSFTSource:
    return SyntheticSFTSource(
        32,
        seed=3,
        vocab=256,
        image_token_id=IMAGE_TOKEN,
        image_tokens=lambda h, w: (h // PATCH) * (w // PATCH),
        image_counts=(1,),
        shapes=((SIZE, SIZE),),
    )


def _run(out: Path, steps: int, resume: Path | None = None) -> MmcacheTrainer:
    source = _source()
    loader = mmcache.DataLoader(source, cache=None, batch_size=4, seed=7, hooks=[ToModelInputs()])
    if resume is not None:
        loader.load_state_dict(json.loads((resume / STATE).read_text()))
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        save_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        ignore_data_skip=True,
        logging_steps=1,
        dataloader_num_workers=0,
    )
    trainer = MmcacheTrainer(
        model=_model(), args=args, loader=loader, callbacks=[LoaderState(loader)]
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) >= 1 and all(torch.isfinite(torch.tensor(losses)))
    return trainer


def test_trainer_trains_and_resumes_the_loader_exactly(tmp_path: Path) -> None:
    whole = _run(tmp_path / "whole", steps=4)
    assert len(whole.seen) == 4
    first = _run(tmp_path / "part", steps=2)
    assert first.seen == whole.seen[:2]
    rest = _run(tmp_path / "part", steps=4, resume=tmp_path / "part" / "checkpoint-2")
    assert rest.seen == whole.seen[2:4]


def test_accelerate_prepare_leaves_the_loader_as_is_and_trains() -> None:
    accelerate = need("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    loader = mmcache.DataLoader(
        _source(), cache=None, batch_size=4, seed=7, hooks=[ToModelInputs()]
    )
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    # Not re-wrapped into a DataLoaderShard: the cache, the order and state_dict stay.
    assert prepared is loader
    expected = [b["id"] for b in mmcache.DataLoader(_source(), cache=None, batch_size=4, seed=7)]
    got = []
    for step, batch in enumerate(prepared):
        got.append(batch.pop("id"))
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        assert torch.isfinite(loss)
        if step == 2:
            break
    assert got == expected[:3]
