"""What the profiling callbacks cost: step time with and without BubbleProfiler + MemoryProfiler.

Real Lightning Trainers on 2 CPU processes x 1 thread, the pipeline benchmark's model (example GPT,
H=128, 8 blocks, 4 heads), micro-batch = 1 sequence, SGD. For each strategy, fits of ``--steps`` steps
alternate A/B/A/B (without / with both profilers, plots on); the first step of every fit is dropped and
the median of the remaining step times is reported, with the ratio B/A and the profilers' own measured
self-time per step (time inside their hooks, including the per-step all-gather) as a fraction of step
time, and the one-off time they take to write their files at the end of fit (trace, PNGs). The ratio also contains what self-time cannot see: MemoryProfiler's dispatch
mode on every op inside the step.

    .venv/bin/python benchmarks/profilers.py --seq-len 2048 --m 4 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pipeline import run_two  # noqa: E402
from examples.models import GPT  # noqa: E402
from lightning_parallel import HelixParallelStrategy, PipelineParallelStrategy  # noqa: E402
from lightning_parallel.callbacks import BubbleProfiler, MemoryProfiler  # noqa: E402


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args: object) -> None:
        self.times.append(time.perf_counter() - self._t0)


def fit(strategy_name: str, seq_len: int, m: int, steps: int, profiled: bool, root: str) -> tuple[list, float, float]:
    torch.manual_seed(0)
    model = GPT(vocab_size=65, block_size=seq_len, n_layer=8, n_head=4, n_embd=128)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randint(0, 65, (m * steps, seq_len + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(list(zip(data[:, :-1], data[:, 1:])), batch_size=m)
    strategy = (
        PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=m, schedule="1f1b")
        if strategy_name == "1f1b"
        else HelixParallelStrategy(pipeline_parallel_size=2, num_microbatches=m)
    )
    timer = StepTimer()
    profilers = [BubbleProfiler(), MemoryProfiler(imbalance_warning=100.0)] if profiled else []
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, callbacks=[timer, *profilers],
    )  # fmt: skip
    trainer.fit(model, loader)
    self_time = sum(p.self_seconds for p in profilers) / sum(timer.times) if profilers else 0.0
    return timer.times[1:], self_time, sum(p.write_seconds for p in profilers)


def worker(rank: int, port: int, args: argparse.Namespace, out: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.strategies:
            times: dict[bool, list[float]] = {False: [], True: []}
            self_times, writes = [], []
            for _ in range(args.reps):
                for profiled in (False, True):
                    t, s, w = fit(name, args.seq_len, args.m, args.steps, profiled, root)
                    times[profiled] += t
                    if profiled:
                        self_times.append(s)
                        writes.append(w)
            median = statistics.median
            rows.append((name, median(times[False]), median(times[True]), max(self_times), median(writes)))
    out.put((rank, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--m", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", default=["1f1b", "helix"], choices=["1f1b", "helix"])
    args = parser.parse_args()
    results = run_two(worker, args)
    print(f"torch {torch.__version__}, 2 processes x 1 thread, T={args.seq_len}, m={args.m}, "
          f"{args.reps} x (fit without, fit with) of {args.steps} steps, first step of each fit dropped\n")  # fmt: skip
    print("| strategy | step s without | step s with | with / without | self-time per step (worst rank) |"
          " files at end of fit, s (rank 0) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for i, (name, without, with_, _, write) in enumerate(results[0]):
        worst_self = max(results[r][i][3] for r in results)
        without, with_ = max(without, results[1][i][1]), max(with_, results[1][i][2])
        cells = [
            name,
            f"{without:.3f}",
            f"{with_:.3f}",
            f"{with_ / without:.3f}x",
            f"{100 * worst_self:.2f} %",
            f"{write:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
