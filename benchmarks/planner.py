"""The planner's predictions against measurements on this machine (2 processes x 1 thread).

    .venv/bin/python benchmarks/planner.py --seq-lens 1024 2048 4096 --m 8 --reps 5

For each T: rank 0 profiles the example GPT of ``benchmarks/pipeline.py`` (H=128, 8 blocks, 4 heads,
micro-batch = 1 sequence) with ``lightning_parallel.plan.profile`` at T/4, T/2 and T while rank 1 waits;
both measure the link between them (``measure_link``); then every schedule runs at pp=2 (our runtime,
outside the Trainer, as ``benchmarks/pipeline.py`` measures it: medians of the interleaved rounds, SGD
step included, peak live tensor bytes per stage of one more step) and the planner predicts the same
layouts from the profile alone. Printed: predicted and measured step time and their error, predicted
and measured peak live MiB per stage (what a ``LiveTensorTracker`` opened at the step's start sees:
gradients and activations), and both rankings.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline as bench  # noqa: E402  (benchmarks/pipeline.py: the model, the runners, the 2-process harness)

from lightning_parallel.plan import Layout, Problem, predict, profile  # noqa: E402
from lightning_parallel.plan.hardware import measure_link  # noqa: E402

SCHEDULES = {  # benchmark row -> the planner's layout (pp=2, no recomputation)
    "ours gpipe": ("gpipe", 1),
    "ours 1f1b": ("1f1b", 1),
    "ours interleaved": ("interleaved_1f1b", 1),
    "ours zb_h1": ("zb_h1", 1),
    "ours zbv": ("zbv", 1),
    "ours helix f1": ("helix", 1),
    "ours helix": ("helix", 2),
}
bench.CONFIGS["planner"] = list(SCHEDULES)


class _Profiled(bench.GPT):
    """The benchmark's GPT with a Lightning-style ``training_step`` for the profiler."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self._loss(batch)


def worker(rank: int, port: int, args: argparse.Namespace, out) -> None:  # type: ignore[no-untyped-def]
    bench.init_worker(rank, port, minutes=30)
    rows = []
    link = measure_link(1 - rank)
    for seq_len in args.seq_lens:
        costs = None
        if rank == 0:
            torch.manual_seed(0)
            model = _Profiled(vocab_size=bench.VOCAB, block_size=seq_len, n_layer=bench.LAYERS, n_head=bench.HEADS,
                              n_embd=bench.H)  # fmt: skip
            lens = [seq_len // 4, seq_len // 2, seq_len]
            costs = profile(model, bench.batch(seq_len, 1), lens, repeats=3)
        dist.barrier()
        for m in args.m:
            measured = bench.measure(rank, seq_len, m, args)
            rows.append((seq_len, m, costs, measured))
    out.put((rank, (rows, link)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--m", type=int, nargs="+", default=[8])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    args.configs = "planner"
    results = bench.run_two(worker, args)
    (rows0, link), (rows1, _) = results[0], results[1]
    print(f"torch {torch.__version__}, 2 processes x 1 thread, medians of {args.reps} interleaved rounds; link measured:"
          f" {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us\n")  # fmt: skip
    cols = ["T", "m", "schedule", "predicted s", "measured s", "error", "pred. live MiB s0 / s1",
            "meas. live MiB s0 / s1", "live error s0 / s1"]  # fmt: skip
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for (seq_len, m, costs, measured0), (_, _, _, measured1) in zip(rows0, rows1):
        problem = Problem(costs, seq_len, global_batch=m, link=link, optimizer="sgd")
        pred_rank, meas_rank = {}, {}
        for (_, _, name, t0, info0), (_, _, _, t1, info1) in zip(measured0, measured1):
            schedule, folds = SCHEDULES[name]
            pr = predict(problem, Layout(pp=2, schedule=schedule, microbatches=m, folds=folds))
            t = max(t0, t1)
            live = [info0["live"], info1["live"]]
            plive = [pr.step_memory[0], pr.step_memory[1]]
            pred_rank[name], meas_rank[name] = pr.step_time, t
            err = [f"{(p - q) / q:+.0%}" for p, q in zip(plive, live)]
            print(f"| {seq_len} | {m} | {name[5:]} | {pr.step_time:.3f} | {t:.3f} | {(pr.step_time - t) / t:+.1%} | "
                  f"{plive[0] / 2**20:.0f} / {plive[1] / 2**20:.0f} | {live[0] / 2**20:.0f} / {live[1] / 2**20:.0f} | "
                  f"{' / '.join(err)} |")  # fmt: skip
        order = lambda d: " < ".join(n[5:] for n in sorted(d, key=d.get))  # noqa: E731
        print(f"|  |  | ranking predicted: {order(pred_rank)} |  |  |  |  |  |  |")
        print(f"|  |  | ranking measured: {order(meas_rank)} |  |  |  |  |  |  |")


if __name__ == "__main__":
    main()
