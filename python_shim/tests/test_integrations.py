"""Framework callbacks drive real trainers (on CPU) and their steps reach the library.

The trainers run on the CPU, so the tensors are not stepalloc's; what is shown is that each
framework calls the hooks where a step begins and ends, and that they reach the allocator.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import stepalloc


def steps(phase: str) -> int:
    return int(stepalloc.stepalloc_stats(0).get(f"steps.{phase}", 0))


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not (has("transformers") and has("accelerate")), reason="transformers/accelerate not installed")
def test_hf_trainer_callback_marks_each_step(tmp_path: Path) -> None:
    import torch
    from transformers import Trainer, TrainingArguments

    from stepalloc.integrations import StepallocTrainerCallback

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}

    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(16)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    callback = stepalloc.hf_callback("hf_train")
    assert isinstance(callback, StepallocTrainerCallback)
    before = steps("hf_train")
    Trainer(model=Regressor(), args=args, train_dataset=data, callbacks=[callback]).train()
    assert steps("hf_train") == before + 3


@pytest.mark.skipif(not has("lightning"), reason="lightning not installed")
def test_lightning_callback_marks_train_and_validation_batches() -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)

        def validation_step(self, batch: tuple, batch_idx: int) -> None:
            x, y = batch
            torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[stepalloc.lightning_callback("pl_train", "pl_eval")],
    )
    before_train, before_eval = steps("pl_train"), steps("pl_eval")
    trainer.fit(Regressor(), data, data)
    assert steps("pl_train") == before_train + 3
    assert steps("pl_eval") == before_eval + 2
