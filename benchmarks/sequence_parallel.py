"""Sequence (context) parallelism vs one process: saved activation bytes per rank and tokens/s.

The pipeline benchmark's model (example GPT, H=128, 8 blocks, 4 heads), one sequence of ``--seq-len``
tokens, forward + backward + SGD step. ``sp=2``: 2 processes x 1 thread, every block made sequence-parallel
by ``lightning_parallel.blocks.parallelize`` (what ``sequence_parallel_size=2`` runs),
in Ulysses and in ring mode; single: one process with 1 and with 2 threads (run on one of the two
processes while the other waits). "saved MiB" = bytes allocated by the trunk's forward and still alive
when it returns (``memory.kept_for_backward``, output included), per rank. Rounds alternate the
configurations after a warm-up round; medians.

    .venv/bin/python benchmarks/sequence_parallel.py --seq-lens 8192 --reps 3
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pipeline import batch, init_worker, make_model, run_two  # noqa: E402
from lightning_parallel.blocks import BlockConfig, parallelize  # noqa: E402
from lightning_parallel.memory import kept_for_backward  # noqa: E402


class Config:
    def __init__(self, seq_len: int, mode: str | None) -> None:
        self.model, self.data = make_model(seq_len), batch(seq_len, 1)
        if mode is not None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
            parallelize(self.model, BlockConfig(sp_mesh=mesh, sp_mode=mode))
            self.model._loss(self.data)  # the blocks' first call verifies their stack
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self) -> None:
        self.model._loss(self.data).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def saved_bytes(self) -> int:
        gpt = self.model.transformer
        idx = self.data[0]
        x = (gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1]))).detach().requires_grad_()

        def trunk() -> torch.Tensor:
            h = x
            for block in gpt.h:
                h = block(h)
            return h

        nbytes, _ = kept_for_backward(trunk)
        return nbytes


def worker(rank: int, port: int, args: argparse.Namespace, out: mp.SimpleQueue) -> None:
    init_worker(rank, port, 30)
    rows = []
    for seq_len in args.seq_lens:
        configs = {"sp=2 ulysses": Config(seq_len, "ulysses"), "sp=2 ring": Config(seq_len, "ring")}
        if rank == 0:
            configs = {"single 1t": Config(seq_len, None), "single 2t": Config(seq_len, None), **configs}
        names = ["single 1t", "single 2t", "sp=2 ulysses", "sp=2 ring"]
        times: dict[str, list[float]] = {k: [] for k in names}
        for rep in range(args.reps + 1):
            for name in names:
                dist.barrier()
                t0 = time.perf_counter()
                if name in configs:
                    torch.set_num_threads(2 if name == "single 2t" else 1)
                    configs[name].step()
                    torch.set_num_threads(1)
                dist.barrier()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        saved = {}
        for name in names:  # one untimed forward per configuration, every rank in lock-step
            dist.barrier()
            if name in configs:
                saved[name] = configs[name].saved_bytes()
            dist.barrier()
        rows += [(seq_len, n, statistics.median(times[n]), saved.get(n)) for n in names]
    out.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    results = run_two(worker, args)
    print(f"torch {torch.__version__}, example GPT H=128 x 8 blocks, 1 sequence, forward+backward+SGD,"
          f" medians of {args.reps} interleaved rounds\n")  # fmt: skip
    print("| T | configuration | step s | tokens/s | vs single 1t | vs single 2t | saved MiB per rank |")
    print("|---|---|---|---|---|---|---|")
    for i, (seq_len, name, t0, nbytes) in enumerate(results[0]):
        t = max(t0, results[1][i][2]) if name.startswith("sp") else t0
        same = {r[1]: r[2] for r in results[0] if r[0] == seq_len}
        single1, single2 = same["single 1t"], same["single 2t"]
        cells = [seq_len, name, f"{t:.3f}", f"{seq_len / t:.0f}", f"{single1 / t:.2f}x", f"{single2 / t:.2f}x",
                 f"{nbytes / 2**20:.0f}" if nbytes is not None else "-"]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
