"""Pipeline throughput on 2 CPU processes x 1 thread: single process vs our schedules (GPipe, 1F1B,
interleaved, zero bubble, HelixPipe) vs torch's Schedule1F1B and zero-bubble schedules.

    .venv/bin/python benchmarks/pipeline.py --seq-lens 1024 2048 --reps 5                       # pipeline schedules
    .venv/bin/python benchmarks/pipeline.py --seq-lens 1024 2048 4096 --m 4 8 --configs helix  # HelixPipe rows
    .venv/bin/python benchmarks/pipeline.py --seq-lens 1024 --m 8 --configs zb                 # zero-bubble rows

Model: the example GPT (H=128, 8 blocks, 4 heads, character vocabulary), global batch of m sequences,
micro-batch = 1 sequence, SGD step included. Every configuration runs one step per round, rounds
repeat A/B/A/B after a warm-up round, and the table reports medians. Rows:

- ``single 1t`` / ``single 2t``: one process with 1 / 2 intra-op threads (the other rank idles);
- ``ours <schedule>``: our runtime (capture-then-drive, the code ``PipelineParallelStrategy`` runs)
  at pp=2, outside the Trainer so both pipelines are measured the same way;
- ``torch Schedule1F1B``: ``torch.distributed.pipelining`` on the same manual split (embeddings +
  blocks 0-3 | blocks 4-7 + final norm + head), ``loss_fn`` on every rank.

- ``ours zb_h1`` / ``ours zbv``: the zero-bubble schedules (backward split into input and weight gradients;
  ZB-V with two chunks per stage in a V); ``torch ScheduleInterleavedZeroBubble`` (one stage per rank,
  the split above) and ``torch ScheduleZBVZeroBubble`` (four chunks of two blocks, rank 0 holding the
  first and the last) are torch's on the same model;
- ``ours helix``: HelixPipe (two folds when m allows) through the runtime ``HelixParallelStrategy`` runs;
  ``+rc`` rows use recomputation without attention (helix's default, with its MLP in 2 chunks) and are
  compared with ``ours 1f1b +rc`` (1F1B with the same ``no_attention`` policy), like with like.

Allocator: by default (``--allocator keep``) glibc keeps freed memory for reuse (``keep_freed_memory``), as
CUDA's caching allocator does on a GPU; with glibc's own settings (``--allocator default``) a configuration
that holds many activations (GPipe, helix without recomputation) gives them back to the OS after every step
and pays page faults for them again in the next (measured at T=4096, m=4: helix's attention kernels 10-15 %
slower than the same kernels under 1F1B; docs/benchmarks.md, HelixPipe).

Also reported: the measured bubble fraction of each stage of the last timed step (idle / window, from
our runtimes' timelines, with the transfer part of receives not counted as idle: exactly what
``BubbleProfiler`` logs, see ``lightning_parallel/callbacks/timeline.py``), parameter bytes per stage, and the peak live bytes per stage during one extra, untimed step
measured with ``LiveTensorTracker`` (activations, including what checkpointing keeps, and gradients).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import GPT  # noqa: E402
from lightning_parallel import _p2p
from lightning_parallel.anatomy.adapters import ADAPTERS, AdapterAnatomy  # noqa: E402
from lightning_parallel.blocks import (
    BlockConfig,  # noqa: E402
    apply_recompute,  # noqa: E402
)
from lightning_parallel.callbacks.timeline import analyze, mean_costs, split_receive  # noqa: E402
from lightning_parallel.memory import LiveTensorTracker  # noqa: E402
from lightning_parallel.pipeline.context import PlainSteps  # noqa: E402
from lightning_parallel.pipeline.helix_runtime import HelixRuntime, place_block  # noqa: E402
from lightning_parallel.pipeline.helix_schedule import helix, simulate_helix  # noqa: E402
from lightning_parallel.pipeline.placement import place_blocks  # noqa: E402
from lightning_parallel.pipeline.runtime import PipelineRuntime  # noqa: E402
from lightning_parallel.pipeline.schedules import build_schedule, chunk_stages, placement_style, simulate  # noqa: E402
from lightning_parallel.trunk import discover_trunk, free_blocks, parameter_bytes  # noqa: E402

VOCAB, H, LAYERS, HEADS = 65, 128, 8, 4


def _lanes() -> object:
    """The runtime's point-to-point lanes, both on the default group: on gloo, which matches by tag, that is enough
    for a measurement, and it makes no process group (a caller may destroy the default group and start another,
    as tests/callbacks/test_profilers.py does)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    return _p2p.Lanes(world, world, world)


