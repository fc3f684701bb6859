"""The planner's predictions for the compositions of helix and full sharding with tensor and sequence parallelism against measurements on this machine: HelixPipe with
tensor or sequence parallelism inside its stages, and full sharding (FSDP2) above tensor parallelism, each on 4
processes x 1 thread (2 cores), with helix at p=2, plain data parallelism, tensor parallelism alone and
data-parallel full sharding on 2 processes beside them (the controls: one process per core).

    .venv/bin/python benchmarks/planner_composed.py --seq-len 2048 --m 4 --reps 5 --profiles 3 --actions

Each layout runs in its own set of spawned processes, trained by a real ``Trainer`` with the strategy (the example
GPT of ``benchmarks/pipeline.py``: H=128, 8 blocks, 4 heads, micro-batch = 1 sequence, SGD). In the same processes,
before training, every rank profiles the model (``lightning_parallel.plan.profile`` at T/4, T/2 and T, all ranks at
once, as all are busy in the run; the medians over the ranks, ``plan.combine``) and pairs of ranks time the link
(``plan.links.receive_time``, the others computing meanwhile) and the all-reduce and all-gather
(``measure_collectives``), so the prediction sees the machine the run sees.
Measured: the step time (from the batch's start to its end on every rank, the slowest rank; medians of the steps
after the first) and the peak of the tensors a step allocates per rank (``LiveTensorTracker``: gradients,
activations, gathered parameters), against the prediction's step time and its memory allocated during the step
(``Prediction.step_memory``); the largest over the ranks of a stage. glibc keeps freed memory (as in
``benchmarks/pipeline.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline as bench  # noqa: E402  (the model, the batch, the process harness)

from lightning_parallel.plan import Layout, Problem, combine, predict, profile  # noqa: E402
from lightning_parallel.plan.hardware import LINK_SIZES, link_from_times, measure_collectives  # noqa: E402
from lightning_parallel.plan.links import receive_time  # noqa: E402

#: name -> (processes, strategy source, the planner's layout)
LAYOUTS: dict[str, tuple[int, str, Layout]] = {
    "helix p=2": (2, "HelixParallelStrategy(pipeline_parallel_size=2, num_microbatches={m}, mlp_chunks=1, recompute='none')",
                  Layout(pp=2, schedule="helix", microbatches=0, folds=2)),
    "helix p=2 x tp=2": (4, "HelixParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches={m},"
                         " mlp_chunks=1, recompute='none')", Layout(pp=2, tp=2, schedule="helix", microbatches=0, folds=2)),
    "helix p=2 x sp=2": (4, "HelixParallelStrategy(pipeline_parallel_size=2, sequence_parallel_size=2, num_microbatches={m},"
                         " mlp_chunks=1, recompute='none')", Layout(pp=2, sp=2, schedule="helix", microbatches=0, folds=2)),
    "dp=2": (2, "HybridParallelStrategy(data_parallel_size=2)", Layout(dp=2, pp=1, microbatches=0)),
    "tp=2": (2, "HybridParallelStrategy(tensor_parallel_size=2)", Layout(dp=1, pp=1, tp=2, microbatches=0)),
    "dp=2 x tp=2": (4, "HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)",
                    Layout(dp=2, pp=1, tp=2, microbatches=0)),
    "dp=2 full": (2, "HybridParallelStrategy(data_parallel_size=2, data_parallel_sharding='full')",
                  Layout(dp=2, pp=1, microbatches=0, sharding="full")),
    "dp=2 x tp=2 full": (4, "HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2,"
                         " data_parallel_sharding='full')", Layout(dp=2, pp=1, tp=2, microbatches=0, sharding="full")),
}  # fmt: skip


class _Model(bench.GPT):
    """The benchmark's GPT with a Lightning ``training_step`` (the profiler and the Trainer call it)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self._loss(batch)


