"""Tensor parallelism vs one process: tokens/s and parameter bytes per rank.

The pipeline benchmark's model (example GPT, H=128, 8 blocks, 4 heads), one batch of ``--batch``
sequences of ``--seq-len`` tokens, forward + backward + SGD step. ``tp=2``: 2 processes x 1 thread, the
blocks composed by ``lightning_parallel.blocks.parallelize`` (what ``tensor_parallel_size=2`` runs;
optionally with sequence parallelism); single: one process with 1 and with 2 threads. Rounds
alternate the configurations after a warm-up round; medians.

    .venv/bin/python benchmarks/tensor_parallel.py --seq-lens 1024 2048 --reps 5
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
from lightning_parallel.tensor_parallel import local  # noqa: E402
from lightning_parallel.trunk import discover_trunk  # noqa: E402


def block_bytes(model: torch.nn.Module) -> int:
    trunk = discover_trunk(model)
    return sum(local(p).numel() * p.element_size() for b in trunk.blocks for p in b.parameters())


class Config:
    def __init__(self, seq_len: int, m: int, tp: int, sequence_parallel: bool = False) -> None:
        self.model, self.data, self.tp = make_model(seq_len), batch(seq_len, m), tp
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
            parallelize(self.model, BlockConfig(tp_mesh=mesh, tp_sequence_parallel=sequence_parallel))
            self.model._loss(self.data)  # the blocks' first call verifies and shards them
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self) -> None:
        loss = self.model._loss(self.data)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def worker(rank: int, port: int, args: argparse.Namespace, out: mp.SimpleQueue) -> None:
    init_worker(rank, port)
    rows = []
    for seq_len in args.seq_lens:
        configs = {
            "tp=2": Config(seq_len, args.batch, 2),
            "tp=2 + sequence parallel": Config(seq_len, args.batch, 2, True),
        }
        if rank == 0:
            configs = {
                "single 1t": Config(seq_len, args.batch, 1),
                "single 2t": Config(seq_len, args.batch, 1),
                **configs,
            }
        times: dict[str, list[float]] = {k: [] for k in ("single 1t", "single 2t", *configs)}
        for rep in range(args.reps + 1):
            for name in times:
                dist.barrier()
                t0 = time.perf_counter()
                if name in configs and (name.startswith("tp") or rank == 0):
                    torch.set_num_threads(2 if name == "single 2t" else 1)
                    configs[name].step()
                    torch.set_num_threads(1)
                dist.barrier()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        bytes_ = {k: block_bytes(c.model) for k, c in configs.items()}
        rows += [(seq_len, k, statistics.median(v), bytes_.get(k)) for k, v in times.items()]
    out.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    results = run_two(worker, args)
    print(f"torch {torch.__version__}, example GPT H=128 x 8 blocks, batch {args.batch}, forward+backward+SGD,"
          f" medians of {args.reps} interleaved rounds\n")  # fmt: skip
    print("| T | configuration | step s | tokens/s | vs single 1t | vs single 2t | block parameter MiB per rank |")
    print("|---|---|---|---|---|---|---|")
    for i, (seq_len, name, t0, nbytes) in enumerate(results[0]):
        t = max(t0, results[1][i][2]) if name.startswith("tp") else t0
        same = {r[1]: r[2] for r in results[0] if r[0] == seq_len}
        same.update(
            {
                r[1]: max(r[2], results[1][j][2])
                for j, r in enumerate(results[0])
                if r[0] == seq_len and r[1].startswith("tp")
            }
        )
        per_rank = f"{nbytes / 2**20:.2f}" if nbytes is not None else "-"
        cells = [seq_len, name, f"{t:.3f}", f"{seq_len * args.batch / t:.0f}", f"{same['single 1t'] / t:.2f}x",
                 f"{same['single 2t'] / t:.2f}x", per_rank]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