def make_model(seq_len: int) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=seq_len, n_layer=LAYERS, n_head=HEADS, n_embd=H)


def batch(seq_len: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (m, seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


class Single:
    def __init__(self, seq_len: int, m: int, threads: int) -> None:
        self.model, self.batch, self.threads = make_model(seq_len), batch(seq_len, m), threads
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self, rank: int) -> dict:
        if rank != 0:
            return {}
        torch.set_num_threads(self.threads)
        try:
            loss = self.model._loss(self.batch)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        finally:
            torch.set_num_threads(1)
        return {}


class Ours:
    def __init__(self, seq_len: int, m: int, rank: int, schedule: str, recompute: str = "none") -> None:
        self.model = make_model(seq_len)
        apply_recompute(self.model, recompute, split_backward=schedule in ("zb_h1", "zbv"))
        v = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
        trunk = discover_trunk(self.model)
        placement, stages = place_blocks(len(trunk), 2 * v), chunk_stages(2, v, placement_style(schedule))
        local = {j for c in range(2 * v) if stages[c] == rank for j in placement[c]}
        free_blocks([b for j, b in enumerate(trunk.blocks) if j not in local])
        self.runtime = PipelineRuntime(trunk, placement, rank, [0, 1], _lanes(), torch.device("cpu"), stages)
        self.schedule, self.v = schedule, v
        self.actions = build_schedule(schedule, 2, m, v)  # every stage's: the messages' order
        x, y = batch(seq_len, m)
        self.micro = [(x[i : i + 1], y[i : i + 1]) for i in range(m)]
        self.params = [p for p in self.model.parameters() if p.device.type != "meta"]
        self.opt = torch.optim.SGD(self.params, lr=1e-3)
        self.m = m

    def step(self, rank: int) -> dict:
        steps = [lambda mb=mb: self.model._loss(mb) for mb in self.micro]
        self.runtime.run(self.actions, PlainSteps(steps), lambda out: out, [1.0 / self.m] * self.m)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"events": list(self.runtime.timeline), "params": parameter_bytes(self.model)}


class OursHelix(Ours):
    def __init__(self, seq_len: int, m: int, rank: int, recompute: bool, folds: int | None = None) -> None:
        self.model = make_model(seq_len)
        trunk = discover_trunk(self.model)
        anatomy = AdapterAnatomy(ADAPTERS["nanogpt"])
        config = BlockConfig(mlp_chunks=2 if recompute else 1)  # helix's default MLP chunking
        splits = [anatomy.helix_split(block, config) for block in trunk.blocks]
        for i, (block, split) in enumerate(zip(trunk.blocks, splits)):
            place_block(i, block, split, rank, 2)
        folds = folds or (2 if m % 4 == 0 else 1)
        self.folds = folds
        self.runtime = HelixRuntime(
            trunk, [range(len(trunk))], rank, [0, 1], _lanes(), torch.device("cpu"), folds=folds, recompute=recompute
        )
        self.runtime.splits = splits
        self.actions = helix(2, len(trunk), m, folds)  # every stage's: the messages' order
        x, y = batch(seq_len, m)
        self.micro = [(x[i : i + 1], y[i : i + 1]) for i in range(m)]
        self.params = [p for p in self.model.parameters() if p.device.type != "meta"]
        self.opt = torch.optim.SGD(self.params, lr=1e-3)
        self.m = m


