"""The launcher and the parity helper themselves: results come back, failures surface fast, and a
strategy that breaks parity is caught."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_parallel import HybridParallelStrategy
from tests.helpers.distributed import RankFailed, run_distributed
from tests.helpers.parity import assert_parity


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([rank])
    dist.all_reduce(t)
    return rank, t.item(), torch.get_num_threads()


def test_results_in_rank_order():
    assert run_distributed(_sum_of_ranks, 3) == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]


def _rank1_raises_while_rank0_waits(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    t = torch.zeros(1)
    dist.recv(t, src=1)  # would block until the PG timeout if failures were not propagated


def test_failing_rank_traceback_is_raised_and_peers_are_stopped():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed.*ValueError: boom on rank 1"):
        run_distributed(_rank1_raises_while_rank0_waits, 2, timeout=60)
    assert time.monotonic() - start < 15


def _hangs(rank, world_size):
    time.sleep(60)


def test_timeout_kills_and_names_the_ranks():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 2 s"):
        run_distributed(_hangs, 2, timeout=2, init_process_group=False)


def _dies(rank, world_size):
    if rank == 0:
        os._exit(3)


def test_rank_that_dies_without_reporting():
    with pytest.raises(RankFailed, match="exited with code 3 without reporting"):
        run_distributed(_dies, 2, init_process_group=False)


class _NoGradientSync(HybridParallelStrategy):
    def sync_gradients(self, optimizer):
        pass


def test_parity_helper_catches_a_strategy_that_skips_gradient_averaging():
    with pytest.raises(AssertionError, match="parameters after step 1"):
        assert_parity("gpt", lambda: _NoGradientSync(data_parallel_size=2), 2, data_parallel_size=2, steps=1)
