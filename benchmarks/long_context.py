"""Long sequences as people train them: a packed step and the LM head's loss at T=16k, before and after.

Part 1, the head and its loss alone: ``F.cross_entropy(lm_head(h).view(-1, V), targets)`` forward and backward
over T tokens (H=128, V=16384, float32), whole (what an unchanged module does) and with
``lightning_parallel.chunked_loss`` over 16 chunks (``loss_chunks=16``); peak live tensor bytes
(``memory.LiveTensorTracker``) against one whole logits tensor, and seconds.

Part 2, one packed training step: the example Llama (dim 64, 2 heads, 2 layers, V=16384) on one row of T tokens
packed from documents of random lengths (exponential, mean 1024; ``position_ids`` restarting, a document mask),
forward, backward and an SGD step. One process (1 thread), and ring sequence parallelism sp=2 (2 processes x 1
thread, the blocks made sequence-parallel by ``lightning_parallel.blocks.parallelize``, what
``sequence_parallel_size=2, sequence_parallel_mode="ring"`` runs): before (whole logits) and after
(``loss_chunks=16``; and also with ``recompute="no_attention"`` and ``recompute_offload=True``). Peak live bytes
per rank over the step and tokens/s; rounds alternate the configurations after a warm-up round; medians.

    .venv/bin/python benchmarks/long_context.py --seq-len 16384 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pipeline import init_worker, run_two  # noqa: E402
from lightning_parallel.blocks import BlockConfig, parallelize  # noqa: E402
from lightning_parallel.chunked_loss import lazy_heads  # noqa: E402
from lightning_parallel.memory import LiveTensorTracker  # noqa: E402
from lightning_parallel.packing import pack_documents  # noqa: E402

VOCAB, CHUNKS, MiB = 16384, 16, 2**20


def head_and_loss(tokens: int, chunks: int) -> tuple[int, float]:
    torch.manual_seed(0)
    head = torch.nn.Linear(128, VOCAB, bias=False)
    h = torch.randn(1, tokens, 128, requires_grad=True)
    target = torch.randint(0, VOCAB, (tokens,))
    with LiveTensorTracker() as tracker, lazy_heads([head], chunks) if chunks > 1 else torch.enable_grad():
        t0 = time.perf_counter()
        F.cross_entropy(head(h).view(-1, VOCAB), target).backward()
    return tracker.peak, time.perf_counter() - t0


def packed_row(seq_len: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < seq_len:
        n = max(1, int(torch.empty(1).exponential_(1 / 1024, generator=g)))
        lengths.append(n)
        total += n
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    row = pack_documents(docs, seq_len)[0]
    return {k: v.unsqueeze(0) for k, v in row.items()}


class Config:
    def __init__(self, seq_len: int, sp: bool, chunks: int, recompute: str = "none", offload: bool = False) -> None:
        from examples.models import Llama

        torch.manual_seed(0)
        self.model = Llama(vocab_size=VOCAB, block_size=seq_len, n_layer=2, n_head=2, n_kv_head=2, dim=64,
                           mlp_hidden=128)  # fmt: skip
        self.batch, self.chunks = packed_row(seq_len), chunks
        if sp or recompute != "none" or offload:
            mesh = None
            if sp:
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
            parallelize(self.model, BlockConfig(sp_mesh=mesh, sp_mode="ring", recompute=recompute, offload=offload))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self) -> int:
        with LiveTensorTracker() as tracker:
            with lazy_heads([self.model.lm_head], self.chunks) if self.chunks > 1 else torch.enable_grad():
                loss = self.model._loss(self.batch)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return tracker.peak


CONFIGS = {  # name -> (sequence parallel, loss chunks, recompute, offload)
    "one process, whole logits": (False, 1, "none", False),
    "one process, loss_chunks=16": (False, CHUNKS, "none", False),
    "ring sp=2, whole logits": (True, 1, "none", False),
    "ring sp=2, loss_chunks=16": (True, CHUNKS, "none", False),
    "ring sp=2, loss_chunks=16, no_attention + offload": (True, CHUNKS, "no_attention", True),
}


def worker(rank: int, port: int, args: argparse.Namespace, out: mp.SimpleQueue) -> None:
    init_worker(rank, port, 60)
    configs = {n: Config(args.seq_len, *c) for n, c in CONFIGS.items() if c[0] or rank == 0}
    times: dict[str, list[float]] = {n: [] for n in CONFIGS}
    peaks: dict[str, int] = {}
    for rep in range(args.reps + 1):
        for name in CONFIGS:
            dist.barrier()
            t0 = time.perf_counter()
            if name in configs:
                peaks[name] = configs[name].step()
            if rep:
                times[name].append(time.perf_counter() - t0)
    out.put((rank, (times, peaks)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    whole = args.seq_len * VOCAB * 4
    print(
        f"torch {torch.__version__}; T={args.seq_len}, V={VOCAB}: one whole float32 logits tensor {whole / MiB:.0f} MiB\n"
    )
    print("Part 1: the head and its cross-entropy, forward and backward (1 thread)\n")
    print("| configuration | peak live MiB | vs one logits tensor | seconds |\n|---|---|---|---|")
    for chunks in (1, CHUNKS):
        peak, seconds = head_and_loss(args.seq_len, chunks)
        name = "whole logits (unchanged module)" if chunks == 1 else f"loss_chunks={chunks}"
        print(f"| {name} | {peak / MiB:.0f} | {peak / whole:.2f}x | {seconds:.2f} |")
    results = run_two(worker, args)
    print(f"\nPart 2: one packed step, medians of {args.reps} interleaved rounds\n")
    print("| configuration | peak live MiB per rank | step s | tokens/s | vs one process |\n|---|---|---|---|---|")
    base = statistics.median(results[0][0]["one process, whole logits"])
    for name in CONFIGS:
        step = statistics.median(results[0][0][name])
        peaks = " / ".join(f"{results[r][1][name] / MiB:.0f}" for r in (0, 1) if name in results[r][1])
        print(f"| {name} | {peaks} | {step:.2f} | {args.seq_len / step:.0f} | {base / step:.2f}x |")


if __name__ == "__main__":
    main()