class TorchStage(nn.Module):
    """Blocks ``blocks`` of the GPT, with the embeddings if ``first`` and the final norm and head if ``last``."""

    def __init__(self, gpt: GPT, first: bool, blocks: range | None = None, last: bool | None = None) -> None:
        super().__init__()
        blocks = blocks if blocks is not None else (range(0, 4) if first else range(4, 8))
        self.first, self.last = first, (not first) if last is None else last
        h = gpt.transformer.h
        self.blocks = nn.ModuleList(h[i] for i in blocks)
        if self.first:
            self.wte, self.wpe = gpt.transformer.wte, gpt.transformer.wpe
        if self.last:
            self.ln_f, self.head = gpt.transformer.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1)))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x)) if self.last else x


class TorchZeroBubble:
    """torch's ``ScheduleInterleavedZeroBubble`` (stage = rank, the 1F1B split) or ``ScheduleZBVZeroBubble``
    (four chunks of two blocks; rank r holds chunks r and 3 - r)."""

    def __init__(self, seq_len: int, m: int, rank: int, v_shape: bool) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

        gpt = make_model(seq_len)
        ids = [rank, 3 - rank] if v_shape else [rank]
        n = 4 if v_shape else 2
        per = LAYERS // n
        self.modules = [TorchStage(gpt, i == 0, range(i * per, (i + 1) * per), i == n - 1) for i in ids]
        stages = [PipelineStage(mod, i, n, torch.device("cpu")) for mod, i in zip(self.modules, ids)]
        loss_fn = lambda logits, tgt: F.cross_entropy(logits.flatten(0, 1), tgt.flatten())  # noqa: E731
        cls = ScheduleZBVZeroBubble if v_shape else ScheduleInterleavedZeroBubble
        self.sched = cls(stages, m, loss_fn=loss_fn)
        self.x, self.y = batch(seq_len, m)
        self.first, self.last = 0 in ids, n - 1 in ids
        params = {id(p): p for mod in self.modules for p in mod.parameters()}  # the tied pair once (ZB-V: rank 0)
        self.opt = torch.optim.SGD(list(params.values()), lr=1e-3)

    def step(self, rank: int) -> dict:
        args = (self.x,) if self.first else ()
        kwargs = dict(target=self.y, losses=[]) if self.last else {}
        self.sched.step(*args, **kwargs)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"params": sum(parameter_bytes(mod) for mod in self.modules)}


class Torch1F1B:
    def __init__(self, seq_len: int, m: int, rank: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.module = TorchStage(make_model(seq_len), first=rank == 0)
        stage = PipelineStage(self.module, rank, 2, torch.device("cpu"))
        loss_fn = lambda logits, tgt: F.cross_entropy(logits.flatten(0, 1), tgt.flatten())  # noqa: E731
        self.sched = Schedule1F1B(stage, m, loss_fn=loss_fn)  # loss_fn on every rank, or it deadlocks on gloo
        self.x, self.y = batch(seq_len, m)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-3)

    def step(self, rank: int) -> dict:
        if rank == 0:
            self.sched.step(self.x)
        else:
            self.sched.step(target=self.y, losses=[])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"params": parameter_bytes(self.module)}


def _ahead(cfg: OursHelix, n: int) -> OursHelix:
    cfg.runtime.receives_ahead = n  # receives posted ahead (the runtime's default is 2)
    return cfg


CONFIGS = {
    "ahead": ["torch Schedule1F1B", "ours helix ahead0", "ours helix ahead1", "ours helix"],
    "issue3": ["single 1t", "single 2t", "ours gpipe", "ours 1f1b", "ours interleaved", "torch Schedule1F1B"],
    "zb": [
        "ours 1f1b",
        "ours zb_h1",
        "ours zbv",
        "torch Schedule1F1B",
        "torch ScheduleInterleavedZeroBubble",
        "torch ScheduleZBVZeroBubble",
        "ours 1f1b +rc",
        "ours zb_h1 +rc",
    ],  # fmt: skip
    "helix": [
        "single 1t",
        "single 2t",
        "torch Schedule1F1B",
        "ours 1f1b",
        "ours helix",
        "ours 1f1b +rc",
        "ours helix +rc",
    ],
}


