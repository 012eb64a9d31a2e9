"""A Lightning ``LightningDataModule`` hands the mmcache DataLoader to ``lightning.Trainer``:
a tiny LLaVA trains on its batches, and resuming from Lightning's checkpoint resumes the
loader exactly (the datamodule's ``state_dict``/``load_state_dict`` carry
``loader.state_dict()`` in the checkpoint)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from refenv import need

L = need("lightning")
sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
from test_llava_client import _model  # noqa: E402
from test_trainers import ToModelInputs, _source  # noqa: E402

import mmcache  # noqa: E402


class Data(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.loader = mmcache.DataLoader(
            _source(), cache=None, batch_size=4, seed=7, hooks=[ToModelInputs()]
        )

    def train_dataloader(self) -> Any:
        return self.loader

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _model()
        self.seen: list[list[str]] = []

    def training_step(self, batch: dict[str, Any], index: int) -> Any:
        self.seen.append(list(batch.pop("id")))
        loss = self.model(**batch).loss
        assert torch.isfinite(loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(root: Path, steps: int, ckpt: Path | None = None) -> Model:
    model = Model()
    save = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[save],
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=Data(), ckpt_path=str(ckpt) if ckpt else None)
    return model


def test_lightning_trains_and_resumes_the_loader_exactly(tmp_path: Path) -> None:
    whole = _fit(tmp_path / "whole", 4)
    assert len(whole.seen) == 4
    first = _fit(tmp_path / "part", 2)
    assert first.seen == whole.seen[:2]
    rest = _fit(tmp_path / "part2", 4, ckpt=tmp_path / "part" / "step=2.ckpt")
    assert rest.seen == whole.seen[2:4]