class _Timer:
    """Per step: wall seconds from the batch's start to its end (a barrier on both sides) and the peak of the
    tensors the step allocates (``LiveTensorTracker``, in the last step)."""

    def __init__(self, last: int) -> None:
        import lightning as L

        from lightning_parallel.memory import LiveTensorTracker

        timer = self

        class Callback(L.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                dist.barrier()
                if batch_idx == last:
                    timer.tracker = LiveTensorTracker()
                    timer.tracker.__enter__()
                timer.start = time.perf_counter()

            def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
                dist.barrier()
                timer.steps.append(time.perf_counter() - timer.start)
                runtime = getattr(trainer.strategy, "runtime", None)  # a pipeline's: its actions of this step
                timer.timeline = list(runtime.timeline) if runtime is not None else []
                if timer.tracker is not None:
                    timer.tracker.__exit__(None, None, None)
                    timer.peak, timer.tracker = timer.tracker.peak, None

        self.callback, self.steps, self.start, self.tracker, self.peak = Callback(), [], 0.0, None, 0
        self.timeline: list = []

    def __call__(self) -> Any:
        return self.callback


def worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_parallel import HelixParallelStrategy, HybridParallelStrategy  # noqa: F401  (named in LAYOUTS)

    bench.keep_freed_memory()
    world, source, _ = LAYOUTS[args.layout]
    # Lightning's cluster environment reads the ranks from the environment, torchrun's way
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    bench.init_worker(rank, port, minutes=60, world_size=world)
    T, m = args.seq_len, args.m
    torch.manual_seed(0)
    model = _Model(vocab_size=bench.VOCAB, block_size=T, n_layer=bench.LAYERS, n_head=bench.HEADS, n_embd=bench.H,
                   optimizer="sgd", lr=1e-3)  # fmt: skip
    # one process per core profiles (the others wait): each is a device at full speed; with more processes than
    # cores the run time-shares them, which main() models as devices at cores / processes of that speed
    cores = os.cpu_count() or 1
    profiles = []
    for _ in range(args.profiles):
        dist.barrier()
        if rank < cores:
            profiles.append(profile(model, bench.batch(T, 1), [T // 4, T // 2, T], repeats=1))
        dist.barrier()
    peer = rank ^ 1  # pairs (0, 1), (2, 3): every rank busy while the link and the collectives are timed
    link_times = [receive_time(peer, n, 5) for n in LINK_SIZES]
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank creates every group
    collectives = measure_collectives(pairs[rank // 2])
    x, y = bench.batch(T, m)
    dp = LAYOUTS[args.layout][2].dp
    timer = _Timer(last=args.reps)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=eval(source.format(m=m)), max_steps=args.reps + 1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer()], use_distributed_sampler=False, limit_train_batches=args.reps + 1,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(x.repeat(args.reps + 1, 1), y.repeat(args.reps + 1, 1)),
                                                    batch_size=m // dp))  # fmt: skip
    stage = getattr(trainer.strategy, "stage", 0)
    kinds = bench.kind_seconds(timer.timeline, timer.steps[-1]) if timer.timeline else {}
    out.put((rank, (profiles, link_times, timer.steps[1:], timer.peak, stage, kinds, collectives)))
    dist.barrier()
    dist.destroy_process_group()


def _slower(costs: Any, factor: float) -> Any:
    """``costs`` with every time ``factor`` times longer (a device at 1 / ``factor`` of the profiled speed)."""
    from dataclasses import replace

    from lightning_parallel.plan.costs import Fit

    if factor == 1:
        return costs
    scale = lambda f: Fit([c * factor for c in f.coef])  # noqa: E731
    helix = costs.helix
    if helix is not None:
        parts = ("pre", "attention", "post", "pre_grad", "attention_grad", "post_grad")
        helix = replace(helix, **{n: scale(getattr(helix, n)) for n in parts})
    times = {
        n: {p: scale(f) for p, f in getattr(costs, n).items()}
        for n in ("forward", "backward", "input_grad", "weight_grad")
    }
    return replace(costs, **times, helix=helix, head_forward=scale(costs.head_forward),
                   head_backward=scale(costs.head_backward), capture=scale(costs.capture), pack=scale(costs.pack))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--m", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profiles", type=int, default=2, help="profiles per rank before training (medians)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--actions", action="store_true", help="also print seconds per action kind and stage (pipelines)")
    args = ap.parse_args()
    breakdown: list = []
    links: list[str] = []
    print(f"torch {torch.__version__}, example GPT H={bench.H} x {bench.LAYERS} blocks, T={args.seq_len}, m={args.m},"
          f" SGD, 1 thread per process on this machine's cores; medians of {args.reps} steps\n")  # fmt: skip
    print("| layout | processes | predicted step s | measured step s | error | predicted step MiB per stage |"
          " measured step MiB per stage (max over its ranks) | error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in args.layouts:
        args.layout = name
        world, _, layout = LAYOUTS[name]
        results = bench.run_n(worker, args, world)
        costs = combine([p for r in results.values() for p in r[0]])
        share = world / min(world, os.cpu_count() or 1)  # processes per core
        costs = _slower(costs, share)
        times = [statistics.median(column) for column in zip(*(r[1] for r in results.values()))]
        fits = {
            f: tuple(statistics.median(c) for c in zip(*(r[6][f] for r in results.values())))
            for f in ("collective", "gather")
        }
        link = replace(link_from_times(LINK_SIZES, times), **fits)
        problem = Problem(costs, args.seq_len, global_batch=args.m, link=link, optimizer="sgd")
        layout = Layout(**{**layout.__dict__, "microbatches": args.m if layout.pp > 1 else 1})
        pr = predict(problem, layout)
        steps = [max(r[2][i] for r in results.values()) for i in range(len(next(iter(results.values()))[2]))]
        measured = statistics.median(steps)
        peaks: dict[int, int] = {}
        for _, _, _, peak, stage, _, _ in results.values():
            peaks[stage] = max(peaks.get(stage, 0), peak)
        if args.actions:
            breakdown.append((name, pr, {r[4]: r[5] for r in results.values()}))
        stages = sorted(pr.step_memory)
        pm = " / ".join(f"{pr.step_memory[s] / 2**20:.0f}" for s in stages)
        mm = " / ".join(f"{peaks.get(s, 0) / 2**20:.0f}" for s in stages)
        mem_err = max(abs(pr.step_memory[s] - peaks.get(s, 0)) / max(peaks.get(s, 1), 1) for s in stages)
        print(f"| {name} | {world} | {pr.step_time:.3f} | {measured:.3f} | {(pr.step_time - measured) / measured:+.1%} |"
              f" {pm} | {mm} | {mem_err:.1%} |", flush=True)  # fmt: skip
        ring = {f: f"{bw / 1e9:.2f} GB/s + {lat * 1e6:.0f} us" for f, (bw, lat) in fits.items()}
        links.append(f"{name}: p2p {link.bandwidth / 1e9:.2f} GB/s + {link.latency * 1e6:.0f} us, one ring step of"
                     f" the all-reduce {ring['collective']}, of the all-gather {ring['gather']}")  # fmt: skip
    print("\nThe links measured in the runs:\n" + "\n".join(f"- {line}" for line in links))
    if breakdown:
        print("\n| layout | stage | kind | predicted s | measured s (last step, one rank) |\n|---|---|---|---|---|")
        for name, pr, measured in breakdown:
            for stage, kinds in sorted(measured.items()):
                predicted: dict[str, float] = {}
                for a in pr.schedule.get(stage, []):
                    predicted[a.kind] = predicted.get(a.kind, 0.0) + pr.cost(a)
                for kind in sorted(set(predicted) | set(kinds)):
                    p = f"{predicted[kind]:.3f}" if kind in predicted else ""
                    q = f"{kinds[kind]:.3f}" if kind in kinds else ""
                    print(f"| {name} | {stage} | {kind} | {p} | {q} |")


if __name__ == "__main__":
    main()