def build(name: str, seq_len: int, m: int, rank: int):
    return {
        "single 1t": lambda: Single(seq_len, m, 1),
        "single 2t": lambda: Single(seq_len, m, 2),
        "ours gpipe": lambda: Ours(seq_len, m, rank, "gpipe"),
        "ours 1f1b": lambda: Ours(seq_len, m, rank, "1f1b"),
        "ours interleaved": lambda: Ours(seq_len, m, rank, "interleaved_1f1b"),
        "ours zb_h1": lambda: Ours(seq_len, m, rank, "zb_h1"),
        "ours zbv": lambda: Ours(seq_len, m, rank, "zbv"),
        "ours zb_h1 +rc": lambda: Ours(seq_len, m, rank, "zb_h1", recompute="no_attention"),
        "torch ScheduleInterleavedZeroBubble": lambda: TorchZeroBubble(seq_len, m, rank, v_shape=False),
        "torch ScheduleZBVZeroBubble": lambda: TorchZeroBubble(seq_len, m, rank, v_shape=True),
        "ours 1f1b +rc": lambda: Ours(seq_len, m, rank, "1f1b", recompute="no_attention"),
        "ours helix": lambda: OursHelix(seq_len, m, rank, recompute=False),
        "ours helix +rc": lambda: OursHelix(seq_len, m, rank, recompute=True),
        "ours helix f1": lambda: OursHelix(seq_len, m, rank, recompute=False, folds=1),
        "ours helix ahead0": lambda: _ahead(OursHelix(seq_len, m, rank, recompute=False), 0),
        "ours helix ahead1": lambda: _ahead(OursHelix(seq_len, m, rank, recompute=False), 1),
        "torch Schedule1F1B": lambda: Torch1F1B(seq_len, m, rank),
    }[name]()


def measure(rank: int, seq_len: int, m: int, args: argparse.Namespace, before_round: Any = None) -> list:
    """Each configuration's step, one per round after a warm-up round (``before_round(rep)`` runs first in each
    round, on both ranks)."""
    configs = {name: build(name, seq_len, m, rank) for name in CONFIGS[args.configs]}
    times: dict[str, list[float]] = {k: [] for k in configs}
    extra: dict[str, dict] = {}
    kinds: dict[str, list[dict[str, float]]] = {k: [] for k in configs}
    for rep in range(args.reps + 1):  # round 0 is the warm-up
        if before_round is not None:
            dist.barrier()
            before_round(rep)
        for name, cfg in configs.items():
            dist.barrier()
            t0 = time.perf_counter()
            info = cfg.step(rank)
            dist.barrier()
            if rep:
                times[name].append(time.perf_counter() - t0)
                extra[name] = info
                if "events" in info:  # per round: seconds per action kind on this stage, and outside actions
                    kinds[name].append(kind_seconds(info["events"], times[name][-1]))
    for name, info in extra.items():  # the bubble of the last timed step, as BubbleProfiler measures it
        if "events" in info:
            everyone: list = [None, None]
            dist.all_gather_object(everyone, info.pop("events"))
            breakdown = analyze(dict(enumerate(everyone)))[rank]
            info["bubble"], info["times"] = breakdown.bubble, breakdown
            info["theory"] = theory(name, m, everyone, rank, configs[name])
    for name, cfg in configs.items():  # one more, untimed step per configuration for memory
        dist.barrier()
        tracker = LiveTensorTracker()
        with tracker:
            cfg.step(rank)
        extra[name]["live"] = tracker.peak
        dist.barrier()
    for name in configs:
        extra[name]["rounds"] = times[name]  # seconds per timed round, in round order
        if kinds[name]:
            extra[name]["kinds"] = {k: statistics.median(r[k] for r in kinds[name]) for k in kinds[name][0]}
    return [(seq_len, m, name, statistics.median(times[name]), extra[name]) for name in configs]


