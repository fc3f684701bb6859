"""A bare Lightning ``Trainer`` for short fits inside forked ranks (no logger, no checkpoints, no validation
unless asked for)."""

from __future__ import annotations

from typing import Any

import lightning as L


def quick_fit(
    module: L.LightningModule, data: Any, strategy: Any, devices: int, steps: int = 1, **kwargs: Any
) -> L.Trainer:
    """Fit ``module`` on ``data`` (a datamodule) for ``steps`` optimizer steps; returns the trainer."""
    kwargs = {"limit_val_batches": 0, "num_sanity_val_steps": 0, **kwargs}
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return trainer
