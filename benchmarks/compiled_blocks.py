"""Blocks compiled with ``torch.compile`` (inductor) against eager blocks: seconds per training step.

The example GPT (``--layers`` blocks, H=``--hidden``, 4 heads, dropout 0), ``--batch`` sequences of ``--seq-len``
characters, AdamW, fp32, real Lightning ``Trainer`` runs: one process, and ``PipelineParallelStrategy`` with 2
stages (2 processes), each with the blocks eager or compiled in the model (``h[i] = torch.compile(h[i])``, the
practice of torchtitan and Lightning's docs). Under the pipeline the strategy composes each block and compiles
the composed block again with the user's compile (``BlockLayer.compiled``). Every process runs 1 thread. Step
time: median of the steps after ``--warmup`` (the first steps compile); "first step" includes the compilation.

    .venv/bin/python benchmarks/compiled_blocks.py --steps 14 --warmup 4
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _StepTimes:
    """Wall time of each training batch (forward, backward, optimizer step)."""

    def __init__(self) -> None:
        import lightning as L

        class Callback(L.Callback):
            def on_train_batch_start(cb, *args: Any) -> None:  # noqa: N805
                cb.start = time.perf_counter()

            def on_train_batch_end(cb, *args: Any) -> None:  # noqa: N805
                self.times.append(time.perf_counter() - cb.start)

        self.times: list[float] = []
        self.callback = Callback()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, compiled: bool, queue: Any) -> None:
    import lightning as L

    from examples.data import CharDataModule
    from examples.models import GPT
    from lightning_parallel import PipelineParallelStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")  # fmt: skip
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = CharDataModule(block_size=args.seq_len, batch_size=args.batch, shuffle=False)
    model = GPT(vocab_size=data.vocab_size, block_size=args.seq_len, n_layer=args.layers, n_head=4,
                n_embd=args.hidden, dropout=0.0, lr=1e-3)  # fmt: skip
    if compiled:
        blocks = model.transformer.h
        for i in range(len(blocks)):
            blocks[i] = torch.compile(blocks[i])
    times = _StepTimes()
    strategy: Any = "auto" if world == 1 else PipelineParallelStrategy(pipeline_parallel_size=2, num_microbatches=4)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[times.callback])  # fmt: skip
    trainer.fit(model, datamodule=data)
    queue.put((rank, times.times))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, args: argparse.Namespace, compiled: bool) -> list[float]:
    """Step times of rank 0 (a pipeline's ranks step together)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, compiled, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, GPT {args.layers} x H={args.hidden}, B={args.batch}, T={args.seq_len}, "
          f"fp32, AdamW, 1 thread per process, {args.steps} steps (median after {args.warmup})\n")  # fmt: skip
    print("| layout | blocks | first step s | step s (median) | compiled / eager |")
    print("|---|---|---|---|---|")
    for name, world in (("one process", 1), ("pipeline pp=2", 2)):
        medians = {}
        for compiled in (False, True):
            times = run(world, args, compiled)
            medians[compiled] = statistics.median(times[args.warmup :])
            ratio = f"{medians[True] / medians[False]:.2f}x" if compiled else ""
            print(f"| {name} | {'compiled' if compiled else 'eager'} | {times[0]:.2f} | {medians[compiled]:.3f} |"
                  f" {ratio} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