def kind_seconds(events: list, step: float) -> dict[str, float]:
    """Seconds this stage spent per action kind (blocked receives apart: ``wait`` before the producer sent,
    ``transfer`` after, over ``receives`` remote receives) and outside its actions (``other``: the step's time
    less the actions' spans)."""
    out: dict[str, float] = {"wait": 0.0, "transfer": 0.0, "receives": 0.0}
    for e in events:
        wait, transfer = split_receive(e)
        out["wait"], out["transfer"] = out["wait"] + wait, out["transfer"] + transfer
        out["receives"] += e.recv_start is not None
        out[e.kind] = out.get(e.kind, 0.0) + e.end - e.start - e.blocked
    out["other"] = step - sum(e.end - e.start for e in events)
    return out


def theory(name: str, m: int, everyone: list, rank: int, cfg: Any) -> float:
    """The schedule's bubble on a virtual clock with the step's measured mean action costs, no latency."""
    costs = mean_costs(e for events in everyone for e in events)
    if "helix" in name:
        folds = cfg.folds
        sim = simulate_helix(helix(2, LAYERS, m, folds), LAYERS, m, folds, lambda a: costs[(a.kind, a.chunk)])
    else:
        schedule = build_schedule(cfg.schedule, 2, m, cfg.v)
        stages = chunk_stages(2, cfg.v, placement_style(cfg.schedule))
        sim = simulate(schedule, 2 * cfg.v, m, cost=lambda a: costs[(a.kind, a.chunk)], stages=stages)
    return sim.bubble(rank)


def keep_freed_memory() -> None:
    """Have glibc keep freed memory for reuse instead of giving it back to the OS (mmap threshold 32 MiB, no
    trimming), as CUDA's caching allocator keeps it on a GPU; by default a step that holds many activations
    (GPipe, helix) pays page faults for them again every step (docs/benchmarks.md, "HelixPipe against torch's 1F1B at T=4096, m=4, after the transport work")."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD


def init_worker(rank: int, port: int, minutes: int = 10, world_size: int = 2) -> None:
    """One thread, and the gloo group of ``world_size`` processes ``run_two`` / ``run_n`` set up the port for."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=minutes))


def worker(rank: int, port: int, args: argparse.Namespace, out: mp.SimpleQueue) -> None:
    if args.allocator == "keep":
        keep_freed_memory()
    init_worker(rank, port)
    rows = []
    for seq_len in args.seq_lens:
        for m in args.m:
            rows += measure(rank, seq_len, m, args)
    out.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def collect(procs: list, out: mp.SimpleQueue) -> dict:
    """Each worker's result; if one dies first, kill the others and exit with its code (never hang)."""
    results: dict = {}
    while len(results) < len(procs):
        if not out.empty():
            rank, rows = out.get()
            results[rank] = rows
            continue
        failed = [p for p in procs if p.exitcode not in (None, 0)]
        if failed:
            for p in procs:
                p.kill()
            sys.exit(f"a benchmark worker failed with exit code {failed[0].exitcode}; see its traceback above")
        time.sleep(0.2)
    for p in procs:
        p.join()
    return results


def run_two(worker: Any, args: argparse.Namespace) -> dict:
    """Run ``worker(rank, port, args, queue)`` in 2 spawned processes; return ``{rank: result}``."""
    return run_n(worker, args, 2)


