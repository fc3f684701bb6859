"""What the derived anatomy costs: the example GPT's blocks composed from its traced graph against the same
blocks composed from the hand-written ``nanogpt`` adapter, on 2 CPU processes x 1 thread.

    .venv/bin/python benchmarks/anatomy.py --seq-len 2048 --reps 5

Model: the pipeline benchmark's example GPT (H=128, 8 blocks, 4 heads), ``--batch`` sequences of
``--seq-len`` tokens, forward + backward + SGD step. Pairs, each measured in the same rounds:

- ``tp=2``, ``sp=2 ulysses``, ``sp=2 ring``: the blocks composed by ``lightning_parallel.blocks.parallelize``
  (what ``tensor_parallel_size=2`` / ``sequence_parallel_size=2`` run) with ``adapter="nanogpt"`` vs with the
  hand-written adapters switched off (the traced graph serves);
- ``helix``: HelixPipe's runtime (two folds, recomputation without attention, MLP in 2 chunks: the
  strategy's defaults) on the adapter's splits vs the traced graph's splits, ``--batch`` micro-batches.

The first call of every configuration (which resolves, traces and verifies) is a warm-up round; then
every round runs each configuration once, alternating, and the table reports medians and the ratio
derived / hand-written (the target is at most 1.03).

The worker processes keep freed memory (``MALLOC_MMAP_THRESHOLD_`` 32 MiB, ``MALLOC_TRIM_THRESHOLD_``
4 GiB, unless set): otherwise glibc hands the tensor-parallel steps' 4 MiB all-reduce buffers back to the
system and each step touches them anew (measured: 6,000-28,000 minor page faults per tp=2 step, on either
side, against under 10 for the other configurations), which made the tp=2 ratio swing by about 5 %
between runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pipeline import batch, init_worker, make_model, run_two  # noqa: E402
from lightning_parallel import _p2p
from lightning_parallel.anatomy.adapters import ADAPTERS, AdapterAnatomy  # noqa: E402
from lightning_parallel.anatomy.traced import anatomy_of  # noqa: E402
from lightning_parallel.blocks import BlockConfig, parallelize  # noqa: E402
from lightning_parallel.pipeline.context import PlainSteps  # noqa: E402
from lightning_parallel.pipeline.helix_runtime import HelixRuntime, place_block  # noqa: E402
from lightning_parallel.pipeline.helix_schedule import helix  # noqa: E402
from lightning_parallel.trunk import discover_trunk  # noqa: E402

TRACED = ("traced",)


def _lanes() -> object:
    """The runtime's point-to-point lanes, both on the default group: on gloo, which matches by tag, that is enough
    for a measurement, and it makes no process group (a caller may destroy the default group and start another,
    as tests/callbacks/test_profilers.py does)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    return _p2p.Lanes(world, world, world)


class Composed:
    """The example GPT with every block composed under ``config`` (tensor or sequence parallelism)."""

    def __init__(self, seq_len: int, m: int, config: BlockConfig) -> None:
        self.model, self.data = make_model(seq_len), batch(seq_len, m)
        parallelize(self.model, config)
        self.model._loss(self.data)  # the first call resolves, traces and verifies the blocks
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self) -> None:
        self.model._loss(self.data).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Helix:
    """HelixPipe's runtime over the adapter's or the traced graph's splits (the strategy's defaults)."""

    def __init__(self, seq_len: int, m: int, rank: int, derived: bool) -> None:
        self.model = make_model(seq_len)
        trunk = discover_trunk(self.model)
        config = BlockConfig(mlp_chunks=2, split=True)
        x, _ = batch(seq_len, 1)
        gpt = self.model.transformer
        hidden = gpt.wte(x) + gpt.wpe(torch.arange(seq_len))
        splits = []
        for block in trunk.blocks:
            anatomy = anatomy_of(block, (hidden, (), {}), config) if derived else AdapterAnatomy(ADAPTERS["nanogpt"])
            splits.append(anatomy.helix_split(block, config))
        for i, (block, split) in enumerate(zip(trunk.blocks, splits)):
            place_block(i, block, split, rank, 2)
        self.runtime = HelixRuntime(trunk, [range(len(trunk))], rank, [0, 1], _lanes(), torch.device("cpu"), folds=2,
                                    recompute=True)  # fmt: skip
        self.runtime.splits = splits
        self.actions = helix(2, len(trunk), m, 2)  # every stage's: the messages' order
        xs, ys = batch(seq_len, m)
        self.micro = [(xs[i : i + 1], ys[i : i + 1]) for i in range(m)]
        self.opt = torch.optim.SGD([p for p in self.model.parameters() if not p.is_meta], lr=1e-3)
        self.m = m

    def step(self) -> None:
        steps = [lambda mb=mb: self.model._loss(mb) for mb in self.micro]
        self.runtime.run(self.actions, PlainSteps(steps), lambda out: out, [1.0 / self.m] * self.m)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def configurations(rank: int, args: argparse.Namespace) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    T, m = args.seq_len, args.batch
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    sp = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
    configs: dict[str, object] = {}
    for name, kwargs in (("tp=2", dict(tp_mesh=tp)), ("sp=2 ulysses", dict(sp_mesh=sp)),
                         ("sp=2 ring", dict(sp_mesh=sp, sp_mode="ring"))):  # fmt: skip
        configs[f"{name} adapter"] = Composed(T, m, BlockConfig(adapter="nanogpt", **kwargs))
        configs[f"{name} traced"] = Composed(T, m, BlockConfig(sources=TRACED, **kwargs))
    configs["helix adapter"] = Helix(T, m, rank, derived=False)
    configs["helix traced"] = Helix(T, m, rank, derived=True)
    return configs


def worker(rank: int, port: int, args: argparse.Namespace, out: mp.SimpleQueue) -> None:
    init_worker(rank, port)
    configs = configurations(rank, args)
    times: dict[str, list[float]] = {k: [] for k in configs}
    for rep in range(args.reps + 1):
        for name, config in configs.items():
            dist.barrier()
            t0 = time.perf_counter()
            config.step()  # type: ignore[attr-defined]
            dist.barrier()
            if rep:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    out.put((rank, {k: statistics.median(v) for k, v in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 * 2**20))  # read by glibc in the spawned workers
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 * 2**30))
    results = run_two(worker, args)
    print(f"torch {torch.__version__}, example GPT H=128 x 8 blocks, T={args.seq_len}, batch {args.batch},"
          f" 2 processes x 1 thread, medians of {args.reps} interleaved rounds\n")  # fmt: skip
    print("| configuration | hand-written adapter s | traced graph s | traced / adapter |")
    print("|---|---|---|---|")
    for name in ("tp=2", "sp=2 ulysses", "sp=2 ring", "helix"):
        adapter = max(results[r][f"{name} adapter"] for r in (0, 1))
        traced = max(results[r][f"{name} traced"] for r in (0, 1))
        print(f"| {name} | {adapter:.3f} | {traced:.3f} | {traced / adapter:.3f} |")


if __name__ == "__main__":
    main()
