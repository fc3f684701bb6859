"""What the profiling callbacks share: where each rank sits, gathering per-step summaries, their own cost."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightning_parallel import _collectives
from lightning_parallel.mesh import AXES, PP


def pipeline_of(trainer: pl.Trainer) -> Any:
    """The strategy if it runs a pipeline schedule (has a runtime with a timeline), else ``None``."""
    strategy = trainer.strategy
    return strategy if getattr(strategy, "runtime", None) is not None else None


def position(trainer: pl.Trainer) -> tuple[int, int]:
    """(stage, replica) of this rank: the pipeline stage and which pipeline copy it belongs to; without a
    pipeline every rank is its own stage 0 of its own replica."""
    strategy = pipeline_of(trainer)
    if strategy is None:
        return 0, trainer.global_rank
    coordinate, replica = strategy.coordinate, 0
    for axis, size in zip(AXES, strategy.parallel_dims.shape):
        if axis != PP:
            replica = replica * size + coordinate[axis]
    return strategy.stage, replica


class ProfilerCallback(Callback):
    """Resolves the output directory on every rank (``trainer.log_dir`` broadcasts), gathers one summary
    per rank and step, and measures the callback's own time per step (``self_seconds``, against
    ``step_seconds``) apart from the time it spends writing its files (``write_seconds``)."""

    def __init__(self, dirpath: str | os.PathLike | None = None, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_steps = every_n_steps
        self.self_seconds = 0.0
        self.write_seconds = 0.0
        self.step_seconds = 0.0
        self._step_start = 0.0

    plot: bool = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.log_dir or trainer.default_root_dir)  # log_dir is a collective: all ranks
        if self.plot and importlib.util.find_spec("matplotlib") is None:
            rank_zero_warn(
                f"{type(self).__name__}: matplotlib is not installed, so no PNG is written (the metrics and the"
                " trace still are); pip install 'lightning-parallel[plots]' or pass plot=False"
            )
            self.plot = False

    @property
    def self_time_fraction(self) -> float:
        """The callback's own time as a fraction of the steps' time so far."""
        return self.self_seconds / self.step_seconds if self.step_seconds else 0.0

    def _gather(self, local: dict[str, Any]) -> list[dict[str, Any]]:
        return _collectives.all_gather_object(local) if _collectives.world_size() > 1 else [local]

    def _output(self, name: str) -> Path:
        assert self.dirpath is not None
        self.dirpath.mkdir(parents=True, exist_ok=True)
        return self.dirpath / name

    def _due(self, trainer: pl.Trainer) -> bool:
        return self.every_n_steps is not None and trainer.global_step % self.every_n_steps == 0

    def _begin(self) -> float:
        return time.perf_counter()

    def _end(self, began: float) -> None:
        self.self_seconds += time.perf_counter() - began

    def _end_write(self, began: float) -> None:
        self.write_seconds += time.perf_counter() - began


def log_metrics(pl_module: pl.LightningModule, metrics: dict[str, float]) -> None:
    """Log values that are already identical on every rank (no further reduction)."""
    for name, value in metrics.items():
        pl_module.log(name, value, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)
