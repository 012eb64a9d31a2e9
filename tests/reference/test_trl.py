"""TRL's ``SFTTrainer`` trains a tiny LLaVA (random weights, built from configs) for 3
steps on mmcache batches (issue 26).

SFTTrainer takes no outside loader as such: its ``train_dataset`` must be a
``datasets.Dataset`` or ``IterableDataset`` (a TypeError otherwise), which it reads one
row of when built. The documented way: a subclass whose ``get_train_dataloader`` returns
the mmcache DataLoader (accelerate passes it through unwrapped), a one-row stand-in
``Dataset`` with ``input_ids`` and ``labels`` for those checks,
``dataset_kwargs={"skip_prepare_dataset": True}`` (nothing is tokenized again) and the
built-in ``PixelValues(model_only=True)`` hook (batches are the model's inputs)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from refenv import need

transformers = need("transformers")
trl = need("trl")
datasets = need("datasets")
need("accelerate")
sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
from test_llava_client import _model  # noqa: E402
from test_trainers import _source  # noqa: E402

import mmcache  # noqa: E402
from mmcache.transforms import PixelValues  # noqa: E402


class MmcacheSFTTrainer(trl.SFTTrainer):
    def __init__(self, *args: Any, loader: mmcache.DataLoader, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.loader = loader
        self.batches: list[dict[str, Any]] = []

    def get_train_dataloader(self) -> Any:
        return self.loader

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kw: Any) -> Any:
        self.batches.append({k: v.clone() for k, v in inputs.items()})
        return super().compute_loss(model, inputs, *args, **kw)


def test_sft_trainer_trains_a_tiny_llava_on_mmcache_batches(tmp_path: Path) -> None:
    source = _source()  # test_trainers' tiny LLaVA data
    hook = PixelValues("clip", model_only=True)
    loader = mmcache.DataLoader(source, cache=None, batch_size=4, seed=7, hooks=[hook])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_byte_tokenizer(), pad_token="<pad>", eos_token="</s>"
    )
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        max_length=None,
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    stand_in = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1, 2]]})
    trainer = MmcacheSFTTrainer(
        model=_model(),
        args=args,
        train_dataset=stand_in,
        processing_class=tokenizer,
        loader=loader,
    )
    trainer.train()
    assert len(trainer.batches) == 3
    expected = list(mmcache.DataLoader(source, cache=None, batch_size=4, seed=7, hooks=[hook]))
    for got, want in zip(trainer.batches, expected, strict=False):
        assert set(got) == {"input_ids", "attention_mask", "labels", "pixel_values"}
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["pixel_values"], want["pixel_values"])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    loader.close()


def _byte_tokenizer() -> Any:
    from chat_support import make_tokenizer

    return make_tokenizer()
