"""The planner's measurements of this machine's links: a pipeline's point-to-point receive and the collectives
of tensor and data parallelism, timed as a run meets them (the processes computing meanwhile), for
:func:`lightning_parallel.plan.hardware.measure_link` and ``measure_collectives`` to fit."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_parallel._collectives import comm_device
from lightning_parallel._p2p import isend_with_header, recv_with_header


def receive_time(peer: int, nbytes: int, repeats: int, group: ProcessGroup | None = None, busy: float = 0.02) -> float:
    """The median seconds a receive of a message of ``nbytes`` blocks when its send was posted first, the
    message sent as the pipeline runtimes send one (``isend_with_header``: a header, then the payload into a
    freshly allocated buffer), and both processes compute meanwhile as a pipeline's stages do: the sender
    goes on to ``busy`` seconds of matrix products once its send is posted (its next action), the receiver
    computes 2 ms before it receives. On a machine whose cores the processes share (gloo on CPU) the
    transfer then competes with that compute, as it does in a run (idle processes measured twice the
    bandwidth here, which no run met: docs/benchmarks.md, Planner). This rank and ``peer`` (global ranks;
    both call it, each naming the other) take turns sending; each returns what it measured as the
    receiver."""
    device = comm_device(group)
    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    operand = torch.randn(128, 128, device=device)
    me, times = dist.get_rank(), []

    def compute(seconds: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            operand @ operand

    for tag in range(2 * repeats):
        dist.barrier(group)
        if (tag % 2 == 0) == (me < peer):
            works = [work for work, _ in isend_with_header(buf, peer, tag, group)]  # type: ignore[arg-type]
            compute(busy)
            for work in works:
                work.wait()
        else:
            compute(0.002)  # the send is posted first, as when a pipeline's producer runs ahead
            t0 = time.perf_counter()
            recv_with_header(peer, tag, group, buf.device)  # type: ignore[arg-type]
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def collective_time(kind: str, nbytes: int, repeats: int, group: ProcessGroup, busy: float = 0.01) -> float:
    """The median seconds of a collective over ``group`` on a tensor of ``nbytes``, each after ``busy``
    seconds of matrix products on every rank (as a tensor-parallel block computes before its all-reduce:
    where processes share cores, the peers reach it apart): ``kind`` "all_reduce" (sum), "all_gather"
    (``nbytes`` the gathered whole, each rank's share in) or "all_to_all" (``nbytes`` each rank's buffer, split
    evenly over the ranks). The slowest rank's time, every rank returns it."""
    world, device = dist.get_world_size(group), comm_device(group)
    whole = torch.zeros(max(nbytes // 4, world), dtype=torch.float32, device=device)
    share = torch.zeros(whole.numel() // world, dtype=torch.float32, device=device)
    run = {
        "all_reduce": lambda: dist.all_reduce(whole, group=group),
        "all_gather": lambda: dist.all_gather_into_tensor(whole[: share.numel() * world], share, group=group),
        "all_to_all": lambda: dist.all_to_all_single(whole[: share.numel() * world].clone(),
                                                     whole[: share.numel() * world], group=group),
    }[kind]  # fmt: skip
    operand, times = torch.randn(128, 128, device=device), []
    for _ in range(repeats):
        dist.barrier(group)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy:
            operand @ operand
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest[0].item()
