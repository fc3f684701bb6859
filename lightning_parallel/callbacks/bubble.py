"""``BubbleProfiler``: the pipeline bubble, measured per step and stage, beside the schedule's theory.

Under a pipeline strategy every rank's runtime records a ``TimelineEvent`` per action. After each
training step the profiler gathers all ranks' events (one ``all_gather_object``), splits each stage's
time over the step into compute, communication (transfer after the producer sent) and idle (waiting for
the producer, gaps) as ``callbacks.timeline`` defines, and logs, identical on every rank:

- ``bubble/stage_k``, ``bubble/mean``: measured idle fraction (mean over pipeline replicas);
- ``bubble/theory_stage_k``, ``bubble/theory_mean``: the same schedule on a virtual clock with the
  measured mean cost of each action and no communication cost;
- ``comm/stage_k``, ``comm/mean``: transfer fraction; ``bubble/self_time``: the profiler's own cost
  as a fraction of step time (worst rank).

Without a pipeline (``"hybrid"``, Lightning's DDP, one device) there is no schedule: it logs the
fraction of the step spent in this library's blocking collectives (``comm/mean``, ``comm/max``; zero for
strategies whose communication it cannot see, e.g. DDP's overlapped bucket all-reduce).

At the end of training (and every ``every_n_steps`` if given) rank 0 writes a merged multi-rank
Chrome/Perfetto trace (``bubble_trace.json``, open in https://ui.perfetto.dev) of the last
``trace_steps`` steps and a PNG timeline of the median one by duration (``bubble_timeline.png``) to
the log dir.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_parallel import _collectives
from lightning_parallel.callbacks._base import ProfilerCallback, log_metrics, pipeline_of, position
from lightning_parallel.callbacks.timeline import analyze, chrome_trace, mean_costs, median_step
from lightning_parallel.pipeline.context import TimelineEvent


class BubbleProfiler(ProfilerCallback):
    """Measure and log the pipeline bubble; write a Perfetto trace and a PNG timeline.

    Args:
        dirpath: where the files go; default: the trainer's ``log_dir``.
        every_n_steps: also write the files every n optimizer steps (default: only at the end of fit).
        trace_steps: how many of the latest steps the trace holds.
        plot: write the PNG timeline (needs matplotlib, the ``plots`` extra).
    """

    def __init__(
        self, dirpath: Any = None, every_n_steps: int | None = None, trace_steps: int = 3, plot: bool = True
    ) -> None:
        super().__init__(dirpath, every_n_steps)
        if trace_steps < 1:
            raise ValueError(f"trace_steps must be >= 1, got {trace_steps}")
        self.plot = plot
        self.history: deque[tuple[int, dict[int, list[TimelineEvent]]]] = deque(maxlen=trace_steps)
        self.stage_of: dict[int, int] = {}
        self.last: dict[str, float] = {}
        self._comm0 = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        began = self._begin()
        self._step_start, self._comm0 = time.perf_counter(), _collectives.comm_seconds
        self._end(began)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        began = self._begin()
        self.step_seconds += began - self._step_start
        strategy = pipeline_of(trainer)
        stage, replica = position(trainer)
        local = {"rank": trainer.global_rank, "stage": stage, "replica": replica,
                 "step_s": began - self._step_start, "comm_s": _collectives.comm_seconds - self._comm0,
                 "self": self.self_time_fraction,
                 "events": list(strategy.runtime.timeline) if strategy is not None else None}  # fmt: skip
        gathered = self._gather(local)
        self.stage_of = {g["rank"]: g["stage"] for g in gathered}
        metrics = self._pipeline_metrics(strategy, gathered) if strategy is not None else _plain_metrics(gathered)
        if strategy is not None and trainer.global_rank == 0:
            self.history.append((trainer.global_step, {g["rank"]: g["events"] for g in gathered}))
        self._end(began)
        metrics["bubble/self_time"] = max(g["self"] for g in gathered)  # up to the previous step, worst rank
        self.last = metrics
        log_metrics(pl_module, metrics)
        if self._due(trainer):
            self.write(trainer, suffix=f"_step{trainer.global_step}")

    def _pipeline_metrics(self, strategy: Any, gathered: list[dict[str, Any]]) -> dict[str, float]:
        measured: dict[int, list[float]] = {}
        comm: dict[int, list[float]] = {}
        for replica in sorted({g["replica"] for g in gathered}):
            mine = [g for g in gathered if g["replica"] == replica]
            for rank, times in analyze({g["rank"]: g["events"] for g in mine}).items():
                stage = self.stage_of[rank]
                measured.setdefault(stage, []).append(times.bubble)
                comm.setdefault(stage, []).append(times.comm)
        costs = mean_costs(e for g in gathered for e in g["events"])
        sim = strategy.simulate_schedule(lambda kind, chunk: costs.get((kind, chunk), 0.0))
        stages = sorted(measured)
        out: dict[str, float] = {}
        for s in stages:
            out[f"bubble/stage_{s}"] = _mean(measured[s])
            out[f"bubble/theory_stage_{s}"] = sim.bubble(s)
            out[f"comm/stage_{s}"] = _mean(comm[s])
        out["bubble/mean"] = _mean([out[f"bubble/stage_{s}"] for s in stages])
        out["bubble/theory_mean"] = _mean([out[f"bubble/theory_stage_{s}"] for s in stages])
        out["comm/mean"] = _mean([out[f"comm/stage_{s}"] for s in stages])
        return out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer)

    def write(self, trainer: pl.Trainer, suffix: str = "") -> None:
        """Rank 0 writes the trace of the buffered steps and the PNG of the median one (by duration, so one
        noisy step does not decide the picture); no collectives."""
        if trainer.global_rank != 0 or not self.history:
            return
        began = self._begin()
        trace = chrome_trace(list(self.history), self.stage_of)
        written = [f"bubble_trace{suffix}.json"]
        self._output(written[0]).write_text(json.dumps(trace))
        if self.plot:
            from lightning_parallel.callbacks._plots import plot_timeline

            step, events = median_step(list(self.history))
            stages = sorted(set(self.stage_of.values()))
            times = {r: t.bubble for r, t in analyze(events).items()}
            measured = " / ".join(
                f"{_mean([b for r, b in times.items() if self.stage_of[r] == s]):.2f}" for s in stages
            )
            title = (f"{type(trainer.strategy).__name__}, step {step} (the median of the last {len(self.history)} by"
                     f" duration): idle fraction per stage {measured}")  # fmt: skip
            written.append(f"bubble_timeline{suffix}.png")
            plot_timeline(events, self.stage_of, self._output(written[1]), title)
        self._end_write(began)
        rank_zero_info(f"BubbleProfiler: wrote {' and '.join(written)} to {self.dirpath}")


def _plain_metrics(gathered: list[dict[str, Any]]) -> dict[str, float]:
    fractions = [g["comm_s"] / g["step_s"] if g["step_s"] > 0 else 0.0 for g in gathered]
    return {
        "comm/mean": _mean(fractions),
        "comm/max": max(fractions),
        "bubble/step_s": max(g["step_s"] for g in gathered),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