def run_n(worker: Any, args: Any, n: int) -> dict:
    """Run ``worker(rank, port, args, queue)`` in ``n`` spawned processes; return ``{rank: result}``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, port, args, out)) for r in range(n)]
    for p in procs:
        p.start()
    return collect(procs, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--m", type=int, nargs="+", default=[8], help="micro-batches (= sequences per batch)")
    parser.add_argument("--configs", choices=sorted(CONFIGS), default="issue3")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--allocator", choices=["keep", "default"], default="keep",
                        help="keep: glibc keeps freed memory between steps (keep_freed_memory); default: glibc's own")  # fmt: skip
    args = parser.parse_args()
    results = run_two(worker, args)
    print(f"torch {torch.__version__}, 2 processes x 1 thread, allocator {args.allocator}, medians of {args.reps}"
          " interleaved rounds\n")  # fmt: skip
    columns = ["T", "m", "configuration", "step s (median)", "tokens/s", "vs single 1t", "vs torch 1F1B", "vs ours 1F1B",
               "bubble s0 / s1", "params MiB s0 / s1", "peak live MiB s0 / s1"]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for i, (seq_len, m, name, med, info0) in enumerate(results[0]):
        info1 = results[1][i][4]
        t = max(med, results[1][i][3])
        same = [(r0, r1) for r0, r1 in zip(results[0], results[1]) if r0[0] == seq_len and r0[1] == m]
        time_of = {r0[2]: max(r0[3], r1[3]) for r0, r1 in same}
        ratio = lambda ref, time_of=time_of, t=t: f"{time_of[ref] / t:.2f}x" if ref in time_of else "-"  # noqa: E731
        bubble = f"{info0['bubble']:.2f} / {info1['bubble']:.2f}" if "bubble" in info0 else "-"
        params = f"{info0['params'] / 2**20:.2f} / {info1['params'] / 2**20:.2f}" if "params" in info0 else "-"
        live = f"{info0['live'] / 2**20:.0f} / {info1['live'] / 2**20:.0f}"
        cells = [seq_len, m, name, f"{t:.3f}", f"{seq_len * m / t:.0f}", ratio("single 1t"), ratio("torch Schedule1F1B"),
                 ratio("ours 1f1b"), bubble, params, live]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")
    print("\nWhere the last timed step's time went, per stage s0 / s1 (seconds; BubbleProfiler's breakdown) and the"
          " schedule's bubble with the measured action costs and no communication cost (theory)\n")  # fmt: skip
    columns = ["T", "m", "configuration", "window s", "compute s", "waiting s", "transfer s", "bubble", "theory bubble"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for i, (seq_len, m, name, _, info0) in enumerate(results[0]):
        info1 = results[1][i][4]
        if "times" not in info0:
            continue
        a, b = info0["times"], info1["times"]
        pair = lambda x, y: f"{x:.3f} / {y:.3f}"  # noqa: E731
        cells = [seq_len, m, name, f"{a.window:.3f}", pair(a.compute, b.compute), pair(a.wait, b.wait),
                 pair(a.transfer, b.transfer), f"{a.bubble:.2f} / {b.bubble:.2f}",
                 f"{info0['theory']:.2f} / {info1['theory']:.2f}"]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")
    print("\nPer action kind, per stage s0 / s1 (seconds per step, medians over the rounds): compute of each kind"
          " (blocked receives excluded), receives blocked before the producer sent (wait) and after (transfer), their"
          " count, and the time outside any action (other)\n")  # fmt: skip
    for i, (seq_len, m, name, _, info0) in enumerate(results[0]):
        k0, k1 = info0.get("kinds"), results[1][i][4].get("kinds")
        if not k0 or not k1:
            continue
        order = [k for k in sorted(set(k0) | set(k1)) if k not in ("wait", "transfer", "receives", "other")]
        order += ["wait", "transfer", "receives", "other"]
        cells = [f"{k} {k0.get(k, 0.0):.3f} / {k1.get(k, 0.0):.3f}" if k != "receives"
                 else f"receives {k0.get(k, 0):.0f} / {k1.get(k, 0):.0f}" for k in order]  # fmt: skip
        print(f"- T={seq_len} m={m} {name}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
