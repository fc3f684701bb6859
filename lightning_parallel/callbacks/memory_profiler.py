"""``MemoryProfiler``: peak memory per rank and stage, every training step, on CPU as well as CUDA.

Per step (from ``on_train_batch_start`` to ``on_train_batch_end``: forward, backward, optimizer step):

- peak live bytes: ``memory.LiveTensorTracker`` (a ``TorchDispatchMode``) counts each storage an op
  allocates until it is freed - activations, what selective checkpointing keeps, gradients, the
  schedule's buffers - on any device; the same count the recomputation and pipeline benchmarks report;
- on CUDA, the caching allocator's peak (``torch.cuda.max_memory_allocated`` after a reset);
- process peak RSS (``getrusage``), a max-so-far by nature, reported as such.

Logged, identical on every rank: ``memory/peak_live_mib/stage_k`` (max over pipeline replicas; without a
pipeline each rank is ``stage_k`` with k its rank), ``memory/stage_ratio`` (max/min over stages),
``memory/peak_rss_mib`` (max over ranks), ``memory/cuda_peak_mib/stage_k`` on CUDA. A warning is raised
once when the stage ratio exceeds ``imbalance_warning``. At the end of training (and every
``every_n_steps``), rank 0 writes ``memory.png``: live bytes over the latest step, one line per rank.
"""

from __future__ import annotations

import resource
import sys
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_parallel.callbacks._base import ProfilerCallback, log_metrics, pipeline_of, position
from lightning_parallel.memory import LiveTensorTracker


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class MemoryProfiler(ProfilerCallback):
    """Log peak memory per stage each step, warn on imbalance, and plot memory over a step.

    Args:
        dirpath: where ``memory.png`` goes; default: the trainer's ``log_dir``.
        every_n_steps: also write the PNG every n optimizer steps (default: only at the end of fit).
        track_live: count live tensor bytes with ``LiveTensorTracker`` (default: on CPU only; CUDA has
            the allocator's statistics).
        imbalance_warning: warn when the max/min ratio of peak live bytes across stages exceeds this.
        plot: write the PNG (needs matplotlib, the ``plots`` extra).
    """

    def __init__(
        self,
        dirpath: Any = None,
        every_n_steps: int | None = None,
        track_live: bool | None = None,
        imbalance_warning: float = 1.5,
        plot: bool = True,
    ) -> None:
        super().__init__(dirpath, every_n_steps)
        if imbalance_warning < 1:
            raise ValueError(f"imbalance_warning is a max/min ratio and must be >= 1, got {imbalance_warning}")
        self.track_live, self.imbalance_warning, self.plot = track_live, imbalance_warning, plot
        self.last: dict[str, float] = {}
        self._tracker: LiveTensorTracker | None = None
        self._series: list[tuple[float, int]] = []
        self._warned = False

    def _live(self, trainer: pl.Trainer) -> bool:
        return self.track_live if self.track_live is not None else trainer.strategy.root_device.type != "cuda"

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        began = self._begin()
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if self._live(trainer):
            self._tracker = LiveTensorTracker(record=self.plot)
            self._tracker.__enter__()
        self._step_start = time.perf_counter()
        self._end(began)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        began = self._begin()
        self.step_seconds += began - self._step_start
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
            self._series = [(t - self._step_start, b) for t, b in tracker.series or []]
        device = trainer.strategy.root_device
        stage, _ = position(trainer)
        local = {"rank": trainer.global_rank, "stage": stage, "rss": peak_rss_bytes(),
                 "live": tracker.peak if tracker is not None else None,
                 "cuda": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}  # fmt: skip
        gathered = self._gather(local)
        self.last = metrics = _metrics(gathered, pipeline=pipeline_of(trainer) is not None)
        self._end(began)
        ratio = metrics.get("memory/stage_ratio", 1.0)
        if trainer.global_rank == 0 and ratio > self.imbalance_warning and not self._warned:
            self._warned = True
            warnings.warn(
                f"MemoryProfiler: the stage with the most live memory holds {ratio:.2f}x the one with the least"
                f" (per stage MiB: {_per_stage(metrics)}); above imbalance_warning={self.imbalance_warning}",
                stacklevel=1,
            )
        log_metrics(pl_module, metrics)
        if self._due(trainer):
            self.write(trainer, suffix=f"_step{trainer.global_step}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._tracker is not None:  # leave no dispatch mode behind on the mode stack
            self._tracker.__exit__(None, None, None)
            self._tracker = None

    def write(self, trainer: pl.Trainer, suffix: str = "") -> None:
        """Gather every rank's latest memory series (a collective: every rank calls this) and plot it."""
        if not self.plot:
            return
        began = self._begin()
        stage, _ = position(trainer)
        gathered = self._gather({"rank": trainer.global_rank, "stage": stage, "series": _thin(self._series)})
        if trainer.global_rank == 0 and any(g["series"] for g in gathered):
            from lightning_parallel.callbacks._plots import plot_memory

            series = {g["rank"]: g["series"] for g in gathered}
            labels = {g["rank"]: f"stage {g['stage']} (rank {g['rank']})" for g in gathered}
            title = f"{type(trainer.strategy).__name__}: live tensor bytes over step {trainer.global_step}"
            plot_memory(series, labels, self._output(f"memory{suffix}.png"), title)
            rank_zero_info(f"MemoryProfiler: wrote {self.dirpath / f'memory{suffix}.png'}")
        self._end_write(began)


def _metrics(gathered: list[dict[str, Any]], pipeline: bool) -> dict[str, float]:
    out: dict[str, float] = {"memory/peak_rss_mib": max(g["rss"] for g in gathered) / 2**20}
    key = (lambda g: g["stage"]) if pipeline else (lambda g: g["rank"])
    for field, name in (("live", "memory/peak_live_mib"), ("cuda", "memory/cuda_peak_mib")):
        if gathered[0][field] is None:
            continue
        per_stage: dict[int, int] = {}
        for g in gathered:
            per_stage[key(g)] = max(per_stage.get(key(g), 0), g[field])
        for s, nbytes in sorted(per_stage.items()):
            out[f"{name}/stage_{s}"] = nbytes / 2**20
        if field == "live" or "memory/stage_ratio" not in out:
            out["memory/stage_ratio"] = max(per_stage.values()) / max(min(per_stage.values()), 1)
    return out


def _per_stage(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k.rsplit('/', 1)[1]}={v:.0f}" for k, v in metrics.items() if "/peak_live_mib/" in k)


def _thin(points: list[tuple[float, int]], limit: int = 4000) -> list[tuple[float, int]]:
    """At most ~``limit`` points, keeping each dropped run's extremes so peaks survive."""
    if len(points) <= limit:
        return points
    size = -(-len(points) // (limit // 2))
    out: list[tuple[float, int]] = []
    for i in range(0, len(points), size):
        window = points[i : i + size]
        lo, hi = min(window, key=lambda p: p[1]), max(window, key=lambda p: p[1])
        out.extend(sorted({lo, hi}))
    return out
