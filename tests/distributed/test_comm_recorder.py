"""The communication recorder (``tests/helpers/comm_check.py``) on forked gloo ranks: what it records of p2p,
batches and collectives, that direction-separated groups and object bookkeeping pass, that cross sends, host
tensors and a strategy that breaks NCCL's order fail ``run_distributed(comm_check=True)`` and ``assert_parity``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from lightning_parallel import HybridParallelStrategy
from tests.helpers import comm_check, comm_taint
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_parity

pytestmark = pytest.mark.timeout(120)


def _host_and_device(rank: int, world_size: int, host: bool) -> None:
    t = torch.zeros(2) if host else torch.zeros(2, device=torch.device("cpu"))
    dist.all_reduce(t)


def test_a_host_tensor_in_a_collective_fails_the_check(monkeypatch):
    monkeypatch.setattr(comm_taint, "package_dir", str(Path(__file__).parent) + os.sep)
    with pytest.raises(AssertionError, match=r"host tensor: all_reduce at tests/distributed/test_comm_recorder.py:\d+"):
        run_distributed(_host_and_device, 2, True, comm_check=True)
    run_distributed(_host_and_device, 2, False, comm_check=True)


# ------------------------------------------------------------------------------ the recorder, on gloo
def _traffic(rank: int, world_size: int, cross: bool) -> list[dict]:
    """Both ranks send first: on one group (``cross``), or each direction on its own group of the same members."""
    up, down = dist.new_group([0, 1]), dist.new_group([0, 1])
    peer, out, got = 1 - rank, torch.full((4,), float(rank)), torch.empty(4)
    send_group = (up if rank == 0 else down) if not cross else dist.group.WORLD
    recv_group = (down if rank == 0 else up) if not cross else dist.group.WORLD
    work = dist.isend(out, group=send_group, group_dst=peer, tag=7)
    dist.recv(got, src=peer, group=recv_group, tag=7)
    work.wait()
    ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, got, peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    dist.all_gather_object([None] * world_size, "x" * (rank + 1))  # sizes differ per rank: bookkeeping
    dist.broadcast_object_list([{"rank": rank}], src=0)
    dist.barrier(up)
    dist.all_reduce(got)
    fc.wait_tensor(fc.all_gather_tensor(got, 0, dist.group.WORLD))  # a functional collective, recorded once
    comm_check.expect_p2p()
    return comm_check._LOG.ops if comm_check._LOG is not None else []


def test_recorder_passes_direction_separated_groups_and_object_bookkeeping():
    ops = run_distributed(_traffic, 2, False, comm_check=True)
    p2p = [op for op in ops[0] if op["kind"] in ("send", "recv")]
    assert [(op["kind"], op["peer"], op.get("batch")) for op in p2p] == [
        ("send", 1, None),
        ("recv", 1, None),
        ("send", 1, 1),
        ("recv", 1, 1),
    ]
    assert p2p[0]["group"] != p2p[1]["group"] and p2p[0]["bytes"] == 16 and p2p[0]["tag"] == 7
    assert p2p[0]["site"].startswith("tests/distributed/test_comm_recorder.py:")
    kinds = [op["kind"] for op in ops[0] if op["kind"] not in ("send", "recv")]
    assert kinds == ["all_gather_object", "broadcast_object_list", "barrier", "all_reduce", "all_gather"]
    assert ops[0][-1]["api"] == "all_gather_tensor" and ops[0][-1]["bytes"] == 32


def test_recorder_fails_cross_sends_on_one_group():
    with pytest.raises(AssertionError, match=r"cyclic wait \(rendezvous model"):
        run_distributed(_traffic, 2, True, comm_check=True)


class _CrossSending(HybridParallelStrategy):
    """Data parallelism that also swaps a message between the two ranks at each step, both sending first."""

    def sync_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        super().sync_gradients(optimizer)
        mine, theirs = torch.ones(4), torch.empty(4)
        work = dist.isend(mine, 1 - dist.get_rank())
        dist.recv(theirs, 1 - dist.get_rank())
        work.wait()


def test_assert_parity_runs_under_the_check():
    with pytest.raises(AssertionError, match=r"(?s)NCCL communication check.*cyclic wait \(rendezvous model"):
        assert_parity("gpt", lambda: _CrossSending(data_parallel_size=2), 2, data_parallel_size=2, steps=1)
